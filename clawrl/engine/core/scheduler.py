"""Scheduler: FCFS continuous batching of prefill and decode under a token budget. No torch here.

Every step computes some tokens of some sequences in one forward:
1. Running sequences, oldest first, each get what they still need (1 token when decoding, a chunk of the
   prompt when prefilling) while the per-step token budget lasts. A long prompt is thus prefilled in chunks
   across steps (chunked prefill) while decodes of other sequences continue.
2. If KV blocks run out, the newest running sequence is preempted: its blocks are freed and it goes back to
   the front of the waiting queue; later it is recomputed from prompt + generated tokens (its own freed blocks
   are usually still in the prefix cache, so recomputation is often cheap). Sampling state is untouched, so
   the sequence continues with exactly the tokens it would have produced.
3. Waiting sequences are admitted in arrival order while the budget, `max_running_requests` and free blocks
   allow; none are admitted in a step that preempted (they would only be preempted again). At admission a
   sequence takes the longest run of cached full blocks of its tokens (prefix cache), but never the block
   holding its last token, which must be computed to produce logits.

Samples 1..n-1 of a request wait until sample 0 (their `leader`) has computed its prompt; then the prompt's
full blocks are in the prefix cache and they share them (reference counts) and compute only the last,
partial block themselves. There is no copy-on-write: the partial block is recomputed per sample.

BlockManager (at the end of this module): the KV cache's block allocator, reference counts and prefix
cache.

The KV cache is `num_blocks` blocks of `block_size` token slots. A sequence owns a block table; a block can
appear in several tables (shared prompt blocks of a request's n samples, or prefix-cache hits), so each block
has a reference count and returns to the free pool when it drops to zero.

Prefix cache: a *full* block whose K/V have been computed is published under a chained hash
`H_i = blake2b(H_{i-1} || token ids of block i)` with `H_{-1} = namespace`. The namespace holds the weight
version (K/V computed by other weights must never be reused) and, when cross-request prefix
caching is off, the request id (so a request's own samples still share its prompt). A freed block keeps its
hash while it sits in the free pool, so a later request can revive it; allocation evicts least-recently
freed blocks first. Blocks are only published once their K/V are computed, and a published block is never
written again (sequences only write positions >= their computed count, which lie past every shared block).
"""

from __future__ import annotations

import hashlib
from array import array
from collections import OrderedDict, deque
from dataclasses import dataclass, field

from clawrl.engine.core.sequence import PENDING_TOKEN, Sequence, SequenceStatus


@dataclass(kw_only=True)
class ScheduledBatch:
    """The work of one step: which sequences compute how many of their next tokens."""

    seqs: list[Sequence] = field(default_factory=list)
    """Scheduled sequences, in batch order."""
    num_new_tokens: list[int] = field(default_factory=list)
    """Tokens each sequence computes this step, starting at its num_computed_tokens."""
    num_preempted: int = 0
    """Sequences preempted while building this batch."""
    is_decode: bool = False
    """Every scheduled sequence computes exactly one token, its last (so every one samples): a decode step."""
    epoch: int = -1
    """Scheduler.epoch when the batch was built: equal epochs mean no sequence joined or left the running set
    in between, so the block table of every sequence in both batches is the same list, only grown."""

    @property
    def is_empty(self) -> bool:
        """True when nothing is computed this step."""
        return not self.seqs

    def samples(self, i: int) -> bool:
        """Whether sequence i reaches its last token this step, so its next token is sampled."""
        seq = self.seqs[i]
        return seq.num_computed_tokens + self.num_new_tokens[i] == seq.num_tokens


class Scheduler:
    """Owns the waiting and running queues and the block manager."""

    def __init__(
        self,
        block_manager: BlockManager,
        *,
        max_running_requests: int,
        max_num_batched_tokens: int,
        enable_prefix_caching: bool = True,
    ) -> None:
        self.block_manager = block_manager
        self.max_running_requests = max_running_requests
        self.max_num_batched_tokens = max_num_batched_tokens
        self.enable_prefix_caching = enable_prefix_caching
        self.weight_version = "0"
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.num_preemptions = 0
        self.epoch = 0  # bumped whenever `running` gains or loses a sequence (see ScheduledBatch.epoch)

    def add(self, seq: Sequence) -> None:
        """Queue a new sequence (FCFS)."""
        assert seq.status is SequenceStatus.WAITING and not seq.block_table
        self.waiting.append(seq)

    def has_unfinished(self) -> bool:
        """True while any sequence waits or runs."""
        return bool(self.waiting or self.running)

    def schedule(self) -> ScheduledBatch:
        """Pick this step's work; allocates the blocks it needs (see the module docstring)."""
        batch = ScheduledBatch(is_decode=True)  # cleared by the first sequence that is not decoding
        budget = self._schedule_running(batch, self.max_num_batched_tokens)
        if batch.num_preempted == 0:
            self._schedule_waiting(batch, budget)
        batch.is_decode = batch.is_decode and not batch.is_empty
        batch.epoch = self.epoch
        return batch

    def postprocess(self, batch: ScheduledBatch, *, pending_tokens: bool = False) -> None:
        """After the forward: advance computed counts and publish blocks that became full.

        Sequences that finished meanwhile are skipped (with the engine's overlap schedule a step's outputs
        are processed while the next step already runs, so its sequences can finish in between).
        `pending_tokens` (overlap schedule): the step's sampled tokens are still on the device, so every
        sequence that sampled gets a PENDING_TOKEN (logprob NaN) as its last output token meanwhile."""
        block_size = self.block_manager.block_size
        finished, nan = SequenceStatus.FINISHED, float("nan")
        # Runs over the whole batch every step: locals, and the publication call only when a block filled up.
        for seq, num_new in zip(batch.seqs, batch.num_new_tokens, strict=True):
            if seq.status is finished:
                continue
            start = seq.num_computed_tokens
            end = seq.num_computed_tokens = start + num_new
            if end // block_size > start // block_size:
                self._publish_full_blocks(seq, start // block_size)
            if pending_tokens and end == len(seq.prompt_token_ids) + len(seq.output_token_ids):
                seq.output_token_ids.append(PENDING_TOKEN)
                seq.output_logprobs.append(nan)

    def finish(self, seq: Sequence, finish_reason: dict) -> None:
        """End a sequence (stop, length or abort): free its blocks and drop it from the queues."""
        if seq.status is SequenceStatus.RUNNING:
            self.running.remove(seq)
            self.epoch += 1
        elif seq.status is SequenceStatus.WAITING:
            self.waiting.remove(seq)
        self._free_blocks(seq)
        seq.status = SequenceStatus.FINISHED
        seq.finish_reason = finish_reason

    def preempt_all(self) -> int:
        """Send every running sequence back to waiting (before a weight update); returns how many."""
        count = len(self.running)
        while self.running:
            self._preempt(self.running[-1])
        return count

    # -- running sequences ------------------------------------------------------------------------------

    def _schedule_running(self, batch: ScheduledBatch, budget: int) -> int:
        # Runs over every running sequence each step: plain attribute reads, no helper calls in the common case.
        block_size = self.block_manager.block_size
        running, seqs, nums = self.running, batch.seqs, batch.num_new_tokens
        all_decode = True
        # Preemption only removes sequences after `seq` (the newest), which the iteration then never reaches.
        for seq in running:
            if budget <= 0:
                break
            num_output = len(seq.output_token_ids)
            if num_output >= seq.params.max_new_tokens:
                continue  # overlap schedule: its last token is still in flight and it finishes then
            computed = seq.num_computed_tokens
            num_left = len(seq.prompt_token_ids) + num_output - computed
            assert num_left > 0, "a running sequence always has a token to compute"
            num_new = num_left if num_left < budget else budget
            end = computed + num_new
            if end > len(seq.block_table) * block_size and not self._grow_or_preempt(seq, end, batch):
                break  # `seq` was the newest and preempted itself; everyone after it is gone too
            seqs.append(seq)
            nums.append(num_new)
            budget -= num_new
            all_decode = all_decode and num_left == 1
        batch.is_decode = batch.is_decode and all_decode
        return budget

    def _grow_or_preempt(self, seq: Sequence, num_tokens: int, batch: ScheduledBatch) -> bool:
        """Give `seq` blocks for `num_tokens` positions, preempting the newest sequences as needed."""
        manager = self.block_manager
        while True:
            num_missing = manager.blocks_for_tokens(num_tokens) - len(seq.block_table)
            if num_missing <= 0 or manager.can_allocate(num_missing):
                if num_missing > 0:
                    seq.block_table.extend(manager.allocate(num_missing))
                return True
            victim = self.running[-1]
            self._preempt(victim)
            batch.num_preempted += 1
            if victim is seq:
                return False

    def _preempt(self, seq: Sequence) -> None:
        self.running.remove(seq)
        self.epoch += 1
        self._free_blocks(seq)
        seq.num_computed_tokens = 0
        seq.status = SequenceStatus.WAITING
        seq.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.appendleft(seq)

    # -- waiting sequences ------------------------------------------------------------------------------

    def _schedule_waiting(self, batch: ScheduledBatch, budget: int) -> None:
        while self.waiting and budget > 0 and len(self.running) < self.max_running_requests:
            seq = self.waiting[0]
            if _waits_for_leader(seq):
                break
            num_new = self._admit(seq, budget)
            if num_new == 0:
                break  # not enough free blocks; FCFS, so nobody behind it goes first
            self.waiting.popleft()
            self.running.append(seq)
            self.epoch += 1
            batch.seqs.append(seq)
            batch.num_new_tokens.append(num_new)
            batch.is_decode = batch.is_decode and num_new == seq.num_tokens - seq.num_computed_tokens == 1
            budget -= num_new

    def _admit(self, seq: Sequence, budget: int) -> int:
        """Attach prefix hits and fresh blocks to `seq`; returns tokens to compute, 0 if blocks are short."""
        manager = self.block_manager
        max_hits = (seq.num_tokens - 1) // manager.block_size
        if seq.prompt_logprobs is not None:
            # Prompt logprobs still to report need the hidden state before each scored position: computed.
            first = seq.params.logprob_start_len + len(seq.prompt_logprobs)
            if first < seq.num_prompt_tokens:
                max_hits = min(max_hits, (first - 1) // manager.block_size)
        hits = manager.match_prefix(self._hashes(seq, max_hits))
        num_cached = len(hits) * manager.block_size
        num_new = min(seq.num_tokens - num_cached, budget)
        num_fresh = manager.blocks_for_tokens(num_cached + num_new) - len(hits)
        if not manager.can_allocate(num_fresh, hits):
            return 0
        manager.acquire(hits)
        seq.block_table = hits + manager.allocate(num_fresh)
        seq.num_computed_tokens = num_cached
        if seq.num_preemptions == 0:
            seq.num_cached_tokens = min(num_cached, seq.num_prompt_tokens)
        seq.status = SequenceStatus.RUNNING
        return num_new

    # -- prefix cache -----------------------------------------------------------------------------------

    def _namespace(self, seq: Sequence) -> str:
        # Keyed by weight version: K/V computed by other weights are never reused. Without cross-request
        # caching the request id scopes the cache, so a request's n samples still share their prompt.
        if self.enable_prefix_caching:
            return f"v={self.weight_version}"
        return f"v={self.weight_version}|r={seq.request_id}"

    def _hashes(self, seq: Sequence, num_blocks: int) -> list[bytes]:
        namespace = self._namespace(seq)
        if seq.hash_namespace != namespace:
            seq.block_hashes = []
            seq.hash_namespace = namespace
        num_hashed = len(seq.block_hashes)
        if num_hashed < num_blocks:
            block_size = self.block_manager.block_size
            # Only the tokens of the blocks still to hash: a decoding sequence adds one block at a time.
            tokens = seq.token_ids(num_hashed * block_size, num_blocks * block_size)
            chain_block_hashes(
                seq.block_hashes,
                tokens,
                block_size,
                num_blocks,
                namespace,
                token_offset=num_hashed * block_size,
            )
        return seq.block_hashes[:num_blocks]

    def _publish_full_blocks(self, seq: Sequence, first_block: int) -> None:
        num_full = seq.num_computed_tokens // self.block_manager.block_size
        if num_full <= first_block:
            return
        hashes = self._hashes(seq, num_full)
        for i in range(first_block, num_full):
            self.block_manager.publish(seq.block_table[i], hashes[i])

    def _free_blocks(self, seq: Sequence) -> None:
        self.block_manager.release(seq.block_table)
        seq.block_table = []


def _waits_for_leader(seq: Sequence) -> bool:
    """Samples 1..n-1 wait while sample 0 is still computing the prompt they will share."""
    leader = seq.leader
    return (
        leader is not None
        and leader.status is SequenceStatus.RUNNING
        and leader.num_computed_tokens < leader.num_prompt_tokens
    )


# ---------------------------------------------------------------------------------------------------
# the block manager


def chain_block_hashes(
    hashes: list[bytes],
    token_ids: list[int],
    block_size: int,
    num_blocks: int,
    namespace: str,
    *,
    token_offset: int = 0,
) -> list[bytes]:
    """Extend `hashes` (of the leading blocks of a sequence) in place to `num_blocks` full blocks.

    `token_ids` are the sequence's tokens from position `token_offset` on (at most len(hashes) * block_size,
    so a caller extending the chain passes only the tokens of the blocks still to hash)."""
    assert token_offset <= len(hashes) * block_size
    prev = hashes[-1] if hashes else namespace.encode()
    for i in range(len(hashes), num_blocks):
        block = token_ids[i * block_size - token_offset : (i + 1) * block_size - token_offset]
        assert len(block) == block_size, "only full blocks are hashed"
        prev = hashlib.blake2b(prev + array("q", block).tobytes(), digest_size=16).digest()
        hashes.append(prev)
    return hashes


class BlockManager:
    """Allocates KV blocks, counts references and keeps the hash -> block map of the prefix cache."""

    def __init__(self, num_blocks: int, block_size: int) -> None:
        assert num_blocks >= 1 and block_size >= 1
        self.num_blocks = num_blocks
        self.block_size = block_size
        self._ref_counts = [0] * num_blocks
        self._hash_of_block: list[bytes | None] = [None] * num_blocks
        self._block_of_hash: dict[bytes, int] = {}
        # Free pool in eviction order (front = evicted first); an OrderedDict gives O(1) removal of a
        # cached free block that a prefix hit revives.
        self._free: OrderedDict[int, None] = OrderedDict((b, None) for b in range(num_blocks))

    @property
    def num_free_blocks(self) -> int:
        """Blocks with no reference (some still hold cached K/V that a prefix hit can revive)."""
        return len(self._free)

    @property
    def num_used_blocks(self) -> int:
        """Blocks referenced by at least one sequence."""
        return self.num_blocks - len(self._free)

    @property
    def num_cached_blocks(self) -> int:
        """Blocks currently published in the prefix cache (in use or free)."""
        return len(self._block_of_hash)

    def ref_count(self, block_id: int) -> int:
        """How many block tables hold `block_id`."""
        return self._ref_counts[block_id]

    def blocks_for_tokens(self, num_tokens: int) -> int:
        """Blocks needed to hold `num_tokens` positions."""
        return -(-num_tokens // self.block_size)

    def match_prefix(self, block_hashes: list[bytes]) -> list[int]:
        """Block ids of the longest run of leading hashes found in the cache (no references taken)."""
        hits = []
        for block_hash in block_hashes:
            block_id = self._block_of_hash.get(block_hash)
            if block_id is None:
                break
            hits.append(block_id)
        return hits

    def can_allocate(self, num_new_blocks: int, hit_block_ids: list[int] = ()) -> bool:
        """Whether `num_new_blocks` fresh blocks fit after reviving `hit_block_ids` from the free pool."""
        if not hit_block_ids:  # a decoding sequence growing by a block, every block_size steps
            return num_new_blocks <= len(self._free)
        num_revived = sum(1 for b in hit_block_ids if self._ref_counts[b] == 0)
        return num_new_blocks + num_revived <= len(self._free)

    def acquire(self, block_ids: list[int]) -> None:
        """Take one more reference on each of `block_ids` (prefix hits, shared prompt blocks)."""
        for block_id in block_ids:
            if self._ref_counts[block_id] == 0:
                del self._free[block_id]
            self._ref_counts[block_id] += 1

    def allocate(self, num_blocks: int) -> list[int]:
        """Take `num_blocks` fresh blocks (evicting their cached contents); caller checked can_allocate."""
        assert num_blocks <= len(self._free), "allocate() without can_allocate()"
        block_ids = []
        for _ in range(num_blocks):
            block_id, _ = self._free.popitem(last=False)
            self._unpublish(block_id)
            self._ref_counts[block_id] = 1
            block_ids.append(block_id)
        return block_ids

    def release(self, block_ids: list[int]) -> None:
        """Drop one reference on each block; unreferenced blocks join the free pool, keeping their hash."""
        # Reversed: a table's last blocks are the least shareable, so they should be evicted first.
        for block_id in reversed(block_ids):
            assert self._ref_counts[block_id] > 0, f"block {block_id} released twice"
            self._ref_counts[block_id] -= 1
            if self._ref_counts[block_id] == 0:
                self._free[block_id] = None

    def publish(self, block_id: int, block_hash: bytes) -> bool:
        """Make a full, computed block findable under `block_hash`; False if the hash or block is taken."""
        assert self._ref_counts[block_id] > 0, "only blocks in use are published"
        if block_hash in self._block_of_hash or self._hash_of_block[block_id] is not None:
            return False
        self._block_of_hash[block_hash] = block_id
        self._hash_of_block[block_id] = block_hash
        return True

    def flush(self) -> None:
        """Forget every cached hash; blocks in use stay allocated, but nothing can be hit any more."""
        self._block_of_hash.clear()
        self._hash_of_block = [None] * self.num_blocks

    def _unpublish(self, block_id: int) -> None:
        block_hash = self._hash_of_block[block_id]
        if block_hash is not None:
            del self._block_of_hash[block_hash]
            self._hash_of_block[block_id] = None
