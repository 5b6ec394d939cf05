import pytest

from tokenmill.core.block_pool import BlockPool, hash_block_tokens


def test_allocate_free_lru_order():
    pool = BlockPool(4)
    a, b = pool.get_new_blocks(2)
    assert (a.ref_cnt, b.ref_cnt) == (1, 1) and pool.num_free_blocks == 2
    pool.free_blocks([b, a])  # tail first
    pool.check_integrity()
    # Never-used blocks come first, then the least recently freed (b before a).
    ids = [blk.block_id for blk in pool.get_new_blocks(4)]
    assert ids == [2, 3, b.block_id, a.block_id]
    with pytest.raises(ValueError):
        pool.get_new_blocks(1)


def test_cached_block_survives_free_until_reused():
    pool = BlockPool(2)
    (blk,) = pool.get_new_blocks(1)
    h = hash_block_tokens(None, [1, 2, 3])
    pool.cache_full_block(blk, h)
    pool.free_blocks([blk])
    assert pool.get_cached_block(h) is blk  # still a hit while on the free list
    pool.touch([blk])
    assert blk.ref_cnt == 1 and pool.num_free_blocks == 1
    pool.free_blocks([blk])
    pool.get_new_blocks(2)  # reusing it evicts the hash
    assert pool.get_cached_block(h) is None
    pool.check_integrity()


def test_chained_hash_depends_on_prefix():
    h1 = hash_block_tokens(None, [1, 2])
    assert hash_block_tokens(h1, [3, 4]) != hash_block_tokens(hash_block_tokens(None, [9, 9]),
                                                              [3, 4])
    assert hash_block_tokens(None, [1, 2]) == h1
    assert hash_block_tokens(None, [1, 2]) != hash_block_tokens(None, [2, 1])


def test_caching_disabled_never_hits():
    pool = BlockPool(2, enable_caching=False)
    (blk,) = pool.get_new_blocks(1)
    pool.cache_full_block(blk, b"x")
    assert pool.get_cached_block(b"x") is None
