"""BlockManager: allocation, reference counts, chained block hashes and the prefix cache (no torch)."""

import pytest

from clawrl.engine.core.scheduler import BlockManager, chain_block_hashes


def test_allocate_release_and_reference_counts():
    manager = BlockManager(num_blocks=4, block_size=2)
    blocks = manager.allocate(3)
    assert sorted(blocks) == [0, 1, 2]
    assert manager.num_free_blocks == 1 and manager.num_used_blocks == 3
    assert not manager.can_allocate(2) and manager.can_allocate(1)
    manager.acquire([blocks[0]])  # a second table shares block 0
    assert manager.ref_count(blocks[0]) == 2
    manager.release(blocks)
    assert manager.ref_count(blocks[0]) == 1 and manager.num_free_blocks == 3
    manager.release([blocks[0]])
    assert manager.num_free_blocks == 4 and manager.ref_count(blocks[0]) == 0
    with pytest.raises(AssertionError):
        manager.release([blocks[0]])


def test_block_hashes_chain_over_prefix_and_namespace():
    tokens = [1, 2, 3, 4, 5, 6]
    hashes = chain_block_hashes([], tokens, 2, 3, "v=0")
    assert len(hashes) == 3 and len(set(hashes)) == 3
    assert chain_block_hashes([], tokens, 2, 3, "v=0") == hashes  # deterministic
    assert chain_block_hashes(hashes[:1], tokens, 2, 3, "v=0") == hashes  # extends in place
    assert chain_block_hashes([], tokens, 2, 3, "v=1")[0] != hashes[0]  # weight version is part of the key
    other_first_block = chain_block_hashes([], [9, 9, 3, 4], 2, 2, "v=0")
    assert other_first_block[1] != hashes[1]  # same block tokens, different prefix -> different hash


def test_prefix_hit_revives_freed_block_and_eviction_forgets_it():
    manager = BlockManager(num_blocks=3, block_size=2)
    hashes = chain_block_hashes([], [1, 2, 3, 4], 2, 2, "v=0")
    table = manager.allocate(2)
    assert manager.publish(table[0], hashes[0]) and manager.publish(table[1], hashes[1])
    assert not manager.publish(table[0], hashes[0])  # already published
    assert manager.match_prefix(hashes) == table
    manager.release(table)
    assert manager.num_free_blocks == 3 and manager.num_cached_blocks == 2
    hits = manager.match_prefix(hashes)
    assert hits == table  # freed blocks keep their cached K/V
    # Reviving both hits plus 2 fresh blocks would need 4 free blocks out of 3.
    assert manager.can_allocate(1, hits) and not manager.can_allocate(2, hits)
    manager.acquire(hits[:1])
    assert manager.ref_count(hits[0]) == 1 and manager.num_free_blocks == 2
    # The never-used block is handed out first; the next allocation has to evict cached block table[1].
    assert manager.allocate(1) == [2]
    assert manager.allocate(1) == [table[1]]
    assert manager.match_prefix(hashes) == [table[0]] and manager.num_cached_blocks == 1


def test_release_order_evicts_a_tables_tail_first():
    manager = BlockManager(num_blocks=3, block_size=1)
    table = manager.allocate(3)
    manager.release(table)
    assert manager.allocate(1) == [table[2]]


def test_flush_forgets_every_hash():
    manager = BlockManager(num_blocks=2, block_size=2)
    hashes = chain_block_hashes([], [5, 6], 2, 1, "v=0")
    block = manager.allocate(1)
    manager.publish(block[0], hashes[0])
    manager.flush()
    assert manager.match_prefix(hashes) == [] and manager.num_cached_blocks == 0
    assert manager.ref_count(block[0]) == 1  # blocks in use stay allocated
    assert manager.publish(block[0], hashes[0])  # and can be published again


def test_duplicate_hash_keeps_first_block():
    manager = BlockManager(num_blocks=2, block_size=2)
    hashes = chain_block_hashes([], [5, 6], 2, 1, "v=0")
    first, second = manager.allocate(2)
    assert manager.publish(first, hashes[0])
    assert not manager.publish(second, hashes[0])
    assert manager.match_prefix(hashes) == [first]
