"""Render the GitHub Actions workflows in this folder from their Jinja templates.

Every `NAME.yml.j2` next to this script becomes `NAME.yml`, starting with an "auto-generated, do not edit"
banner. Templates use `<% %>` for blocks, `<< >>` for variables and `<# #>` for comments, so GitHub's own
`${{ }}` expressions (and shell `${#x}`) pass through untouched.

The GPU test matrix of pr-test.yml is discovered, not written by hand: each `tests/e2e/test_*.py` declares at
module level `NUM_GPUS = N` and `CI_LABELS = ["run-ci-short", ...]`, read here with `ast` (the file is not
imported). Adding a test file and regenerating adds it to the matrix of each labelled job.

    python .github/workflows/generate_workflows.py           # rewrite the .yml files
    python .github/workflows/generate_workflows.py --check   # exit 1 if a committed .yml is stale
"""

from __future__ import annotations

import argparse
import ast
import difflib
import re
import sys
from dataclasses import dataclass
from pathlib import Path

import jinja2

WORKFLOWS_DIR = Path(__file__).resolve().parent
REPO_ROOT = WORKFLOWS_DIR.parents[1]
E2E_DIR = REPO_ROOT / "tests" / "e2e"
REGENERATE_COMMAND = "python .github/workflows/generate_workflows.py"
TEST_FILE_NAME = re.compile(r"^test_[A-Za-z0-9_.-]+\.py$")


class GeneratorError(Exception):
    """A template or test-file declaration is wrong; the message names the file (and line)."""


@dataclass(kw_only=True)
class E2ETest:
    """One GPU end-to-end test file found under tests/e2e."""

    file_name: str
    """Name relative to tests/e2e, e.g. test_gsm8k_short.py."""
    num_gpus: int
    """Its module-level NUM_GPUS: GPUs locked for it with `clawrl gpu-lock-exec --count`."""
    labels: list[str]
    """Its module-level CI_LABELS: the PR labels whose job runs it."""


@dataclass(kw_only=True)
class GpuSuite:
    """One label-gated job of pr-test.yml."""

    label: str
    """PR label that runs the job, e.g. run-ci-short."""
    job_name: str
    """Job id in the workflow."""
    timeout_minutes: int
    """Per matrix entry, including waiting for GPU locks."""
    tests: list[E2ETest]
    """Test files declaring the label; an empty list renders the job disabled (`if: false`)."""


# label -> (job name, timeout minutes). A test may only declare labels listed here.
GPU_SUITES = {
    "run-ci-short": ("e2e-test-short", 60),
    "run-ci-precision": ("e2e-test-precision", 90),
    "run-ci-long": ("e2e-test-long", 360),
}

# Settings shared by the templates.
TEMPLATE_SETTINGS = {
    "python_version": "3.11",
    "ci_data_dir": "/data/clawrl_ci",
    "default_image": "pytorch/pytorch:2.11.0-cuda12.8-cudnn9-devel",
    "container_options": "--gpus all --ipc=host --shm-size=16g --ulimit memlock=-1",
    # (variable in the job container, repository variable it comes from), both spellings of each proxy
    "proxy_variables": [
        (spelling, f"CLAWRL_CI_{name.upper()}")
        for name in ("http_proxy", "https_proxy", "all_proxy", "no_proxy")
        for spelling in (name, name.upper())
    ],
}


def module_constant(tree: ast.Module, name: str, path: Path):
    """(value, line) of a module-level `NAME = literal` (or `NAME: type = literal`); (None, 0) if absent."""
    for node in tree.body:
        if isinstance(node, ast.Assign):
            targets = node.targets
        elif isinstance(node, ast.AnnAssign) and node.value is not None:
            targets = [node.target]
        else:
            continue
        if any(isinstance(target, ast.Name) and target.id == name for target in targets):
            try:
                return ast.literal_eval(node.value), node.lineno
            except ValueError:
                raise GeneratorError(
                    f"{path}:{node.lineno}: {name} must be a literal, not an expression"
                ) from None
    return None, 0


def read_e2e_test(path: Path) -> E2ETest:
    if not TEST_FILE_NAME.match(path.name):
        raise GeneratorError(f"{path}: e2e test file names may use only letters, digits, '_', '.', '-'")
    tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
    known = ", ".join(GPU_SUITES)
    num_gpus, line = module_constant(tree, "NUM_GPUS", path)
    if line == 0:
        raise GeneratorError(f"{path}: missing module-level NUM_GPUS = N (the GPUs the test needs)")
    if type(num_gpus) is not int or num_gpus < 0:
        raise GeneratorError(f"{path}:{line}: NUM_GPUS must be an integer >= 0, got {num_gpus!r}")
    labels, line = module_constant(tree, "CI_LABELS", path)
    if line == 0:
        raise GeneratorError(
            f"{path}: missing module-level CI_LABELS = [...] (PR labels that run it; known: {known})"
        )
    if not isinstance(labels, list | tuple) or not labels or not all(isinstance(x, str) for x in labels):
        raise GeneratorError(
            f"{path}:{line}: CI_LABELS must be a non-empty list of label strings, got {labels!r}"
        )
    unknown = [label for label in labels if label not in GPU_SUITES]
    if unknown:
        raise GeneratorError(f"{path}:{line}: unknown CI label {unknown[0]!r}; known labels: {known}")
    return E2ETest(file_name=path.name, num_gpus=num_gpus, labels=list(labels))


def discover_e2e_tests(e2e_dir: Path) -> list[E2ETest]:
    """Every tests/e2e/test_*.py, sorted by name; none when the folder does not exist."""
    return [read_e2e_test(path) for path in sorted(e2e_dir.glob("test_*.py"))] if e2e_dir.is_dir() else []


def gpu_suites(tests: list[E2ETest]) -> list[GpuSuite]:
    return [
        GpuSuite(
            label=label,
            job_name=job_name,
            timeout_minutes=timeout_minutes,
            tests=[test for test in tests if label in test.labels],
        )
        for label, (job_name, timeout_minutes) in GPU_SUITES.items()
    ]


def make_environment(workflows_dir: Path) -> jinja2.Environment:
    return jinja2.Environment(
        loader=jinja2.FileSystemLoader(str(workflows_dir)),
        block_start_string="<%",
        block_end_string="%>",
        variable_start_string="<<",
        variable_end_string=">>",
        comment_start_string="<#",
        comment_end_string="#>",
        trim_blocks=True,
        lstrip_blocks=True,
        keep_trailing_newline=True,
        undefined=jinja2.StrictUndefined,
        autoescape=False,
    )


def banner(template_name: str) -> str:
    rule = "#" * 80
    return (
        f"{rule}\n"
        f"# AUTO-GENERATED FILE - DO NOT EDIT. Rendered from .github/workflows/{template_name}.\n"
        f"# Edit the template (the GPU test matrix: NUM_GPUS / CI_LABELS in tests/e2e/test_*.py),\n"
        f"# then regenerate with:\n"
        f"#   {REGENERATE_COMMAND}\n"
        f"{rule}\n"
    )


def render_all(workflows_dir: Path = WORKFLOWS_DIR, e2e_dir: Path = E2E_DIR) -> dict[Path, str]:
    """{output .yml path: rendered text} for every *.yml.j2 in workflows_dir."""
    environment = make_environment(workflows_dir)
    context = {**TEMPLATE_SETTINGS, "gpu_suites": gpu_suites(discover_e2e_tests(e2e_dir))}
    rendered = {}
    for template_path in sorted(workflows_dir.glob("*.yml.j2")):
        try:
            body = environment.get_template(template_path.name).render(**context)
        except jinja2.TemplateError as error:
            raise GeneratorError(f"{template_path}: {error}") from error
        rendered[template_path.with_suffix("")] = banner(template_path.name) + body
    return rendered


def stale_files(rendered: dict[Path, str]) -> list[str]:
    """Unified diffs of the committed files that differ from a fresh rendering."""
    diffs = []
    for path, text in rendered.items():
        current = path.read_text(encoding="utf-8") if path.exists() else ""
        if current != text:
            lines = difflib.unified_diff(
                current.splitlines(True), text.splitlines(True), f"{path} (committed)", f"{path} (rendered)"
            )
            diffs.append("".join(lines))
    return diffs


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--check", action="store_true", help="exit 1 if a rendered file differs from the committed one"
    )
    parser.add_argument(
        "--workflows-dir", type=Path, default=WORKFLOWS_DIR, help="folder with the *.yml.j2 templates"
    )
    parser.add_argument(
        "--e2e-dir", type=Path, default=E2E_DIR, help="folder with the GPU e2e tests (test_*.py)"
    )
    args = parser.parse_args(argv)
    try:
        rendered = render_all(args.workflows_dir, args.e2e_dir)
    except GeneratorError as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    if args.check:
        diffs = stale_files(rendered)
        for diff in diffs:
            print(diff, end="")
        if diffs:
            print(f"\n{len(diffs)} workflow file(s) out of date; run: {REGENERATE_COMMAND}", file=sys.stderr)
        return 1 if diffs else 0
    for path, text in rendered.items():
        path.write_text(text, encoding="utf-8")
        print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
