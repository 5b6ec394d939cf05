"""Speculative decoding (n-gram prompt lookup) in the engine: greedy outputs identical to
decoding without it on the tiny models, batched with requests that don't speculate, under
chunked prefill, prefix-cache hits and preemption; KV blocks all back in the pool; seeded
sampling reproducible."""

import random

import pytest

from tokenmill import LLM, SamplingParams

NGRAM = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1,
         "prompt_lookup_max": 3}


def _prompts():
    rng = random.Random(0)
    loop = [rng.randrange(2, 500) for _ in range(6)]
    shared = [rng.randrange(2, 500) for _ in range(20)]
    return [loop * 4, shared + loop * 2, shared + [7, 8, 9], list(range(30, 60)) * 2, [3, 4],
            [rng.randrange(2, 500) for _ in range(40)]]


def _params():
    """Greedy requests that speculate (one with logprobs), one that doesn't (a repetition
    penalty), one stopping on a token and one with a short max_tokens."""
    plain = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)
    return [plain, SamplingParams(temperature=0, max_tokens=20, ignore_eos=True, logprobs=2),
            plain, SamplingParams(temperature=0, max_tokens=20, ignore_eos=True,
                                  repetition_penalty=1.3),
            SamplingParams(temperature=0, max_tokens=5, ignore_eos=True),
            SamplingParams(temperature=0, max_tokens=20, ignore_eos=True, min_tokens=3,
                           stop_token_ids=[57, 58])]


def _run(path, **engine):
    with LLM(path, **engine) as llm:
        outs = llm.generate([{"prompt_token_ids": p} for p in _prompts()], _params(),
                            use_tqdm=False)
        core = llm.engine.core
        kv = core.kv_cache
        stats = (core.scheduler.num_draft_tokens, core.scheduler.num_accepted_tokens)
        assert kv.pool.num_free_blocks == kv.num_blocks  # every block back, drafts' too
        kv.pool.check_integrity()
        _run.logprobs = outs[1].outputs[0].logprobs  # (the request asking for them)
        return [list(o.outputs[0].token_ids) for o in outs], stats


@pytest.mark.parametrize("arch", ["llama", "qwen2", "gemma2", "deepseek_v3", "qwen3_moe",
                                  "phi3"])
def test_greedy_outputs_equal_decoding_without_speculation(tiny_models, arch):
    path, _ = tiny_models(arch)
    base, _ = _run(path, kv_cache_memory_gib=0.05)
    base_logprobs = _run.logprobs
    spec, (drafts, accepted) = _run(path, kv_cache_memory_gib=0.05, speculative_config=NGRAM)
    assert spec == base
    assert drafts > 0  # (how many the random weights accept varies by model)
    # the emitted tokens' logprobs too: top-2 and the chosen token's, at each position
    assert len(_run.logprobs) == len(base_logprobs) == 20
    for ours, theirs in zip(_run.logprobs, base_logprobs, strict=True):
        assert ours.keys() == theirs.keys()
        assert all(abs(ours[t].logprob - theirs[t].logprob) < 1e-4 for t in ours)
    # chunked prefill (7-token steps: drafts cut to the budget too) and prefix-cache hits
    chunked, _ = _run(path, kv_cache_memory_gib=0.05, speculative_config=NGRAM,
                      max_num_batched_tokens=7, block_size=8)
    assert chunked == base


def test_preemption_with_drafts_keeps_outputs(tiny_models):
    path, _ = tiny_models("qwen2")
    params = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)
    prompts = [{"prompt_token_ids": p} for p in _prompts()]
    with LLM(path, kv_cache_memory_gib=0.05) as llm:
        base = [list(o.outputs[0].token_ids)
                for o in llm.generate(prompts, params, use_tqdm=False)]
    with LLM(path, num_kv_blocks=12, block_size=8, speculative_config=NGRAM) as llm:
        outs = llm.generate(prompts, params, use_tqdm=False)
        core = llm.engine.core
        assert core.scheduler.num_preemptions > 0
        # drafts were both kept and thrown away
        assert core.scheduler.num_draft_tokens > core.scheduler.num_accepted_tokens > 0
        assert core.kv_cache.pool.num_free_blocks == 12
    assert [list(o.outputs[0].token_ids) for o in outs] == base


def test_seeded_sampling_with_drafts_reproduces(tiny_models):
    path, _ = tiny_models("llama")
    prompts = [{"prompt_token_ids": p} for p in _prompts()[:4]]
    params = SamplingParams(temperature=0.8, top_k=20, max_tokens=20, seed=7, ignore_eos=True)
    runs = []
    for _ in range(2):
        with LLM(path, kv_cache_memory_gib=0.05, speculative_config=NGRAM) as llm:
            runs.append([list(o.outputs[0].token_ids)
                         for o in llm.generate(prompts, params, use_tqdm=False)])
            assert llm.engine.core.scheduler.num_draft_tokens > 0
    assert runs[0] == runs[1]
    assert all(len(r) == 20 for r in runs[0])


def test_bad_speculative_config_is_a_start_up_error(tiny_models):
    path, _ = tiny_models("llama")
    with pytest.raises(ValueError, match="num_speculative_tokens must be a positive"):
        LLM(path, speculative_config={"method": "ngram", "num_speculative_tokens": 0})
    with pytest.raises(ValueError, match="not served yet"):
        LLM(path, speculative_config={"method": "mtp", "num_speculative_tokens": 1})


def test_the_benchmark_script_runs(tiny_models, tmp_path):
    """bench/spec_decode.py end to end on a tiny model: a row per prompt set and batch size,
    outputs with and without speculation identical."""
    import json
    import os
    import subprocess
    import sys

    path, _ = tiny_models("llama")
    out = tmp_path / "spec.json"
    script = os.path.join(os.path.dirname(os.path.dirname(__file__)), "bench",
                          "spec_decode.py")
    subprocess.run([sys.executable, script, "--model", path, "--batch", "1,2",
                    "--max-tokens", "8", "--ngram", "1,2", "--out", str(out)], check=True,
                   capture_output=True, timeout=300)
    rows = json.loads(out.read_text())["results"]
    assert [(r["prompts"], r["batch"]) for r in rows] == [
        ("edit", 1), ("edit", 2), ("chat", 1), ("chat", 2)]
    assert all(r["identical"] and r["off_tok_s"] > 0 for r in rows)
