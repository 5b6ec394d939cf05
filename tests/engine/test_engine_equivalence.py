"""Chunked prefill, prefix-cache hits and preemption change scheduling, never the tokens."""

import random

import pytest

from tokenmill import LLM, SamplingParams

GREEDY = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)


@pytest.fixture(scope="module")
def prompts():
    rng = random.Random(0)
    shared = [rng.randrange(2, 500) for _ in range(40)]  # a long shared prefix (system prompt)
    out = [shared + [rng.randrange(2, 500) for _ in range(rng.randrange(1, 30))]
           for _ in range(6)]
    out += [[rng.randrange(2, 500) for _ in range(n)] for n in (3, 17, 64, 90)]
    return [{"prompt_token_ids": p} for p in out]


@pytest.fixture(scope="module")
def baseline(tiny_models, prompts):
    path, _ = tiny_models("qwen2")
    llm = LLM(path, kv_cache_memory_gib=0.05, enable_prefix_caching=False)
    # One at a time: no batching effects at all.
    return [llm.generate(p, GREEDY, use_tqdm=False)[0].outputs[0].token_ids for p in prompts]


def tokens(outs):
    return [o.outputs[0].token_ids for o in outs]


def test_batched_equals_one_by_one(tiny_models, prompts, baseline):
    llm = LLM(tiny_models("qwen2")[0], kv_cache_memory_gib=0.05, enable_prefix_caching=False)
    assert tokens(llm.generate(prompts, GREEDY, use_tqdm=False)) == baseline


def test_chunked_prefill_forced(tiny_models, prompts, baseline):
    llm = LLM(tiny_models("qwen2")[0], kv_cache_memory_gib=0.05, max_num_batched_tokens=7)
    assert tokens(llm.generate(prompts, GREEDY, use_tqdm=False)) == baseline


def test_prefix_cache_hits(tiny_models, prompts, baseline):
    llm = LLM(tiny_models("qwen2")[0], kv_cache_memory_gib=0.05, block_size=8)
    first = llm.generate(prompts[:1], GREEDY, use_tqdm=False)
    outs = llm.generate(prompts, GREEDY, use_tqdm=False)
    assert tokens(first) + tokens(outs) == baseline[:1] + baseline
    assert all(o.num_cached_tokens >= 40 for o in outs[:6])
    assert llm.engine.core.kv_cache.num_hit_tokens >= 6 * 40


def test_preemption_keeps_outputs(tiny_models, prompts, baseline):
    # 14 blocks of 8 tokens: the longest request (~106 tokens) fits alone, the batch does not.
    llm = LLM(tiny_models("qwen2")[0], num_kv_blocks=14, block_size=8)
    assert tokens(llm.generate(prompts, GREEDY, use_tqdm=False)) == baseline
    core = llm.engine.core
    assert core.scheduler.num_preemptions > 0
    assert core.kv_cache.pool.num_free_blocks == 14
    core.kv_cache.pool.check_integrity()


def test_request_too_large_for_cache_is_rejected(tiny_models):
    llm = LLM(tiny_models("qwen2")[0], num_kv_blocks=2, block_size=8)
    with pytest.raises(ValueError, match="KV cache"):
        llm.generate({"prompt_token_ids": list(range(2, 30))}, GREEDY, use_tqdm=False)
    assert not llm.engine.has_unfinished_requests()


def test_abort_mid_generation_frees_everything(tiny_models, prompts):
    llm = LLM(tiny_models("qwen2")[0], kv_cache_memory_gib=0.05)
    engine = llm.engine
    ids = [engine.add_request(None, p, GREEDY) for p in prompts[:4]]
    engine.step()
    engine.step()
    engine.abort_request(ids[:2])
    finished = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            finished[out.request_id] = out
    assert set(finished) == set(ids[2:])
    pool = engine.core.kv_cache.pool
    assert pool.num_free_blocks == pool.num_blocks


def test_prompt_logprobs_same_when_chunked_and_preempted(tiny_models, prompts):
    params = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True, prompt_logprobs=2)
    path = tiny_models("qwen2")[0]

    def run(**kwargs):
        outs = LLM(path, **kwargs).generate(prompts[6:], params, use_tqdm=False)
        return [[None if p is None else {t: lp.logprob for t, lp in p.items()}
                 for p in o.prompt_logprobs] for o in outs]

    def assert_close(got, want):
        # Same top tokens at every position; values equal up to float reduction order.
        assert len(got) == len(want)
        for g_seq, w_seq in zip(got, want):
            assert len(g_seq) == len(w_seq)
            for g, w in zip(g_seq, w_seq):
                if w is None:
                    assert g is None
                    continue
                assert set(g) == set(w)
                assert all(abs(g[t] - w[t]) < 1e-4 for t in w)

    whole = run(kv_cache_memory_gib=0.05)
    assert all(len(p) == len(q["prompt_token_ids"]) for p, q in zip(whole, prompts[6:]))
    assert_close(run(kv_cache_memory_gib=0.05, max_num_batched_tokens=5), whole)
    assert_close(run(num_kv_blocks=14, block_size=8), whole)
