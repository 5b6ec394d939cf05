"""The step message's block table sent as what changed (worker/step_sync.py): another rank's
rebuilt rows equal rank 0's at every step of a real scheduler's run, through prefix hits,
preemption, sliding-window drops, aborts and requests that come back under the same id;
and a decode step's message does not grow with the context."""

import random

import numpy as np
import pytest

from tokenmill.core.kv_cache_manager import KVCacheManager
from tokenmill.core.request import Request
from tokenmill.core.scheduler import Scheduler, SchedulerConfig
from tokenmill.sampling_params import SamplingParams
from tokenmill.worker.step_inputs import StepInputs
from tokenmill.worker.step_sync import StepReceiver, StepSender, with_rows


def _ordered(scheduled):  # (the model runner's order: decodes first)
    return sorted(scheduled, key=lambda s: s.num_new_tokens != 1)


@pytest.mark.parametrize("window", [None, 10])
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_rows_on_another_rank_equal_rank_0s_at_every_step(seed, window):
    rng = random.Random(seed)
    kv = KVCacheManager(12 if window else 24, 4, enable_prefix_caching=True, window=window)
    scheduler = Scheduler(SchedulerConfig(max_num_seqs=6, max_num_batched_tokens=20,
                                          max_model_len=96), kv)
    sender, receiver = StepSender(), StepReceiver()
    shared = [rng.randrange(1, 50) for _ in range(12)]  # a prefix some prompts share
    preempted = reused = dropped = 0
    seen = set()
    for _ in range(300):
        if rng.random() < 0.3:  # arrivals, ids reused once their request is gone
            rid = f"r{rng.randrange(12)}"
            if rid not in scheduler.requests:
                reused += rid in seen
                seen.add(rid)
                prompt = (shared if rng.random() < 0.5 else []) + [
                    rng.randrange(1, 50) for _ in range(rng.randrange(1, 30))]
                scheduler.add_request(Request(rid, prompt, SamplingParams(
                    max_tokens=rng.randrange(1, 40), eos_token_ids=[0], ignore_eos=True)))
        if rng.random() < 0.05 and scheduler.requests:
            scheduler.abort_requests([rng.choice(sorted(scheduler.requests))])
        before = scheduler.num_preemptions
        out = scheduler.schedule()
        preempted += scheduler.num_preemptions > before
        sender.release(out.finished_ids)
        if out.empty:
            continue
        scheduled = _ordered(out.scheduled)
        inputs = StepInputs.of(scheduled)
        got = receiver.decode(sender.encode(inputs, scheduled))
        assert len(got.block_ids) == len(inputs.block_ids)
        for mine, theirs in zip(inputs.block_ids, got.block_ids):
            np.testing.assert_array_equal(theirs, mine)
        assert got.token_ids == inputs.token_ids and got.ends == inputs.ends
        # no row is kept for a request that no longer holds blocks
        assert receiver.num_rows == sender.num_rows <= len(scheduler.requests)
        sampled = {s.request.request_id: [rng.randrange(1, 50)] for s in out.scheduled
                   if s.end >= s.request.num_tokens}
        scheduler.update_from_output(out, sampled)
        dropped += any(kv._num_dropped.values())
    assert preempted and kv.num_hit_tokens and reused and bool(dropped) == bool(window)


def test_a_decode_steps_message_does_not_grow_with_the_context():
    sender, receiver = StepSender(), StepReceiver()
    kv = KVCacheManager(64 * 2001, 16, enable_prefix_caching=False)
    scheduler = Scheduler(SchedulerConfig(max_num_seqs=64, max_num_batched_tokens=64 * 32000,
                                          max_model_len=40000), kv)
    for i in range(64):
        scheduler.add_request(Request(f"r{i}", [1 + i] * 31999, SamplingParams(max_tokens=9)))
    sizes = []
    for _ in range(3):
        out = scheduler.schedule()
        scheduled = _ordered(out.scheduled)
        inputs = StepInputs.of(scheduled)
        data = sender.encode(inputs, scheduled)
        got = receiver.decode(data)
        np.testing.assert_array_equal(got.block_ids[-1], inputs.block_ids[-1])
        sizes.append((len(data), len(inputs.encode())))
        scheduler.update_from_output(out, {s.request.request_id: [7] for s in out.scheduled})
    assert len(inputs.block_ids[0]) > 2000  # 32k tokens in 16-token blocks
    for decode, whole in sizes[1:]:
        assert whole > 64 * 2000 * 3  # the full table in every step's message before
        assert decode < 64 * 40  # a few bytes a sequence now (the third step: a new block)


def test_a_head_pass_takes_its_rows_from_the_target_step():
    target = StepInputs([1, 2], [3, 5], [4, 6], [[7, 8], [9]], [0, 1], [], [], [1, 1])
    bare = StepInputs([4], [6], [7], [], [], [], [], [])
    assert with_rows(bare, target, [1]).block_ids == [[9]]
