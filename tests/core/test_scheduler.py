from tokenmill.core.kv_cache_manager import KVCacheManager
from tokenmill.core.request import Request, RequestStatus
from tokenmill.core.scheduler import Scheduler, SchedulerConfig
from tokenmill.sampling_params import SamplingParams


def make(num_blocks=64, block_size=4, budget=32, max_seqs=8, chunked=True, max_len=256):
    kv = KVCacheManager(num_blocks, block_size)
    cfg = SchedulerConfig(max_num_seqs=max_seqs, max_num_batched_tokens=budget,
                          max_model_len=max_len, enable_chunked_prefill=chunked)
    return Scheduler(cfg, kv)


def req(rid, n_prompt, max_tokens=4, first=None, **kw):
    # Distinct prompts per id unless `first` is given, so prefix caching stays out of the way.
    first = 1 + 1000 * (ord(rid[0]) - 96) if first is None else first
    return Request(rid, list(range(first, first + n_prompt)),
                   SamplingParams(max_tokens=max_tokens, eos_token_ids=[0], **kw))


def run_step(s, token=5):
    out = s.schedule()
    sampled = {x.request.request_id: [token] for x in out.scheduled
               if x.end == x.request.num_tokens}
    return out, s.update_from_output(out, sampled)


def test_chunked_prefill_then_decode_in_one_step():
    s = make(budget=10)
    s.add_request(req("a", 4))
    s.add_request(req("b", 25))
    out, _ = run_step(s)
    assert [(x.request.request_id, x.num_new_tokens) for x in out.scheduled] == \
        [("a", 4), ("b", 6)]
    out, updated = run_step(s)
    # Running first: a decodes 1 token, b's prompt continues with the rest of the budget.
    assert [(x.request.request_id, x.start, x.num_new_tokens) for x in out.scheduled] == \
        [("a", 4, 1), ("b", 6, 9)]
    assert [(r.request_id, n) for r, n in updated] == [("a", 1)]


def test_no_chunking_waits_for_budget():
    s = make(budget=10, chunked=False)
    s.add_request(req("a", 12))
    assert s.schedule().empty


def test_max_num_seqs_and_fcfs():
    s = make(max_seqs=2)
    for rid in "abc":
        s.add_request(req(rid, 3))
    out, _ = run_step(s)
    assert [x.request.request_id for x in out.scheduled] == ["a", "b"]
    assert [r.request_id for r in s.waiting] == ["c"]


def test_stop_rules():
    s = make()
    s.add_request(req("len", 3, max_tokens=2))
    s.add_request(req("eos", 3, max_tokens=9))
    s.add_request(req("tok", 3, max_tokens=9, stop_token_ids=[7]))
    s.add_request(req("min", 3, max_tokens=9, min_tokens=2))
    out = s.schedule()
    s.update_from_output(out, {"len": [5], "eos": [0], "tok": [7], "min": [0]})
    assert s.requests.keys() == {"len", "min"}
    out = s.schedule()
    s.update_from_output(out, {"len": [5], "min": [0]})
    assert not s.has_unfinished_requests()


def test_preempts_newest_and_recomputes():
    s = make(num_blocks=6, block_size=4, budget=64)
    a, b = req("a", 8, max_tokens=12), req("b", 8, max_tokens=12)
    s.add_request(a)
    s.add_request(b)
    run_step(s)
    for _ in range(8):  # grow until the 6 blocks run out
        run_step(s)
    assert s.num_preemptions >= 1
    assert b.status in (RequestStatus.PREEMPTED, RequestStatus.RUNNING)
    assert b.num_preemptions >= 1 and a.num_preemptions == 0
    while s.has_unfinished_requests():
        run_step(s)
    assert a.num_output_tokens == 12 and b.num_output_tokens == 12
    s.kv_cache.pool.check_integrity()
    assert s.kv_cache.pool.num_free_blocks == 6


def test_abort_anywhere_frees_blocks():
    s = make()
    s.add_request(req("a", 5))
    s.add_request(req("b", 5))
    run_step(s)
    s.add_request(req("c", 5))
    s.abort_requests(["a", "c", "missing"])
    assert [r.request_id for r in s.running] == ["b"] and not s.waiting
    out, _ = run_step(s)
    assert out.finished_ids == {"a", "c"}
    s.abort_requests(["b"])
    assert s.kv_cache.pool.num_free_blocks == s.kv_cache.num_blocks


def test_prefix_hit_skips_cached_tokens():
    s = make(block_size=4)
    s.add_request(req("a", 9, first=1))
    run_step(s)
    s.add_request(req("b", 9, first=1))
    out, _ = run_step(s)
    b = [x for x in out.scheduled if x.request.request_id == "b"][0]
    assert (b.start, b.num_new_tokens) == (8, 1)
    assert s.kv_cache.num_hit_tokens == 8


def test_draft_tokens_ride_with_a_decode_and_roll_back():
    """A decode with drafts computes its last token and the drafts (within the budget); the
    step's verified tokens are appended up to a stop, and the computed tokens end after the
    last accepted draft: the rejected drafts' KV is left to be overwritten."""
    s = make(budget=4, block_size=4)
    a = req("a", 4, max_tokens=20, stop_token_ids=[99])
    s.add_request(a)
    run_step(s)  # the prompt; first token 5
    a.spec_token_ids = [6, 7, 8, 9, 10]
    out = s.schedule()
    (x,) = out.scheduled
    assert (x.start, x.num_new_tokens, x.drafts) == (4, 4, [6, 7, 8]) and not a.spec_token_ids
    assert a.num_computed_tokens == 8
    # two drafts accepted, then the target's own token
    updated = s.update_from_output(out, {"a": [6, 7, 42]})
    assert updated == [(a, 3)] and a.output_token_ids == [5, 6, 7, 42]
    assert a.num_computed_tokens == 7 and a.num_tokens == 8  # the next step computes 42
    assert (s.num_draft_tokens, s.num_accepted_tokens, s.num_spec_emitted) == (3, 2, 3)
    # a stop token among the accepted ones: what follows it is dropped
    a.spec_token_ids = [99, 3]
    out = s.schedule()
    assert s.update_from_output(out, {"a": [99, 3, 4]}) == [(a, 1)]
    assert a.output_token_ids[-1] == 99 and a.status.finished
    assert s.kv_cache.pool.num_free_blocks == s.kv_cache.num_blocks
