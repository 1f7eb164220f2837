"""HF export end to end: one real `clawrl train` run (1 trainer rank, 1 engine, 2 rollouts) with `--save` and
`--save-hf`, then `clawrl convert-checkpoint` on its checkpoints.

The exports load in transformers and in clawrl's engine, and both decode greedily exactly what the trainer's
final weights (read back from the --save checkpoint) decode; convert-checkpoint writes the same files,
bit for bit, as --save-hf did for the same rollout; forced small shards load; a bfloat16 source exports
bfloat16. One training run (~40 s on 2 cores), hence slow.
"""

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

pytestmark = pytest.mark.slow
REWARD = str(Path(__file__).with_name("loop_reward.py")) + ":reward"
NUM_NEW_TOKENS = 8


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """Paths of one 2-rollout run: source model, --save dir, --save-hf root; and the CLI's output."""
    from clawrl.demo.task import TaskSpec, write_task_files
    from clawrl.models.tiny import build_tiny_model

    root = tmp_path_factory.mktemp("hf_export")
    source = build_tiny_model(root / "model", arch="qwen2", vocab_size=2048, hidden_size=64, num_layers=2)
    data = write_task_files(root / "data", TaskSpec(), seed=0, num_train=64, num_eval=8)
    ckpt, exports = root / "ckpt", root / "exports"
    result = _clawrl(
        "train", "--hf-checkpoint", str(source), "--prompt-data", str(data["train"]), "--input-key", "input",
        "--label-key", "label", "--apply-chat-template", "--custom-rm-path", REWARD,
        "--rollout-batch-size", "4", "--n-samples-per-prompt", "2", "--rollout-max-response-len", "12",
        "--rollout-temperature", "0.9", "--global-batch-size", "8", "--lr", "1e-3", "--actor-num-nodes", "1",
        "--actor-num-gpus-per-node", "1", "--rollout-num-gpus", "1", "--num-rollout", "2",
        "--output-dir", str(root / "run"), "--save", str(ckpt), "--save-interval", "1",
        "--save-hf", str(exports / "hf_{rollout_id}"),
    )  # fmt: skip
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-5000:]
    return {"source": Path(source), "ckpt": ckpt, "exports": exports, "root": root, "log": result.stderr}


def _clawrl(*args, timeout=600):
    return subprocess.run(
        [sys.executable, "-m", "clawrl.cli.main", *args], capture_output=True, text=True, timeout=timeout
    )


def _prompts(model_dir: Path) -> list[list[int]]:
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(model_dir))
    texts = ["Tom has 3 apples and buys 4 more.", "What is 12 plus 7?", "A farmer counts 9 cows"]
    return [tokenizer(t)["input_ids"] for t in texts]


def _trainer_greedy(state: dict[str, torch.Tensor], source: Path, prompts) -> tuple[list[list[int]], float]:
    """Greedy tokens of the trainer's weights (native model, full recompute per token) and the smallest
    top-1 / top-2 logit gap met on the way."""
    from clawrl.models.attention import VarlenAttention
    from clawrl.trainer.actor import native_model_from

    model = native_model_from(state, str(source)).eval()
    outputs, min_gap = [], float("inf")
    with torch.no_grad():
        for prompt in prompts:
            ids = list(prompt)
            for _ in range(NUM_NEW_TOKENS):
                tokens = torch.tensor(ids)
                hidden = model(tokens, torch.arange(len(ids)), VarlenAttention.from_lengths([len(ids)]))
                top2 = model.compute_logits(hidden[-1:])[0].topk(2)
                min_gap = min(min_gap, float(top2.values[0] - top2.values[1]))
                ids.append(int(top2.indices[0]))
            outputs.append(ids[len(prompt) :])
    return outputs, min_gap


def _transformers_greedy(model_dir: Path, prompts) -> list[list[int]]:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    with torch.no_grad():
        return [
            model.generate(
                torch.tensor([p]),
                do_sample=False,
                max_new_tokens=NUM_NEW_TOKENS,
                min_new_tokens=NUM_NEW_TOKENS,
            )[0, len(p) :].tolist()  # fmt: skip
            for p in prompts
        ]


def _engine_greedy(model_dir: Path, prompts) -> list[list[int]]:
    from clawrl.engine.config import EngineConfig
    from clawrl.engine.core.engine import Engine
    from clawrl.engine.core.request import SamplingParams

    engine = Engine(EngineConfig(model_path=str(model_dir), num_kv_blocks=64, block_size=4))
    params = SamplingParams(max_new_tokens=NUM_NEW_TOKENS, temperature=0.0, ignore_eos=True)
    return [r["output_ids"] for r in engine.generate([list(p) for p in prompts], params)]


def _files(directory: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(directory.iterdir())}


def test_save_hf_exports_decode_exactly_as_the_trainer_weights(trained):
    from clawrl.trainer.checkpoint import find_iteration_dir, read_model_state

    exports, source = trained["exports"], trained["source"]
    assert sorted(p.name for p in exports.iterdir()) == ["hf_0", "hf_1"]  # every save; no staging left
    assert f"rollout 1: HF model written to {exports / 'hf_1'}" in trained["log"]
    state, meta = read_model_state(find_iteration_dir(trained["ckpt"]))
    assert meta["rollout_id"] == 1 and meta["extra"]["job"]["model"]["hf_checkpoint"] == str(source)

    final = exports / "hf_1"
    saved = load_file(final / "model.safetensors")
    assert saved.keys() == state.keys() - {"lm_head.weight"}  # tied, as the source stores it
    assert all(torch.equal(t, state[n]) for n, t in saved.items())  # fp32 source: the exact fp32 weights
    initial = load_file(source / "model.safetensors")
    assert not all(torch.equal(t, initial[n]) for n, t in saved.items())  # training moved the weights
    for name in ("tokenizer.json", "tokenizer_config.json", "generation_config.json"):
        assert (final / name).read_bytes() == (source / name).read_bytes(), name
    assert json.loads((final / "config.json").read_text())["dtype"] == "float32"

    prompts = _prompts(source)
    want, min_gap = _trainer_greedy(state, source, prompts)
    assert min_gap > 1e-3  # a meaningful comparison: no argmax decided by rounding
    assert _transformers_greedy(final, prompts) == want
    assert _engine_greedy(final, prompts) == want


def _convert(capsys, *args) -> tuple[int, str, str]:
    """`clawrl convert-checkpoint ARGS` in this process (it needs neither Ray nor a process group)."""
    from clawrl.cli.main import main

    capsys.readouterr()
    code = main(["convert-checkpoint", *map(str, args)])
    out, err = capsys.readouterr()
    return code, out, err


def test_convert_checkpoint_writes_the_save_hf_files_bit_for_bit(trained, capsys):
    root, ckpt, exports = trained["root"], trained["ckpt"], trained["exports"]
    code, _, err = _convert(capsys, ckpt, "--to-hf", root / "converted")
    assert code == 0, err
    assert _files(root / "converted") == _files(exports / "hf_1")  # source taken from the recorded job
    code, out, err = _convert(capsys, ckpt, "--step", 1, "--to-hf", root / "converted_0")
    assert code == 0, err
    assert out.startswith(f"clawrl convert-checkpoint: {ckpt / 'iter_0000001'} (after rollout 0) -> ")
    assert _files(root / "converted_0") == _files(exports / "hf_0")
    assert _files(exports / "hf_0") != _files(exports / "hf_1")

    sharded = root / "sharded"
    code, _, err = _convert(capsys, ckpt, "--to-hf", sharded, "--max-shard-size", 200_000)
    assert code == 0, err
    shards = sorted(p.name for p in sharded.glob("model-*.safetensors"))
    index = json.loads((sharded / "model.safetensors.index.json").read_text())
    assert len(shards) > 2 and sorted(set(index["weight_map"].values())) == shards
    merged = {n: t for shard in shards for n, t in load_file(sharded / shard).items()}
    single = load_file(exports / "hf_1" / "model.safetensors")
    assert merged.keys() == single.keys() and all(torch.equal(merged[n], t) for n, t in single.items())
    prompts = _prompts(trained["source"])
    assert _transformers_greedy(sharded, prompts) == _transformers_greedy(exports / "hf_1", prompts)


def test_convert_checkpoint_of_a_bfloat16_source_writes_bfloat16(trained, tmp_path, capsys):
    source = tmp_path / "bf16_source"
    shutil.copytree(trained["source"], source)
    config = json.loads((source / "config.json").read_text())
    (source / "config.json").write_text(json.dumps({**config, "dtype": "bfloat16"}))
    out = tmp_path / "bf16"
    code, stdout, err = _convert(capsys, trained["ckpt"], "--to-hf", out, "--hf-checkpoint", source)
    assert code == 0, err
    assert "written in bfloat16" in stdout
    fp32 = load_file(trained["exports"] / "hf_1" / "model.safetensors")
    saved = load_file(out / "model.safetensors")
    assert saved.keys() == fp32.keys()
    assert all(t.dtype == torch.bfloat16 and torch.equal(t, fp32[n].bfloat16()) for n, t in saved.items())
    assert json.loads((out / "config.json").read_text())["dtype"] == "bfloat16"
    code, _, err = _convert(
        capsys, trained["ckpt"], "--to-hf", tmp_path / "f32", "--dtype", "float32", "--hf-checkpoint", source
    )
    assert code == 0, err
    assert load_file(tmp_path / "f32" / "model.safetensors").keys() == fp32.keys()
    assert (
        _files(tmp_path / "f32")["model.safetensors"]
        == _files(trained["exports"] / "hf_1")["model.safetensors"]
    )


def test_convert_checkpoint_errors_are_one_line_with_exit_2(trained, tmp_path, capsys):
    ckpt, source = trained["ckpt"], trained["source"]
    unrecorded = tmp_path / "unrecorded"
    shutil.copytree(ckpt, unrecorded)
    meta = json.loads((unrecorded / "iter_0000002" / "meta.json").read_text())
    del meta["extra"]["job"]
    (unrecorded / "iter_0000002" / "meta.json").write_text(json.dumps(meta))
    other = tmp_path / "other_arch"
    shutil.copytree(source, other)
    config = json.loads((other / "config.json").read_text())
    (other / "config.json").write_text(json.dumps({**config, "model_type": "no_such_model"}))
    cases = [
        ([tmp_path / "missing"], f"{tmp_path / 'missing'}: no such directory"),
        ([source], f"{source}: not a clawrl checkpoint directory (no latest_checkpointed_iteration.txt"),
        ([ckpt, "--step", 7], f"{ckpt}: no checkpoint of iteration 7 (saved iterations: [1, 2])"),
        ([unrecorded], f"{unrecorded / 'iter_0000002'}: the checkpoint does not record its source model; "
         "pass --hf-checkpoint SOURCE"),
        ([ckpt, "--hf-checkpoint", other], f"{other}: unsupported architecture for a HF export: "),
    ]  # fmt: skip
    for args, message in cases:
        code, _, err = _convert(capsys, *args, "--to-hf", tmp_path / "out")
        lines = err.strip().splitlines()
        assert code == 2 and len(lines) == 1, (args, lines)
        assert lines[0].startswith(f"clawrl convert-checkpoint: error: {message}"), lines
    from clawrl.models.config import SUPPORTED_ARCHS

    assert (
        f"model_type 'no_such_model' is neither one clawrl implements ({', '.join(SUPPORTED_ARCHS)})"
        in lines[0]
    )
    assert not (tmp_path / "out").exists()
    code, _, _ = _convert(capsys, unrecorded, "--hf-checkpoint", source, "--to-hf", tmp_path / "out")
    assert code == 0 and _files(tmp_path / "out") == _files(trained["exports"] / "hf_1")


def test_save_hf_flag_template_and_save_interval_without_save():
    from clawrl.config import ConfigError, parse_job_args
    from clawrl.config.model import save_hf_path

    base = ["--rollout-batch-size", "4", "--num-rollout", "3"]
    job = parse_job_args([*base, "--save-hf", "out/hf_{rollout_id}", "--save-interval", "2"])
    assert job.model.save_hf == "out/hf_{rollout_id}" and job.model.save is None
    assert save_hf_path(job.model.save_hf, 7) == "out/hf_7" and save_hf_path("out/final", 7) == "out/final"
    with pytest.raises(ConfigError) as info:
        parse_job_args([*base, "--save-hf", "out/{step}"])
    assert (
        str(info.value)
        == "--save-hf 'out/{step}': the only field a template may use is {rollout_id} (KeyError('step'))"
    )
    with pytest.raises(ConfigError, match=r"^--save-interval 2 requires --save DIR or --save-hf TEMPLATE$"):
        parse_job_args([*base, "--save-interval", "2"])
