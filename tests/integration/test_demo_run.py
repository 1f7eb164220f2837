"""`clawrl demo` end to end with a micro recipe: SFT in-process, then GRPO through Ray, HTTP and FSDP2.

The accuracy bar belongs to the full recipe (a ~4-minute run, quoted in docs/benchmarks.md); this checks
that the command produces everything it promises: eval before RL and after the last weights, the metrics
stream, the report and summary.json, and that a second run refuses to overwrite the first.
"""

import json

import pytest

from clawrl.cli.main import main
from clawrl.demo.recipe import micro_recipe
from clawrl.demo.run import run_demo

pytestmark = pytest.mark.slow


def test_demo_writes_metrics_report_and_summary_and_refuses_to_overwrite(tmp_path, capsys):
    out = tmp_path / "demo"
    lines = []
    summary = run_demo(out, recipe=micro_recipe(seed=1), echo=lines.append)

    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    evals = [(r["step"], r["eval/demo"]) for r in rows if "eval/demo" in r]
    # eval before RL (step 0), after each of the 2 rollouts; the last row holds only the final weights' eval
    assert [step for step, _ in evals] == [0, 1, 2]
    assert all(0.0 <= score <= 1.0 for _, score in evals)
    assert summary["eval_before_rl"] == evals[0][1] and summary["eval_after_rl"] == evals[-1][1]
    assert summary["eval_gain"] == pytest.approx(evals[-1][1] - evals[0][1])
    assert json.loads((out / "summary.json").read_text()) == json.loads(json.dumps(summary))
    train_rows = [r for r in rows if "train/loss" in r]
    assert len(train_rows) == 2
    for row in train_rows:
        assert 0.0 <= row["rollout/raw_reward"] <= 1.0
        assert (
            row["train/train_rollout_logprob_abs_diff"] <= 1e-5
        )  # fp32: the engine serves the trainer's weights
    assert train_rows[0]["train/ppo_kl"] == 0.0
    assert (out / "report" / "index.html").is_file() and (out / "report" / "eval.png").is_file()
    assert (out / "sft_model" / "model.safetensors").is_file()
    assert "SFT step 4/4" in "\n".join(lines) and "before RL" in lines[-1]

    assert main(["demo", "--output-dir", str(out)]) == 2
    err = capsys.readouterr().err
    assert "clawrl demo: error:" in err and str(out) in err and "--output-dir" in err
