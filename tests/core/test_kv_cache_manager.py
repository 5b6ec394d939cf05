from tokenmill.core.kv_cache_manager import KVCacheManager
from tokenmill.core.request import Request
from tokenmill.sampling_params import SamplingParams


def ids(kv: KVCacheManager, request_id: str) -> list[int]:
    """The request's block ids as a step's table row takes them."""
    return kv.block_row(request_id).tolist()


def req(rid, tokens):
    return Request(rid, list(tokens), SamplingParams(max_tokens=4))


def test_allocation_grows_by_blocks():
    kv = KVCacheManager(num_blocks=4, block_size=4)
    r = req("a", range(6))
    assert kv.allocate_slots(r, 6)
    assert len(ids(kv, "a")) == 2
    r.num_computed_tokens = 6
    r.output_token_ids.append(7)
    assert kv.allocate_slots(r, 1)  # 7 tokens still fit in 2 blocks
    assert len(ids(kv, "a")) == 2
    r.num_computed_tokens = 7
    r.output_token_ids.append(8)
    assert kv.allocate_slots(r, 1) and len(ids(kv, "a")) == 2
    r.num_computed_tokens = 8
    r.output_token_ids.append(9)
    assert kv.allocate_slots(r, 1) and len(ids(kv, "a")) == 3


def test_refuses_without_side_effects():
    kv = KVCacheManager(num_blocks=2, block_size=4)
    assert not kv.allocate_slots(req("a", range(12)), 12)
    assert kv.pool.num_free_blocks == 2 and ids(kv, "a") == []


def test_prefix_hit_full_blocks_only_and_last_token_recomputed():
    kv = KVCacheManager(num_blocks=8, block_size=4)
    a = req("a", range(10))
    assert kv.allocate_slots(a, 10)
    b = req("b", list(range(8)) + [99, 98])
    hits, n = kv.get_computed_blocks(b)
    assert n == 8 and [h.block_id for h in hits] == ids(kv, "a")[:2]
    # A prompt that is exactly two cached blocks still recomputes its last block.
    c = req("c", range(8))
    _, n = kv.get_computed_blocks(c)
    assert n == 4
    assert kv.allocate_slots(b, 2, hits)
    assert ids(kv, "b")[:2] == ids(kv, "a")[:2]
    assert all(kv.pool.blocks[i].ref_cnt == 2 for i in ids(kv, "a")[:2])
    kv.free(a)
    kv.free(b)
    kv.pool.check_integrity()
    assert kv.pool.num_free_blocks == 8
    # Freed but still cached: a new request hits.
    _, n = kv.get_computed_blocks(req("d", range(10)))
    assert n == 8


def test_prefix_caching_off_and_prompt_logprobs_skip_cache():
    kv = KVCacheManager(num_blocks=8, block_size=4, enable_prefix_caching=False)
    assert kv.allocate_slots(req("a", range(10)), 10)
    assert kv.get_computed_blocks(req("b", range(10)))[1] == 0
    kv = KVCacheManager(num_blocks=8, block_size=4)
    assert kv.allocate_slots(req("a", range(10)), 10)
    r = Request("b", list(range(10)), SamplingParams(prompt_logprobs=1))
    assert kv.get_computed_blocks(r)[1] == 0


def test_block_ids_follow_the_blocks_through_hits_windows_and_frees():
    # the ids a step's table takes, kept beside the blocks, against the blocks themselves
    import random

    rng = random.Random(5)
    for window in (None, 6):
        kv = KVCacheManager(num_blocks=40, block_size=4, window=window)
        live: dict[str, Request] = {}
        for step in range(300):
            if live and rng.random() < 0.15:  # a request finishes or is preempted
                kv.free(live.pop(rng.choice(sorted(live))))
            elif len(live) < 5 and rng.random() < 0.3:  # a new one, maybe sharing a prefix
                r = req(f"r{step}", [1, 2, 3, 4, 5, 6, 7, 8][:rng.randrange(9)]
                        + [rng.randrange(50) for _ in range(rng.randrange(1, 12))])
                hits, cached = kv.get_computed_blocks(r)
                if kv.allocate_slots(r, r.num_tokens - cached, hits):
                    r.num_computed_tokens = r.num_tokens
                    live[r.request_id] = r
            elif live:  # a decode
                r = live[rng.choice(sorted(live))]
                r.output_token_ids.append(rng.randrange(50))
                if kv.allocate_slots(r, 1):
                    r.num_computed_tokens += 1
                else:
                    r.output_token_ids.pop()
            for rid in live:
                assert ids(kv, rid) == [0 if b is None else b.block_id
                                             for b in kv._blocks[rid]]
        assert kv._rows.keys() == kv._blocks.keys()


def test_a_steps_block_row_view_keeps_what_it_held():
    """The scheduler hands a step a view of each request's row: rows growing in place or into
    a new array later never change what an earlier step's view holds."""
    from tokenmill.core.int_row import IntRow

    row, views, want = IntRow(), [], []
    for step in range(60):
        row.extend(list(range(step * 3, step * 3 + step % 4)))
        views.append(row.view())
        want.append(row.view().tolist())  # (a copy, as the step saw it)
    assert [v.tolist() for v in views] == want
    assert row.view().tolist() == [i for s in range(60) for i in range(s * 3, s * 3 + s % 4)]
