"""A custom rollout function (slime's signature): the whole training rollout, from prompts to rewarded groups.

    clawrl train ... --rollout-function-path examples/guide/rollout.py:generate_rollout \
        --custom-rm-path examples/guide/reward.py:reward

It replaces clawrl's default rollout loop (over-sampling, filters, abort of leftovers): here every prompt group
of the batch is generated with the default generate function and scored with the job's reward flags
(--custom-rm-path or --rm-type), and one extra metric is logged. Start from this when a rollout is not "one
generate call per sample", e.g. samples that depend on each other or an environment stepped from outside.
"""

from __future__ import annotations

import asyncio

from clawrl.rollout.generate import generate, train_sampling_params
from clawrl.rollout.hooks import RolloutFnTrainOutput
from clawrl.rollout.rewards import batched_reward, build_reward_fn


async def generate_rollout(
    args, rollout_id: int, data_source, evaluation: bool = False
) -> RolloutFnTrainOutput:
    """Prompt groups of --rollout-batch-size prompts x --n-samples-per-prompt samples, generated and rewarded."""
    if evaluation:
        raise ValueError(
            "examples/guide/rollout.py makes training rollouts only: run without --eval-prompt-data"
        )
    groups = data_source.get_samples(args.rollout_batch_size)
    params = train_sampling_params(args)
    samples = [sample for group in groups for sample in group]
    await asyncio.gather(*(generate(args, sample, params) for sample in samples))
    reward_fn = build_reward_fn(rm_type=args.rm_type, custom_rm_path=args.custom_rm_path, args=args)
    for sample, reward in zip(samples, await batched_reward(samples, reward_fn, args=args), strict=True):
        sample.reward = reward
    await reward_fn.aclose()
    mean_chars = sum(len(s.response) for s in samples) / len(samples)
    return RolloutFnTrainOutput(samples=groups, metrics={"rollout/guide_response_chars": mean_chars})
