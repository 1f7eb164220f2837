"""`clawrl debug show / replay-reward / send` end to end, on the files of a real tiny `clawrl train` run.

The module runs `clawrl train --dump-details DIR` once as a subprocess (1 rollout of 4 samples on the tiny
model, an eval before and after it), then runs each tool on what that run left: DIR/rollout_data/0.pt,
eval_0.pt, eval_1.pt, DIR/train_data/0.pt and DIR/tokenizer. `send` talks to the real built-in engine over
HTTP (tests/integration/cpu_server.py).
"""

import html
import json
import re
import socket
import subprocess
import sys

import pytest
import torch
from cpu_server import cpu_server

from clawrl.cli.main import main
from clawrl.debug.dump import load_rollout_dump, load_train_dump, save_rollout_dump, save_train_dump

pytestmark = pytest.mark.slow
# Rewards that differ between samples of a random model (0, 0.25, ..., 1 by the last token id), so the
# stats, advantages and replay comparisons below are not all equal numbers.
REWARD_SOURCE = "def reward(sample, **kw):\n    return (sample.tokens[-1] % 5) / 4\n"


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    """A finished tiny training run with --dump-details: {"model", "details", "eval"}."""
    from clawrl.demo.task import TaskSpec, write_task_files
    from clawrl.models.tiny import build_tiny_model

    root = tmp_path_factory.mktemp("debug-tools")
    (root / "spread_reward.py").write_text(REWARD_SOURCE)
    reward = f"{root / 'spread_reward.py'}:reward"
    model = build_tiny_model(root / "model", arch="qwen2", vocab_size=2048, hidden_size=64, num_layers=2)
    data = write_task_files(root / "data", TaskSpec(), seed=0, num_train=8, num_eval=4)
    details = root / "details"
    flags = [
        "--hf-checkpoint", str(model), "--prompt-data", str(data["train"]), "--input-key", "input",
        "--label-key", "label", "--apply-chat-template", "--custom-rm-path", reward,
        "--rollout-batch-size", "2", "--n-samples-per-prompt", "2", "--rollout-max-response-len", "8",
        "--rollout-temperature", "0.9", "--use-kl-loss", "--kl-loss-coef", "0.01", "--lr", "1e-3",
        "--actor-num-nodes", "1", "--actor-num-gpus-per-node", "1", "--rollout-num-gpus", "1",
        "--num-rollout", "1", "--eval-prompt-data", "demo", str(data["eval"]), "--eval-interval", "1",
        "--output-dir", str(root / "out"), "--run-name", "tools", "--dump-details", str(details),
    ]  # fmt: skip
    proc = subprocess.run([sys.executable, "-m", "clawrl.cli.main", "train", *flags],
                          capture_output=True, text=True, timeout=400)  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    return {"model": str(model), "details": details, "reward": reward}


def _debug(capsys, *argv) -> tuple[int, str, str]:
    code = main(["debug", *map(str, argv)])
    out, err = capsys.readouterr()
    return code, out, err


def test_run_left_the_files(run):
    details = run["details"]
    assert sorted(p.name for p in (details / "rollout_data").iterdir()) == ["0.pt", "eval_0.pt", "eval_1.pt"]
    assert (details / "tokenizer" / "tokenizer.json").is_file()
    dump = load_rollout_dump(details / "rollout_data" / "0.pt")
    assert dump.source_format == "clawrl" and dump.category == "train" and len(dump.samples) == 4
    assert load_rollout_dump(details / "rollout_data" / "eval_0.pt").category == "eval"


def test_show_dump_details_dir(run, capsys):
    details = run["details"]
    code, out, err = _debug(capsys, "show", details, "--max-samples", "1")
    assert code == 0, err
    headers = re.findall(r"^=== rollout (\S+) \((\w+)\) · (\d+) samples", out, re.M)
    assert headers == [("0", "train", "4"), ("eval_0", "eval", "4"), ("eval_1", "eval", "4")]
    dump = load_rollout_dump(details / "rollout_data" / "0.pt")
    rewards = [s.reward for s in dump.samples]
    assert len(set(rewards)) > 1, rewards  # else the std below checks nothing
    mean = sum(rewards) / 4
    std = (sum((r - mean) ** 2 for r in rewards) / 4) ** 0.5
    lengths = [s.response_length for s in dump.samples]
    truncated = sum(s.status.value == "truncated" for s in dump.samples) / 4
    first_block = out.split("=== rollout eval_0")[0]
    assert (
        f"reward mean {mean:.4g} std {std:.4g} · response len mean {sum(lengths) / 4:.1f} min {min(lengths)} "
        f"max {max(lengths)}" in first_block
    )
    assert f"truncated {truncated:.1%}" in first_block
    assert "weight versions 0" in first_block and "temperature=0.9" in first_block
    # metrics from the dump, the train dump and each optimizer step
    assert "rollout/raw_reward=" in first_block and "optimizer step 0:" in first_block
    assert "train/grad_norm=" in first_block
    # one sample shown, with its train record and its texts
    sample = dump.samples[0]
    assert first_block.count("  --- [") == 1 and "... 3 more samples" in first_block
    assert "train: step 0 mb 0 rank 0" in first_block and "|train-rollout logp| mean" in first_block
    assert f"response | {sample.response.splitlines()[0]}" in first_block
    assert "eval/demo=" in out


def test_show_template_categories_and_flags(run, capsys):
    template = f"{run['details']}/rollout_data/{{rollout_id}}.pt"
    code, out, _ = _debug(capsys, "show", template, "--category", "eval", "--no-samples", "--no-metrics")
    assert code == 0
    assert re.findall(r"^=== rollout (\S+)", out, re.M) == ["eval_0", "eval_1"]
    assert "metrics:" not in out and "  --- [" not in out
    # a template has no train dumps unless --train-data names them
    code, out, _ = _debug(capsys, "show", template, "--category", "train", "--full")
    assert (
        code == 0 and out.count("  --- [") == 4 and "optimizer step" not in out and "train: step" not in out
    )


def test_show_html(run, capsys, tmp_path):
    """The run's rollout 0 with a loss mask and trainer log-probs edited by hand, so that every colour
    and number on the page is known: sample 0 masks out every other response token, and its trainer
    log-probs are the rollout's + 0.5 (|diff| 0.5 -> red at (log10(0.5) + 4) / 4 = 0.92)."""
    details = run["details"]
    dump = load_rollout_dump(details / "rollout_data" / "0.pt")
    train = load_train_dump(details / "train_data" / "0.pt")
    sample, record = dump.samples[0], train["samples"][0]
    sample.loss_mask = [(r + 1) % 2 for r in range(sample.response_length)]
    record["loss_mask"] = torch.tensor(sample.loss_mask)
    record["log_probs"] = record["rollout_log_probs"] + 0.5
    save_rollout_dump(tmp_path / "d" / "0.pt", rollout_id=0, samples=dump.samples, meta=dump.meta)
    save_train_dump(tmp_path / "t" / "0.pt", train)
    page_path = tmp_path / "page.html"
    code, out, err = _debug(capsys, "show", tmp_path / "d" / "0.pt", "--train-data", f"{tmp_path}/t/{{rollout_id}}.pt",
                            "--html", page_path, "--tokenizer", details / "tokenizer", "--max-samples", "1")  # fmt: skip
    assert code == 0, err
    page = page_path.read_text()
    spans = re.findall(r"<span class='(p|m0|m1)'([^>]*)title='([^']*)'>(.*?)</span>", page, re.S)
    num_prompt = len(sample.tokens) - sample.response_length
    assert len(spans) == len(sample.tokens)
    assert [c for c, _, _, _ in spans] == ["p"] * num_prompt + ["m1", "m0"] * (sample.response_length // 2)
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(details / "tokenizer")
    assert [html.unescape(text) for _, _, _, text in spans] == [tok.decode([t]) for t in sample.tokens]
    rollout_lp = sample.rollout_log_probs[-1]
    last_style, last_title = spans[-1][1], html.unescape(spans[-1][2])
    assert f"rollout logp {rollout_lp:.6g}" in last_title
    assert f"trainer logp {record['log_probs'][-1].item():.6g}" in last_title and "|diff| 0.5" in last_title
    assert "background:rgba(220,38,38,0.92)" in last_style
    # without a tokenizer the page still works and shows ids
    code, _, _ = _debug(capsys, "show", tmp_path / "d" / "0.pt", "--html", page_path,
                        "--tokenizer", tmp_path / "no_tokenizer", "--max-samples", "1")  # fmt: skip
    page = page_path.read_text()
    assert code == 0 and f">[{sample.tokens[0]}]</span>" in page and "|diff|" not in page


def test_show_errors_are_one_line(run, capsys, tmp_path):
    code, out, err = _debug(capsys, "show", tmp_path / "missing.pt")
    assert code == 2 and err == f"clawrl debug show: error: {tmp_path / 'missing.pt'}: no such dump file\n"

    class Hook:
        def __reduce__(self):
            return (print, ("ran",))

    torch.save({"rollout_id": 0, "samples": [], "x": Hook()}, tmp_path / "evil.pt")
    code, out, err = _debug(capsys, "show", tmp_path / "evil.pt")
    assert code == 2 and "ran" not in out
    assert (
        err.startswith(f"clawrl debug show: error: {tmp_path / 'evil.pt'}: refused") and err.count("\n") == 1
    )


def test_replay_reward(run, capsys, tmp_path):
    path = run["details"] / "rollout_data" / "0.pt"
    samples = load_rollout_dump(path).samples
    old = [s.reward for s in samples]
    # the run's own reward function: every reward reproduces
    code, out, err = _debug(
        capsys, "replay-reward", path, "--custom-rm-path", run["reward"], "--json-out", tmp_path / "a.json"
    )
    assert code == 0, err
    summary = json.loads((tmp_path / "a.json").read_text())["summary"]
    assert summary["num_disagree"] == 0 and summary["disagreement_rate"] == 0.0
    assert summary["mean_old"] == pytest.approx(sum(old) / 4) and summary["mean_new"] == summary["mean_old"]
    assert f"disagreement 0/4 = 0.0% · mean old {sum(old) / 4:.6g}" in out
    # another reward: the number of response tokens, so new reward = response_length
    other = tmp_path / "length_reward.py"
    other.write_text("def reward(sample, **kw):\n    return float(sample.response_length)\n")
    code, out, err = _debug(capsys, "replay-reward", path, "--custom-rm-path", f"{other}:reward",
                            "--json-out", tmp_path / "b.json")  # fmt: skip
    assert code == 0, err
    result = json.loads((tmp_path / "b.json").read_text())
    new = [float(s.response_length) for s in samples]
    assert [r["new_reward"] for r in result["samples"]] == new
    assert [r["old_reward"] for r in result["samples"]] == old
    num_diff = sum(abs(a - b) > 1e-9 for a, b in zip(old, new, strict=True))
    assert result["summary"]["num_disagree"] == num_diff and result["summary"]["mean_new"] == sum(new) / 4
    first = out.splitlines()[1]
    assert first.startswith("    ") and "\\n" in first and "\n" not in first and len(first) <= 4 + 203
    code, _, err = _debug(capsys, "replay-reward", path)
    assert code == 2 and "pass --rm-type or --custom-rm-path" in err


def test_send_against_the_engine(run, capsys, tmp_path):
    prompts = tmp_path / "prompts.jsonl"
    rows = [{"input": "What is 2+2?", "label": "4"},
            {"input": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}]}]  # fmt: skip
    prompts.write_text("".join(json.dumps(r) + "\n" for r in rows))
    out_file = tmp_path / "responses.jsonl"
    with cpu_server(run["model"]) as server:
        code, _, err = _debug(capsys, "send", "--url", f"{server.url}/v1", "--prompt-data", prompts,
                              "--n-samples-per-prompt", "2", "--rollout-max-response-len", "6",
                              "--rollout-temperature", "0", "--output", out_file, "--concurrency", "3")  # fmt: skip
        assert code == 0, err
        from clawrl.engine.http.client import EngineClient

        with EngineClient(server.url, timeout=60) as client:
            expected = [
                client.chat_completions(m, max_tokens=6, temperature=0.0, top_p=1.0)["choices"][0]["message"][
                    "content"
                ]
                for m in ([{"role": "user", "content": rows[0]["input"]}], rows[1]["input"])
            ]
    lines = [json.loads(line) for line in out_file.read_text().splitlines()]
    assert [(x["row_index"], x["repeat_index"]) for x in lines] == [(0, 0), (0, 1), (1, 0), (1, 1)]
    assert lines[0]["label"] == "4" and lines[2]["input"] == rows[1]["input"]
    assert [x["response"] for x in lines] == [expected[0], expected[0], expected[1], expected[1]]
    assert all(x["response"] for x in lines)


def test_send_dead_url_is_one_error(capsys, tmp_path):
    prompts = tmp_path / "p.jsonl"
    prompts.write_text('{"input": "hi"}\n')
    with socket.socket() as s:  # a port nobody listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    code, out, err = _debug(capsys, "send", "--url", f"http://127.0.0.1:{port}", "--prompt-data", prompts,
                            "--timeout", "5")  # fmt: skip
    assert code == 2 and out == ""
    assert err.startswith(f"clawrl debug send: error: --url http://127.0.0.1:{port}: cannot reach the server")
    assert err.count("\n") == 1
