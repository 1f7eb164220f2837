"""Test helper: run the engine's Triton kernels on CPU with the Triton interpreter (TRITON_INTERPRET=1).

Import this module before anything that imports triton. The interpreter only works when triton itself is
imported after TRITON_INTERPRET is set: triton's @jit library functions (tl.max, tl.sum, tl.cdiv, ...) are
built at import time and cannot run inside interpreted kernels otherwise. In a full pytest run some earlier
test module has usually imported triton already (transformers does), so a kernel test module ends with

    replace_tests_if_triton_was_imported_too_early(globals(), __file__)

which then swaps its tests for one test that runs the whole file in a fresh pytest process. On a CUDA
machine nothing changes: the kernels are compiled and run on the GPU.
"""

import os
import subprocess
import sys

import torch

ON_GPU = torch.cuda.is_available()
DEVICE = "cuda" if ON_GPU else "cpu"
if not ON_GPU:
    os.environ.setdefault("TRITON_INTERPRET", "1")


def interpreter_usable() -> bool:
    """True on a GPU, or when this process's triton was imported in interpreter mode."""
    if ON_GPU:
        return True
    import triton.language.standard as standard
    from triton.runtime.interpreter import InterpretedFunction

    return isinstance(standard.cdiv, InterpretedFunction)


def replace_tests_if_triton_was_imported_too_early(namespace: dict, path: str) -> None:
    """Swap the module's tests for one that runs `path` in a fresh process when the interpreter is unusable."""
    if interpreter_usable():
        return
    for name in [n for n in namespace if n.startswith("test_")]:
        del namespace[name]

    def test_kernels_in_a_fresh_process():
        env = {**os.environ, "TRITON_INTERPRET": "1"}
        command = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", path]
        proc = subprocess.run(command, env=env, capture_output=True, text=True, timeout=600, check=False)
        assert proc.returncode == 0, proc.stdout[-6000:] + proc.stderr[-2000:]

    namespace["test_kernels_in_a_fresh_process"] = test_kernels_in_a_fresh_process
