"""The Triton attention backend (attention/triton/) against the slow reference backend, and the
whole engine on it against transformers; on a machine without a GPU the kernels run in
Triton's interpreter (conftest sets TRITON_INTERPRET=1), on a GPU natively. Also the CUDA-graph
buckets and padding (worker/cuda_graphs.py), run eagerly where there is no GPU."""

import random

import pytest
import torch
from helpers import hf_greedy, paged_step

from tokenmill import LLM, SamplingParams
from tokenmill.attention.backend import AttentionBackend
from tokenmill.attention.reference import ReferenceBackend
from tokenmill.attention.triton import kernels
from tokenmill.attention.triton.backend import TritonBackend, decode_splits
from tokenmill.platforms.cpu import CpuPlatform
from tokenmill.quantization.kv_cache import dequantize_kv, quantize_kv
from tokenmill.worker.cuda_graphs import DecodeGraphs, capture_sizes

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def random_step(seed, seqs, num_decodes, hq, hkv, d, block_size=4, num_blocks=64,
                dtype=torch.float32, int8=False):
    """seqs: (context, new tokens) per sequence, decodes first; K/V of every context cached."""
    rng = random.Random(seed)
    torch.manual_seed(seed)
    meta = paged_step(seqs, block_size, num_blocks, rng, num_decodes=num_decodes)
    for name in ("slot_mapping", "seq_lens", "block_table"):
        setattr(meta, name, getattr(meta, name).to(DEVICE))
    t = meta.query_start_loc[-1]
    # q as the model passes it: a view of a wider row (token stride > Hq * D)
    q = torch.randn(t, hq + 2, d, dtype=dtype, device=DEVICE)[:, :hq]
    k, v = (torch.randn(t, hkv, d, dtype=dtype, device=DEVICE) for _ in range(2))
    caches = [torch.randn(num_blocks, block_size, hkv, d, device=DEVICE).to(dtype) * scale
              for scale in (3, 1)]  # K and V of different magnitudes
    if int8:
        caches = [quantize_kv(c) for c in caches]
    return q, k, v, caches, meta


def both(q, k, v, caches, meta, scale, **kw):
    """(reference output, Triton output, reference caches, Triton caches)."""
    ref_caches = [c.clone() for c in caches]
    ref = ReferenceBackend().forward(q, k, v, *ref_caches, meta, scale, **kw)
    backend = TritonBackend()
    backend.prepare(meta)
    out_caches = [c.clone() for c in caches]
    out = backend.forward(q, k, v, *out_caches, meta, scale, **kw)
    return ref, out, ref_caches, out_caches


MIXED = [(3, 1), (17, 1), (0, 1), (0, 7), (9, 5), (4, 3), (0, 20)]


@pytest.mark.parametrize("hq,hkv,d", [(6, 2, 8), (4, 4, 16), (8, 1, 24), (14, 2, 64),
                                      (40, 2, 16)])
def test_mixed_steps_match_the_reference(hq, hkv, d):
    # decodes, fresh prompts and prompt chunks with cached context in one launch; head sizes
    # that are not powers of two, groups of 1 to 20 query heads per KV head (more than 16: a
    # KV head's query heads split over two programs)
    for seed in range(2):
        q, k, v, caches, meta = random_step(seed, MIXED, 3, hq, hkv, d)
        ref, out, ref_caches, out_caches = both(q, k, v, caches, meta, d ** -0.5)
        torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)
        for a, b in zip(out_caches, ref_caches):
            assert torch.equal(a, b)


@pytest.mark.parametrize("window,softcap", [(5, None), (None, 2.0), (6, 1.5), (1, None)])
def test_sliding_window_and_soft_capping(window, softcap):
    seqs = [(30, 1), (3, 1), (0, 25), (12, 9)]
    q, k, v, caches, meta = random_step(4, seqs, 2, 6, 2, 16)
    ref, out, _, _ = both(q, k, v, caches, meta, 0.4, window=window, softcap=softcap)
    torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("window", [None, 5])
def test_bidirectional_spans_take_the_masked_path(window):
    """Gemma 3's image spans (a query sees its span's later keys) on a Triton device: the
    torch masked path, equal to the reference."""
    q, k, v, caches, meta = random_step(9, [(3, 1), (0, 12), (6, 10)], 1, 4, 2, 16)
    meta.bidirectional = [(1, 3, 7), (2, 8, 14)]
    ref, out, _, _ = both(q, k, v, caches, meta, 0.4, window=window)
    torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("chunk,sinks", [(4, False), (None, True)])
def test_chunks_and_sinks_take_the_masked_path(chunk, sinks):
    """Llama 4's chunked layers and gpt-oss' sinks on a Triton device: the torch masked
    path, equal to the reference."""
    q, k, v, caches, meta = random_step(10, [(3, 1), (0, 12), (6, 10)], 1, 4, 2, 16)
    head_sinks = torch.randn(4, device=DEVICE) if sinks else None
    ref, out, _, _ = both(q, k, v, caches, meta, 0.4, chunk=chunk, sinks=head_sinks)
    torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)


def test_int8_cache_rows_written_and_read():
    q, k, v, caches, meta = random_step(5, MIXED, 3, 6, 2, 16, int8=True)
    ref, out, ref_caches, out_caches = both(q, k, v, caches, meta, 0.25)
    torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)
    for a, b in zip(out_caches, ref_caches):  # the same values and scales, row for row
        torch.testing.assert_close(dequantize_kv(a, torch.float32),
                                   dequantize_kv(b, torch.float32), atol=1e-6, rtol=0)


def test_half_precision_within_its_rounding():
    q, k, v, caches, meta = random_step(6, MIXED, 3, 8, 2, 32, dtype=torch.float16)
    ref, out, _, _ = both(q, k, v, caches, meta, 32 ** -0.5)
    assert out.dtype == torch.float16
    torch.testing.assert_close(out.float(), ref.float(), atol=2e-2, rtol=2e-2)


@pytest.mark.parametrize("seqs", [[(700, 1), (5, 1), (1300, 1)],
                                  [(700, 4), (5, 4), (1300, 4), (0, 3)]])
def test_split_decodes_equal_one_range(seqs):
    # long decodes (and decodes carrying 3 drafts: short queries of several rows, each row
    # its own causal limit) split over several programs, merged by the second kernel; an
    # empty split (a short sequence beside long ones) contributes nothing
    longest = max(n for _, n in seqs)
    q, k, v, caches, meta = random_step(7, seqs, 3 if longest == 1 else 0, 4, 2, 16,
                                        block_size=16, num_blocks=140)
    kv = [c.clone() for c in caches]
    kernels.write_kv(k, v, *kv, meta.slot_mapping)
    q_start = torch.tensor(meta.query_start_loc, dtype=torch.int32, device=DEVICE)
    outs = []
    for splits in (1, 4, 16):
        out = torch.empty_like(q)
        kernels.paged_attention(q, *kv, out, meta.block_table, meta.seq_lens, q_start, longest,
                                0.3, splits=splits)
        outs.append(out)
    ref = ReferenceBackend().forward(q, k, v, *[c.clone() for c in caches], meta, 0.3)
    for out in outs:
        torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)
    backend = TritonBackend()  # such a step splits its keys as a decode step does
    backend.prepare(meta)
    assert meta.backend_data.splits == decode_splits(len(seqs), 1300 + longest) > 1
    assert decode_splits(1, 40) == 1 and decode_splits(1, 100) == 2
    assert decode_splits(1, 4096) == decode_splits(1, 1024) == 16
    assert decode_splits(64, 4096) == 1 and decode_splits(8, 1024) == 8


@pytest.mark.parametrize("heads,rank,rope", [(4, 32, 16), (20, 64, 8)])
def test_latent_attention_matches_torch(heads, rank, rope):
    # DeepSeek's MLA: one cached row of latent | rotary key per token, values the latents
    from tokenmill.attention.mla import mla_attention

    seqs = [(9, 1), (0, 1), (30, 1), (0, 12), (7, 5)]
    _, _, _, caches, meta = random_step(8, seqs, 3, 1, 1, rank + rope)
    cache = caches[0]
    t = meta.query_start_loc[-1]
    q_latent = torch.randn(t, heads, rank, device=DEVICE)
    q_pe = torch.randn(t, heads, rope, device=DEVICE)
    ref = mla_attention(q_latent, q_pe, cache, meta, rank, 0.2)
    backend = TritonBackend()
    backend.prepare(meta)
    torch.testing.assert_close(backend.mla(q_latent, q_pe, cache, meta, rank, 0.2), ref,
                               atol=1e-5, rtol=1e-5)


def test_fp8_cache_read_by_the_kernel_and_written_within_its_rounding():
    q, k, v, caches, meta = random_step(9, MIXED, 3, 6, 2, 16)
    fp8 = [c.to(torch.float8_e4m3fn) for c in caches]
    # K/V written with torch's rounding, then read by the kernel, as by the reference
    kv = [c.clone() for c in fp8]
    AttentionBackend.write_kv(k, v, *kv, meta.slot_mapping)
    ref = ReferenceBackend().forward(q, k, v, *[c.clone() for c in fp8], meta, 0.3)
    out = torch.empty_like(q)
    q_start = torch.tensor(meta.query_start_loc, dtype=torch.int32, device=DEVICE)
    kernels.paged_attention(q, *kv, out, meta.block_table, meta.seq_lens, q_start, 20, 0.3)
    torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)
    if not torch.cuda.is_available():
        return  # (Triton's interpreter converts to float8 wrongly: the write is a GPU check)
    # the kernel's own write: each value within one float8 step (3 mantissa bits) of torch's
    mine = [c.clone() for c in fp8]
    kernels.write_kv(k, v, *mine, meta.slot_mapping)
    written = mine[0].view(-1, 2, 16)[meta.slot_mapping].float()
    want = k.to(torch.float8_e4m3fn).float()
    assert ((written - want).abs() <= want.abs() / 8 + 1e-3).all()


def test_padding_slots_are_written_nowhere():
    k = torch.randn(3, 2, 8, device=DEVICE)
    v = torch.randn(3, 2, 8, device=DEVICE)
    caches = [torch.zeros(4, 4, 2, 8, device=DEVICE) for _ in range(2)]
    kernels.write_kv(k, v, *caches, torch.tensor([5, -1, 0], device=DEVICE))
    flat_k = caches[0].view(-1, 2, 8)
    assert torch.equal(flat_k[5], k[0]) and torch.equal(flat_k[0], k[2])
    assert int((flat_k.abs().sum((1, 2)) != 0).sum()) == 2  # nothing else touched


@pytest.mark.parametrize("dtype,cache", [(torch.float32, "same"), (torch.float16, "same"),
                                         (torch.float32, "int8"), (torch.float16, "int8")])
@pytest.mark.parametrize("q_heads", [6, 0])
def test_rotation_and_kv_write_in_one_launch(dtype, cache, q_heads):
    # TritonBackend.rotate_and_write (one kernel) against the default (the rotation, then
    # write_kv): the same rotated q and k, the same cache bytes; a padding slot written
    # nowhere; q_heads 0: only K heads (models with q/k norms rotate q on their own)
    from tokenmill.layers.rotary import RotaryEmbedding, StepRotary

    torch.manual_seed(q_heads)
    t, hkv, d = 5, 2, 16
    rotary = RotaryEmbedding(d, 64, {"rope_type": "default", "rope_theta": 10000.0},
                             64).to(DEVICE)
    rope = StepRotary(rotary, torch.tensor([0, 9, 63, 4, 4], device=DEVICE), dtype)
    rope.compiled = False  # (the torch ops as the reference, not the CPU's in-place kernel)
    qkv = torch.randn(t, (q_heads + 2 * hkv) * d + 3, device=DEVICE).to(dtype)  # wider rows
    x = qkv[:, : (q_heads + hkv) * d].view(t, q_heads + hkv, d)
    v = qkv[:, (q_heads + hkv) * d: (q_heads + 2 * hkv) * d].view(t, hkv, d)
    caches = [torch.zeros(4, 4, hkv, d, device=DEVICE).to(dtype) for _ in range(2)]
    if cache == "int8":
        caches = [quantize_kv(c) for c in caches]
    slots = torch.tensor([5, -1, 0, 15, 7], device=DEVICE)
    ref_caches = [c.clone() for c in caches]
    ref_q, ref_k = AttentionBackend.rotate_and_write(TritonBackend(), rope, x, v, *ref_caches,
                                                     slots, q_heads)
    q, k = TritonBackend().rotate_and_write(rope, x, v, *caches, slots, q_heads)
    assert q.shape == (t, q_heads, d) and k.shape == (t, hkv, d)
    tol = dict(atol=1e-6, rtol=1e-6) if dtype == torch.float32 else dict(atol=1e-3, rtol=2e-3)
    torch.testing.assert_close(q, ref_q, **tol)
    torch.testing.assert_close(k, ref_k, **tol)
    for mine, theirs in zip(caches, ref_caches):
        if cache == "int8":  # (a value on a rounding edge may round the other way)
            assert (mine[..., :d].int() - theirs[..., :d].int()).abs().max() <= 1
            mine, theirs = dequantize_kv(mine, torch.float32), dequantize_kv(theirs,
                                                                             torch.float32)
            torch.testing.assert_close(mine, theirs, atol=0.05, rtol=0)
        else:
            torch.testing.assert_close(mine, theirs, **tol)
    flat = caches[0][..., :d].reshape(16, -1)  # (int8: the values; zero rows' scales are not)
    written = torch.zeros(16, dtype=torch.bool, device=DEVICE)
    written[[5, 0, 15, 7]] = True
    assert not flat[~written].any()  # the padding row (slot -1) went nowhere


@pytest.mark.parametrize("seqs", [[(0, 7), (0, 7), (0, 7)], [(0, 5)], [(0, 20)] * 2])
def test_fresh_prompt_steps_through_sdpa_equal_the_kernel(seqs):
    # the CUDA platform's choice for a step of fresh prompts of one length: one SDPA call
    # over the step's own K/V, the same K/V written to the cache
    q, k, v, caches, meta = random_step(3, seqs, 0, 6, 2, 16)
    ref, kernel_out, _, kernel_caches = both(q, k, v, caches, meta, 0.3)
    backend = TritonBackend(fresh_sdpa=True)
    backend.prepare(meta)
    assert meta.backend_data.fresh_runs == [(0, len(seqs))]
    out_caches = [c.clone() for c in caches]
    out = backend.forward(q, k, v, *out_caches, meta, 0.3)
    torch.testing.assert_close(out, kernel_out, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)
    assert all(torch.equal(a, b) for a, b in zip(out_caches, kernel_caches))


def test_steps_sdpa_cannot_serve_stay_on_the_kernel(monkeypatch):
    from tokenmill.attention.triton import backend as triton_backend

    monkeypatch.setattr(triton_backend, "fresh_prompt_attention", None)  # (never called)
    sdpa = TritonBackend(fresh_sdpa=True)
    # a decode or a prompt chunk with cached context in the step, or fresh prompts of
    # several lengths (one launch, not one SDPA call per length): all of it on the kernel
    for seqs, decodes in (([(3, 1), (0, 7)], 1), ([(0, 7), (4, 3)], 0),
                          ([(0, 7), (0, 7), (0, 20)], 0)):
        q, k, v, caches, meta = random_step(5, seqs, decodes, 4, 2, 16)
        ref, out, *_ = both(q, k, v, caches, meta, 0.3)
        sdpa.prepare(meta)
        assert meta.backend_data.fresh_runs is None
        torch.testing.assert_close(sdpa.forward(q, k, v, *caches, meta, 0.3), ref,
                                   atol=1e-5, rtol=1e-5)
    # soft-capping and sliding windows (Gemma 2): masks SDPA's causal call does not have
    q, k, v, caches, meta = random_step(6, [(0, 12)], 0, 4, 2, 16)
    for kw in ({"softcap": 5.0}, {"window": 4}):
        ref, _, _, _ = both(q, k, v, caches, meta, 0.3, **kw)
        sdpa.prepare(meta)
        torch.testing.assert_close(sdpa.forward(q, k, v, *[c.clone() for c in caches], meta,
                                                0.3, **kw), ref, atol=1e-5, rtol=1e-5)


# ---- the engine on the Triton backend ------------------------------------------------------

PROMPTS = [[5, 17, 99, 200, 3, 45, 67], list(range(10, 70)), [7, 8], list(range(300, 333))]
GREEDY = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)


def generate(llm, prompts, params=GREEDY):
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    return [o.outputs[0].token_ids for o in outs]


@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3", "gemma2", "phi3", "deepseek_v3",
                                  "deepseek_v2"])
def test_engine_greedy_matches_transformers(tiny_models, arch):
    # gemma2: soft-capping and a sliding window of 8 (shorter than the prompts); deepseek:
    # latent attention
    path, hf = tiny_models(arch)
    llm = LLM(path, kv_cache_memory_gib=0.01, attention_backend="triton")
    assert isinstance(llm.engine.core.runner.backend, TritonBackend)
    assert generate(llm, PROMPTS) == [hf_greedy(hf, p, 8) for p in PROMPTS]


def test_engine_with_fresh_prompts_through_sdpa(tiny_models, monkeypatch):
    # as on a GPU: fresh prompts' steps through SDPA, later chunks and decodes on the kernel
    from tokenmill.attention.triton import backend as triton_backend

    calls = []
    original = triton_backend.fresh_prompt_attention
    monkeypatch.setattr(triton_backend, "fresh_prompt_attention",
                        lambda *a: calls.append(a[-2]) or original(*a))
    path, hf = tiny_models("qwen2")
    llm = LLM(path, kv_cache_memory_gib=0.01, attention_backend="triton",
              max_num_batched_tokens=48)  # the 60-token prompt: a fresh chunk, then the rest
    llm.engine.core.runner.backend.fresh_sdpa = True
    layers = llm.engine.core.hf_config.num_hidden_layers
    prompts = [PROMPTS[1], list(range(300, 320)), list(range(400, 420))]
    # the long prompt alone (its first chunk through SDPA), then two fresh prompts of one
    # length in one step (one SDPA call for both), then all of them with different lengths;
    # (eagerly the last layer attends only the sampled rows, as decodes: on the kernel; in
    # piecewise graphs, on a GPU, every row)
    assert generate(llm, prompts[:1]) == [hf_greedy(hf, prompts[0], 8)]
    assert generate(llm, prompts[1:]) == [hf_greedy(hf, p, 8) for p in prompts[1:]]
    per_step = layers - (llm.engine.core.runner.pieces is None)
    assert calls == [[(0, 1)]] * per_step + [[(0, 2)]] * per_step
    assert generate(llm, prompts + PROMPTS) == [hf_greedy(hf, p, 8) for p in prompts + PROMPTS]


def test_chunked_prefill_prefix_hits_and_preemption(tiny_models):
    path, hf = tiny_models("qwen2")
    expected = [hf_greedy(hf, p, 8) for p in PROMPTS]
    shared = list(range(100, 124))  # three blocks
    with_prefix = [shared + PROMPTS[0], shared + PROMPTS[2]]
    llm = LLM(path, attention_backend="triton", max_num_batched_tokens=16, block_size=8,
              num_kv_blocks=12)  # 96 slots: the batch does not fit at once
    assert generate(llm, PROMPTS) == expected
    core = llm.engine.core
    assert core.scheduler.num_preemptions > 0
    first = generate(llm, with_prefix[:1])
    assert generate(llm, with_prefix) == first + [hf_greedy(hf, with_prefix[1], 8)]
    assert core.kv_cache.num_hit_tokens >= 24
    core.kv_cache.pool.check_integrity()


def test_triton_on_the_cpu_needs_the_interpreter(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    with pytest.raises(ValueError, match="TRITON_INTERPRET=1"):
        CpuPlatform(torch.device("cpu")).attention_backend("triton")


# ---- CUDA-graph buckets ---------------------------------------------------------------------

def test_capture_sizes():
    assert capture_sizes(256) == [1, 2, 4, 8] + list(range(16, 257, 16))
    assert capture_sizes(3) == [1, 2, 3]
    assert capture_sizes(40) == [1, 2, 4, 8, 16, 32, 40]
    assert capture_sizes(1000)[-1] == 256


def test_padded_decode_buckets_give_the_same_tokens(tiny_models, monkeypatch):
    # Decode steps of 4, 3, 2 and 1 sequences run in buckets 4, 4, 2, 1 (eagerly here, as
    # captured graphs on a GPU); the padding rows must change nothing.
    path, hf = tiny_models("llama")
    monkeypatch.setenv("TOKENMILL_CPU_GRAPH_BUCKETS", "1")
    llm = LLM(path, kv_cache_memory_gib=0.01, attention_backend="triton", max_num_seqs=4)
    graphs = llm.engine.core.runner.graphs
    assert isinstance(graphs, DecodeGraphs) and graphs.sizes == [1, 2, 4]
    runs = []
    original = graphs.run
    monkeypatch.setattr(graphs, "run", lambda inputs, fill=None: runs.append(
        (len(inputs.starts), graphs.bucket(len(inputs.starts)))) or original(inputs, fill))
    params = [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True) for n in (9, 6, 4, 3)]
    outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == [
        hf_greedy(hf, p, n) for p, n in zip(PROMPTS, (9, 6, 4, 3))]
    assert {(4, 4), (3, 4), (2, 2), (1, 1)} <= set(runs)
    # short sequences run the variant without key splits; a longer one the variant captured
    # for the longest a replay may hold (1024 keys: 16 splits), which serves every length
    assert graphs.variants[1, 1] == [1, decode_splits(1, 1024)] == [1, 16]
    assert graphs.variant(1, 40) == 1
    assert graphs.variant(1, 100) == graphs.variant(1, 1024) == 16  # (2 not captured)
    assert graphs.variants[4, 1] == [1, decode_splits(4, 1024)]
    # both variants of a bucket compute the same step (the buffers hold the last one's rows)
    with torch.inference_mode():
        # (logits and hidden states)
        torch.testing.assert_close(graphs.forward(1, 1, 16), graphs.forward(1, 1, 1))
    eager = LLM(path, kv_cache_memory_gib=0.01, attention_backend="triton", max_num_seqs=4,
                enforce_eager=True)
    assert eager.engine.core.runner.graphs is None
