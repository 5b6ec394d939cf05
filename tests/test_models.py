"""Greedy tokens and logprobs equal HF transformers on tiny random models of each family."""

import copy

import pytest
import torch
from helpers import hf_greedy

from tokenmill import LLM, SamplingParams, csrc

ARCHS = ["llama", "llama3", "llama_linear", "mistral", "qwen2", "qwen3"]
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


@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3"])
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
    from tokenmill.models import llama

    path, hf = tiny_models("llama")
    prompts = [list(range(10 + i, 300 + i)) for i in range(2)]  # 580 rows in one step
    params = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True, logprobs=3)

    def run():
        llm = LLM(path, kv_cache_memory_gib=0.05, quantization=quantization)
        return llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)

    whole = run()
    chunk_rows = []
    real = llama._mlp_chunk_rows

    def spy(x, width):
        chunk_rows.append((x.shape[0], real(x, width)))
        return chunk_rows[-1][1]

    monkeypatch.setattr(llama, "MLP_CHUNK_BYTES", 4096)
    monkeypatch.setattr(llama, "_mlp_chunk_rows", spy)
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
