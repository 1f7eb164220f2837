"""The built-in --custom-tis-function-path functions (clawrl.algo.tis: vanilla_tis_function, icepop_function,
mis_function) on two hand-made samples, with the numbers worked out by hand.

Sample A: train [-1.0, -2.0, -0.5], rollout [-1.5, -1.0, -0.5], mask [1, 1, 1]
          -> train - rollout d = [0.5, -1.0, 0.0], ratios [e^0.5, e^-1, 1] = [1.6487, 0.3679, 1]
Sample B: train [-0.2, -0.3], rollout [-0.9, -0.3], mask [1, 0] -> d = [0.7, 0.0], ratios [2.0138, 1]

    .venv/bin/pytest tests/unit/test_mismatch_functions.py -x -q -p no:cacheprovider
"""

from __future__ import annotations

import math
from types import SimpleNamespace

import pytest
import torch

from clawrl.algo.tis import icepop_function, mis_function, vanilla_tis_function

E = math.exp
TRAIN = [torch.tensor([-1.0, -2.0, -0.5]), torch.tensor([-0.2, -0.3])]
ROLLOUT = [torch.tensor([-1.5, -1.0, -0.5]), torch.tensor([-0.9, -0.3])]
MASKS = [torch.tensor([1.0, 1.0, 1.0]), torch.tensor([1.0, 0.0])]


def _args(**kw) -> SimpleNamespace:
    values = dict(tis_clip=2.0, tis_clip_low=0.0, use_tis=True, tis_level="token", tis_mode="truncate",
                  tis_upper_bound=2.0, tis_lower_bound=None, tis_batch_normalize=False, use_rs=False,
                  rs_level="token", rs_lower_bound=None, rs_upper_bound=None, rs_veto_threshold=None)  # fmt: skip
    return SimpleNamespace(**{**values, **kw})


def _call(fn, **kw):
    """fn on the two samples with pg_loss = 1 per token: the returned pg_loss is the weight."""
    return fn(args=_args(**kw), pg_loss=torch.ones(5), train_log_probs=TRAIN, rollout_log_probs=ROLLOUT,
              loss_masks=MASKS, total_lengths=[7, 4], response_lengths=[3, 2])  # fmt: skip


def _close(got, want):
    assert torch.as_tensor(got).tolist() == pytest.approx(want, abs=1e-5)


def test_vanilla_clamps_the_ratio_and_reports_it_unclamped():
    weights, masks, metrics = _call(vanilla_tis_function, tis_clip=1.5, tis_clip_low=0.5)
    _close(weights, [1.5, 0.5, 1.0, 1.5, 1.0])
    assert masks is MASKS
    _close(metrics["tis"], [E(0.5), E(-1), 1.0, E(0.7), 1.0])
    _close(metrics["tis_clipfrac"], [1, 1, 0, 1, 0])
    _close(metrics["tis_abs"], [E(0.5) - 1, 1 - E(-1), 0, E(0.7) - 1, 0])


def test_icepop_zeroes_the_ratio_outside_the_bounds():
    weights, _, metrics = _call(icepop_function, tis_clip=1.5, tis_clip_low=0.5)
    _close(weights, [0.0, 0.0, 1.0, 0.0, 1.0])
    _close(metrics["tis_clipfrac"], [1, 1, 0, 1, 0])


def test_mis_token_truncate():
    weights, masks, metrics = _call(mis_function)
    _close(weights, [E(0.5), E(-1), 1.0, 2.0, 0.0])  # masked tokens get weight 0
    _close(torch.cat(masks), [1, 1, 1, 1, 0])
    _close(metrics["mis_truncate_fraction"], [0, 0, 0, 1, 0])
    _close(metrics["mis_tis_weight_before_bound"], [E(0.5), E(-1), 1.0, E(0.7), 1.0])


def test_mis_sequence_clip_uses_the_product_of_ratios():
    weights, _, metrics = _call(mis_function, tis_level="sequence", tis_mode="clip", tis_lower_bound=0.5)
    _close(weights, [E(-0.5)] * 3 + [2.0, 0.0])  # A: e^(0.5 - 1 + 0); B: e^0.7 clipped to 2
    _close(metrics["mis_clip_fraction_high"], [0, 0, 0, 1, 1])
    _close(metrics["mis_clip_fraction_low"], [0] * 5)


def test_mis_geometric_mask_drops_samples_outside_the_bounds_from_the_mask():
    weights, masks, metrics = _call(mis_function, tis_level="geometric", tis_mode="mask", tis_upper_bound=1.2)
    _close(weights, [E(-0.5 / 3)] * 3 + [E(0.7), 0.0])  # weights kept, B leaves the mask instead
    _close(torch.cat(masks), [1, 1, 1, 0, 0])
    _close(metrics["mis_mask_fraction_high"], [0, 0, 0, 1, 1])


def test_mis_batch_normalize_rescales_to_mean_one_over_the_masked_tokens():
    weights, _, metrics = _call(mis_function, tis_batch_normalize=True)
    mean = (E(0.5) + E(-1) + 1 + 2) / 4
    _close(weights, [E(0.5) / mean, E(-1) / mean, 1 / mean, 2 / mean, 0.0])
    _close(metrics["mis_batch_norm_factor"], [mean] * 5)


def test_mis_sequence_batch_normalize_averages_the_samples():
    weights, _, _ = _call(mis_function, tis_level="sequence", tis_batch_normalize=True)
    mean = (E(-0.5) + 2.0) / 2  # A's weight e^-0.5 on every token; B truncated to 2
    _close(weights, [E(-0.5) / mean] * 3 + [2 / mean, 0.0])


def test_mis_rejection_sampling_and_veto():
    weights, masks, metrics = _call(mis_function, use_rs=True, rs_lower_bound=0.5, rs_upper_bound=1.8,
                                    rs_veto_threshold=0.4)  # fmt: skip
    _close(torch.cat(masks), [0, 0, 0, 0, 0])  # A vetoed by its e^-1 token, B's e^0.7 above 1.8
    _close(weights, [E(0.5), E(-1), 1.0, 2.0, 0.0])  # IS weights unaffected
    _close(metrics["mis_rs_mask_fraction_low"], [0, 1, 0, 0, 0])
    _close(metrics["mis_rs_mask_fraction_high"], [0, 0, 0, 1, 0])
    _close(metrics["mis_catastrophic_token_fraction"], [0, 1, 0, 0, 0])
    _close(metrics["mis_catastrophic_seq_fraction"], [1, 1, 1, 0, 0])


def test_mis_without_use_tis_only_measures_and_rejects():
    weights, masks, metrics = _call(mis_function, use_tis=False, use_rs=True, rs_upper_bound=1.8)
    _close(weights, [1.0] * 5)
    _close(torch.cat(masks), [1, 0, 1, 0, 0])  # default lower bound 1 / --tis-upper-bound = 0.5
    _close(metrics["mis_rs_mask_fraction_low"], [0, 1, 0, 0, 0])


def test_mis_perplexity_and_kl_metrics():
    _, _, metrics = _call(mis_function, use_tis=False)
    assert not any(k.startswith("mis_tis") for k in metrics)
    _close(metrics["mis_training_log_ppl"], [3.5 / 3] * 3 + [0.2] * 2)
    _close(metrics["mis_rollout_log_ppl"], [1.0] * 3 + [0.9] * 2)
    _close(metrics["mis_training_ppl"], [E(3.5 / 3)] * 3 + [E(0.2)] * 2)
    _close(metrics["mis_log_ppl_diff"], [3.5 / 3 - 1] * 3 + [-0.7] * 2)
    _close(metrics["mis_ppl_ratio"], [E(3.5 / 3 - 1)] * 3 + [E(-0.7)] * 2)
    _close(metrics["mis_kl"], [-0.5, 1.0, 0.0, -0.7, 0.0])
    _close(metrics["mis_k3_kl"], [E(0.5) - 1.5, E(-1), 0.0, E(0.7) - 1.7, 0.0])
