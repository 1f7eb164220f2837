"""Scheduler: token budget, chunked prefill, admission limits, preemption, prefix cache and n > 1 sharing.

Sequences are real `Sequence` records driven without a model: after each step every sequence that reached
its last token "samples" a made-up token, exactly as the engine appends sampled tokens.
"""

from clawrl.engine.core.request import SamplingParams
from clawrl.engine.core.scheduler import BlockManager, Scheduler
from clawrl.engine.core.sequence import Sequence, SequenceStatus


def make_scheduler(num_blocks=64, block_size=4, budget=64, max_running=8, prefix_caching=True):
    return Scheduler(
        BlockManager(num_blocks, block_size),
        max_running_requests=max_running,
        max_num_batched_tokens=budget,
        enable_prefix_caching=prefix_caching,
    )


_next_id = iter(range(1_000_000))


def make_seq(prompt, max_new_tokens=4, request_id=None, index=0, leader=None):
    seq_id = next(_next_id)
    params = SamplingParams(max_new_tokens=max_new_tokens)
    return Sequence(
        seq_id=seq_id, request_id=request_id or f"r{seq_id}", index=index, prompt_token_ids=list(prompt),
        params=params, leader=leader,
    )  # fmt: skip


def step(scheduler):
    """One engine step without a model; returns [(seq_id, num_new_tokens, samples)]."""
    batch = scheduler.schedule()
    plan = [
        (s.seq_id, n, batch.samples(i))
        for i, (s, n) in enumerate(zip(batch.seqs, batch.num_new_tokens, strict=True))
    ]
    sampling = [s for i, s in enumerate(batch.seqs) if batch.samples(i)]
    scheduler.postprocess(batch)
    for seq in sampling:
        seq.output_token_ids.append(1000 + seq.num_tokens)
        if seq.num_output_tokens == seq.params.max_new_tokens:
            scheduler.finish(seq, {"type": "length", "length": seq.num_output_tokens})
    return plan


def run_to_end(scheduler, max_steps=500):
    for _ in range(max_steps):
        if not scheduler.has_unfinished():
            return
        step(scheduler)
    raise AssertionError("scheduler did not finish")


def test_token_budget_chunks_long_prompt_and_mixes_decode():
    scheduler = make_scheduler(budget=8)
    a, b = make_seq(range(10), max_new_tokens=3), make_seq(range(3), max_new_tokens=3)
    scheduler.add(a)
    scheduler.add(b)
    assert step(scheduler) == [(a.seq_id, 8, False)]  # a's first chunk takes the whole budget
    assert step(scheduler) == [(a.seq_id, 2, True), (b.seq_id, 3, True)]
    assert step(scheduler) == [(a.seq_id, 1, True), (b.seq_id, 1, True)]  # both decode
    run_to_end(scheduler)
    assert a.num_output_tokens == 3 and b.num_output_tokens == 3
    assert scheduler.block_manager.num_used_blocks == 0


def test_max_running_requests_limits_admission():
    scheduler = make_scheduler(max_running=2)
    seqs = [make_seq([1, 2, 3], max_new_tokens=2) for _ in range(3)]
    for seq in seqs:
        scheduler.add(seq)
    assert [sid for sid, _, _ in step(scheduler)] == [seqs[0].seq_id, seqs[1].seq_id]
    assert seqs[2].status is SequenceStatus.WAITING
    step(scheduler)  # seqs 0 and 1 finish here
    assert [sid for sid, _, _ in step(scheduler)] == [seqs[2].seq_id]


def test_preemption_frees_newest_and_recomputes_it_later():
    # 4 blocks of 2 tokens. Two sequences of prompt 3 take 2 blocks each; the first decode step needs
    # no block (position 3 fits), the second needs a third block each -> the newest is preempted.
    scheduler = make_scheduler(num_blocks=4, block_size=2, budget=16, prefix_caching=False)
    old, new = make_seq([1, 2, 3], max_new_tokens=4), make_seq([4, 5, 6], max_new_tokens=4)
    scheduler.add(old)
    scheduler.add(new)
    step(scheduler)  # prefill both, sample 1 token each
    step(scheduler)  # decode position 3 (fits), sample token 2
    plan = step(scheduler)  # position 4 needs a new block for both -> `new` preempted
    assert plan == [(old.seq_id, 1, True)]
    assert scheduler.num_preemptions == 1 and new.num_preemptions == 1
    assert new.status is SequenceStatus.WAITING and new.block_table == [] and new.num_computed_tokens == 0
    assert scheduler.waiting[0] is new and new.num_output_tokens == 2
    run_to_end(scheduler)
    assert old.num_output_tokens == 4 and new.num_output_tokens == 4
    # Outputs are a function of each sequence's length only, so preemption left them unchanged.
    assert new.output_token_ids == [1000 + n for n in (3, 4, 5, 6)]
    assert scheduler.block_manager.num_used_blocks == 0


def test_preempted_sequence_recomputes_prompt_and_outputs():
    scheduler = make_scheduler(num_blocks=4, block_size=2, budget=16, prefix_caching=False)
    old, new = make_seq([1, 2, 3], max_new_tokens=3), make_seq([4, 5, 6], max_new_tokens=4)
    scheduler.add(old)
    scheduler.add(new)
    step(scheduler)
    step(scheduler)
    assert step(scheduler) == [(old.seq_id, 1, True)]  # `new` preempted; `old` samples its last token
    assert old.is_finished and new.status is SequenceStatus.WAITING and new.num_output_tokens == 2
    # `new` comes back with prompt 3 + 2 outputs. Its freed block 1 (positions 2-3) was evicted to give
    # `old` a block, but block 0 is still cached (request-scoped): positions 2..4 are recomputed.
    assert step(scheduler) == [(new.seq_id, 3, True)]
    assert new.num_computed_tokens == 5 and new.num_output_tokens == 3


def test_no_admission_in_a_step_that_preempted():
    scheduler = make_scheduler(num_blocks=3, block_size=2, budget=16, prefix_caching=False)
    a, b = make_seq([1, 2, 3], max_new_tokens=5), make_seq([1], max_new_tokens=5)
    scheduler.add(a)
    scheduler.add(b)
    step(scheduler)  # a: 2 blocks, b: 1 block
    step(scheduler)  # a decodes position 3 (fits), b position 1 (fits)
    plan = step(scheduler)  # a needs a third block -> b preempted; b must not be re-admitted now
    assert plan == [(a.seq_id, 1, True)] and b.status is SequenceStatus.WAITING


def test_prefix_cache_hit_is_keyed_by_weight_version():
    scheduler = make_scheduler(block_size=4)
    prompt = list(range(10))
    first = make_seq(prompt, max_new_tokens=1)
    scheduler.add(first)
    run_to_end(scheduler)
    again = make_seq(prompt, max_new_tokens=1)
    scheduler.add(again)
    assert step(scheduler) == [(again.seq_id, 2, True)]  # 8 of 10 tokens from the cache
    assert again.num_cached_tokens == 8
    scheduler.weight_version = "1"
    third = make_seq(prompt, max_new_tokens=1)
    scheduler.add(third)
    assert step(scheduler) == [(third.seq_id, 10, True)] and third.num_cached_tokens == 0


def test_last_token_is_never_served_from_cache():
    scheduler = make_scheduler(block_size=4)
    prompt = list(range(8))  # exactly two full blocks
    scheduler.add(make_seq(prompt, max_new_tokens=1))
    run_to_end(scheduler)
    again = make_seq(prompt, max_new_tokens=1)
    scheduler.add(again)
    assert step(scheduler) == [(again.seq_id, 4, True)] and again.num_cached_tokens == 4


def test_generated_full_blocks_are_published():
    scheduler = make_scheduler(block_size=4)
    seq = make_seq([1, 2, 3], max_new_tokens=6)
    scheduler.add(seq)
    step(scheduler)
    assert scheduler.block_manager.num_cached_blocks == 0
    step(scheduler)  # position 3 computed: block 0 is full and computed
    assert scheduler.block_manager.num_cached_blocks == 1


def test_n_samples_wait_for_leader_then_share_prompt_blocks():
    scheduler = make_scheduler(block_size=4, budget=64, prefix_caching=False)
    prompt = list(range(10))  # blocks: [0..3] [4..7] [8, 9]
    leader = make_seq(prompt, max_new_tokens=3, request_id="grp")
    siblings = [make_seq(prompt, max_new_tokens=3, request_id="grp", index=i, leader=leader) for i in (1, 2)]
    for seq in [leader, *siblings]:
        scheduler.add(seq)
    assert step(scheduler) == [(leader.seq_id, 10, True)]  # siblings wait for the leader's prompt
    plan = step(scheduler)
    assert plan == [(leader.seq_id, 1, True)] + [(s.seq_id, 2, True) for s in siblings]
    shared = leader.block_table[:2]
    assert all(s.block_table[:2] == shared for s in siblings)
    assert [scheduler.block_manager.ref_count(b) for b in shared] == [3, 3]
    assert len({s.block_table[2] for s in [leader, *siblings]}) == 3  # partial block: one per sample
    assert scheduler.block_manager.num_used_blocks == 2 + 3  # instead of 3 * 3 without sharing
    assert [s.num_cached_tokens for s in siblings] == [8, 8]
    run_to_end(scheduler)
    assert scheduler.block_manager.num_used_blocks == 0


def test_request_scoped_cache_when_prefix_caching_is_off():
    scheduler = make_scheduler(block_size=4, prefix_caching=False)
    prompt = list(range(10))
    scheduler.add(make_seq(prompt, max_new_tokens=1, request_id="a"))
    run_to_end(scheduler)
    other = make_seq(prompt, max_new_tokens=1, request_id="b")
    scheduler.add(other)
    assert step(scheduler) == [(other.seq_id, 10, True)] and other.num_cached_tokens == 0


def test_finish_and_preempt_all_release_blocks():
    scheduler = make_scheduler()
    running, waiting = make_seq(range(5), max_new_tokens=9), make_seq(range(5), max_new_tokens=9)
    scheduler.add(running)
    step(scheduler)
    scheduler.add(waiting)
    scheduler.finish(waiting, {"type": "abort"})
    assert waiting.is_finished and not scheduler.waiting
    assert scheduler.preempt_all() == 1
    assert running.status is SequenceStatus.WAITING and scheduler.block_manager.num_used_blocks == 0
    run_to_end(scheduler)
    assert running.num_output_tokens == 9
