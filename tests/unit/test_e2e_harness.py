"""The GPU e2e tests' harness (tests/e2e/e2e_common.py) on CPU: the W&B flags helper and the proxy-free
environment of the launched training command.

    .venv/bin/pytest -q tests/unit/test_e2e_harness.py
"""

from __future__ import annotations

import importlib.util
import json
import re
import sys
from pathlib import Path

import pytest

E2E_COMMON = Path(__file__).resolve().parents[1] / "e2e" / "e2e_common.py"
PROXIES = {
    "http_proxy": "http://proxy:3128",
    "https_proxy": "http://proxy:3128",
    "HTTP_PROXY": "http://proxy:3128",
    "HTTPS_PROXY": "http://proxy:3128",
    "all_proxy": "socks5://proxy:1080",
    "ALL_PROXY": "socks5://proxy:1080",
    "no_proxy": "localhost",
    "NO_PROXY": "localhost",
}

# Stands in for the Python interpreter that run_clawrl launches (`python -m clawrl.cli.main ...`): records
# its arguments and environment, and writes the metrics file a finished run leaves in --output-dir.
RECORDING_INTERPRETER = """#!{python}
import json, os, sys
output_dir = sys.argv[sys.argv.index("--output-dir") + 1]
os.makedirs(output_dir)
with open(os.path.join(output_dir, "metrics.jsonl"), "w") as f:
    f.write(json.dumps({{"step": 0}}) + "\\n" + json.dumps({{"step": 1}}) + "\\n")
with open({record!r}, "w") as f:
    json.dump({{"argv": sys.argv[1:], "env": dict(os.environ)}}, f)
"""


@pytest.fixture
def harness():
    """A fresh import of e2e_common per test, so its once-per-process notice starts unprinted."""
    spec = importlib.util.spec_from_file_location("e2e_common_under_test", E2E_COMMON)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture
def ci_env(monkeypatch):
    for name in ("WANDB_API_KEY", "GITHUB_RUN_ID", "GITHUB_COMMIT_NAME"):
        monkeypatch.delenv(name, raising=False)
    return monkeypatch


def test_without_wandb_key_no_flags_and_one_notice(harness, ci_env, capsys):
    assert harness.wandb_flags("tests/e2e/test_gsm8k_colocated_short.py") == []
    assert harness.wandb_flags("tests/e2e/test_gsm8k_long.py") == []
    assert capsys.readouterr().out == "W&B skipped: WANDB_API_KEY is not set\n"
    ci_env.setenv("WANDB_API_KEY", "")  # the CI's value when the repository has no such secret
    assert harness.wandb_flags("tests/e2e/test_gsm8k_long.py") == []


def test_with_wandb_key_project_per_test_and_group_per_ci_run(harness, ci_env, capsys):
    ci_env.setenv("WANDB_API_KEY", "secret-key")
    ci_env.setenv("GITHUB_RUN_ID", "9876543210")
    ci_env.setenv("GITHUB_COMMIT_NAME", "0123abcd_42")
    flags = harness.wandb_flags("/repo/tests/e2e/test_gsm8k_colocated_short.py")
    assert flags == [
        "--use-wandb",
        "--wandb-project",
        "clawrl-test_gsm8k_colocated_short",
        "--wandb-group",
        "9876543210_0123abcd_42",
    ]
    assert "secret-key" not in " ".join(
        flags
    )  # the key travels in the environment, never in the printed command
    assert capsys.readouterr().out == ""


def test_local_run_groups_by_start_time(harness, ci_env):
    ci_env.setenv("WANDB_API_KEY", "secret-key")
    first = harness.wandb_flags("test_a.py")
    assert re.fullmatch(r"\d{6}-\d{6}", first[-1])  # UTC %y%m%d-%H%M%S, no commit name outside the CI
    assert harness.wandb_flags("test_b.py")[-1] == first[-1]  # one group for every test of this process
    ci_env.setenv("GITHUB_COMMIT_NAME", "0123abcd_non-pr")
    assert harness.wandb_flags("test_a.py")[-1] == first[-1] + "_0123abcd_non-pr"


def test_training_command_runs_without_proxy_variables(harness, monkeypatch, tmp_path):
    for name, value in PROXIES.items():
        monkeypatch.setenv(name, value)
    monkeypatch.setenv("WANDB_API_KEY", "secret-key")
    assert set(harness.PROXY_VARIABLES) >= set(PROXIES)
    env = harness.training_env()
    assert not set(PROXIES) & set(env) and env["WANDB_API_KEY"] == "secret-key"
    record = tmp_path / "record.json"
    interpreter = tmp_path / "python"
    interpreter.write_text(RECORDING_INTERPRETER.format(python=sys.executable, record=str(record)))
    interpreter.chmod(0o755)
    monkeypatch.setattr(harness.sys, "executable", str(interpreter))
    rows = harness.run_clawrl("train", ["--num-rollout", "2"], tmp_path / "out")
    assert rows == [{"step": 0}, {"step": 1}]
    launched = json.loads(record.read_text())
    assert launched["argv"] == [
        "-m",
        "clawrl.cli.main",
        "train",
        "--num-rollout",
        "2",
        "--output-dir",
        str(tmp_path / "out"),
    ]
    assert not set(PROXIES) & set(launched["env"]) and launched["env"]["WANDB_API_KEY"] == "secret-key"
    for name, value in PROXIES.items():  # this process keeps them, for downloads
        assert harness.os.environ[name] == value
