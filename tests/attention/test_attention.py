"""The CPU backend (compiled in-place decode kernel and the torch gather + SDPA path) against
the slow reference on random paged caches."""

import random

import pytest
import torch
from helpers import paged_step

from tokenmill import csrc
from tokenmill.attention.backend import AttentionMetadata
from tokenmill.attention.reference import ReferenceBackend
from tokenmill.attention.torch_sdpa import TorchSDPABackend
from tokenmill.quantization.kv_cache import quantize_kv


def random_step(seed, num_decodes, prefills, block_size=4, hq=6, hkv=2, d=8,
                decode_contexts=None, num_blocks=64):
    """prefills: (context_len, query_len) pairs; decodes get random context lengths unless
    decode_contexts gives them."""
    rng = random.Random(seed)
    torch.manual_seed(seed)
    contexts = decode_contexts or [rng.randrange(0, 30) for _ in range(num_decodes)]
    seqs = [(c, 1) for c in contexts] + prefills
    meta = paged_step(seqs, block_size, num_blocks, rng, num_decodes=len(contexts))
    t = meta.query_start_loc[-1]
    q, k, v = torch.randn(t, hq, d), torch.randn(t, hkv, d), torch.randn(t, hkv, d)
    cache = torch.randn(2, num_blocks, block_size, hkv, d)  # context K/V already there
    return q, k, v, cache, meta


BACKENDS = [pytest.param(False, id="torch-gather")] + [pytest.param(
    True, id="compiled-decode",
    marks=pytest.mark.skipif(not csrc.available(), reason="no compiled CPU kernels"))]


@pytest.mark.parametrize("compiled", BACKENDS)
def test_sdpa_matches_reference_mixed_batch(compiled):
    for seed in range(5):
        # fresh prompts of equal length run as one SDPA batch, the others one by one
        q, k, v, cache, meta = random_step(seed, num_decodes=3,
                                           prefills=[(0, 7), (0, 7), (0, 7), (9, 5),
                                                     (0, 3 + seed), (4, 1 + seed), (0, 7)])
        k1, v1 = cache[0].clone(), cache[1].clone()
        k2, v2 = cache[0].clone(), cache[1].clone()
        ref = ReferenceBackend().forward(q, k, v, k1, v1, meta, scale=0.3)
        out = TorchSDPABackend(compiled).forward(q, k, v, k2, v2, meta, scale=0.3)
        torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(k2, k1)
        torch.testing.assert_close(v2, v1)


@pytest.mark.parametrize("compiled", BACKENDS)
def test_decode_only_and_prefill_only(compiled):
    for num_decodes, prefills in ((5, []), (0, [(0, 12)]), (0, [(13, 3), (0, 1)]),
                                  (0, [(0, 5)] * 4)):
        q, k, v, cache, meta = random_step(7, num_decodes, prefills)
        ref = ReferenceBackend().forward(q, k, v, cache[0].clone(), cache[1].clone(), meta, 0.5)
        out = TorchSDPABackend(compiled).forward(q, k, v, cache[0].clone(), cache[1].clone(),
                                                 meta, 0.5)
        torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("compiled", BACKENDS)
@pytest.mark.parametrize("kv_dtype", [torch.float32, torch.int8])
@pytest.mark.parametrize("hq,hkv,d", [(9, 3, 64), (14, 2, 64), (4, 4, 128), (8, 1, 16),
                                      (12, 6, 80), (16, 1, 24)])
def test_decode_batch_head_shapes_and_int8_cache(compiled, kv_dtype, hq, hkv, d):
    # Real model head layouts (SmolLM2 9/3, Qwen2.5 14/2), context lengths that are not
    # multiples of 8 or of the block size, and int8 rows with their scales. The compiled
    # kernel keeps 4 / 1 / 8 / 1 / 2 8-dim steps of value sums in registers for these; the last
    # (16 query heads per KV head) keeps them in memory.
    q, k, v, cache, meta = random_step(3, 9, [], block_size=16, hq=hq, hkv=hkv, d=d)
    # q as the model passes it: a view of a wider qkv row (token stride > Hq * D)
    q = torch.cat([q, torch.randn(q.shape[0], 2, d)], dim=1)[:, :hq]
    caches = [cache[0] * 3, cache[1]]  # a different magnitude for K and V
    if kv_dtype == torch.int8:
        caches = [quantize_kv(c) for c in caches]
    ref = ReferenceBackend().forward(q, k, v, *(c.clone() for c in caches), meta, d ** -0.5)
    out = TorchSDPABackend(compiled).forward(q, k, v, *(c.clone() for c in caches), meta,
                                             d ** -0.5)
    torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)


@pytest.mark.skipif(not csrc.available(), reason="no compiled CPU kernels")
@pytest.mark.parametrize("kv_dtype", [torch.float32, torch.bfloat16, torch.int8])
def test_long_decodes_split_into_chunks_match_reference_and_each_other(kv_dtype):
    # The compiled kernel splits a sequence into 64-token chunks across threads and merges
    # them; lengths around the chunk edges, and a sequence's result must not depend on what
    # else is in the batch (the chunking depends only on its own length).
    contexts = [0, 62, 63, 64, 127, 200, 300]
    q, k, v, cache, meta = random_step(7, None, [], block_size=16, hq=9, hkv=3, d=64,
                                       decode_contexts=contexts, num_blocks=160)
    caches = [quantize_kv(c) if kv_dtype == torch.int8 else c.to(kv_dtype) for c in cache]
    ref = ReferenceBackend().forward(q, k, v, *(c.clone() for c in caches), meta, 0.125)
    out = TorchSDPABackend(True).forward(q, k, v, *(c.clone() for c in caches), meta, 0.125)
    torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)
    for i in (0, 4, 6):  # the same sequence alone: bit-identical
        alone = AttentionMetadata(
            slot_mapping=meta.slot_mapping[i:i + 1], query_start_loc=[0, 1],
            context_lens=[contexts[i]], seq_lens=meta.seq_lens[i:i + 1],
            block_table=meta.block_table[i:i + 1], num_decodes=1, block_size=16)
        TorchSDPABackend().prepare(alone)
        one = TorchSDPABackend(True).forward(q[i:i + 1], k[i:i + 1], v[i:i + 1],
                                             *(c.clone() for c in caches), alone, 0.125)
        assert torch.equal(one, out[i:i + 1])


def test_compiled_decode_is_used_where_the_kernels_build():
    assert TorchSDPABackend().use_compiled_decode == csrc.available()


@pytest.mark.skipif(not csrc.available(), reason="no compiled CPU kernels")
@pytest.mark.parametrize("kv_dtype", [torch.float32, torch.bfloat16, torch.int8])
@pytest.mark.parametrize("hq,hkv,d", [(9, 3, 64), (14, 2, 64), (4, 4, 128), (32, 2, 32)])
def test_compiled_prompts_match_reference(monkeypatch, hq, hkv, d, kv_dtype):
    # Prompt attention in place over the paged cache: fresh prompts and chunks with cached
    # context, query counts around the kernel's 32-key blocks and past its work items (128 or
    # 288 rows: 8-288 query tokens with their heads), 1-16 query heads per KV head, beside
    # decodes in the same step; float32, bfloat16 and int8 caches (the rows the reference
    # reads: the cache's own, widened).
    calls = []
    kernel = csrc.prompt_attention
    monkeypatch.setattr(csrc, "prompt_attention", lambda *a: calls.append(kernel(*a)) or calls[-1])
    prefills = [(0, 1), (0, 16), (0, 17), (0, 33), (31, 1), (32, 15), (40, 70), (100, 128),
                (7, 300)]
    q, k, v, cache, meta = random_step(5, 2, prefills, block_size=16, hq=hq, hkv=hkv, d=d,
                                       num_blocks=128)
    q = torch.cat([q, torch.randn(q.shape[0], 2, d)], dim=1)[:, :hq]  # a view, as in a model
    cache = [quantize_kv(c) if kv_dtype == torch.int8 else c.to(kv_dtype) for c in cache]
    ref = ReferenceBackend().forward(q, k, v, cache[0].clone(), cache[1].clone(), meta, 0.2)
    out = TorchSDPABackend(True).forward(q, k, v, cache[0].clone(), cache[1].clone(), meta,
                                         0.2)
    assert calls == [True]
    torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)


@pytest.mark.skipif(not csrc.available(), reason="no compiled CPU kernels")
def test_prompt_kernel_declines_head_sizes_it_does_not_take():
    # head size 8 (not a multiple of 32) and float8 caches stay with SDPA: the same result as
    # the torch path
    for d, kv_dtype in ((8, torch.float32), (64, torch.float8_e4m3fn)):
        q, k, v, cache, meta = random_step(2, 1, [(0, 9), (5, 4)], block_size=16, d=d)
        caches = [c.to(kv_dtype) for c in cache]
        ref = TorchSDPABackend(False).forward(q, k, v, *(c.clone() for c in caches), meta, 0.3)
        out = TorchSDPABackend(True).forward(q, k, v, *(c.clone() for c in caches), meta, 0.3)
        torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)
    q, k, v, cache, meta = random_step(2, 0, [(0, 9)], block_size=16, d=8)
    assert not csrc.prompt_attention(q, cache[0], cache[1], meta.block_table,
                                     TorchSDPABackend._prompt_rows(meta), 0.3,
                                     torch.empty_like(q))


@pytest.mark.parametrize("compiled", BACKENDS)
def test_fp8_cache_matches_reference_over_the_same_rounded_rows(compiled):
    # the torch backend over float8 e4m3 caches (no compiled kernel reads them): decodes and
    # prompt chunks with context read the rounded rows as the reference does
    q, k, v, cache, meta = random_step(11, 4, [(9, 5), (4, 3)], block_size=8, d=16)
    fp8 = [c.to(torch.float8_e4m3fn) for c in cache]
    ref = ReferenceBackend().forward(q, k, v, *(c.clone() for c in fp8), meta, 0.3)
    out = TorchSDPABackend(compiled).forward(q, k, v, *(c.clone() for c in fp8), meta, 0.3)
    torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)


def test_fp8_cache_engine(tiny_models):
    """--kv-cache-dtype fp8: a quarter of float32's bytes per block; the prompt's own token
    (attended unrounded) as transformers', later ones close to the float cache's."""
    from helpers import hf_greedy

    from tokenmill import LLM, SamplingParams

    path, hf = tiny_models("llama")
    params = SamplingParams(temperature=0, max_tokens=8, logprobs=3, ignore_eos=True)
    prompt = list(range(10, 70))
    outs = {}
    for kv in ("auto", "fp8_e4m3"):
        llm = LLM(path, kv_cache_memory_gib=0.01, kv_cache_dtype=kv)
        outs[kv] = (llm.engine.core.runner.block_bytes, llm.generate(
            {"prompt_token_ids": prompt}, params, use_tqdm=False)[0].outputs[0])
    (full, exact), (small, fp8) = outs["auto"], outs["fp8_e4m3"]
    assert small * 4 == full
    assert fp8.token_ids[0] == exact.token_ids[0] == hf_greedy(hf, prompt, 1)[0]
    same = [i for i in range(8) if fp8.token_ids[:i + 1] == exact.token_ids[:i + 1]]
    diffs = [abs(fp8.logprobs[i][t].logprob - exact.logprobs[i][t].logprob)
             for i in same for t in [exact.token_ids[i]]]
    assert max(diffs) < 0.5


def test_bf16_cache_engine(tiny_models, monkeypatch):
    """--kv-cache-dtype bfloat16 on the CPU: half of float32's bytes per block, read and
    written by the compiled kernels (prompts, decodes, the decode step); the prompt's own token
    as transformers', later ones close to the float cache's; and the default under --dtype
    bfloat16."""
    from helpers import hf_greedy

    from tokenmill import LLM, SamplingParams

    path, hf = tiny_models("llama")
    params = SamplingParams(temperature=0, max_tokens=8, logprobs=3, ignore_eos=True)
    prompt = list(range(10, 70))
    calls = []
    kernel = csrc.prompt_attention
    monkeypatch.setattr(csrc, "prompt_attention",
                        lambda q, kc, *a: calls.append(kc.dtype) or kernel(q, kc, *a))
    outs = {}
    for kv in ("auto", "bfloat16"):
        llm = LLM(path, kv_cache_memory_gib=0.01, kv_cache_dtype=kv)
        outs[kv] = (llm.engine.core.runner.block_bytes, llm.generate(
            {"prompt_token_ids": prompt}, params, use_tqdm=False)[0].outputs[0])
        if kv == "bfloat16" and csrc.available():
            assert llm.engine.core.runner.decode_step is not None
    (full, exact), (small, bf16) = outs["auto"], outs["bfloat16"]
    assert small * 2 == full
    if csrc.available():
        assert calls == [torch.float32, torch.bfloat16]
    assert bf16.token_ids[0] == exact.token_ids[0] == hf_greedy(hf, prompt, 1)[0]
    same = [i for i in range(8) if bf16.token_ids[:i + 1] == exact.token_ids[:i + 1]]
    diffs = [abs(bf16.logprobs[i][t].logprob - exact.logprobs[i][t].logprob)
             for i in same for t in [exact.token_ids[i]]]
    assert max(diffs) < 0.1
    llm = LLM(path, kv_cache_memory_gib=0.01, dtype="bfloat16")
    assert llm.engine.core.runner.kv_dtype == torch.bfloat16


@pytest.mark.parametrize("window", [None, 5])
def test_bidirectional_spans_match_reference(window):
    """Gemma 3's image rows: a query in a span also sees the span's later keys (a span in a
    fresh prompt, one after cached context, two in one sequence), within the window."""
    q, k, v, cache, meta = random_step(11, 2, [(0, 12), (6, 10)])
    meta.bidirectional = [(2, 3, 7), (2, 8, 11), (3, 9, 14)]
    ref = ReferenceBackend().forward(q, k, v, *cache.clone(), meta, 0.3, window=window)
    backend = TorchSDPABackend()
    backend.prepare(meta)
    out = backend.forward(q, k, v, *cache.clone(), meta, 0.3, window=window)
    torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)
    meta.bidirectional = []  # (the spans matter: causal rows differ)
    causal = ReferenceBackend().forward(q, k, v, *cache.clone(), meta, 0.3, window=window)
    assert not torch.allclose(causal, ref, atol=1e-3)


@pytest.mark.parametrize("chunk,sinks,softcap", [(4, False, None), (None, True, None),
                                                 (5, True, None), (None, True, 3.0)])
def test_chunks_and_sinks_match_reference(chunk, sinks, softcap):
    """Llama 4's chunked local attention (a query sees its own chunk's keys only: decodes,
    a fresh prompt, a prompt after cached context) and gpt-oss' sinks (a logit per head in
    each softmax's denominator), against the reference; and both change the outputs."""
    q, k, v, cache, meta = random_step(13, 3, [(0, 12), (6, 10), (9, 1)])
    head_sinks = torch.randn(q.shape[1]) if sinks else None
    args = dict(window=None, softcap=softcap, chunk=chunk, sinks=head_sinks)
    ref = ReferenceBackend().forward(q, k, v, *cache.clone(), meta, 0.3, **args)
    backend = TorchSDPABackend()
    backend.prepare(meta)
    out = backend.forward(q, k, v, *cache.clone(), meta, 0.3, **args)
    torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)
    plain = ReferenceBackend().forward(q, k, v, *cache.clone(), meta, 0.3, softcap=softcap)
    assert not torch.allclose(plain, ref, atol=1e-3)


@pytest.mark.parametrize("compiled", BACKENDS)
@pytest.mark.parametrize("kv_dtype", [torch.float32, torch.int8, torch.bfloat16])
@pytest.mark.parametrize("window,sinks", [(None, True), (5, False), (70, True), (1, True)])
def test_windows_and_sinks_on_decodes_match_reference(compiled, kv_dtype, window, sinks,
                                                      monkeypatch):
    """Sliding windows and gpt-oss' sinks: the compiled kernel attends the decodes (the
    window's start inside a 64-token chunk and past it, a window of one key, sequences
    shorter than the window, an empty one), the masked path the prompts of the same step;
    the torch backend takes the masked path for all."""
    q, k, v, cache, meta = random_step(17, 6, [(0, 9), (75, 4)], block_size=16, hq=8,
                                       hkv=2, d=16, decode_contexts=[0, 3, 64, 69, 140, 200],
                                       num_blocks=96)
    caches = [cache[0] * 3, cache[1]]
    if kv_dtype == torch.int8:
        caches = [quantize_kv(c) for c in caches]
    elif kv_dtype == torch.bfloat16:
        caches = [c.bfloat16() for c in caches]
    head_sinks = torch.randn(q.shape[1]) * 2 if sinks else None
    args = dict(window=window, sinks=head_sinks)
    ref = ReferenceBackend().forward(q, k, v, *(c.clone() for c in caches), meta, 0.3, **args)
    calls = []
    kernel = csrc.paged_decode_attention
    monkeypatch.setattr(csrc, "paged_decode_attention",
                        lambda *a: calls.append(a[-2:]) or kernel(*a))
    backend = TorchSDPABackend(compiled)
    backend.prepare(meta)
    out = backend.forward(q, k, v, *(c.clone() for c in caches), meta, 0.3, **args)
    torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)
    assert len(calls) == (1 if compiled else 0)
    plain = ReferenceBackend().forward(q, k, v, *(c.clone() for c in caches), meta, 0.3)
    assert not torch.allclose(plain[:6], ref[:6], atol=1e-3)  # (the decodes' rows differ)
