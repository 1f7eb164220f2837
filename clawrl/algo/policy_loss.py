"""Policy-gradient losses: PPO clip (clip-higher, dual clip), GSPO, and the PPO critic loss (slime 4.3-4.4).

All losses are per token and unreduced; reduce them with `clawrl.algo.aggregation.aggregate_loss`. Metrics are
per-token tensors too, reduced the same way by the caller.

  ratio_t  = exp(log_probs_t - old_log_probs_t)
  ppo_kl_t = old_log_probs_t - log_probs_t                      (so ratio = exp(-ppo_kl))
  L_t      = max(-A_t * ratio_t, -A_t * clip(ratio_t, 1 - eps_clip, 1 + eps_clip_high))
  dual clip (eps_clip_c = c > 1): for A_t < 0, L_t = min(L_t, -c * A_t)
  GSPO: ppo_kl is the masked mean of ppo_kl_t over each sample, broadcast to its tokens.

Shapes: B = samples, N = sum(response_lengths) flat response tokens (samples concatenated in order).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor

from clawrl.algo.segments import as_lengths, broadcast_to_tokens, segment_sum


def _clipped_surrogate(
    ppo_kl_N: Tensor,
    advantages_N: Tensor,
    eps_clip: float,
    eps_clip_high: float | None,
    eps_clip_c: float | None,
) -> tuple[Tensor, dict[str, Tensor]]:
    """Clip objective from a (token- or sequence-level) ppo_kl; shared by PPO and GSPO."""
    if eps_clip_high is None:
        eps_clip_high = eps_clip
    if eps_clip < 0 or eps_clip_high < 0:
        raise ValueError(f"--eps-clip / --eps-clip-high must be >= 0, got {eps_clip} / {eps_clip_high}")
    if eps_clip_c is not None and not eps_clip_c > 1.0:
        raise ValueError(f"--eps-clip-c must be > 1 (dual-clip lower bound on -A*ratio), got {eps_clip_c}")
    ratio_N = torch.exp(-ppo_kl_N)
    unclipped_N = -advantages_N * ratio_N
    clipped_N = -advantages_N * ratio_N.clamp(1.0 - eps_clip, 1.0 + eps_clip_high)
    loss_N = torch.maximum(unclipped_N, clipped_N)
    clipfrac_N = (clipped_N > unclipped_N).to(loss_N.dtype)
    if eps_clip_c is not None:
        # Dual clip: with A < 0 a huge ratio would make the loss unbounded; cap it at -c*A.
        dual_N = torch.minimum(loss_N, -eps_clip_c * advantages_N)
        loss_N = torch.where(advantages_N < 0, dual_N, loss_N)
    return loss_N, {"pg_clipfrac": clipfrac_N, "ppo_kl": ppo_kl_N.detach()}


def ppo_policy_loss(
    log_probs_N: Tensor,
    old_log_probs_N: Tensor,
    advantages_N: Tensor,
    *,
    eps_clip: float,
    eps_clip_high: float | None = None,
    eps_clip_c: float | None = None,
) -> tuple[Tensor, dict[str, Tensor]]:
    """Token-level PPO clip loss -> (loss_N, {"pg_clipfrac": float 0/1 [N], "ppo_kl": [N]}).

    eps_clip_high None means eps_clip (symmetric clip); eps_clip_c None disables dual clip.
    Gradient flows into log_probs_N only.
    """
    ppo_kl_N = old_log_probs_N.detach() - log_probs_N
    return _clipped_surrogate(ppo_kl_N, advantages_N.detach(), eps_clip, eps_clip_high, eps_clip_c)


def gspo_policy_loss(
    log_probs_N: Tensor,
    old_log_probs_N: Tensor,
    advantages_N: Tensor,
    *,
    response_lengths: Sequence[int] | Tensor,
    loss_mask_N: Tensor,
    eps_clip: float,
    eps_clip_high: float | None = None,
    eps_clip_c: float | None = None,
) -> tuple[Tensor, dict[str, Tensor]]:
    """GSPO: the clip loss on the sequence-level ratio exp(mean_masked(log_probs - old_log_probs)).

    The sequence ratio is shared by all tokens of a sample; the gradient reaches every masked token of the
    sample through the mean. A sample with no masked token gets ratio 1.
    """
    lengths_B = as_lengths(response_lengths, log_probs_N.numel(), log_probs_N.device)
    mask_N = loss_mask_N.to(log_probs_N.dtype)
    token_kl_N = (old_log_probs_N.detach() - log_probs_N) * mask_N
    seq_kl_B = segment_sum(token_kl_N, lengths_B) / segment_sum(mask_N, lengths_B).clamp(min=1.0)
    ppo_kl_N = broadcast_to_tokens(seq_kl_B, lengths_B, log_probs_N.numel())
    return _clipped_surrogate(ppo_kl_N, advantages_N.detach(), eps_clip, eps_clip_high, eps_clip_c)
