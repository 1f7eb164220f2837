"""BlockManager: the KV cache's block allocator, reference counts and prefix cache. No torch here.

The KV cache is `num_blocks` blocks of `block_size` token slots. A sequence owns a block table; a block can
appear in several tables (shared prompt blocks of a request's n samples, or prefix-cache hits), so each block
has a reference count and returns to the free pool when it drops to zero.

Prefix cache: a *full* block whose K/V have been computed is published under a chained hash
`H_i = blake2b(H_{i-1} || token ids of block i)` with `H_{-1} = namespace`. The namespace holds the weight
version (K/V computed by other weights must never be reused; decision 8) and, when cross-request prefix
caching is off, the request id (so a request's own samples still share its prompt). A freed block keeps its
hash while it sits in the free pool, so a later request can revive it; allocation evicts least-recently
freed blocks first. Blocks are only published once their K/V are computed, and a published block is never
written again (sequences only write positions >= their computed count, which lie past every shared block).
"""

from __future__ import annotations

import hashlib
from array import array
from collections import OrderedDict


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
