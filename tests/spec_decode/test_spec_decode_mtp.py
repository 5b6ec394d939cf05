"""Speculative decoding with DeepSeek's MTP layers (method "mtp") on a tiny DeepSeek-V3 that
carries one: each step's drafts equal a from-scratch computation with transformers' layer
over the whole context (so the MTP layer's paged cache holds the right rows across prompt
chunks, accepted and rejected drafts); greedy outputs identical to decoding without
speculation; start-up errors."""

import pytest
import torch
from helpers import (
    accept_by_fiat,
    check_drafts_each_step,
    hf_greedy,
    make_model,
    record_replays,
    speculation_keeps_outputs,
)

from tests.spec_decode.test_deepseek_mtp import PROMPTS, _add_mtp
from tokenmill import LLM, SamplingParams


@pytest.fixture(scope="module")
def mtp_model(tmp_path_factory):
    path = str(tmp_path_factory.mktemp("v3mtp") / "v3")
    hf = make_model(path, "deepseek_v3")
    tensors, block = _add_mtp(path, hf)
    return path, hf, tensors, block


def _reference_drafts(hf, tensors, block, context: list[int], k: int) -> list[int]:
    """k drafts after `context`: the MTP layer (transformers' decoder layer + norm) over
    rows 0 .. N-2 (embedding of token i + 1 with the target's final hidden state at i), then
    one more row per draft fed the draft and the layer's output before its norm."""
    n = hf.config.num_hidden_layers
    eps = hf.config.rms_norm_eps
    enorm, hnorm, eh = (tensors[f"model.layers.{n}.{name}.weight"]
                        for name in ("enorm", "hnorm", "eh_proj"))
    emb = hf.model.embed_tokens.weight

    def rms(x, w):
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * w

    def row(token_embeds, previous):
        return torch.cat([rms(token_embeds, enorm), rms(previous, hnorm)], -1) @ eh.T

    captured = {}
    hook = block.norm.register_forward_hook(lambda m, inp, out: captured.update(pre=inp[0]))
    try:
        with torch.no_grad():
            ids = torch.tensor(context)
            hidden = hf.model(ids[None]).last_hidden_state[0]
            rows = row(emb[ids[1:]], hidden[:-1])
            drafts = []
            for _ in range(k):
                out = block(inputs_embeds=rows[None],
                            position_ids=torch.arange(len(rows))[None]).last_hidden_state[0]
                drafts.append(int((out[-1] @ hf.lm_head.weight.T).argmax()))
                rows = torch.cat([rows, row(emb[drafts[-1]], captured["pre"][0][-1])[None]])
    finally:
        hook.remove()
    return drafts


@pytest.mark.parametrize("k,engine", [(1, {}), (3, {"max_num_batched_tokens": 9,
                                                   "block_size": 4})])
def test_drafts_equal_the_layer_over_the_whole_context(mtp_model, k, engine):
    path, hf, tensors, block = mtp_model
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    with LLM(path, kv_cache_memory_gib=0.01, enable_prefix_caching=False,
             speculative_config={"method": "mtp", "num_speculative_tokens": k},
             **engine) as llm:
        core = llm.engine.core
        checked = check_drafts_each_step(
            core, lambda context, k: _reference_drafts(hf, tensors, block, context, k), k,
            prompts=PROMPTS, params=params, tag="r")
        assert checked >= 6
        assert core.kv_cache.pool.num_free_blocks == core.kv_cache.num_blocks


def test_greedy_outputs_equal_decoding_without_mtp(mtp_model):
    params = [SamplingParams(temperature=0, max_tokens=16, ignore_eos=True),
              SamplingParams(temperature=0, max_tokens=16, ignore_eos=True,
                             repetition_penalty=1.2)]  # (this one does not speculate)
    speculation_keeps_outputs(mtp_model[0], PROMPTS, params,
                              {"method": "mtp", "num_speculative_tokens": 2},
                              [{}, {"num_kv_blocks": 15, "block_size": 4}])  # (preemption)


@pytest.mark.parametrize("tp,pp", [(2, 1), (1, 2), (2, 2)])
def test_mtp_under_tensor_and_pipeline_parallel(mtp_model, tp, pp):
    """Tensor parallel: two ranks run every MTP pass (rank 0 samples the drafts, the other
    follows). Pipeline parallel: the MTP layer runs on stage 0 over the final hidden states
    the last stage sends back, while other micro-batches are in flight. Each step's drafts
    equal the from-scratch reference, and outputs equal one rank's without speculation,
    greedy and seeded sampling alike."""
    path, hf, tensors, block = mtp_model
    prompts = [{"prompt_token_ids": p} for p in PROMPTS]
    params = [SamplingParams(temperature=0, max_tokens=12, ignore_eos=True),
              SamplingParams(temperature=0.8, max_tokens=12, ignore_eos=True, seed=5)]
    spec = {"method": "mtp", "num_speculative_tokens": 2}
    with LLM(path, kv_cache_memory_gib=0.01, speculative_config=spec) as llm:
        seeded_one_rank = [list(o.outputs[0].token_ids)
                           for o in llm.generate(prompts, params[1], use_tqdm=False)]
    with LLM(path, kv_cache_memory_gib=0.01) as llm:
        base = [list(o.outputs[0].token_ids) for o in llm.generate(prompts, params[0],
                                                                    use_tqdm=False)]
    with LLM(path, kv_cache_memory_gib=0.01, tensor_parallel_size=tp,
             pipeline_parallel_size=pp, speculative_config=spec,
             enable_prefix_caching=False) as llm:
        core = llm.engine.core
        checked = check_drafts_each_step(
            core, lambda context, k: _reference_drafts(hf, tensors, block, context, k), 2,
            prompts=PROMPTS, params=params[0], tag="r")
        assert checked >= 6
        assert [list(o.outputs[0].token_ids) for o in llm.generate(
            prompts, params[0], use_tqdm=False)] == base
        seeded = [list(o.outputs[0].token_ids)
                  for o in llm.generate(prompts, params[1], use_tqdm=False)]
        assert core.scheduler.num_draft_tokens > 0
    # the same draws as on one rank: the sampler and the draft draws live on rank 0 alone
    assert seeded == seeded_one_rank


def test_seeded_sampling_with_mtp_reproduces(mtp_model):
    path = mtp_model[0]
    params = SamplingParams(temperature=0.9, max_tokens=12, seed=11, ignore_eos=True)
    runs = []
    for _ in range(2):
        with LLM(path, kv_cache_memory_gib=0.01,
                 speculative_config={"method": "mtp", "num_speculative_tokens": 2}) as llm:
            runs.append([list(o.outputs[0].token_ids) for o in llm.generate(
                [{"prompt_token_ids": p} for p in PROMPTS], params, use_tqdm=False)])
    assert runs[0] == runs[1] and all(len(r) == 12 for r in runs[0])


def test_mtp_start_up_errors(tiny_models, mtp_model):
    llama = tiny_models("llama")[0]
    spec = {"method": "mtp", "num_speculative_tokens": 1}
    with pytest.raises(ValueError, match="needs a model with multi-token-prediction"):
        LLM(llama, speculative_config=spec)
    with pytest.raises(ValueError, match="target's path or left out"):
        LLM(mtp_model[0], kv_cache_memory_gib=0.01,
            speculative_config={**spec, "model": llama})
    with pytest.raises(ValueError, match="drop \"quantization\""):
        LLM(mtp_model[0], speculative_config={**spec, "quantization": "int8"})


def test_sharded_folder_keeps_mtp_on_stage_0(mtp_model, tmp_path):
    """`tokenmill convert --tp-size 1 --pp-size 2` writes the MTP layer into stage 0's file
    (where draft heads run); the folder serves with MTP (drafts as the reference) and
    without it (its tensors then unread), both with the original's greedy tokens."""
    from safetensors import safe_open

    from tokenmill.entrypoints.cli import main as cli
    from tokenmill.loading.sharded import rank_file

    path, hf, tensors, block = mtp_model
    out = str(tmp_path / "pp2")
    assert cli(["convert", path, out, "--tp-size", "1", "--pp-size", "2"]) == 0
    for rank, want in ((0, True), (1, False)):
        with safe_open(f"{out}/{rank_file(rank)}", framework="pt") as f:
            assert any(name.startswith("mtp.0.") for name in list(f.keys())) == want, rank
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    prompts = [{"prompt_token_ids": p} for p in PROMPTS]
    base = [hf_greedy(hf, p, 12) for p in PROMPTS]
    with LLM(out, kv_cache_memory_gib=0.01, pipeline_parallel_size=2) as llm:
        assert [list(o.outputs[0].token_ids)
                for o in llm.generate(prompts, params, use_tqdm=False)] == base
    with LLM(out, kv_cache_memory_gib=0.01, pipeline_parallel_size=2,
             enable_prefix_caching=False,
             speculative_config={"method": "mtp", "num_speculative_tokens": 2}) as llm:
        core = llm.engine.core
        checked = check_drafts_each_step(
            core, lambda context, k: _reference_drafts(hf, tensors, block, context, k), 2,
            prompts=PROMPTS, params=params, tag="r")
        assert checked >= 6
        assert [list(o.outputs[0].token_ids)
                for o in llm.generate(prompts, params, use_tqdm=False)] == base


def test_mtp_in_cuda_graph_buckets(mtp_model, monkeypatch):
    """DeepSeek on fused experts and the Triton backend (MLA) runs its decode steps, its
    steps carrying 3 drafts a request and the MTP layer's passes in the CUDA-graph buckets
    (eagerly here, as captured on a GPU). Drafts equal the reference at every step, also
    with 1 or 2 drafts accepted by fiat (so the first pass reads accepted rows among padded
    ones); greedy outputs equal decoding without speculation."""
    from tokenmill.layers.linear import CpuPackedKernel
    from tokenmill.layers.moe import SparseMoE
    from tokenmill.sample import rejection_sampler as rejection

    path, hf, tensors, block = mtp_model
    fuse = SparseMoE.fuse_experts
    monkeypatch.setattr(SparseMoE, "fuse_experts", lambda self: fuse(self, force=True))
    monkeypatch.setattr(CpuPackedKernel, "supports", staticmethod(lambda layer: False))
    monkeypatch.setenv("TOKENMILL_CPU_GRAPH_BUCKETS", "1")
    params = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)
    engine = {"kv_cache_memory_gib": 0.01, "attention_backend": "triton", "max_num_seqs": 4}
    with LLM(path, **engine) as llm:
        base = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], params, use_tqdm=False)
    # seeded sampling: drafts drawn on the device between graphed passes, the same draws
    seeded = [SamplingParams(temperature=0.9, seed=s, max_tokens=10, ignore_eos=True)
              for s in (3, 4)]
    spec = {"method": "mtp", "num_speculative_tokens": 3}
    sampled = []
    for eager in (True, False):
        with LLM(path, **engine, speculative_config=spec, enforce_eager=eager) as llm:
            assert (llm.engine.core.runner.graphs is None) == eager
            sampled.append([o.outputs[0].token_ids for o in llm.generate(
                [{"prompt_token_ids": p} for p in PROMPTS], seeded, use_tqdm=False)])
            assert llm.engine.core.scheduler.num_draft_tokens >= 6
    assert sampled[0] == sampled[1]
    with LLM(path, enable_prefix_caching=False, **engine, speculative_config=spec) as llm:
        runner = llm.engine.core.runner
        assert runner.graphs.widths == {1: [1, 2, 4], 4: [1, 2, 4]}
        passes = []
        record_replays(monkeypatch, {"target": runner.graphs, "first": runner.heads.graphs.first,
                                     "chain": runner.heads.graphs.chain[0]}, passes)
        outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], params,
                            use_tqdm=False)
        assert [o.outputs[0].token_ids for o in outs] == [o.outputs[0].token_ids for o in base]
        assert {("target", 2, 4), ("first", 2, 4), ("chain", 2, 1)} <= set(passes)
        monkeypatch.setattr(rejection, "verify_greedy", accept_by_fiat)
        core = llm.engine.core
        checked = check_drafts_each_step(
            core, lambda context, k: _reference_drafts(hf, tensors, block, context, k), 3,
            prompts=PROMPTS, params=params, tag="fiat")
        assert checked >= 4 and core.scheduler.num_accepted_tokens >= 4
