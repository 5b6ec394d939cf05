"""Speculative decoding with Qwen3-Next's MTP layer (method "mtp") on a tiny Qwen3-Next that
carries one (`mtp.*`, as Qwen ships it): kept only when the engine speculates with it; each
step's drafts equal a from-scratch computation with transformers' layer over the whole
context, also when drafts are accepted (by fiat: random weights accept few), so the
DeltaNet layers' states resumed after the last accepted draft are checked through the
hidden states the drafts read; greedy outputs identical to decoding without speculation,
with chunked prefill and preemption."""

import json
import os

import pytest
import torch
from helpers import (
    accept_by_fiat,
    check_drafts_each_step,
    make_model,
    speculation_keeps_outputs,
)
from safetensors import safe_open
from safetensors.torch import save_file

from tokenmill import LLM, SamplingParams

PROMPTS = [[5, 17, 99, 200, 3, 45, 67], list(range(10, 40)), [7, 8]]
SPEC = {"method": "mtp", "num_speculative_tokens": 2}


def _add_mtp(path, hf_main):
    """The MTP layer's tensors beside the checkpoint: a one-layer Qwen3-Next of gated
    attention and experts (its `norm` the layer's final norm), the pre-fc norms and fc;
    returns (those tensors, the one-layer model)."""
    import transformers as tf

    config = hf_main.config
    one = tf.Qwen3NextConfig(**{**config.to_dict(), "num_hidden_layers": 1,
                                "layer_types": ["full_attention"]})
    torch.manual_seed(1)
    block = tf.Qwen3NextModel(one).eval()
    with torch.no_grad():
        for name, param in block.named_parameters():
            if "norm" in name:
                param.normal_(0.0, 0.2)
    hidden = config.hidden_size
    g = torch.Generator().manual_seed(2)
    tensors = {"mtp.pre_fc_norm_embedding.weight": 0.2 * torch.randn(hidden, generator=g),
               "mtp.pre_fc_norm_hidden.weight": 0.2 * torch.randn(hidden, generator=g),
               "mtp.fc.weight": 0.1 * torch.randn(hidden, 2 * hidden, generator=g),
               "mtp.norm.weight": block.norm.weight.detach().clone()}
    block.save_pretrained(os.path.join(path, "block"))
    with safe_open(os.path.join(path, "block", "model.safetensors"), "pt") as f:
        names = f.keys()
        for name in names:
            if "layers.0." in name:
                tensors[f"mtp.layers.0.{name.split('layers.0.', 1)[1]}"] = f.get_tensor(name)
    save_file({k: v.contiguous() for k, v in tensors.items()},
              os.path.join(path, "mtp.safetensors"))
    index = os.path.join(path, "model.safetensors.index.json")
    if os.path.exists(index):  # (a sharded save names every tensor's file)
        with open(index) as f:
            saved = json.load(f)
        saved["weight_map"].update({name: "mtp.safetensors" for name in tensors})
        with open(index, "w") as f:
            json.dump(saved, f)
    return tensors, block


@pytest.fixture(scope="module")
def mtp_model(tmp_path_factory):
    path = str(tmp_path_factory.mktemp("qnext") / "m")
    hf = make_model(path, "qwen3_next")
    tensors, block = _add_mtp(path, hf)
    return path, hf, tensors, block


def _reference_drafts(hf, tensors, block, context: list[int], k: int) -> list[int]:
    """k drafts after `context`: the layer over rows 0 .. N-2 (the embedding of token i + 1
    with the target's final hidden state at i, each (1 + w)-normed, joined, fc), then one
    more row per draft fed the draft and the layer's final hidden state (vLLM's chaining)."""
    eps = hf.config.rms_norm_eps
    emb = hf.model.embed_tokens.weight

    def rms(x, w):
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * (1 + w)

    def row(token_embeds, previous):
        joined = torch.cat([rms(token_embeds, tensors["mtp.pre_fc_norm_embedding.weight"]),
                            rms(previous, tensors["mtp.pre_fc_norm_hidden.weight"])], -1)
        return joined @ tensors["mtp.fc.weight"].T

    with torch.no_grad():
        ids = torch.tensor(context)
        hidden = hf.model(ids[None]).last_hidden_state[0]
        rows = row(emb[ids[1:]], hidden[:-1])
        drafts = []
        for _ in range(k):
            out = block(inputs_embeds=rows[None], position_ids=torch.arange(len(rows))[None],
                        use_cache=False).last_hidden_state[0]
            drafts.append(int((out[-1] @ hf.lm_head.weight.T).argmax()))
            rows = torch.cat([rows, row(emb[drafts[-1]], out[-1])[None]])
    return drafts


@pytest.mark.parametrize("k,engine", [(1, {}), (3, {"max_num_batched_tokens": 9,
                                                   "block_size": 4})])
def test_drafts_equal_the_layer_over_the_whole_context(mtp_model, k, engine, monkeypatch):
    from tokenmill.sample import rejection_sampler as rejection

    path, hf, tensors, block = mtp_model
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    with LLM(path, kv_cache_memory_gib=0.01,
             speculative_config={"method": "mtp", "num_speculative_tokens": k},
             **engine) as llm:
        core = llm.engine.core
        assert len(core.runner.model.mtp) == 1
        checked = check_drafts_each_step(
            core, lambda context, k: _reference_drafts(hf, tensors, block, context, k), k,
            prompts=PROMPTS, params=params, tag="r")
        assert checked >= 6
        # drafts accepted whatever the target says: the contexts the drafts read then hold
        # them, and the DeltaNet states resume after the last accepted one
        monkeypatch.setattr(rejection, "verify_greedy", accept_by_fiat)
        checked = check_drafts_each_step(
            core, lambda context, k: _reference_drafts(hf, tensors, block, context, k), k,
            prompts=PROMPTS, params=params, tag="fiat")
        assert checked >= 4 and core.scheduler.num_accepted_tokens >= 4
        assert core.kv_cache.pool.num_free_blocks == core.kv_cache.num_blocks
        assert core.kv_cache.states.num_free == core.kv_cache.states.num_slots


def test_greedy_outputs_equal_decoding_without_mtp(mtp_model):
    with LLM(mtp_model[0], kv_cache_memory_gib=0.01) as llm:
        assert not len(llm.engine.core.runner.model.mtp)  # (not built without speculation)
    speculation_keeps_outputs(
        mtp_model[0], PROMPTS, SamplingParams(temperature=0, max_tokens=16, ignore_eos=True),
        SPEC, [{}, {"max_num_batched_tokens": 6},
               {"num_kv_blocks": 14, "block_size": 4}])  # (preemption)


@pytest.mark.parametrize("layout", [{"tensor_parallel_size": 2},
                                    {"pipeline_parallel_size": 2}])
def test_mtp_under_tensor_and_pipeline_parallel(mtp_model, layout):
    """TP: every rank runs the layer's passes; PP: the layer on stage 0, the DeltaNet
    layers split over the stages."""
    speculation_keeps_outputs(mtp_model[0], PROMPTS,
                              SamplingParams(temperature=0, max_tokens=10, ignore_eos=True),
                              SPEC, [layout])


def test_a_checkpoint_without_the_mtp_layer_is_refused_by_name(tiny_models):
    path, _ = tiny_models("qwen3_next")
    with pytest.raises(ValueError, match="multi-token-prediction"):
        LLM(path, kv_cache_memory_gib=0.01,
            speculative_config={"method": "mtp", "num_speculative_tokens": 1})
