"""A dynamic-sampling filter (slime's signature, DAPO's rule): drop prompt groups whose rewards are all equal.

    clawrl train ... --dynamic-sampling-filter-path examples/guide/dynamic_filter.py:keep_informative_groups \
        --over-sampling-batch-size 8

A group whose samples all got the same reward has zero advantage under GRPO: training on it only costs time.
A dropped group is replaced by a fresh prompt group (take --over-sampling-batch-size above
--rollout-batch-size to start replacements early) and counted as rollout/dynamic_filter/drop_<reason>.
"""

from __future__ import annotations

from clawrl.rollout.filters import DynamicFilterOutput


def keep_informative_groups(args, samples, **kwargs) -> DynamicFilterOutput:
    """Keep the group unless its rewards (the --reward-key value of dict rewards) are all equal."""
    rewards = [sample.get_reward_value(args.reward_key) for sample in samples]
    if max(rewards) > min(rewards):
        return DynamicFilterOutput(keep=True)
    return DynamicFilterOutput(keep=False, reason="all_equal")
