"""The engine's layout: three layers (core, runner, http), at most 20 modules, a server that does not pull in
the trainer side, and commands dispatched through an explicit table.

    .venv/bin/pytest tests/unit/test_engine_layers.py -q

The server's import closure is measured in a fresh interpreter (a subprocess), so modules that other tests
imported into this one do not count.
"""

from __future__ import annotations

import ast
import json
import subprocess
import sys
from pathlib import Path

ENGINE_DIR = Path(__file__).resolve().parents[2] / "clawrl" / "engine"
MAX_MODULES = 20
# Trainer-side code the inference server must not load: the weight senders and the trainer itself.
FORBIDDEN_PREFIXES = ("clawrl.trainer", "clawrl.weight_sync.broadcast", "clawrl.weight_sync.colocated")


def _modules() -> list[str]:
    return sorted(str(p.relative_to(ENGINE_DIR)) for p in ENGINE_DIR.rglob("*.py") if p.name != "__init__.py")


def _imports(path: Path) -> set[str]:
    """Absolute names of every module `path` imports, at any depth (function-local imports included)."""
    names = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module:
            names.add(node.module)
    return names


def test_engine_has_at_most_20_modules_in_three_layers():
    modules = _modules()
    assert len(modules) <= MAX_MODULES, f"{len(modules)} engine modules (at most {MAX_MODULES}): {modules}"
    layers = {Path(m).parts[0] for m in modules if len(Path(m).parts) > 1}
    assert layers == {"core", "runner", "http"}, layers
    for layer in layers:
        assert (ENGINE_DIR / layer / "__init__.py").read_text().startswith('"""'), (
            f"{layer}/ lacks a docstring"
        )
    for name in (
        "core/engine.py",
        "runner/base.py",
        "runner/cpu_runner.py",
        "runner/gpu_runner.py",
        "http/app.py",
    ):
        assert name in modules, name


def test_the_server_import_closure_has_no_trainer_side_module():
    code = (
        "import json, sys\n"
        "import clawrl.engine.http.app\n"
        "print(json.dumps(sorted(m for m in sys.modules if m.startswith('clawrl'))))\n"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    loaded = json.loads(result.stdout.strip().splitlines()[-1])
    assert "clawrl.engine.http.app" in loaded and "clawrl.engine.async_engine" in loaded  # the probe worked
    bad = [m for m in loaded if m.startswith(FORBIDDEN_PREFIXES)]
    assert not bad, f"importing the engine's HTTP app loads trainer-side modules: {bad}"


def test_core_bookkeeping_imports_neither_torch_nor_the_runners():
    # The scheduler, sequences and requests are tested with plain Python objects; only engine.py, which
    # owns the model and the KV cache, may import torch and the runners.
    for name in ("request.py", "sequence.py", "scheduler.py"):
        imported = _imports(ENGINE_DIR / "core" / name)
        assert not {
            m for m in imported if m == "torch" or m.startswith(("torch.", "clawrl.engine.runner"))
        }, name
    # The seam: runners depend on the core's records, never on the engine step that drives them.
    for path in (ENGINE_DIR / "runner").glob("*.py"):
        assert "clawrl.engine.core.engine" not in _imports(path), path.name


def _handler_kinds(path: Path, container: str) -> set[str]:
    """String keys of the dict literal that `container` (an assignment target or a function) holds."""
    for node in ast.walk(ast.parse(path.read_text())):
        target = None
        if isinstance(node, ast.AnnAssign) and isinstance(node.value, ast.Dict):
            target, table = ast.unparse(node.target), node.value
        elif isinstance(node, ast.FunctionDef) and node.name == container:
            returns = [n.value for n in ast.walk(node) if isinstance(n, ast.Return)]
            target, table = container, returns[0] if returns else None
        if target == container and isinstance(table, ast.Dict):
            return {key.value for key in table.keys if isinstance(key, ast.Constant)}
    raise AssertionError(f"{path.name}: no dict literal for {container}")


def _submitted_kinds(path: Path) -> set[str]:
    """The kinds (first argument, a string literal) of every `_call(...)` / `_submit(...)` in `path`."""
    calls = [n for n in ast.walk(ast.parse(path.read_text())) if isinstance(n, ast.Call)]
    named = [c for c in calls if isinstance(c.func, ast.Attribute) and c.func.attr in ("_call", "_submit")]
    return {c.args[0].value for c in named if c.args and isinstance(c.args[0], ast.Constant)}


def test_every_command_kind_has_an_entry_in_the_dispatch_table():
    table = _handler_kinds(ENGINE_DIR / "async_engine.py", "self._handlers")
    table |= _handler_kinds(ENGINE_DIR / "control.py", "control_handlers")
    submitted = _submitted_kinds(ENGINE_DIR / "async_engine.py") | _submitted_kinds(ENGINE_DIR / "control.py")
    assert {"add", "abort", "pause", "continue", "release", "resume", "call"} <= submitted
    assert submitted <= table, f"commands without a handler: {sorted(submitted - table)}"
    sources = "\n".join(p.read_text() for p in ENGINE_DIR.rglob("*.py"))
    assert "_cmd_" not in sources and 'getattr(self, f"' not in sources
