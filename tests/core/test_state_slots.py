"""The state slots a model with state layers keeps per running request (core/state_slots.py),
handed out and taken back by the KV-cache manager with the request's blocks."""

from tokenmill.core.kv_cache_manager import KVCacheManager
from tokenmill.core.request import Request
from tokenmill.core.scheduler import Scheduler, SchedulerConfig
from tokenmill.core.state_slots import StateSlots
from tokenmill.sampling_params import SamplingParams


def req(rid, n, first=1):
    return Request(rid, list(range(first, first + n)),
                   SamplingParams(max_tokens=3, eos_token_ids=[0]))


def test_slots_are_taken_once_and_come_back():
    slots = StateSlots(2)
    assert slots.take("a") and slots.take("a") and slots.get("a") == 0
    assert slots.take("b") and slots.get("b") == 1 and slots.num_free == 0
    assert not slots.take("c") and slots.get("c") == -1  # (nothing changed)
    slots.free("a")
    slots.free("a")  # (twice: no second slot appears)
    assert slots.num_free == 1 and slots.take("c") and slots.get("c") == 0


def test_the_manager_gives_a_slot_with_the_first_blocks_and_takes_it_back():
    kv = KVCacheManager(num_blocks=4, block_size=4, enable_prefix_caching=True,
                        num_state_slots=2)
    assert not kv.enable_prefix_caching  # (a state holds every token before it: no sharing)
    a, b, c = req("a", 6), req("b", 6), req("c", 6)
    assert kv.allocate_slots(a, 6) and kv.state_slot("a") == 0
    a.num_computed_tokens = 6
    a.output_token_ids.append(9)
    assert kv.allocate_slots(a, 1) and kv.state_slot("a") == 0  # (kept while it runs)
    # out of blocks: no slot is kept either
    assert not kv.allocate_slots(b, 12) and kv.state_slot("b") == -1
    assert kv.states.num_free == 1
    assert kv.allocate_slots(b, 6) and kv.state_slot("b") == 1
    # out of slots: no block is taken
    free = kv.pool.num_free_blocks
    assert not kv.allocate_slots(c, 1) and kv.pool.num_free_blocks == free
    kv.free(a)
    assert kv.state_slot("a") == -1 and kv.allocate_slots(c, 4) and kv.state_slot("c") == 0
    # the same prompt again finds no cached block
    assert kv.get_computed_blocks(req("d", 6)) == ([], 0)


def test_preemption_gives_the_slot_back_and_the_request_starts_over():
    kv = KVCacheManager(num_blocks=5, block_size=4, num_state_slots=4)
    scheduler = Scheduler(SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=64,
                                          max_model_len=64), kv)
    requests = {rid: req(rid, 8, first=ord(rid)) for rid in "ab"}
    for request in requests.values():
        scheduler.add_request(request)
    restarted = []
    for _ in range(12):  # (decodes outgrow the 5 blocks: the newer request is preempted)
        out = scheduler.schedule()
        slots = [s.state_slot for s in out.scheduled]
        assert min(slots, default=0) >= 0 and len(set(slots)) == len(slots)
        restarted += [s.request.request_id for s in out.scheduled
                      if s.start == 0 and s.request.num_preemptions]
        scheduler.update_from_output(out, {s.request.request_id: [5] for s in out.scheduled
                                           if s.end == s.request.num_tokens})
        # every slot is free or held by a running request: a preempted one holds none
        held = [kv.state_slot(r.request_id) for r in scheduler.running]
        assert all(kv.state_slot(rid) == -1 for rid in requests
                   if requests[rid] not in scheduler.running)
        assert kv.states.num_free + len(held) == 4 and -1 not in held
    assert scheduler.num_preemptions > 0 and restarted == ["b"]
