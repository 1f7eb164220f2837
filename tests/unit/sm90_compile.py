"""Compile Triton kernels for an H100/H200 (sm_90) on a machine without a GPU, for the compile tests.

`compiling_for_sm90()` replaces every kernel launch (`kernel[grid](...)`) with `triton.compile(..., target
sm_90)` of that launch's signature, down to a cubin with Triton's bundled ptxas, and records the kernel's
name; the wrappers run on CPU tensors and nothing executes. `run_compile_script(path)` runs a test file as
a script in a fresh process without the interpreter (the interpreter accepts code the compiler rejects)
and returns the names it printed.
"""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
from collections.abc import Iterator

_POINTER = {"bfloat16": "*bf16", "float32": "*fp32", "float16": "*fp16", "int64": "*i64", "int32": "*i32"}


def _signature_of(value) -> str:
    import torch

    if isinstance(value, torch.Tensor):
        return _POINTER[str(value.dtype).removeprefix("torch.")]
    if isinstance(value, bool):
        return "i1"
    if isinstance(value, int):
        return "i32" if -(2**31) <= value < 2**31 else "i64"
    return "fp32"


@contextlib.contextmanager
def compiling_for_sm90() -> Iterator[list[str]]:
    """Within the block each kernel launch compiles for sm_90 instead of running; yields the names compiled."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource
    from triton.runtime.jit import JITFunction

    compiled: list[str] = []

    def compiling_launch(self, grid):
        def launch(*args, **kwargs):
            options = {k: kwargs.pop(k) for k in ("num_warps", "num_stages") if k in kwargs}
            values = dict(zip(self.arg_names, args, strict=False)) | kwargs
            constexprs = {p.name: values[p.name] for p in self.params if p.is_constexpr}
            signature = {n: "constexpr" if n in constexprs else _signature_of(v) for n, v in values.items()}
            source = ASTSource(fn=self, signature=signature, constexprs=constexprs)
            triton.compile(source, target=GPUTarget("cuda", 90, 32), options=options)
            compiled.append(self.fn.__name__)

        return launch

    original = JITFunction.__getitem__
    JITFunction.__getitem__ = compiling_launch
    try:
        yield compiled
    finally:
        JITFunction.__getitem__ = original


def run_compile_script(path: str) -> list[str]:
    """Run `path` as a script without the Triton interpreter; the kernel names it printed, in order."""
    # "0", not unset: interpreted_triton (imported by some test files) sets it to 1 on machines without CUDA.
    env = {**os.environ, "TRITON_INTERPRET": "0"}
    env.setdefault("TRITON_DEFAULT_FP_FUSION", "1")  # silences Triton 3.9's notice; 1 is the default
    proc = subprocess.run(
        [sys.executable, path], env=env, capture_output=True, text=True, timeout=300, check=False
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    return proc.stdout.split()
