"""DeepSeek-V3's multi-token-prediction layers: loaded and kept when the engine speculates with
them (the embedding and head they share with the main model not copied), under the same layers
and kernels as the decoder; not built otherwise (as vLLM: ~1.6% of R1's weights); one MTP step
equals transformers' decoder layer run on the joined inputs; a checkpoint without them keeps
none."""

import json
import os
import random

import pytest
import torch
from helpers import hf_greedy, make_model, paged_step
from safetensors import safe_open
from safetensors.torch import save_file

from tokenmill import LLM, SamplingParams
from tokenmill.attention.torch_sdpa import TorchSDPABackend

SPEC = {"method": "mtp", "num_speculative_tokens": 1}
PROMPTS = [[5, 17, 99, 200, 3, 45, 67], list(range(10, 40))]


def _mtp_model(config):
    """A one-layer DeepSeek-V3 whose layer is what the MTP layer holds (MoE, as the MTP
    layer's index is past first_k_dense_replace) and whose final norm is shared_head.norm."""
    import transformers as tf

    one = tf.DeepseekV3Config(**{**config.to_dict(), "num_hidden_layers": 1,
                                 "first_k_dense_replace": 0})
    torch.manual_seed(1)
    hf = tf.DeepseekV3Model(one).eval()
    with torch.no_grad():
        hf.layers[0].mlp.gate.e_score_correction_bias.normal_(0, 0.3)
    return hf


def _add_mtp(path, hf_main):
    """Append layer `num_hidden_layers` (the MTP layer) to the checkpoint, as DeepSeek ships
    it, with its copies of the embedding and head; returns (its tensors, reference parts)."""
    config = hf_main.config
    n, hidden = config.num_hidden_layers, config.hidden_size
    block = _mtp_model(config)
    g = torch.Generator().manual_seed(2)
    extra = {"enorm.weight": 1 + 0.1 * torch.randn(hidden, generator=g),
             "hnorm.weight": 1 + 0.1 * torch.randn(hidden, generator=g),
             "eh_proj.weight": 0.1 * torch.randn(hidden, 2 * hidden, generator=g),
             "shared_head.norm.weight": block.norm.weight.detach().clone(),
             "shared_head.head.weight": hf_main.lm_head.weight.detach().clone(),
             "embed_tokens.weight": hf_main.model.embed_tokens.weight.detach().clone()}
    tensors = {f"model.layers.{n}.{k}": v.contiguous() for k, v in extra.items()}
    block.save_pretrained(os.path.join(path, "block"))  # per-expert tensors, as shipped
    with safe_open(os.path.join(path, "block", "model.safetensors"), "pt") as f:
        names = f.keys()  # (a safe_open handle is not iterable)
        for name in names:
            if "layers.0." in name:
                tensors[f"model.layers.{n}.{name.split('layers.0.', 1)[1]}"] = f.get_tensor(name)
    save_file(tensors, os.path.join(path, "mtp.safetensors"))
    with open(os.path.join(path, "config.json")) as f:
        saved = json.load(f)
    saved["num_nextn_predict_layers"] = 1
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(saved, f)
    return tensors, block


def test_mtp_layers_are_kept_and_one_step_matches_transformers(tmp_path):
    path = str(tmp_path / "v3")
    hf = make_model(path, "deepseek_v3")
    tensors, block = _add_mtp(path, hf)
    n = hf.config.num_hidden_layers
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    with LLM(path, kv_cache_memory_gib=0.01) as llm:  # (not speculating: not built)
        assert len(llm.engine.core.runner.model.mtp) == 0
        plain = [o.outputs[0].token_ids for o in llm.generate(
            [{"prompt_token_ids": p} for p in PROMPTS], params, use_tqdm=False)]
    assert plain == [hf_greedy(hf, p, 8) for p in PROMPTS]
    with LLM(path, kv_cache_memory_gib=0.01, speculative_config=SPEC) as llm:
        model = llm.engine.core.runner.model
        assert len(model.mtp) == 1
        mtp = model.mtp[0]
        eh_proj = tensors[f"model.layers.{n}.eh_proj.weight"]
        x = torch.randn(3, eh_proj.shape[1])
        torch.testing.assert_close(mtp.eh_proj(x), x @ eh_proj.T, rtol=1e-4, atol=1e-5)
        torch.testing.assert_close(mtp.block.self_attn.kv_b_proj.weight,
                                   tensors[f"model.layers.{n}.self_attn.kv_b_proj.weight"])
        # nothing of the main model's was loaded twice
        assert not any("embed" in name or "lm_head" in name
                       for name, _ in mtp.named_parameters())
        # the main model is untouched by the extra layer
        out = [o.outputs[0].token_ids for o in llm.generate(
            [{"prompt_token_ids": p} for p in PROMPTS], params, use_tqdm=False)]
        assert out == [hf_greedy(hf, p, 8) for p in PROMPTS]

        # one MTP step over a 12-token prompt against transformers' layer on the same inputs
        t = 12
        attn = mtp.block.self_attn
        attn.k_cache = torch.zeros(4, 16, 1, attn.head_dim)
        attn.backend = TorchSDPABackend()  # (as the runner binds it with the cache)
        meta = paged_step([(0, t)], 16, 4, random.Random(0))
        embeds = torch.randn(t, hf.config.hidden_size)
        previous = torch.randn(t, hf.config.hidden_size)
        positions = torch.arange(t)
        with torch.no_grad():
            ours = mtp(model.model.rotary.for_step(positions, torch.float32), embeds, previous,
                       meta)
            joined = torch.cat([mtp.enorm(embeds), mtp.hnorm(previous)], dim=-1)
            ref = block(inputs_embeds=(joined @ eh_proj.T)[None],
                        position_ids=positions[None]).last_hidden_state[0]
        torch.testing.assert_close(ours, ref, rtol=1e-4, atol=1e-4)


def test_mtp_layers_under_two_ranks_and_int8(tmp_path):
    """int8 reaches the MTP layer's projections and experts (and its router stays float);
    two tensor-parallel ranks or pipeline stages not speculating leave them unread."""
    path = str(tmp_path / "v3")
    hf = make_model(path, "deepseek_v3")
    _add_mtp(path, hf)
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    with LLM(path, kv_cache_memory_gib=0.01, quantization="int8",
             speculative_config=SPEC) as llm:
        mtp = llm.engine.core.runner.model.mtp[0]
        assert mtp.block.mlp.experts[3].gate_up_proj.kernel.name.startswith("int8")
        assert mtp.block.self_attn.o_proj.kernel.name.startswith("int8")
        assert not mtp.block.mlp.gate.kernel.name.startswith("int")
    expected = [hf_greedy(hf, p, 8) for p in PROMPTS]
    for layout in ({"tensor_parallel_size": 2}, {"pipeline_parallel_size": 2}):
        with LLM(path, kv_cache_memory_gib=0.01, **layout) as llm:
            assert len(llm.engine.core.runner.model.mtp) == 0
            out = [o.outputs[0].token_ids for o in llm.generate(
                [{"prompt_token_ids": p} for p in PROMPTS], params, use_tqdm=False)]
        assert out == expected, layout


def test_without_mtp_tensors_none_are_kept(tmp_path):
    path = str(tmp_path / "v3")
    make_model(path, "deepseek_v3", num_nextn_predict_layers=1)
    with pytest.raises(ValueError, match="needs a model with multi-token-prediction"):
        LLM(path, kv_cache_memory_gib=0.01, speculative_config=SPEC)
