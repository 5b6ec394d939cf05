"""Greedy tokens and logprobs equal HF transformers on tiny random models of each family."""

import copy
import random

import pytest
import torch
from helpers import BIASED, hf_greedy, make_model, paged_step

from tokenmill import LLM, SamplingParams, csrc
from tokenmill.attention.backend import LogitsRows

# the second round of families (issue 64): every one greedy, logprobs, chunked prefill,
# prefix hits, preemption (tests/models/test_moe.py) and two ranks (distributed/)
BREADTH = list(BIASED)
ARCHS = ["llama", "llama3", "llama_linear", "mistral", "qwen2", "qwen3", "phi3", "phi3_longrope",
         "phi3_partial",
         "qwen2_yarn", "mixtral", "qwen2_moe", "qwen3_moe", "deepseek_v3", "deepseek_v3_yarn",
         "deepseek_v2", "gemma2", "gemma3", *BREADTH]
PROMPTS = [[5, 17, 99, 200, 3, 45, 67], list(range(10, 70)), [7, 8], list(range(300, 333))]
MAX_TOKENS = 12


@pytest.fixture(params=["compiled", "torch"])
def cpu_ops(request, monkeypatch):
    """Run with the compiled CPU kernels (norm, rotary, SiLU, KV write, decode attention) and
    with torch ops only."""
    if request.param == "torch":
        monkeypatch.setattr(csrc, "available", lambda: False)
    elif not csrc.available():
        pytest.skip("no compiled CPU kernels")
    return request.param


@pytest.mark.parametrize("arch", ARCHS)
def test_greedy_matches_transformers(tiny_models, arch, cpu_ops):
    path, hf = tiny_models(arch)
    llm = LLM(path, kv_cache_memory_gib=0.01)
    params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)
    # Batch 1, one prompt at a time.
    for prompt in PROMPTS[:2]:
        (out,) = llm.generate({"prompt_token_ids": prompt}, params, use_tqdm=False)
        assert out.outputs[0].token_ids == hf_greedy(hf, prompt, MAX_TOKENS)
    # Batched, mixed prompt lengths.
    outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], params, use_tqdm=False)
    for prompt, out in zip(PROMPTS, outs):
        assert out.outputs[0].token_ids == hf_greedy(hf, prompt, MAX_TOKENS)
        assert out.outputs[0].finish_reason == "length"


@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3", "mixtral", "qwen2_moe", "qwen3_moe",
                                  "deepseek_v3", "gemma2", "gemma3", *BREADTH])
def test_logprobs_close_to_transformers(tiny_models, arch, cpu_ops):
    path, hf = tiny_models(arch)
    llm = LLM(path, kv_cache_memory_gib=0.01)
    prompt = PROMPTS[1]
    (out,) = llm.generate({"prompt_token_ids": prompt},
                          SamplingParams(temperature=0, max_tokens=4, ignore_eos=True,
                                         logprobs=5, prompt_logprobs=3), use_tqdm=False)
    full = prompt + out.outputs[0].token_ids
    with torch.no_grad():
        ref = torch.log_softmax(hf(torch.tensor([full])).logits[0].float(), dim=-1)
    diffs = []
    # Prompt logprobs: position i scored by the logits at i - 1; position 0 is None.
    assert out.prompt_logprobs[0] is None and len(out.prompt_logprobs) == len(prompt)
    for i in range(1, len(prompt)):
        entry = out.prompt_logprobs[i]
        assert prompt[i] in entry and len(entry) >= 3
        for token, lp in entry.items():
            diffs.append(abs(lp.logprob - ref[i - 1, token].item()))
    for j, entry in enumerate(out.outputs[0].logprobs):
        pos = len(prompt) - 1 + j
        top = ref[pos].topk(5).indices.tolist()
        assert list(entry)[0] == full[pos + 1] and set(top) <= set(entry)
        assert entry[full[pos + 1]].rank == 1  # greedy picks the top token
        for token, lp in entry.items():
            diffs.append(abs(lp.logprob - ref[pos, token].item()))
    print(f"{arch}: max |logprob diff| vs transformers = {max(diffs):.2e}")
    assert max(diffs) < 1e-4


def test_bfloat16_runs_and_mostly_agrees(tiny_models):
    path, hf = tiny_models("llama")
    llm = LLM(path, dtype="bfloat16", kv_cache_memory_gib=0.01)
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    (out,) = llm.generate({"prompt_token_ids": PROMPTS[0]}, params, use_tqdm=False)
    # A copy: the session's shared HF model must keep its float32 weights (a round trip
    # through bfloat16 would round them for every later test).
    ref = hf_greedy(copy.deepcopy(hf).to(torch.bfloat16), PROMPTS[0], 8)
    assert out.outputs[0].token_ids[:3] == ref[:3]


def test_sharded_safetensors_with_index(tmp_path):
    from helpers import make_model

    hf = make_model(str(tmp_path / "src"), "llama")
    hf.save_pretrained(str(tmp_path / "sharded"), max_shard_size="100KB")
    import shutil
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(tmp_path / "src" / name, tmp_path / "sharded" / name)
    assert (tmp_path / "sharded" / "model.safetensors.index.json").exists()
    llm = LLM(str(tmp_path / "sharded"), kv_cache_memory_gib=0.01)
    (out,) = llm.generate({"prompt_token_ids": PROMPTS[0]},
                          SamplingParams(temperature=0, max_tokens=6, ignore_eos=True),
                          use_tqdm=False)
    assert out.outputs[0].token_ids == hf_greedy(hf, PROMPTS[0], 6)


@pytest.mark.parametrize("quantization", [None, "int8"])
def test_prompt_mlp_in_row_chunks_gives_the_same_outputs(tiny_models, monkeypatch,
                                                         quantization):
    """CPU prompt steps cut the MLP into row chunks where its gate|up output would be large
    (glibc maps such buffers afresh on every use). The compiled kernels' sums for a row do
    not depend on the rows beside it, so the outputs stay the same, and equal transformers'."""
    if not csrc.available():
        pytest.skip("no compiled CPU kernels")
    from tokenmill.layers import row_chunks

    path, hf = tiny_models("llama")
    prompts = [list(range(10 + i, 300 + i)) for i in range(2)]  # 580 rows in one step
    params = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True, logprobs=3)

    def run():
        llm = LLM(path, kv_cache_memory_gib=0.05, quantization=quantization, device="cpu")
        return llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)

    whole = run()
    chunk_rows = []
    real = row_chunks.mlp_chunk_rows

    def spy(x, width):
        chunk_rows.append((x.shape[0], real(x, width)))
        return chunk_rows[-1][1]

    monkeypatch.setattr(row_chunks, "MLP_CHUNK_BYTES", 4096)
    monkeypatch.setattr(row_chunks, "mlp_chunk_rows", spy)
    chunked = run()
    assert (580, 194) in chunk_rows  # the prompt step ran in three chunks of 194 rows
    for a, b in zip(whole, chunked, strict=True):
        assert a.outputs[0].token_ids == b.outputs[0].token_ids
        for pa, pb in zip(a.outputs[0].logprobs, b.outputs[0].logprobs, strict=True):
            assert pa.keys() == pb.keys()
            for token in pa:
                assert abs(pa[token].logprob - pb[token].logprob) < 1e-5
        if quantization is None:
            prompt = prompts[whole.index(a)]
            assert a.outputs[0].token_ids == hf_greedy(hf, prompt, 4)


@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3"])
def test_last_layer_runs_only_the_rows_sampled_from(tiny_models, arch, cpu_ops):
    """A step's last layer takes only the rows it samples from past the K/V projection: their
    hidden states equal the full forward's, and every row's K/V reaches the cache the same."""
    # device: the metadata below is built on the CPU
    llm = LLM(tiny_models(arch)[0], kv_cache_memory_gib=0.01, block_size=4, device="cpu")
    runner = llm.engine.core.runner
    model, caches = runner.model, [c for a in runner.model.attention_layers()
                                   for c in (a.k_cache, a.v_cache)]
    # two decodes, a whole prompt, and a prompt's chunk that does not end it (not sampled)
    seqs = [(5, 1), (9, 1), (0, 7), (4, 6)]
    meta = paged_step(seqs, runner.block_size, runner.num_blocks, random.Random(0))
    pos = torch.tensor([p for ctx, n in seqs for p in range(ctx, ctx + n)])
    torch.manual_seed(0)
    ids = torch.randint(3, runner.vocab_size, pos.shape)
    for c in caches:
        c.normal_()  # the contexts' K/V
    before = [c.clone() for c in caches]

    def run(kept):
        for c, saved in zip(caches, before):
            c.copy_(saved)
        with torch.inference_mode():
            hidden = model(ids, pos, meta, kept)
        return hidden, [c.clone() for c in caches]

    full, full_caches = run(None)
    for sampled in ([0, 1, 2], []):
        kept = LogitsRows.last_of(meta, sampled, runner.backend)
        hidden, kept_caches = run(kept)
        assert kept.rows.tolist() == [meta.query_start_loc[i + 1] - 1 for i in sampled]
        assert hidden.shape == (len(sampled), full.shape[1])
        torch.testing.assert_close(hidden, full[kept.rows], rtol=1e-4, atol=1e-5)
        assert all(torch.equal(a, b) for a, b in zip(kept_caches, full_caches))


def test_prompt_steps_skip_the_last_layer_for_rows_not_sampled(tiny_models, monkeypatch):
    """The runner hands the model its sampled rows: a prompt step's last MLP sees one row per
    finished prompt, except for prompt logprobs, which score every row. (Eager: on a GPU
    piecewise graphs run every row through every layer.)"""
    path, hf = tiny_models("llama")
    llm = LLM(path, kv_cache_memory_gib=0.01, enable_prefix_caching=False, enforce_eager=True)
    mlp = llm.engine.core.runner.model.model.layers[-1].mlp
    rows, real = [], mlp.forward
    monkeypatch.setattr(mlp, "forward", lambda x: rows.append(x.shape[0]) or real(x))
    params = SamplingParams(temperature=0, max_tokens=2, ignore_eos=True)
    outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS[:2]], params, use_tqdm=False)
    assert rows[0] == 2  # 67 prompt rows in the step, two sampled
    for prompt, out in zip(PROMPTS, outs):
        assert out.outputs[0].token_ids == hf_greedy(hf, prompt, 2)
    rows.clear()
    llm.generate({"prompt_token_ids": PROMPTS[1]},
                 SamplingParams(temperature=0, max_tokens=1, prompt_logprobs=1), use_tqdm=False)
    assert rows == [len(PROMPTS[1])]


@pytest.mark.parametrize("arch,overrides", [
    ("mistral", {"sliding_window": 16}),
    ("phi3", {"sliding_window": 16}),
    # Qwen2: the window on the layers `layer_types` marks (here layer 1 only)
    ("qwen2", {"sliding_window": 16, "use_sliding_window": True,
               "layer_types": ["full_attention", "sliding_attention"]})])
def test_sliding_window_attention_matches_transformers_past_the_window(tmp_path, arch,
                                                                       overrides):
    """Prompts and generations past a 16-token window, whole and in 8-token chunks with
    prefix-cache hits: transformers' tokens."""
    path = str(tmp_path / arch)
    hf = make_model(path, arch, **overrides)
    shared = list(range(30, 60))
    prompts = [shared + [i, i + 5] for i in range(100, 104)] + [list(range(5, 12))]
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    expected = [hf_greedy(hf, p, 24) for p in prompts]
    for engine in ({}, {"max_num_batched_tokens": 8}):
        with LLM(path, kv_cache_memory_gib=0.01, **engine) as llm:
            assert llm.engine.core.max_model_len == hf.config.max_position_embeddings
            outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params,
                                use_tqdm=False)
        assert [o.outputs[0].token_ids for o in outs] == expected, engine


def test_longrope_short_factors_by_default_long_factors_past_the_original_context(
        tiny_models):
    """By default the model length stops at LongRoPE's original context (the short factors:
    transformers' outputs); a longer max_model_len serves long sequences with the long
    factors, as transformers rotates a sequence that has passed the original context (checked
    on prompts longer than it, chunked too)."""
    path, hf = tiny_models("phi3_longrope")  # original 256 of 1024 positions
    with LLM(path, kv_cache_memory_gib=0.01) as llm:
        assert llm.engine.core.max_model_len == 256
    prompts = [[(7 * i) % 400 + 3 for i in range(300)], list(range(5, 405))]
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    expected = [hf_greedy(hf, p, 8) for p in prompts]
    for engine in ({}, {"max_num_batched_tokens": 64}):
        with LLM(path, kv_cache_memory_gib=0.05, max_model_len=1024, **engine) as llm:
            outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params,
                                use_tqdm=False)
        assert [o.outputs[0].token_ids for o in outs] == expected, engine


def test_blocks_that_left_every_layers_window_go_back_to_the_pool(tmp_path):
    """Every layer windowed (16 tokens, blocks of 16): a 100-token request holds at most
    the blocks its window spans, not all 7, and still gives transformers' tokens."""
    path = str(tmp_path / "swa")
    hf = make_model(path, "mistral", sliding_window=16)
    prompt = list(range(5, 45))
    with LLM(path, kv_cache_memory_gib=0.01, block_size=16) as llm:
        core = llm.engine.core
        used, schedule = [], core.scheduler.schedule

        def watched(*args, **kwargs):
            step = schedule(*args, **kwargs)
            used.append(core.kv_cache.pool.num_used_blocks)
            return step
        core.scheduler.schedule = watched
        out = llm.generate([{"prompt_token_ids": prompt}],
                           SamplingParams(temperature=0, max_tokens=60, ignore_eos=True),
                           use_tqdm=False)[0]
        core.kv_cache.pool.check_integrity()
    assert out.outputs[0].token_ids == hf_greedy(hf, prompt, 60)
    assert max(used) <= 3 and used[-1] <= 3  # one window's blocks + the one being filled
