"""Bad inputs fail fast: before Ray starts, with one line naming the flag, file (and line) and the value,
exit code 2, in a few seconds, and nothing written (the output directory is not even created).

The one-line stderr already shows Ray never started (it prints its own line, and clawrl "Ray ready"). The time
bound, 8 s, catches a check that moved after the start-up (a tiny run's start-up alone takes ~12 s); the
slowest case, the architecture check, imports transformers and took 5.0 s once on 2 cores busy with a
parallel test worker, so a tighter bound measured the machine's load rather than the order of the checks."""

import json
import subprocess
import sys
import time
from pathlib import Path

import pytest

REWARD = str(Path(__file__).with_name("loop_reward.py")) + ":reward"


@pytest.fixture(scope="module")
def inputs(tmp_path_factory):
    from clawrl.models.tiny import build_tiny_model

    root = tmp_path_factory.mktemp("preflight")
    model = build_tiny_model(root / "model", arch="qwen2", vocab_size=2048, hidden_size=64, num_layers=1)
    odd = root / "odd_model"
    odd.mkdir()
    (odd / "config.json").write_text(json.dumps({"model_type": "gpt_neox", "hidden_size": 8}))
    good = root / "good.jsonl"
    good.write_text('{"input": "1+1?", "label": "2"}\n' * 4)
    broken = root / "broken.jsonl"
    broken.write_text(
        '{"input": "a", "label": "1"}\n{"input": "b", "label": "2"}\n{"input": "c", "label": \n'
    )
    no_key = root / "no_key.jsonl"
    no_key.write_text('{"input": "a", "label": "1"}\n{"question": "b", "label": "2"}\n')
    bad_sig = root / "bad_sig.py"
    bad_sig.write_text("async def reward(a, b, c, d):\n    return 0.0\n")
    blocker = root / "blocker"
    blocker.write_text("a file where the output directory should go")
    return {"model": str(model), "odd": str(odd), "good": str(good), "broken": str(broken),
            "no_key": str(no_key), "bad_sig": str(bad_sig), "blocker": str(blocker), "root": root}  # fmt: skip


CASES = {
    "missing --hf-checkpoint": (["--hf-checkpoint"], "--hf-checkpoint is required"),
    "no such model dir": (
        ["--hf-checkpoint", "{root}/nope"],
        "--hf-checkpoint '{root}/nope': no such directory",
    ),
    "unsupported architecture": (["--hf-checkpoint", "{odd}"], "model_type 'gpt_neox' is not supported"),
    "missing dataset": (["--prompt-data", "{root}/none.jsonl"], "none.jsonl: prompt data file not found"),
    "malformed line": (["--prompt-data", "{broken}"], "broken.jsonl line 3: malformed JSON"),
    "input key absent": (["--prompt-data", "{no_key}"], "no_key.jsonl line 2: no --input-key 'input' field"),
    "unknown reward type": (["--rm-type", "nonsense"], "nonsense"),
    "reward not importable": (["--custom-rm-path", "no_such_module_xyz.reward"], "no_such_module_xyz"),
    "reward bad signature": (["--custom-rm-path", "{bad_sig}:reward"], "cannot tell how to call it"),
    "output dir blocked": (["--output-dir", "{blocker}/out"], "is a file, not a directory"),
}


def _argv(inputs, override: list[str], out: Path) -> list[str]:
    base = {
        "--hf-checkpoint": inputs["model"], "--prompt-data": inputs["good"], "--custom-rm-path": REWARD,
        "--output-dir": str(out),
    }  # fmt: skip
    values = [v.format(**inputs) for v in override]
    flags = dict(base)
    if values == ["--hf-checkpoint"]:
        del flags["--hf-checkpoint"]
    else:
        flags.update(dict(zip(values[::2], values[1::2], strict=True)))
        if "--rm-type" in flags:
            del flags["--custom-rm-path"]
    argv = [item for pair in flags.items() for item in pair]
    return [*argv, "--input-key", "input", "--label-key", "label", "--rollout-batch-size", "2",
            "--num-rollout", "1", "--actor-num-gpus-per-node", "1", "--rollout-num-gpus", "1"]  # fmt: skip


@pytest.mark.parametrize("case", list(CASES))
def test_bad_input_is_one_line_exit_2_fast_and_writes_nothing(inputs, tmp_path, case):
    override, expected = CASES[case]
    out = tmp_path / "out"
    started = time.monotonic()
    result = subprocess.run(
        [sys.executable, "-m", "clawrl.cli.main", "train", *_argv(inputs, override, out)],
        capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    elapsed = time.monotonic() - started
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert result.returncode == 2, result.stderr
    assert len(lines) == 1 and lines[0].startswith("clawrl train: error: "), result.stderr
    assert expected.format(**inputs) in lines[0]
    assert result.stdout == ""
    assert not out.exists()
    assert elapsed < 8.0, f"{case}: {elapsed:.1f} s"
