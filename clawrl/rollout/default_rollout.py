"""clawrl's default rollout: generate and reward prompt groups, dynamic sampling, abort of the leftovers.

The training loop follows slime's `generate_rollout_async`:

    while fewer than --rollout-batch-size groups are kept:
        while fewer than --rollout-batch-size groups are in flight or kept:
            take --over-sampling-batch-size groups from the data source, start each (generate -> reward)
        wait for the first finished group; run the dynamic filter on it
            keep -> add it to the batch (until the batch is full)
            drop -> count rollout/dynamic_filter/drop_<reason>; its slot is refilled by the outer loop
    abort the groups still in flight (see `abort_and_drain`); their prompts stay consumed, as in slime

A group with an ABORTED sample that was not aborted by us (e.g. an engine aborted it for a weight update)
cannot be trained on: it is dropped with reason "aborted" and replaced.

With `keep_partial` (--partial-rollout) nothing generated is thrown away: the groups that come back from
the abort (finished or half-generated), finished groups beyond the batch, and engine-aborted groups are
returned as `CollectedGroups.leftovers`, which the manager puts back into the data source
(clawrl/rollout/partial.py). A sample that is already COMPLETED or TRUNCATED when it is handed to
`GroupGenerator.sample` (a finished member of such a group) is returned as it is, as slime does.

Evaluation (`generate_eval_samples`) runs every prompt of a dataset `--n-samples-per-eval-prompt` times,
with the per-copy seed `--rollout-seed + j` as slime uses, and no filter.
"""

from __future__ import annotations

import asyncio
import collections
import copy
import logging
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

from clawrl.data.sample import Sample, Status
from clawrl.rollout.context import RolloutContext, current_timeline
from clawrl.rollout.filters import DynamicFilterOutput
from clawrl.rollout.hooks import GenerateFunctions
from clawrl.rollout.rewards import RewardFunction, batched_reward, compute_reward
from clawrl.rollout.router import EngineRouterError

logger = logging.getLogger(__name__)

ABORT_POLL_S = 0.5  # how often abort_all is repeated while leftover requests drain


@dataclass(kw_only=True)
class GroupGenerator:
    """Runs the generate function and the reward function over a sample or a prompt group."""

    args: Any
    """slime's flat args, passed to every plugin."""
    generate_fns: GenerateFunctions
    """The configured generate function and per-sample overrides."""
    reward_fn: RewardFunction | None
    """The reward function; None when the generate function sets rewards itself."""

    async def sample(
        self, sample: Sample, sampling_params: dict[str, Any], evaluation: bool, *,
        generated_with: tuple[float, float] | None = None,
    ) -> list[Sample]:  # fmt: skip
        """Generate (one Sample, or several from a fan-out generate function), then reward what needs it.
        `generated_with` (sent, generated): the sample was already generated in a group batch at those times."""
        # a training rollout's timeline (set by the RolloutManager): each training sample's timestamps go there
        timeline = None if evaluation else current_timeline()
        if generated_with is not None:
            samples, (sent, generated) = [sample], generated_with
        else:
            sent = time.monotonic()
            gen = self.generate_fns.for_sample(sample)
            if sample.status in (Status.COMPLETED, Status.TRUNCATED):  # finished in an earlier rollout
                samples = [sample]
            else:
                samples = await gen(self.args, sample, sampling_params, evaluation)
            generated = time.monotonic()
        # As slime: aborted samples get no reward; a reward set during generation (agents) is kept.
        todo = [s for s in samples if s.status != Status.ABORTED and s.reward is None]
        if not todo:
            if timeline is not None:
                timeline.add(sent, generated)
            return samples
        if self.reward_fn is None:
            gen = self.generate_fns.for_sample(sample)
            raise ValueError(
                f"{gen.flag} {gen.path!r} left sample {todo[0].index} without a reward and no reward function "
                "is configured (--rm-type or --custom-rm-path)"
            )
        if len(samples) == 1:
            todo[0].reward = await compute_reward(todo[0], self.reward_fn, args=self.args)
        else:
            for s, reward in zip(
                todo, await batched_reward(todo, self.reward_fn, args=self.args), strict=True
            ):
                s.reward = reward
        if timeline is not None:
            timeline.add(sent, generated, time.monotonic())
        return samples

    async def group(
        self, group: list[Sample], sampling_params: dict[str, Any], evaluation: bool, *,
        on_samples: Callable[[list[Sample]], None] | None = None,
    ) -> list[Sample]:  # fmt: skip
        """All samples of one prompt group, generated concurrently, as one flat list in group order. With the
        default generate function the group's unfinished samples go to the engine as one batch request.
        `on_samples` is called with each sample's result as soon as it is rewarded (progress counting)."""

        async def one(sample: Sample, generated_with: tuple[float, float] | None) -> list[Sample]:
            samples = await self.sample(sample, sampling_params, evaluation, generated_with=generated_with)
            if on_samples is not None:
                on_samples(samples)
            return samples

        times = None
        if len(group) > 1 and all(self._default_generate(s) for s in group):
            times = await self._generate_batch(group, sampling_params)
        results = await asyncio.gather(*(one(s, times) for s in group))
        return [s for samples in results for s in samples]

    def _default_generate(self, sample: Sample) -> bool:
        from clawrl.rollout.generate import generate

        return self.generate_fns.for_sample(sample).fn is generate

    async def _generate_batch(
        self, group: list[Sample], sampling_params: dict[str, Any]
    ) -> tuple[float, float]:
        """Generate the group's unfinished samples in one batch request; returns (sent, generated) times."""
        from clawrl.rollout.generate import generate_group

        sent = time.monotonic()
        todo = [s for s in group if s.status not in (Status.COMPLETED, Status.TRUNCATED)]
        await generate_group(self.args, todo, sampling_params)
        return sent, time.monotonic()


@dataclass(kw_only=True)
class CollectedGroups:
    """What the over-sampling loop produced."""

    groups: list[list[Sample]]
    """Kept groups, in the order they finished."""
    drops: collections.Counter = field(default_factory=collections.Counter)
    """Dropped groups per reason."""
    num_submitted: int = 0
    """Groups taken from the data source."""
    num_aborted_samples: int = 0
    """Leftover samples that came back aborted."""
    leftovers: list[list[Sample]] = field(default_factory=list)
    """With keep_partial: groups generated (wholly or in part) but not in the batch, to resume later."""


async def collect_train_groups(
    *,
    target: int,
    over_sampling: int,
    get_groups: Callable[[int], list[list[Sample]]],
    run_group: Callable[[list[Sample]], Awaitable[list[Sample]]],
    judge: Callable[[list[Sample]], DynamicFilterOutput],
    ctx: RolloutContext,
    abort_timeout_s: float,
    keep_partial: bool = False,
) -> CollectedGroups:
    """slime's over-sampling loop (module docstring); leftovers are aborted before returning or raising."""
    out = CollectedGroups(groups=[])
    pending: set[asyncio.Task] = set()
    submitted: dict[asyncio.Task, int] = {}
    num_open = 0  # groups in flight or kept
    try:
        while len(out.groups) < target:
            while num_open < target:
                groups = get_groups(over_sampling)
                assert groups, "the data source handed out no groups"
                for group in groups:
                    task = asyncio.create_task(run_group(group))
                    submitted[task] = len(submitted)
                    pending.add(task)
                num_open += len(groups)
                out.num_submitted += len(groups)
            done, pending = await asyncio.wait(pending, return_when=asyncio.FIRST_COMPLETED)
            # Groups that finished together are judged in submission order, so the batch does not depend
            # on set iteration order.
            for task in sorted(done, key=submitted.__getitem__):
                group = task.result()
                if keep_partial and any(s.status == Status.ABORTED for s in group):
                    out.leftovers.append(group)  # aborted by an engine: resumed in a later rollout
                    num_open -= 1
                    continue
                verdict = _judge(group, judge)
                if not verdict.keep:
                    out.drops[verdict.reason or "unspecified"] += 1
                    num_open -= 1
                elif len(out.groups) < target:
                    out.groups.append(group)
                elif keep_partial:
                    out.leftovers.append(group)
    finally:
        drained = await abort_and_drain(pending, ctx, abort_timeout_s)
        out.num_aborted_samples = sum(s.status == Status.ABORTED for group in drained for s in group)
        if keep_partial:  # in prompt order, so the next rollout does not depend on finishing order
            out.leftovers = sorted([*out.leftovers, *drained], key=_first_index)
        for task in submitted:  # after a failure, finished siblings' errors are superseded by the first one
            if task.done() and not task.cancelled():
                task.exception()
    return out


def _first_index(group: list[Sample]) -> int:
    return -1 if not group or group[0].index is None else group[0].index


def _judge(group: list[Sample], judge: Callable[[list[Sample]], DynamicFilterOutput]) -> DynamicFilterOutput:
    if any(s.status == Status.ABORTED for s in group):
        return DynamicFilterOutput(keep=False, reason="aborted")
    return judge(group)


async def abort_and_drain(
    pending: set[asyncio.Task], ctx: RolloutContext, timeout_s: float
) -> list[list[Sample]]:
    """Stop the groups still in flight; returns the groups that came back (in no particular order),
    their aborted samples holding the partial responses.

    Sets `ctx.aborted` (requests not yet sent are not sent), then repeats POST /abort_request abort_all on
    every engine every ABORT_POLL_S until all tasks finished (a request sent just after one abort is caught
    by the next). Raises TimeoutError if they have not finished within `timeout_s`.
    """
    if not pending:
        return []
    ctx.aborted = True
    deadline = time.monotonic() + timeout_s
    drained: list[list[Sample]] = []
    while pending:
        try:
            await ctx.router.abort_all()
        except EngineRouterError as error:  # a dead engine's requests fail on their own
            logger.warning("abort of leftover requests: %s", error)
        done, pending = await asyncio.wait(pending, timeout=ABORT_POLL_S)
        drained.extend(group for group in map(_drained_group, done) if group is not None)
        if pending and time.monotonic() > deadline:
            for task in pending:
                task.cancel()
            raise TimeoutError(
                f"{len(pending)} leftover prompt group(s) did not come back within {timeout_s} s of aborting "
                f"them on the engines {ctx.router.urls}"
            )
    return drained


def _drained_group(task: asyncio.Task) -> list[Sample] | None:
    if task.cancelled():
        return None
    error = task.exception()
    if error is not None:  # the group is discarded; say why it failed
        logger.warning("a leftover prompt group failed while being aborted: %r", error)
        return None
    return task.result()


async def generate_eval_samples(
    gen: GroupGenerator, prototypes: list[Sample], n_samples: int, sampling_params: dict[str, Any], seed: int
) -> list[Sample]:
    """Every prompt `n_samples` times; copy j is sampled with seed `seed + j` (slime's eval seeds)."""
    jobs = []
    for position, prototype in enumerate(prototypes):
        for j in range(n_samples):
            sample = copy.deepcopy(prototype)
            sample.group_index, sample.index = position, position * n_samples + j
            params = {**sampling_params, "seed": seed + j}
            jobs.append(gen.sample(sample, params, evaluation=True))
    results = await asyncio.gather(*jobs)
    return [s for samples in results for s in samples]
