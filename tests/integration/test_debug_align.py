"""`clawrl debug align` end to end on a tiny 3-layer model (fp32, CPU): the real engine against the trainer.

Same checkpoint on both sides -> every per-layer hidden-state difference and every log-prob difference is
within 1e-5 and no divergence is named; an engine checkpoint whose layer 1 MLP down projection is perturbed ->
layer 1 is named as the first divergence while the embedding and layer 0 stay aligned; a rollout dump written
from real engine generations (at temperature 0.7) is aligned, and its recorded log-probs agree with both
sides only when the tool uses the dump's temperature; bad input exits 2 with one error line.

    .venv/bin/pytest tests/integration/test_debug_align.py -x -q -p no:cacheprovider
"""

from __future__ import annotations

import argparse
import json
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from clawrl.data.sample import Sample, Status
from clawrl.debug import align
from clawrl.debug.dump import save_rollout_dump
from clawrl.engine.config import EngineConfig
from clawrl.engine.core.engine import Engine
from clawrl.engine.core.request import SamplingParams

TOL = 1e-5
NUM_LAYERS = 3


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory, one_torch_thread):
    from clawrl.models.tiny import build_tiny_model

    root = tmp_path_factory.mktemp("align")
    return str(
        build_tiny_model(root / "m", arch="qwen2", vocab_size=2048, hidden_size=64, num_layers=NUM_LAYERS)
    )


@pytest.fixture(scope="module")
def perturbed_dir(model_dir, tmp_path_factory):
    """The same checkpoint with layer 1's mlp.down_proj weight shifted by small random noise."""
    out = tmp_path_factory.mktemp("perturbed") / "m"
    shutil.copytree(model_dir, out)
    weights = load_file(str(out / "model.safetensors"))
    name = "model.layers.1.mlp.down_proj.weight"
    weights[name] = weights[name] + 0.05 * torch.randn(
        weights[name].shape, generator=torch.Generator().manual_seed(0)
    )
    save_file(weights, str(out / "model.safetensors"), metadata={"format": "pt"})
    return str(out)


def run_align(argv: list[str], capsys) -> tuple[int, str, str]:
    parser = argparse.ArgumentParser(prog="clawrl debug align")
    align.add_arguments(parser)
    code = align.run(parser.parse_args(argv))
    captured = capsys.readouterr()
    return code, captured.out, captured.err


def test_same_checkpoint_is_aligned_and_forcing_reproduces_the_sampler(model_dir, tmp_path, capsys):
    out_json = tmp_path / "align.json"
    code, out, err = run_align(
        ["--hf-checkpoint", model_dir, "--prompt", "The cat sat on", "--prompt", "12 + 7 =",
         "--max-new-tokens", "10", "--temperature", "0.9", "--seed", "3", "--json-out", str(out_json)],
        capsys,
    )  # fmt: skip
    assert code == 0, err
    summary = json.loads(out_json.read_text())
    assert summary["num_samples"] == 2 and summary["num_positions"] == 20
    assert [layer["name"] for layer in summary["layers"]] == ["embed", "0", "1", "2", "norm"]
    assert all(layer["max"] <= TOL for layer in summary["layers"]), summary["layers"]
    assert summary["layers"][0]["max"] == 0.0  # an embedding lookup is exact on both sides
    assert summary["logprob"]["max"] <= TOL and summary["logprob"]["num_above_tolerance"] == 0
    assert summary["first_divergence"] is None
    assert "no divergence above 1e-05" in out
    # Replayed with the generation's seeds, the engine's sampler draws every recorded token again, and the
    # forced log-prob computed from the step's logits is bit-identical to the one the sampler returns.
    assert summary["sampler_check"] == {"num_steps": 20, "max_abs_diff": 0.0}
    # The responses were generated now by the same engine: its recorded log-probs are reproduced.
    assert summary["recorded"]["engine"]["count"] == 20 and summary["recorded"]["engine"]["max"] <= TOL
    assert len(summary["logprob"]["worst"]) == 5


def test_perturbed_layer_is_named_as_first_divergence(model_dir, perturbed_dir, tmp_path, capsys):
    out_json = tmp_path / "align.json"
    code, out, err = run_align(
        ["--hf-checkpoint", model_dir, "--engine-checkpoint", perturbed_dir, "--prompt", "The cat sat on",
         "--max-new-tokens", "8", "--temperature", "0", "--json-out", str(out_json)],
        capsys,
    )  # fmt: skip
    assert code == 0, err
    summary = json.loads(out_json.read_text())
    layers = {layer["name"]: layer for layer in summary["layers"]}
    assert layers["embed"]["max"] <= TOL and layers["0"]["max"] <= TOL
    assert layers["1"]["max"] > 1e-3 and layers["2"]["max"] > 1e-3
    assert summary["first_divergence"]["layer"] == "1"
    assert f"first divergence: layer 1 (max |dh| {layers['1']['max']:.1e} > 1e-05)" in out
    assert summary["logprob"]["num_above_tolerance"] > 0


def write_dump(model_dir: str, path, *, temperature: float) -> list[Sample]:
    """A rollout dump (save_rollout_dump, sampling params recorded) of real engine generations: 4 samples,
    2 per prompt, plus one aborted sample without a response."""
    engine = Engine(EngineConfig(model_path=model_dir, device="cpu", dtype="float32"))
    prompts = [
        engine.tokenizer("Tom has 3 apples")["input_ids"],
        engine.tokenizer("Hello there")["input_ids"],
    ]
    params = SamplingParams(max_new_tokens=9, temperature=temperature, seed=5, n=2)
    samples = []
    for i, out in enumerate(engine.generate(prompts, params)):
        sample = Sample(index=i, group_index=i // 2, tokens=list(prompts[i // 2]))
        sample.append_response(out["output_ids"], out["logprobs"], engine.tokenizer.decode(out["output_ids"]))
        sample.apply_finish(out["finish_reason"], out["weight_version"])
        sample.reward = 0.0
        samples.append(sample)
    samples.append(Sample(index=4, group_index=2, tokens=list(prompts[0]), status=Status.ABORTED))
    meta = {"sampling_params": {"temperature": temperature, "max_new_tokens": 9}, "weight_version": "0"}
    save_rollout_dump(path, rollout_id=0, samples=samples, meta=meta)
    return samples


def test_rollout_dump_aligned_at_its_temperature(model_dir, tmp_path, capsys):
    dump = tmp_path / "rollout_0.pt"
    samples = write_dump(model_dir, dump, temperature=0.7)
    out_json = tmp_path / "align.json"
    code, out, err = run_align(
        ["--hf-checkpoint", model_dir, "--dump", str(dump), "--json-out", str(out_json)],
        capsys,
    )  # fmt: skip
    assert code == 0, err
    assert "skipping 1 sample(s)" in err  # the aborted one has no response
    summary = json.loads(out_json.read_text())
    num_tokens = sum(s.response_length for s in samples)
    assert summary["temperature"] == 0.7  # taken from the dump's sampling params
    assert summary["num_samples"] == 4 and summary["num_positions"] == num_tokens == 36
    assert summary["first_divergence"] is None and summary["logprob"]["max"] <= TOL
    recorded = summary["recorded"]
    assert recorded["engine"]["count"] == num_tokens
    assert recorded["engine"]["max"] <= TOL and recorded["trainer"]["max"] <= TOL
    # The worst positions point back at the dump's samples and tokens.
    for worst in summary["logprob"]["worst"]:
        sample = samples[worst["sample"]]
        response = sample.tokens[len(sample.tokens) - sample.response_length :]
        assert response[worst["position"]] == worst["token"]

    # At the wrong temperature the hidden states still agree, but the recorded log-probs do not.
    code, out, err = run_align(
        ["--hf-checkpoint", model_dir, "--dump", str(dump), "--temperature", "1", "--json-out", str(out_json)],
        capsys,
    )  # fmt: skip
    summary = json.loads(out_json.read_text())
    assert code == 0 and summary["temperature"] == 1.0 and summary["first_divergence"] is None
    assert summary["recorded"]["trainer"]["max"] > 1e-2 and summary["recorded"]["engine"]["max"] > 1e-2


def test_bad_input_exits_2_with_one_error_line(model_dir, tmp_path, capsys):
    empty = tmp_path / "empty.pt"
    torch.save({"rollout_id": 0, "samples": []}, empty)
    pickled = tmp_path / "pickled.pt"
    torch.save({"rollout_id": 0, "samples": [argparse.Namespace(tokens=[1, 2])]}, pickled)
    cases = [
        (["--hf-checkpoint", str(tmp_path / "nope"), "--prompt", "hi"], "--hf-checkpoint"),
        (["--hf-checkpoint", model_dir, "--dump", str(empty)], "holds no samples"),
        (["--hf-checkpoint", model_dir, "--dump", str(tmp_path / "missing.pt")], "no such dump file"),
        (["--hf-checkpoint", model_dir, "--dump", str(pickled)], "refused"),
        (
            ["--hf-checkpoint", model_dir, "--prompt", "hi", "--tolerance", "-1"],
            "--tolerance -1.0: must be >= 0",
        ),
    ]
    for argv, expected in cases:
        code, out, err = run_align(argv, capsys)
        assert code == 2, (argv, out, err)
        lines = err.strip().splitlines()
        assert len(lines) == 1 and lines[0].startswith("clawrl debug align: error: ") and expected in lines[0]
