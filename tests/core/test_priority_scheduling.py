"""--scheduling-policy priority: requests wait in (priority, arrival) order; when blocks run
short the running request last in that order is preempted (even one already scheduled in
the step, whose tokens go back to the budget); a waiting request that ranks ahead of a
running one takes its slot or its blocks. FCFS stays as it was. Each case is checked by
order and cause, against a slow reference of the queue order."""

import random

from tokenmill.core.kv_cache_manager import KVCacheManager
from tokenmill.core.request import Request, RequestStatus
from tokenmill.core.scheduler import Scheduler, SchedulerConfig
from tokenmill.sampling_params import SamplingParams


def make(policy="priority", num_blocks=64, block_size=4, budget=64, max_seqs=8):
    cfg = SchedulerConfig(max_num_seqs=max_seqs, max_num_batched_tokens=budget,
                          max_model_len=256, policy=policy)
    return Scheduler(cfg, KVCacheManager(num_blocks, block_size))


def req(rid, n_prompt, priority=0, arrival=0.0, max_tokens=4):
    first = 1 + 1000 * (ord(rid[0]) - 96)
    return Request(rid, list(range(first, first + n_prompt)),
                   SamplingParams(max_tokens=max_tokens, eos_token_ids=[0]),
                   arrival_time=arrival, priority=priority)


def run_step(s):
    out = s.schedule()
    sampled = {x.request.request_id: [5] for x in out.scheduled
               if x.end == x.request.num_tokens}
    s.update_from_output(out, sampled)
    return out


def test_waiting_order_is_priority_then_arrival():
    s = make(max_seqs=1)
    s.add_request(req("a", 3, priority=0, arrival=0))  # (runs: the only slot)
    run_step(s)
    rng = random.Random(0)
    added = [req(chr(ord("b") + i), 3, priority=rng.randint(-2, 2), arrival=rng.random())
             for i in range(12)]
    for r in added:
        s.add_request(r)
    want = sorted(added, key=lambda r: (r.priority, r.arrival_time))
    assert [r.request_id for r in s.waiting] == [r.request_id for r in want]


def test_fcfs_ignores_priority_and_preempts_the_newest():
    s = make(policy="fcfs", max_seqs=1)
    s.add_request(req("a", 3, priority=5, arrival=0))
    s.add_request(req("b", 3, priority=-5, arrival=1))
    out = run_step(s)
    assert [x.request.request_id for x in out.scheduled] == ["a"]


def test_a_higher_priority_request_takes_the_slot_of_a_lower_one():
    """Slots full of priority-1 work: a priority-0 arrival runs in the next step, the latest
    priority-1 request is preempted for it, and the others keep running."""
    s = make(max_seqs=3)
    for i, rid in enumerate("abc"):
        s.add_request(req(rid, 3, priority=1, arrival=i, max_tokens=50))
    run_step(s)
    s.add_request(req("z", 3, priority=0, arrival=9))
    out = run_step(s)
    assert "z" in [x.request.request_id for x in out.scheduled]
    assert s.requests["c"].status == RequestStatus.PREEMPTED
    assert [r.request_id for r in s.running] == ["a", "b", "z"]
    assert [r.request_id for r in s.waiting] == ["c"]
    assert s.requests["c"].num_preemptions == 1


def test_equal_priority_waits_its_turn():
    s = make(max_seqs=2)
    for i, rid in enumerate("ab"):
        s.add_request(req(rid, 3, priority=0, arrival=i, max_tokens=50))
    run_step(s)
    s.add_request(req("c", 3, priority=0, arrival=5))
    out = run_step(s)
    assert "c" not in [x.request.request_id for x in out.scheduled] and not s.num_preemptions


def test_out_of_blocks_preempts_the_lowest_priority_even_if_scheduled_first():
    """Blocks run out while decoding: the victim is the priority-2 request, though it was
    admitted first (FCFS would take the newest); its step tokens return to the budget."""
    s = make(num_blocks=6, block_size=4)
    low, high = req("low", 8, priority=2, arrival=0, max_tokens=12), \
        req("high", 8, priority=0, arrival=1, max_tokens=12)
    s.add_request(low)
    run_step(s)
    s.add_request(high)
    out = run_step(s)
    assert [x.request.request_id for x in out.scheduled] == ["low", "high"]
    for _ in range(20):  # (bounded: the 6 blocks run out within a few decodes)
        out = run_step(s)
        if s.num_preemptions:
            break
    assert low.num_preemptions == 1 and high.num_preemptions == 0
    assert [x.request.request_id for x in out.scheduled] == ["high"]
    while s.has_unfinished_requests():
        run_step(s)
    s.kv_cache.pool.check_integrity()
    assert s.kv_cache.pool.num_free_blocks == 6


def test_a_higher_priority_prompt_takes_the_blocks_of_a_lower_one():
    """No free blocks for the arrival's prompt: the lower-priority running request makes
    room (FCFS would let the arrival wait)."""
    s = make(num_blocks=5, block_size=4)
    s.add_request(req("low", 12, priority=3, arrival=0, max_tokens=40))
    run_step(s)
    s.add_request(req("high", 12, priority=0, arrival=1))
    out = run_step(s)
    assert [x.request.request_id for x in out.scheduled] == ["high"]
    assert s.requests["low"].status == RequestStatus.PREEMPTED
    fcfs = make(policy="fcfs", num_blocks=5, block_size=4)
    fcfs.add_request(req("low", 12, arrival=0, max_tokens=40))
    run_step(fcfs)
    fcfs.add_request(req("high", 12, arrival=1))
    assert "high" not in [x.request.request_id for x in run_step(fcfs).scheduled]


def test_a_full_micro_batch_displaces_nobody_outside_it():
    """A pipeline micro-batch's share (max_seqs 2) already full of high-priority requests:
    displacing lower-priority ones outside it would free no room in it, so none is."""
    s = make(max_seqs=4)
    for i, (rid, priority) in enumerate((("h", 0), ("i", 0), ("l", 5), ("m", 5))):
        s.add_request(req(rid, 3, priority=priority, arrival=i, max_tokens=50))
    run_step(s)
    assert [r.request_id for r in s.running] == ["h", "i", "l", "m"]
    s.add_request(req("n", 3, priority=0, arrival=9))
    out = s.schedule(max_seqs=2)
    assert [x.request.request_id for x in out.scheduled] == ["h", "i"]
    assert s.num_preemptions == 0 and [r.request_id for r in s.waiting] == ["n"]


def test_a_victim_scheduled_in_the_same_step_leaves_no_unwritten_block_cached():
    """A prompt chunk scheduled and then preempted in the same step (by priority) never had
    its KV written: its blocks must not serve a later request as prefix-cache hits."""
    s = make(num_blocks=5, block_size=4, budget=12, max_seqs=8)
    low = req("l", 20, priority=5, arrival=0, max_tokens=4)
    s.add_request(low)
    run_step(s)  # (its first 12 tokens: blocks 0-2 written)
    s.add_request(req("h", 4, priority=0, arrival=1, max_tokens=20))
    out = run_step(s)  # (l's last 8 took blocks 3-4, then l made room for h)
    assert [x.request.request_id for x in out.scheduled] == ["h"]
    assert low.status == RequestStatus.PREEMPTED
    again = req("m", 20, priority=5, arrival=2)
    again.prompt_token_ids = list(low.prompt_token_ids)
    hits, _ = s.kv_cache.get_computed_blocks(again)
    assert len(hits) == 3  # (what the first step wrote; block 3 was never written)
    s.kv_cache.pool.check_integrity()
