"""gpt-oss as OpenAI ships it: MXFP4 experts read into the int8 kernel exactly, against
transformers' own MXFP4 reading and its model over the same (dequantized) weights."""

import json

import pytest
import torch
from helpers import hf_greedy, make_model
from safetensors.torch import save_file
from transformers.integrations.mxfp4 import convert_moe_packed_tensors

from tokenmill import LLM, SamplingParams, csrc
from tokenmill.quantization.mxfp4 import dequantize_mxfp4, mxfp4_int8
from tokenmill.quantization.schemes import dequantize_int8

PROMPTS = [[5, 17, 99, 200, 3, 45, 67], list(range(10, 70)), [7, 8]]


def _random_mxfp4(gen, *shape):
    """blocks [..., G, 16] and scales [..., G] of weights of a realistic size."""
    *lead, inputs = shape
    blocks = torch.randint(0, 256, (*lead, inputs // 32, 16), generator=gen, dtype=torch.uint8)
    scales = torch.randint(118, 126, (*lead, inputs // 32), generator=gen, dtype=torch.uint8)
    return blocks, scales


def test_mxfp4_reads_as_transformers_reads_it_and_int8_holds_it_exactly():
    gen = torch.Generator().manual_seed(0)
    blocks, scales = _random_mxfp4(gen, 3, 48, 64)  # [experts, out, in]
    scales[0, 0, 0], scales[1, 2, 1] = 0, 254  # (the extremes of the exponent)
    ours = dequantize_mxfp4(blocks, scales)
    theirs = convert_moe_packed_tensors(blocks, scales, dtype=torch.float32)
    assert torch.equal(ours, theirs.transpose(1, 2))  # (theirs: [experts, in, out])
    for e in range(3):
        shard = mxfp4_int8(blocks[e], scales[e])
        assert shard.method == "int8" and shard.tensors["qweight"].abs().max() <= 12
        assert torch.equal(dequantize_int8(shard.tensors["qweight"], shard.tensors["scale"]),
                           ours[e])


@pytest.fixture(scope="module")
def mxfp4_model(tmp_path_factory):
    """A tiny gpt-oss whose experts are stored as MXFP4 (its config's quantization_config
    says so, as OpenAI's do), and transformers' model over the same weights dequantized."""
    path = tmp_path_factory.mktemp("gpt_oss_mxfp4")
    hf = make_model(str(path), "gpt_oss")
    gen = torch.Generator().manual_seed(1)
    state = {k: v for k, v in hf.state_dict().items()}
    config = hf.config
    inter, hidden = config.intermediate_size, config.hidden_size
    for i in range(config.num_hidden_layers):
        prefix = f"model.layers.{i}.mlp.experts."
        for kind, out, inputs in (("gate_up_proj", 2 * inter, hidden),
                                  ("down_proj", hidden, inter)):
            blocks, scales = _random_mxfp4(gen, config.num_local_experts, out, inputs)
            del state[prefix + kind]
            state[prefix + kind + "_blocks"] = blocks
            state[prefix + kind + "_scales"] = scales
            with torch.no_grad():  # transformers' layout: [experts, in, out]
                getattr(hf.model.layers[i].mlp.experts, kind).copy_(
                    dequantize_mxfp4(blocks, scales).transpose(1, 2))
    save_file({k: v.contiguous() for k, v in state.items()}, str(path / "model.safetensors"))
    data = json.loads((path / "config.json").read_text())
    data["quantization_config"] = {"quant_method": "mxfp4",
                                   "modules_to_not_convert": ["model.layers.*.self_attn"]}
    (path / "config.json").write_text(json.dumps(data))
    return str(path), hf


@pytest.mark.parametrize("engine,kernels", [({}, "compiled"), ({}, "torch"),
                                            ({"tensor_parallel_size": 2}, "compiled")])
def test_mxfp4_checkpoint_equals_transformers(mxfp4_model, monkeypatch, engine, kernels):
    """Greedy tokens equal transformers'; logprobs within 1e-4 where the int8 kernel's
    torch form multiplies by the weights it holds (exactly the MXFP4 ones), within 5e-3
    where the compiled kernel rounds activations to int8 per 32 inputs (as llama.cpp's
    q8_0 dot products do)."""
    if kernels == "torch":
        monkeypatch.setattr(csrc, "available", lambda: False)
    elif not csrc.available():
        pytest.skip("no compiled CPU kernels")
    bound = 1e-4 if kernels == "torch" else 5e-3
    path, hf = mxfp4_model
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, logprobs=3)
    with LLM(path, kv_cache_memory_gib=0.01, **engine) as llm:
        moe = llm.engine.core.runner.model.model.layers[1].mlp
        assert moe.experts[0].gate_up_proj.kernel.name.startswith("int8")
        outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], params,
                            use_tqdm=False)
    for prompt, out in zip(PROMPTS, outs):
        tokens = out.outputs[0].token_ids
        assert tokens == hf_greedy(hf, prompt, 12)
        with torch.no_grad():
            ref = torch.log_softmax(hf(torch.tensor([prompt + tokens])).logits[0], dim=-1)
        for j, entry in enumerate(out.outputs[0].logprobs):
            row = ref[len(prompt) - 1 + j]
            assert max(abs(lp.logprob - row[t].item()) for t, lp in entry.items()) < bound
