"""The CI configuration: workflow generator (e2e discovery, rendering, --check), the committed workflows,
the self-hosted runner compose file, the pre-commit config and docs/ci.md staying in step with gpu-lock-exec.
"""

from __future__ import annotations

import importlib.util
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from clawrl.ci import gpu_lock_exec

REPO_ROOT = Path(__file__).resolve().parents[2]
WORKFLOWS_DIR = REPO_ROOT / ".github" / "workflows"
GENERATOR = WORKFLOWS_DIR / "generate_workflows.py"
RUN_COMMAND = "clawrl gpu-lock-exec --count ${{ matrix.info.num_gpus }} -- python tests/e2e/${{ matrix.info.test_file }}"


def load_generator():
    spec = importlib.util.spec_from_file_location("generate_workflows", GENERATOR)
    module = importlib.util.module_from_spec(spec)
    sys.modules["generate_workflows"] = module  # dataclasses resolve annotations through sys.modules
    spec.loader.exec_module(module)
    return module


gen = load_generator()


def write_e2e_tree(root: Path) -> Path:
    e2e = root / "e2e"
    e2e.mkdir()
    (e2e / "test_gsm8k_short.py").write_text(
        '"""Short GRPO run."""\n\nNUM_GPUS = 4\nCI_LABELS = ["run-ci-short", "run-ci-long"]\n\n\ndef main():\n    NUM_GPUS = 99\n'
    )
    (e2e / "test_logprob_precision.py").write_text('NUM_GPUS: int = 1\nCI_LABELS = ("run-ci-precision",)\n')
    (e2e / "test_async_short.py").write_text('import os\n\nCI_LABELS = ["run-ci-short"]\nNUM_GPUS = 2\n')
    (e2e / "helpers.py").write_text("NUM_GPUS = 'not a test file, ignored'\n")
    return e2e


def parse(text: str) -> dict:
    data = yaml.safe_load(text)
    data["on"] = data.pop(True, data.get("on"))  # YAML 1.1 reads the key `on` as the boolean True
    return data


def test_discovery_reads_num_gpus_and_labels_without_importing(tmp_path):
    tests = gen.discover_e2e_tests(write_e2e_tree(tmp_path))
    assert [(t.file_name, t.num_gpus, t.labels) for t in tests] == [
        ("test_async_short.py", 2, ["run-ci-short"]),
        ("test_gsm8k_short.py", 4, ["run-ci-short", "run-ci-long"]),
        ("test_logprob_precision.py", 1, ["run-ci-precision"]),
    ]
    assert gen.discover_e2e_tests(tmp_path / "missing") == []


@pytest.mark.parametrize(
    ("source", "message"),
    [
        ('CI_LABELS = ["run-ci-short"]\n', ": missing module-level NUM_GPUS = N (the GPUs the test needs)"),
        (
            'NUM_GPUS = int("4")\nCI_LABELS = ["run-ci-short"]\n',
            ":1: NUM_GPUS must be a literal, not an expression",
        ),
        ('NUM_GPUS = "4"\nCI_LABELS = ["run-ci-short"]\n', ":1: NUM_GPUS must be an integer >= 0, got '4'"),
        ("NUM_GPUS = -1\nCI_LABELS = ['run-ci-short']\n", ":1: NUM_GPUS must be an integer >= 0, got -1"),
        (
            "NUM_GPUS = 2\n",
            ": missing module-level CI_LABELS = [...] (PR labels that run it; known: run-ci-short, run-ci-precision, run-ci-long)",
        ),
        ("NUM_GPUS = 2\nCI_LABELS = []\n", ":2: CI_LABELS must be a non-empty list of label strings, got []"),
        (
            'NUM_GPUS = 2\nCI_LABELS = ["run-ci-short", "run-ci-nightly"]\n',
            ":2: unknown CI label 'run-ci-nightly'; known labels: run-ci-short, run-ci-precision, run-ci-long",
        ),
    ],
)
def test_bad_declarations_name_file_and_line(tmp_path, source, message):
    (tmp_path / "test_bad.py").write_text(source)
    with pytest.raises(gen.GeneratorError) as error:
        gen.discover_e2e_tests(tmp_path)
    assert str(error.value) == f"{tmp_path / 'test_bad.py'}{message}"


def test_generator_reports_a_bad_declaration_and_exits_2(tmp_path):
    (tmp_path / "test_bad.py").write_text("NUM_GPUS = 2\nCI_LABELS = ['run-ci-nightly']\n")
    args = [sys.executable, str(GENERATOR), "--check", "--e2e-dir", str(tmp_path)]
    result = subprocess.run(args, capture_output=True, text=True)
    assert result.returncode == 2
    assert result.stderr.startswith(f"error: {tmp_path / 'test_bad.py'}:2: unknown CI label 'run-ci-nightly'")


def test_pr_test_matrix_follows_discovered_tests(tmp_path):
    rendered = gen.render_all(WORKFLOWS_DIR, write_e2e_tree(tmp_path))
    jobs = parse(rendered[WORKFLOWS_DIR / "pr-test.yml"])["jobs"]
    assert list(jobs) == ["e2e-test-short", "e2e-test-precision", "e2e-test-long"]
    expected = {
        "e2e-test-short": ("run-ci-short", [(2, "test_async_short.py"), (4, "test_gsm8k_short.py")]),
        "e2e-test-precision": ("run-ci-precision", [(1, "test_logprob_precision.py")]),
        "e2e-test-long": ("run-ci-long", [(4, "test_gsm8k_short.py")]),
    }
    for job_name, (label, entries) in expected.items():
        job = jobs[job_name]
        assert f"contains(github.event.pull_request.labels.*.name, '{label}')" in job["if"]
        assert (
            f"inputs.suite == '{label}'" in job["if"]
            and "github.event_name == 'workflow_dispatch'" in job["if"]
        )
        assert job["strategy"] == {
            "fail-fast": False,
            "matrix": {"info": [{"num_gpus": n, "test_file": f} for n, f in entries]},
        }
        assert job["steps"][-1]["run"] == RUN_COMMAND
        assert "self-hosted" in job["runs-on"]


def test_pr_test_container_env_concurrency_and_triggers(tmp_path):
    workflow = parse(gen.render_all(WORKFLOWS_DIR, write_e2e_tree(tmp_path))[WORKFLOWS_DIR / "pr-test.yml"])
    assert workflow["concurrency"] == {
        "group": "pr-test-${{ github.event.pull_request.number || github.ref }}",
        "cancel-in-progress": True,
    }
    assert set(workflow["on"]["pull_request"]["types"]) >= {"synchronize", "labeled"}
    inputs = workflow["on"]["workflow_dispatch"]["inputs"]
    assert inputs["infinite_run"]["type"] == "boolean" and inputs["infinite_run"]["default"] is False
    assert inputs["suite"]["options"] == ["all", "run-ci-short", "run-ci-precision", "run-ci-long"]
    job = workflow["jobs"]["e2e-test-short"]
    assert job["container"]["options"].split() == [
        "--gpus",
        "all",
        "--ipc=host",
        "--shm-size=16g",
        "--ulimit",
        "memlock=-1",
    ]
    assert {"/data/clawrl_ci/models:/root/models", "/data/clawrl_ci/datasets:/root/datasets"} <= set(
        job["container"]["volumes"]
    )
    env = job["env"]
    assert env["WANDB_API_KEY"] == "${{ secrets.WANDB_API_KEY }}"
    assert (
        env["GITHUB_COMMIT_NAME"] == "${{ github.sha }}_${{ github.event.pull_request.number || 'non-pr' }}"
    )
    assert "inputs.infinite_run" in env["CLAWRL_TEST_ENABLE_INFINITE_RUN"]
    assert env["CLAWRL_TEST_ENABLE_EVAL"] == "${{ vars.CLAWRL_TEST_ENABLE_EVAL || '1' }}"


def load_e2e_common():
    spec = importlib.util.spec_from_file_location("e2e_common", REPO_ROOT / "tests" / "e2e" / "e2e_common.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_job_containers_get_the_proxies_that_the_training_command_drops():
    """Downloads in the job container go through the repository's proxy variables; every variable passed in
    is one the e2e harness removes before launching training (local HTTP must not go to a proxy)."""
    workflow = parse((WORKFLOWS_DIR / "pr-test.yml").read_text())
    expected = {}
    for name in ["http_proxy", "https_proxy", "all_proxy", "no_proxy"]:
        source = f"${{{{ vars.CLAWRL_CI_{name.upper()} }}}}"
        expected[name] = expected[name.upper()] = source
    assert expected["HTTPS_PROXY"] == "${{ vars.CLAWRL_CI_HTTPS_PROXY }}"
    enabled = [job for job in workflow["jobs"].values() if job["if"] is not False]
    assert enabled, "no enabled GPU job in the committed pr-test.yml"
    for job in enabled:
        assert job["container"]["env"] == expected
    assert set(expected) <= set(load_e2e_common().PROXY_VARIABLES)


def test_label_without_tests_renders_a_disabled_job(tmp_path):
    """Chosen behaviour (docs/ci.md): the job stays, as `if: false` without a matrix, so the file stays valid."""
    e2e = tmp_path / "e2e"
    e2e.mkdir()
    (e2e / "test_only_short.py").write_text('NUM_GPUS = 8\nCI_LABELS = ["run-ci-short"]\n')
    text = gen.render_all(WORKFLOWS_DIR, e2e)[WORKFLOWS_DIR / "pr-test.yml"]
    jobs = parse(text)["jobs"]
    assert jobs["e2e-test-short"]["strategy"]["matrix"]["info"] == [
        {"num_gpus": 8, "test_file": "test_only_short.py"}
    ]
    for name, label in [("e2e-test-precision", "run-ci-precision"), ("e2e-test-long", "run-ci-long")]:
        assert jobs[name]["if"] is False and "strategy" not in jobs[name]
        assert f'# Disabled: no tests/e2e/test_*.py lists "{label}" in CI_LABELS yet.' in text


def test_committed_workflows_equal_a_fresh_render():
    rendered = gen.render_all()  # the real templates and the real tests/e2e
    assert sorted(p.name for p in rendered) == ["cpu-test.yml", "pr-test.yml", "pre-commit.yml"]
    assert gen.stale_files(rendered) == [], f"run: {gen.REGENERATE_COMMAND}"
    result = subprocess.run([sys.executable, str(GENERATOR), "--check"], capture_output=True, text=True)
    assert result.returncode == 0, result.stdout + result.stderr


def test_check_mode_fails_on_a_hand_edited_file(tmp_path):
    for template in WORKFLOWS_DIR.glob("*.yml.j2"):
        shutil.copy(template, tmp_path / template.name)
    args = [
        sys.executable,
        str(GENERATOR),
        "--workflows-dir",
        str(tmp_path),
        "--e2e-dir",
        str(tmp_path / "none"),
    ]
    assert subprocess.run(args, capture_output=True).returncode == 0
    assert subprocess.run([*args, "--check"], capture_output=True).returncode == 0
    edited = tmp_path / "cpu-test.yml"
    edited.write_text(edited.read_text().replace("make test", "pytest -x"))
    result = subprocess.run([*args, "--check"], capture_output=True, text=True)
    assert result.returncode == 1
    assert "-        run: pytest -x" in result.stdout and "+        run: make test" in result.stdout
    assert (
        "1 workflow file(s) out of date; run: python .github/workflows/generate_workflows.py" in result.stderr
    )


@pytest.mark.parametrize("name", ["cpu-test.yml", "pr-test.yml", "pre-commit.yml"])
def test_committed_workflow_is_clean_yaml_with_banner(name):
    text = (WORKFLOWS_DIR / name).read_text()
    lines = text.splitlines()
    assert lines[0] == lines[5] == "#" * 80
    assert f"AUTO-GENERATED FILE - DO NOT EDIT. Rendered from .github/workflows/{name}.j2." in lines[1]
    assert lines[4] == "#   python .github/workflows/generate_workflows.py"
    assert parse(text)["jobs"]
    # What pre-commit's whitespace hooks would otherwise rewrite, making --check fail after a commit.
    assert text.endswith("\n") and not text.endswith("\n\n")
    assert not [n for n, line in enumerate(lines) if line != line.rstrip()]
    assert "<<" not in text and "<%" not in text and "${{" in text


def test_hosted_workflows_run_the_readme_command_and_pre_commit():
    cpu = parse((WORKFLOWS_DIR / "cpu-test.yml").read_text())
    assert cpu["jobs"]["cpu-test"]["runs-on"] == "ubuntu-latest"
    assert cpu["jobs"]["cpu-test"]["steps"][-1]["run"] == "make test"
    assert "make test" in (REPO_ROOT / "README.md").read_text()
    lint = parse((WORKFLOWS_DIR / "pre-commit.yml").read_text())
    assert lint["jobs"]["pre-commit"]["runs-on"] == "ubuntu-latest"
    assert lint["jobs"]["pre-commit"]["steps"][-1]["run"].startswith("pre-commit run --all-files")


def test_runner_compose_file():
    runner_dir = REPO_ROOT / "ci" / "github_runner"
    service = yaml.safe_load((runner_dir / "docker-compose.yml").read_text())["services"]["runner"]
    assert re.fullmatch(r"ghcr\.io/actions/actions-runner:\d+\.\d+\.\d+", service["image"])
    assert service["privileged"] is True and service["deploy"]["replicas"] == "${RUNNER_REPLICAS:-8}"
    assert service["environment"]["RUNNER_ALLOW_RUNASROOT"] == "1"
    volumes = service["volumes"]
    assert "/var/run/docker.sock:/var/run/docker.sock" in volumes
    assert "/home/runner/externals:/home/runner/externals" in volumes
    assert "${CLAWRL_CI_DATA_DIR:-/data/clawrl_ci}:${CLAWRL_CI_DATA_DIR:-/data/clawrl_ci}" in volumes
    script = service["command"][0]
    for part in [
        "./config.sh --unattended",
        "--disableupdate",
        '--work "$$CLAWRL_CI_DATA_DIR/runner_$$(hostname)"',
    ]:
        assert part in script
    assert script.rstrip().endswith("exec ./run.sh")
    assert ".env" in (runner_dir / ".gitignore").read_text().splitlines()
    example = (runner_dir / ".env.example").read_text()
    assert "GITHUB_RUNNER_URL=" in example and "GITHUB_RUNNER_TOKEN=" in example


def test_pre_commit_config_pins_every_hook_repo():
    config = yaml.safe_load((REPO_ROOT / ".pre-commit-config.yaml").read_text())
    hook_ids = {hook["id"] for repo in config["repos"] for hook in repo["hooks"]}
    assert {
        "ruff-check",
        "ruff-format",
        "check-yaml",
        "check-added-large-files",
        "detect-private-key",
    } <= hook_ids
    assert {"end-of-file-fixer", "trailing-whitespace"} <= hook_ids
    assert all(re.fullmatch(r"v\d+\.\d+\.\d+", repo["rev"]) for repo in config["repos"])


def test_ci_docs_cover_every_gpu_lock_exec_option_and_exit_code():
    docs = (REPO_ROOT / "docs" / "ci.md").read_text()
    options = [
        o
        for action in gpu_lock_exec.build_parser()._actions
        for o in action.option_strings
        if o.startswith("--")
    ]
    assert len(options) == 11
    assert [o for o in options if f"`{o}" not in docs] == []
    for code in ["124", "126", "127", "128+N"]:
        assert f"| {code} " in docs
    for step in [
        "docker compose up -d",
        "docker compose logs -f",
        "docker compose exec",
        "docker compose down",
        "run-ci-short",
    ]:
        assert step in docs


def test_hosted_cpu_job_runs_the_fault_tolerance_e2e_script():
    cpu = parse((WORKFLOWS_DIR / "cpu-test.yml").read_text())
    job = cpu["jobs"]["cpu-e2e-fault-tolerance"]
    assert job["runs-on"] == "ubuntu-latest"
    script = job["steps"][-1]["run"].split()[-1]
    assert script == "tests/e2e/cpu_fault_tolerance.py"
    text = (WORKFLOWS_DIR.parents[1] / script).read_text()
    assert "--use-fault-tolerance" in text and "--ci-test" in text
