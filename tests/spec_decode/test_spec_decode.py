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
    """Greedy requests: plain, with logprobs, with bad words, with penalties (each verified
    row penalized by the context up to it), one with a short max_tokens, one with min_tokens
    banning its stop tokens."""
    plain = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)
    return [plain, SamplingParams(temperature=0, max_tokens=20, ignore_eos=True, logprobs=2),
            SamplingParams(temperature=0, max_tokens=20, ignore_eos=True,
                           bad_words=["fox", " the lazy"]),
            SamplingParams(temperature=0, max_tokens=20, ignore_eos=True,
                           repetition_penalty=1.3, frequency_penalty=0.4,
                           presence_penalty=0.2),
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
        _run.drafts = [o.metrics["num_draft_tokens"] for o in outs]
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
    assert sum(_run.drafts) == drafts  # per-request counts (RequestOutput.metrics) add up
    # the emitted tokens' logprobs too: top-2 and the chosen token's, at each position
    assert len(_run.logprobs) == len(base_logprobs) == 20
    for ours, theirs in zip(_run.logprobs, base_logprobs, strict=True):
        assert ours.keys() == theirs.keys()
        assert all(abs(ours[t].logprob - theirs[t].logprob) < 1e-4 for t in ours)
    # chunked prefill (7-token steps: drafts cut to the budget too) and prefix-cache hits
    chunked, _ = _run(path, kv_cache_memory_gib=0.05, speculative_config=NGRAM,
                      max_num_batched_tokens=7, block_size=8)
    assert chunked == base


def _greedy_baseline(path):
    """(params, prompts, token ids decoding them without speculation) of the preemption
    tests."""
    params = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)
    prompts = [{"prompt_token_ids": p} for p in _prompts()]
    with LLM(path, kv_cache_memory_gib=0.05) as llm:
        return params, prompts, [list(o.outputs[0].token_ids)
                                 for o in llm.generate(prompts, params, use_tqdm=False)]


def test_preemption_with_drafts_keeps_outputs(tiny_models):
    path, _ = tiny_models("qwen2")
    params, prompts, base = _greedy_baseline(path)
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
    with pytest.raises(ValueError, match="matches no parameter of an EAGLE-1 head"):
        LLM(path, speculative_config={"method": "eagle", "model": path,  # a whole model
                                      "num_speculative_tokens": 1})


def test_the_benchmark_script_runs(tiny_models, tmp_path):
    """bench/spec_decode.py end to end on a tiny model: a row per prompt set and batch size,
    outputs with and without speculation identical."""
    import json
    import os
    import subprocess
    import sys

    path, _ = tiny_models("llama")
    out = tmp_path / "spec.json"
    script = os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(__file__))), "bench",
                          "spec_decode.py")
    subprocess.run([sys.executable, script, "--model", path, "--batch", "1,2",
                    "--max-tokens", "8", "--ngram", "1,2", "--methods", "ngram,int4-self",
                    "--kv-gib", "0.05", "--out", str(out)], check=True, capture_output=True,
                   timeout=600)
    rows = json.loads(out.read_text())["results"]
    assert all(r["int4-self_tok_s"] > 0 and r["ngram_tok_s"] > 0 for r in rows)
    assert [(r["prompts"], r["batch"]) for r in rows] == [
        ("edit", 1), ("edit", 2), ("repeat", 1), ("repeat", 2), ("chat", 1), ("chat", 2)]
    assert all(r["identical"] and r["off_tok_s"] > 0 for r in rows)


def _draft(path=None, k=3, **extra):
    """(speculating at every batch size: the tests batch several requests)"""
    return {"method": "draft_model", "num_speculative_tokens": k,
            "disable_by_batch_size": 64, **extra, **({"model": path} if path else {})}


def _noisy_copy(path: str, out: str) -> str:
    """The model at `path` with every weight perturbed (a draft that often disagrees)."""
    import shutil

    import torch
    from safetensors.torch import load_file, save_file

    shutil.copytree(path, out)
    weights = load_file(f"{out}/model.safetensors")
    gen = torch.Generator().manual_seed(1)
    save_file({name: t * (1 + 0.5 * torch.randn(t.shape, generator=gen)).to(t.dtype)
               for name, t in weights.items()}, f"{out}/model.safetensors",
              metadata={"format": "pt"})
    return out


def _draft_blocks_free(llm):
    proposer = llm.engine.core.proposer
    proposer.pool.check_integrity()
    return proposer.pool.num_free_blocks == proposer.pool.num_blocks and not proposer.cached


@pytest.mark.parametrize("arch", ["llama", "qwen2", "gemma2", "deepseek_v3", "qwen3_moe",
                                  "phi3"])
def test_draft_model_greedy_outputs_equal_decoding_without_it(tiny_models, arch, tmp_path):
    """A draft with other random weights, and the target's own int4 copy: whatever they
    accept, the outputs are the target's."""
    path, _ = tiny_models(arch)
    draft = _noisy_copy(path, str(tmp_path / "draft"))
    base, _ = _run(path, kv_cache_memory_gib=0.05)
    # (the tiny DeepSeek's 48-wide q_b_proj input takes no int4 groups of 32)
    own = _draft(quantization="int8" if arch == "deepseek_v3" else "int4", k=2)
    for spec in (_draft(draft), own):
        with LLM(path, kv_cache_memory_gib=0.05, speculative_config=spec) as llm:
            outs = llm.generate([{"prompt_token_ids": p} for p in _prompts()], _params(),
                                use_tqdm=False)
            assert [list(o.outputs[0].token_ids) for o in outs] == base
            assert llm.engine.core.scheduler.num_draft_tokens > 0
            assert _draft_blocks_free(llm)


def test_drafted_steps_in_decode_graph_buckets(tiny_models, tmp_path, monkeypatch):
    """Verification steps whose every sequence carries its k drafts run in the CUDA-graph
    buckets of 1 + k rows a sequence (eagerly here, the Triton kernels in the interpreter, as
    captured on a GPU), 3 sequences in bucket 4 beside a padding one. Outputs equal
    decoding without speculation."""

    path, _ = tiny_models("llama")
    draft = _noisy_copy(path, str(tmp_path / "draft"))
    prompts, params = _prompts()[:3], _params()[1:4]
    monkeypatch.setenv("TOKENMILL_CPU_GRAPH_BUCKETS", "1")
    with LLM(path, kv_cache_memory_gib=0.05, attention_backend="triton", max_num_seqs=4,
             speculative_config=_draft(draft, k=2)) as llm:
        graphs = llm.engine.core.runner.graphs
        assert graphs.widths == {1: [1, 2, 4], 3: [1, 2, 4]}
        runs = []
        original = graphs.run
        monkeypatch.setattr(graphs, "run", lambda inputs, fill=None: runs.append(
            (len(inputs.starts), inputs.uniform_rows)) or original(inputs, fill))
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params,
                            use_tqdm=False)
        assert (3, 3) in runs
    with LLM(path, kv_cache_memory_gib=0.05, attention_backend="triton", enforce_eager=True
             ) as plain:
        want = plain.generate([{"prompt_token_ids": p} for p in prompts], params,
                              use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == [o.outputs[0].token_ids for o in want]


def test_ngram_drafts_filled_up_to_k_run_in_graph_buckets(tiny_models, monkeypatch):
    """Where the target has buckets for drafted steps, an n-gram lookup shorter than k (or
    none) is filled up to k, so every drafted step of 3 requests runs in a bucket of 4 rows
    a request (eagerly here, as captured on a GPU). Outputs equal decoding without
    speculation; the draft metrics count the lookups' tokens, not the fillers."""
    from tokenmill.spec_decode import proposer

    path, _ = tiny_models("llama")
    prompts, params = _prompts()[:3], _params()[1:4]
    monkeypatch.setenv("TOKENMILL_CPU_GRAPH_BUCKETS", "1")
    looked_up = []
    propose = proposer.ngram.propose
    monkeypatch.setattr(proposer.ngram, "propose", lambda *a: looked_up.append(
        len(found := propose(*a))) or found)
    with LLM(path, kv_cache_memory_gib=0.05, attention_backend="triton", max_num_seqs=4,
             speculative_config={**NGRAM, "disable_by_batch_size": 64}) as llm:
        core = llm.engine.core
        assert core.proposer.pad and core.runner.graphs.widths[4] == [1, 2, 4]
        runs = []
        original = core.runner.graphs.run
        monkeypatch.setattr(core.runner.graphs, "run", lambda inputs, fill=None: runs.append(
            (len(inputs.starts), inputs.uniform_rows)) or original(inputs, fill))
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params,
                            use_tqdm=False)
        sched = core.scheduler
        assert (3, 4) in runs and 0 < sched.num_draft_tokens <= sum(looked_up)
        assert sched.num_accepted_tokens <= sched.num_draft_tokens
        assert min(looked_up) < 3  # (some lookups came short and were filled)
    with LLM(path, kv_cache_memory_gib=0.05, attention_backend="triton", enforce_eager=True,
             speculative_config=NGRAM) as eager:
        assert not eager.engine.core.proposer.pad
    with LLM(path, kv_cache_memory_gib=0.05, attention_backend="triton", enforce_eager=True
             ) as plain:
        want = plain.generate([{"prompt_token_ids": p} for p in prompts], params,
                              use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == [o.outputs[0].token_ids for o in want]


def test_draft_model_beside_a_tensor_parallel_target(tiny_models):
    """The draft runs whole on rank 0 while two ranks run the target: outputs equal one
    rank's without speculation, with the target as its own draft and with its int4 copy."""
    path, _ = tiny_models("llama")
    base, _ = _run(path, kv_cache_memory_gib=0.05)
    for spec in (_draft(path, k=3), _draft(quantization="int4", k=2)):
        with LLM(path, kv_cache_memory_gib=0.05, tensor_parallel_size=2,
                 speculative_config=spec) as llm:
            outs = llm.generate([{"prompt_token_ids": p} for p in _prompts()], _params(),
                                use_tqdm=False)
            assert [list(o.outputs[0].token_ids) for o in outs] == base
            assert llm.engine.core.scheduler.num_accepted_tokens > 0
            assert _draft_blocks_free(llm)
            # the draft's layers are whole: its runner is a world of one
            assert llm.engine.core.proposer.runner.tp.size == 1


def test_ngram_and_draft_model_under_pipeline_parallel(tiny_models):
    """Two pipeline stages, micro-batches in flight: drafts proposed on rank 0 when a
    request's micro-batch lands, verified rows' logits back from the last stage; outputs
    equal one rank's without speculation."""
    path, _ = tiny_models("llama")
    base, _ = _run(path, kv_cache_memory_gib=0.05)
    for spec in ({**NGRAM, "disable_by_batch_size": 64}, _draft(path, k=3)):
        with LLM(path, kv_cache_memory_gib=0.05, pipeline_parallel_size=2,
                 speculative_config=spec) as llm:
            outs = llm.generate([{"prompt_token_ids": p} for p in _prompts()], _params(),
                                use_tqdm=False)
            assert [list(o.outputs[0].token_ids) for o in outs] == base
            sched = llm.engine.core.scheduler
            assert sched.num_draft_tokens > 0
            if spec["method"] == "draft_model":  # the target as its own draft: all accepted
                assert sched.num_accepted_tokens == sched.num_draft_tokens
            assert llm.engine.core.kv_cache.pool.num_free_blocks == \
                llm.engine.core.kv_cache.num_blocks


def test_draft_model_under_chunked_prefill_prefix_hits_and_preemption(tiny_models):
    path, _ = tiny_models("qwen2")
    params, prompts, base = _greedy_baseline(path)
    for engine in ({"max_num_batched_tokens": 7, "block_size": 8,
                    "kv_cache_memory_gib": 0.05},
                   {"num_kv_blocks": 12, "block_size": 8}):
        # the target itself as an exact draft: every draft is accepted unless preempted
        with LLM(path, speculative_config=_draft(path, k=4), **engine) as llm:
            outs = llm.generate(prompts, params, use_tqdm=False)
            sched = llm.engine.core.scheduler
            assert [list(o.outputs[0].token_ids) for o in outs] == base
            assert sched.num_accepted_tokens > 0
            if "num_kv_blocks" in engine:
                assert sched.num_preemptions > 0
            else:
                assert sched.num_accepted_tokens == sched.num_draft_tokens
            assert _draft_blocks_free(llm)
            assert llm.engine.core.kv_cache.pool.num_free_blocks == \
                llm.engine.core.kv_cache.num_blocks


def test_sampled_drafts_carry_their_distribution(tiny_models):
    """Drafts drawn from the draft's distribution: a draft equal to the target (p = q) is
    always accepted; seeded runs reproduce with an int4 draft."""
    path, _ = tiny_models("llama")
    prompts = [{"prompt_token_ids": p} for p in _prompts()[:4]]
    params = SamplingParams(temperature=1.0, top_p=0.9, max_tokens=20, seed=3,
                            ignore_eos=True)
    with LLM(path, kv_cache_memory_gib=0.05, speculative_config=_draft(path)) as llm:
        llm.generate(prompts, params, use_tqdm=False)
        sched = llm.engine.core.scheduler
        assert sched.num_accepted_tokens == sched.num_draft_tokens > 0
    runs = []
    for _ in range(2):
        with LLM(path, kv_cache_memory_gib=0.05,
                 speculative_config=_draft(quantization="int4")) as llm:
            runs.append([list(o.outputs[0].token_ids)
                         for o in llm.generate(prompts, params, use_tqdm=False)])
    assert runs[0] == runs[1]


def test_draft_state_released_on_abort(tiny_models):
    from tokenmill.engine.protocol import EngineCoreRequest

    path, _ = tiny_models("llama")
    with LLM(path, kv_cache_memory_gib=0.05, speculative_config=_draft(path)) as llm:
        core = llm.engine.core
        params = SamplingParams(temperature=0, max_tokens=50, ignore_eos=True)
        for i, prompt in enumerate(_prompts()[:3]):
            core.add_request(EngineCoreRequest(f"r{i}", prompt, params))
        for _ in range(4):
            core.step()
        assert core.proposer.cached
        core.abort_requests(["r0", "r1", "r2"])
        assert _draft_blocks_free(llm)


def test_bad_draft_model_is_a_start_up_error(tiny_models, tmp_path):
    import shutil

    from transformers import AutoTokenizer

    path, _ = tiny_models("llama")
    other = str(tmp_path / "other")
    shutil.copytree(path, other)
    tokenizer = AutoTokenizer.from_pretrained(other)
    tokenizer.add_tokens(["<not-in-the-target>"])
    tokenizer.save_pretrained(other)
    with pytest.raises(ValueError, match="tokenizer .* differs from the target"):
        LLM(path, speculative_config=_draft(other))
    with pytest.raises(FileNotFoundError, match="does not exist"):
        LLM(path, speculative_config=_draft(str(tmp_path / "missing")))


@pytest.mark.parametrize("spec", [NGRAM, _draft(k=3, quantization="int4")],
                         ids=["ngram", "int4-self-draft"])
def test_n_completions_and_stop_strings_with_speculation(tiny_models, spec):
    """n > 1 (each completion its own speculating sequence, seeded sampling) and stop
    strings (found in the text of several tokens accepted at once) give what decoding
    without speculation gives."""
    path, _ = tiny_models("llama")
    prompts = [{"prompt_token_ids": p} for p in _prompts()[:4]]
    with LLM(path, kv_cache_memory_gib=0.05) as llm:
        texts = [o.outputs[0].text for o in llm.generate(
            prompts, SamplingParams(temperature=0, max_tokens=16, ignore_eos=True),
            use_tqdm=False)]
    stops = [t[len(t) // 2:len(t) // 2 + 2] for t in texts]  # (stop strings the text has)
    greedy = [SamplingParams(temperature=0, max_tokens=16, ignore_eos=True, stop=[s],
                             n=2) for s in stops]
    sampled = SamplingParams(temperature=1.0, max_tokens=12, ignore_eos=True, seed=4, n=3)
    runs = []
    for config in (None, spec):
        with LLM(path, kv_cache_memory_gib=0.05, speculative_config=config) as llm:
            outs = llm.generate(prompts, greedy, use_tqdm=False)
            runs.append([[(c.text, c.finish_reason, c.stop_reason) for c in o.outputs]
                         for o in outs])
            seeded = llm.generate(prompts[:2], sampled, use_tqdm=False)
            assert all(len(o.outputs) == 3 for o in seeded)
            if config is not None:
                assert llm.engine.core.scheduler.num_draft_tokens > 0
    assert runs[0] == runs[1]
    assert any(reason == "stop" for out in runs[1] for _, reason, _ in out)
