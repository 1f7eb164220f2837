"""LR schedules (constant / linear / cosine with warmup) against hand-computed values; LRSchedule and AdamW."""

import math

import pytest
import torch

from clawrl.trainer.optim import LRSchedule, build_adamw, lr_at

# lr 1.0 -> 0.1 over 12 steps, 2 of them warmup: decay runs over steps 2..12 (10 steps).
KW = dict(lr=1.0, min_lr=0.1, warmup_iters=2, total_iters=12)


@pytest.mark.parametrize("style", ["constant", "linear", "cosine"])
def test_warmup_is_linear_from_zero_and_reaches_lr(style):
    assert lr_at(0, style=style, **KW) == pytest.approx(0.5)  # (0 + 1) / 2
    assert lr_at(1, style=style, **KW) == pytest.approx(1.0)
    assert lr_at(2, style=style, **KW) == pytest.approx(1.0)  # first decay step: progress 0


def test_constant_stays_at_lr():
    assert [lr_at(s, style="constant", **KW) for s in (2, 7, 12, 50)] == [1.0] * 4


def test_linear_decay_hand_computed():
    # lr - (lr - min_lr) * (step - 2) / 10
    expected = {3: 0.91, 7: 0.55, 11: 0.19, 12: 0.1, 40: 0.1}
    for step, value in expected.items():
        assert lr_at(step, style="linear", **KW) == pytest.approx(value), step


def test_cosine_decay_hand_computed():
    # min_lr + (lr - min_lr) / 2 * (1 + cos(pi * (step - 2) / 10))
    expected = {
        4: 0.1 + 0.45 * (1 + math.cos(0.2 * math.pi)),  # 0.9140576...
        7: 0.55,
        10: 0.1 + 0.45 * (1 + math.cos(0.8 * math.pi)),  # 0.1859424...
        12: 0.1,
        99: 0.1,
    }
    for step, value in expected.items():
        assert lr_at(step, style="cosine", **KW) == pytest.approx(value), step
    assert lr_at(4, style="cosine", **KW) == pytest.approx(0.9140576474687263)


def test_no_warmup_starts_at_lr_and_total_shorter_than_warmup_is_safe():
    assert lr_at(0, lr=2.0, min_lr=0.0, warmup_iters=0, total_iters=4, style="linear") == 2.0
    assert lr_at(3, lr=2.0, min_lr=0.0, warmup_iters=0, total_iters=4, style="linear") == pytest.approx(0.5)
    # total_iters <= warmup_iters: decay over one step, then min_lr (no division by zero)
    assert lr_at(5, lr=1.0, min_lr=0.2, warmup_iters=5, total_iters=3, style="cosine") == pytest.approx(1.0)
    assert lr_at(6, lr=1.0, min_lr=0.2, warmup_iters=5, total_iters=3, style="cosine") == pytest.approx(0.2)


def test_unknown_style_names_the_flag():
    with pytest.raises(ValueError, match="--lr-decay-style must be one of .* got 'step'"):
        lr_at(0, lr=1.0, min_lr=0.0, warmup_iters=0, total_iters=1, style="step")
    with pytest.raises(ValueError, match="--lr-decay-style"):
        LRSchedule(None, lr=1.0, min_lr=0.0, warmup_iters=0, total_iters=1, style="exp")


def test_schedule_writes_the_rate_into_the_optimizer_and_checkpoints():
    param = torch.nn.Parameter(torch.zeros(3))
    optimizer = build_adamw([param], lr=1.0, weight_decay=0.0, betas=(0.9, 0.95))
    schedule = LRSchedule(optimizer, lr=1.0, min_lr=0.1, warmup_iters=2, total_iters=12, style="linear")
    seen = []
    for _ in range(8):
        seen.append(schedule.apply())
        assert optimizer.param_groups[0]["lr"] == seen[-1]
        schedule.advance()
    assert seen == pytest.approx([0.5, 1.0, 1.0, 0.91, 0.82, 0.73, 0.64, 0.55])
    resumed = LRSchedule(optimizer, lr=1.0, min_lr=0.1, warmup_iters=2, total_iters=12, style="linear")
    resumed.load_state_dict(schedule.state_dict())
    assert resumed.state_dict() == {"step_count": 8} and resumed.apply() == pytest.approx(0.46)


def test_adamw_skips_frozen_parameters_and_uses_foreach_on_cpu():
    trained, frozen = (
        torch.nn.Parameter(torch.ones(2)),
        torch.nn.Parameter(torch.ones(2), requires_grad=False),
    )
    optimizer = build_adamw([trained, frozen], lr=0.1, weight_decay=0.01, betas=(0.8, 0.9), eps=1e-6)
    group = optimizer.param_groups[0]
    assert group["params"] == [trained] and group["fused"] is None
    assert (group["betas"], group["eps"], group["weight_decay"]) == ((0.8, 0.9), 1e-6, 0.01)
    trained.grad = torch.tensor([1.0, -2.0])
    optimizer.step()
    # First AdamW step: p <- p(1 - lr*wd) - lr * sign(g) (bias-corrected m/sqrt(v) = g/|g|, up to eps)
    expected = torch.tensor([1 - 0.001 - 0.1, 1 - 0.001 + 0.1])
    torch.testing.assert_close(trained.detach(), expected, rtol=0, atol=1e-6)
