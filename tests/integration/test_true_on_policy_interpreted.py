"""--true-on-policy-mode end to end on CPU under the Triton interpreter: the real Engine (GPU runner path,
batch-invariant kernels, chunked prefill, mixed prefill/decode steps, greedy and sampled rows at two
temperatures) generates sequences of a tiny random model; the trainer's log-prob pass
(clawrl/trainer/rl_step.py `forward_log_probs`) on the same sequences packed into one micro-batch, with the
native non-fused model (separate q/k/v and gate/up) switched to the same kernels, gives exactly the engine's
log-probs. The default trainer path on the same inputs is only close, which shows the comparison can fail.

tests/gpu/test_true_on_policy.py is the same check in bf16 on an H200 with CUDA graphs.
"""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent.parent / "unit"))
sys.path.insert(0, str(Path(__file__).parent))
import pytest
import torch  # noqa: E402
from interpreted_triton import replace_tests_if_triton_was_imported_too_early  # noqa: E402  (before triton)
from test_engine_core import make_checkpoint  # noqa: E402

from clawrl.data.train_batch import TrainBatch  # noqa: E402
from clawrl.engine.config import EngineConfig  # noqa: E402
from clawrl.engine.core.engine import Engine  # noqa: E402
from clawrl.engine.core.request import SamplingParams  # noqa: E402
from clawrl.engine.runner.gpu_runner import GpuModelRunner  # noqa: E402
from clawrl.models.batch_invariant import enable_batch_invariant  # noqa: E402
from clawrl.models.hf_io import load_model  # noqa: E402
from clawrl.trainer.micro_batch import build_micro_batch  # noqa: E402
from clawrl.trainer.rl_step import forward_log_probs  # noqa: E402

PROMPTS = [[5, 17, 301, 44], [9, 2, 77, 120, 18, 400, 3, 61, 250], [33, 12]]
TEMPERATURE = 0.8
MAX_NEW = 6

pytestmark = pytest.mark.usefixtures("one_torch_thread")  # tiny matmuls: see tests/conftest.py


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return make_checkpoint(tmp_path_factory.mktemp("tiny_true_on_policy"), seed=3)


@pytest.fixture(scope="module")
def rollout(ckpt):
    """(prompt + response token lists, response lengths, engine log-probs) of a few sampled sequences."""
    config = EngineConfig(
        model_path=str(ckpt),
        device="cpu",
        true_on_policy_mode=True,
        block_size=4,
        num_kv_blocks=64,
        max_num_batched_tokens=8,
        max_running_requests=4,
        enable_cuda_graph=False,
    )  # fmt: skip  (8-token steps: the 9-token prompt is prefilled in two chunks beside decode tokens)
    engine = Engine(config)
    assert isinstance(engine.runner, GpuModelRunner) and engine.runner.batch_invariant
    params = [SamplingParams(max_new_tokens=MAX_NEW, temperature=TEMPERATURE, seed=7 + i, ignore_eos=True)
              for i in range(len(PROMPTS))]  # fmt: skip
    results = engine.generate(PROMPTS, params)
    tokens = [p + r["output_ids"] for p, r in zip(PROMPTS, results, strict=True)]
    return tokens, [len(r["output_ids"]) for r in results], [r["logprobs"] for r in results]


def trainer_log_probs(ckpt, tokens, response_lengths, *, batch_invariant: bool) -> torch.Tensor:
    model = load_model(str(ckpt), fused=False, device="cpu", dtype=torch.float32)
    if batch_invariant:
        enable_batch_invariant(model)
    batch = TrainBatch(
        rollout_id=0, tokens=tokens, response_lengths=response_lengths,
        loss_masks=[[1] * n for n in response_lengths], rewards=[0.0] * len(tokens),
        raw_rewards=[0.0] * len(tokens),
    )  # fmt: skip
    mb = build_micro_batch(batch, list(range(len(tokens))), torch.device("cpu"))
    with torch.no_grad():
        log_probs, _ = forward_log_probs(model, mb, TEMPERATURE, with_entropy=False)
    return log_probs


def test_trainer_log_probs_equal_the_engines_bit_for_bit(ckpt, rollout):
    tokens, response_lengths, engine_log_probs = rollout
    assert response_lengths == [MAX_NEW] * len(PROMPTS)
    expected = torch.tensor([lp for row in engine_log_probs for lp in row], dtype=torch.float32)
    got = trainer_log_probs(ckpt, tokens, response_lengths, batch_invariant=True)
    assert torch.equal(got, expected), (got - expected).abs().max()


def test_trainer_with_several_tokens_per_attention_program_still_equals_the_engine(
    ckpt, rollout, monkeypatch
):
    # the engine ran one token per attention program; the trainer's packed forward now puts up to 8 tokens
    # (16 rows / 2 query heads per KV head) of a sequence in one: a row's bits must not change
    from clawrl.models import batch_invariant as bi

    monkeypatch.setattr(bi, "PREFILL_QUERY_BLOCKS", True)
    assert bi.layout_block_m(4, 2) == 8
    tokens, response_lengths, engine_log_probs = rollout
    expected = torch.tensor([lp for row in engine_log_probs for lp in row], dtype=torch.float32)
    got = trainer_log_probs(ckpt, tokens, response_lengths, batch_invariant=True)
    assert torch.equal(got, expected), (got - expected).abs().max()


def test_default_trainer_path_differs(ckpt, rollout):
    tokens, response_lengths, engine_log_probs = rollout
    expected = torch.tensor([lp for row in engine_log_probs for lp in row], dtype=torch.float32)
    got = trainer_log_probs(ckpt, tokens, response_lengths, batch_invariant=False)
    assert not torch.equal(got, expected)
    torch.testing.assert_close(got, expected, atol=1e-4, rtol=0)


replace_tests_if_triton_was_imported_too_early(globals(), __file__)
