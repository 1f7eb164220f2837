"""Packaging: every third-party package that clawrl/ imports is declared in pyproject.toml, either in
[project] dependencies or in the extra of the optional feature that imports it; the extras exist, `all` is
their union, and `dev` installs what the tests use (but not wandb or peft, which no test needs)."""

from __future__ import annotations

import ast
import importlib.metadata
import re
import sys
from pathlib import Path

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10: pip vendors the same parser
    from pip._vendor import tomli as tomllib

ROOT = Path(__file__).resolve().parents[2]
PYPROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())
# Imported only behind an optional feature: module -> the extra that provides it.
OPTIONAL = {"wandb": "wandb", "tensorboard": "tensorboard", "math_verify": "math"}
# triton: imported only on GPU code paths; CUDA builds of torch depend on it (and `dev` has it for CPU tests).
COMES_WITH_TORCH = {"triton"}
RUNTIME_EXTRAS = ("wandb", "tensorboard", "peft", "math")


def _name(requirement: str) -> str:
    """'ray[default]>=2.40' -> 'ray'; names compared in PEP 503 normal form."""
    return re.sub(r"[-_.]+", "-", re.match(r"[A-Za-z0-9._-]+", requirement).group()).lower()


def _imported_modules() -> dict[str, str]:
    """Top-level module -> one file importing it, for every absolute import anywhere under clawrl/."""
    found: dict[str, str] = {}
    for path in sorted((ROOT / "clawrl").rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
            if isinstance(node, ast.Import):
                names = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                names = [node.module]
            else:
                continue
            for name in names:
                found.setdefault(name.split(".")[0], str(path.relative_to(ROOT)))
    return found


def _third_party(modules: dict[str, str]) -> dict[str, str]:
    return {m: f for m, f in modules.items() if m not in sys.stdlib_module_names and m != "clawrl"}


def test_every_runtime_import_is_declared():
    declared = {_name(r) for r in PYPROJECT["project"]["dependencies"]}
    extras = PYPROJECT["project"]["optional-dependencies"]
    distributions = importlib.metadata.packages_distributions()
    problems = []
    for module, where in sorted(_third_party(_imported_modules()).items()):
        if module in COMES_WITH_TORCH:
            continue
        if module in OPTIONAL:
            extra = OPTIONAL[module]
            needed = {_name(d) for d in distributions.get(module, [module])}
            if not needed & {_name(r) for r in extras.get(extra, [])}:
                problems.append(f"{module} (imported by {where}) is not in the [{extra}] extra")
            continue
        dists = {_name(d) for d in distributions.get(module, [])}
        if not dists:
            problems.append(
                f"{module} (imported by {where}) is not installed, so its distribution is unknown"
            )
        elif not dists & declared:
            problems.append(f"{module} (imported by {where}) comes from {sorted(dists)}: not in dependencies")
    assert problems == []


def test_the_check_sees_what_clawrl_imports():
    third_party = _third_party(_imported_modules())
    # a module imported at the top of the engine's HTTP app, and the optional ones imported lazily
    assert third_party["pydantic"] == "clawrl/engine/http/app.py"
    assert {"torch", "ray", "wandb", "math_verify"} <= set(third_party)
    assert "json" not in third_party and "clawrl" not in third_party


def test_extras():
    extras = {k: {_name(r) for r in v} for k, v in PYPROJECT["project"]["optional-dependencies"].items()}
    assert extras["wandb"] == {"wandb"}
    assert extras["tensorboard"] == {"tensorboard"}
    assert extras["peft"] == {"peft"}
    assert extras["math"] == {"math-verify"}
    assert extras["all"] == set().union(*(extras[e] for e in RUNTIME_EXTRAS))
    # dev: what the tests import (tensorboard, math-verify, yaml, openai), not the extras no test needs
    assert {"tensorboard", "math-verify", "pyyaml", "openai", "pytest"} <= extras["dev"]
    assert not {"wandb", "peft"} & extras["dev"]
