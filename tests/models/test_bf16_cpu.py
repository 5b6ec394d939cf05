"""`--dtype bfloat16` on the CPU: linear weights in bf16 panels, the rest in float32. Checked
against transformers computing the same thing the slow way (its linear weights and inputs
rounded to bf16, everything else float32), and against the float32 model within bf16's
tolerance."""

import copy

import pytest
import torch
from torch import nn

from tokenmill import LLM, SamplingParams, csrc

pytestmark = pytest.mark.skipif(not csrc.available(), reason="no compiled CPU kernels")

PROMPT = list(range(10, 50))


def bf16_linears(hf: nn.Module) -> nn.Module:
    """A copy of `hf` whose nn.Linear layers multiply bf16-rounded weights by bf16-rounded
    inputs in float32, its embedding table rounded to bf16 too (a mixture's router stays
    float32, as tokenmill's)."""
    ref = copy.deepcopy(hf)
    embed = ref.get_input_embeddings()
    embed.weight.data = embed.weight.data.to(torch.bfloat16).float()  # (a tied head's too)
    for name, module in ref.named_modules():
        if isinstance(module, nn.Linear) and not name.endswith(".gate"):
            module.weight.data = module.weight.data.to(torch.bfloat16).float()
            module.register_forward_pre_hook(
                lambda _, args: (args[0].to(torch.bfloat16).float(),) + args[1:])
    return ref


def logprob_diffs(out, prompt, ref_model) -> list[float]:
    full = prompt + out.outputs[0].token_ids
    with torch.no_grad():
        ref = torch.log_softmax(ref_model(torch.tensor([full])).logits[0].float(), dim=-1)
    diffs = []
    for i in range(1, len(prompt)):
        for token, lp in out.prompt_logprobs[i].items():
            diffs.append(abs(lp.logprob - ref[i - 1, token].item()))
    for j, entry in enumerate(out.outputs[0].logprobs):
        for token, lp in entry.items():
            diffs.append(abs(lp.logprob - ref[len(prompt) - 1 + j, token].item()))
    return diffs


@pytest.mark.parametrize("arch", ["llama", "qwen3", "phi3"])  # qwen3: a tied LM head
def test_bf16_weights_equal_their_slow_formula_and_stay_near_float32(tiny_models, arch):
    path, hf = tiny_models(arch)
    # (float32 K/V, as the formula keeps them; bfloat16 ones are the default:
    # test_attention.py's test_bf16_cache_engine)
    llm = LLM(path, dtype="bfloat16", kv_cache_memory_gib=0.01, kv_cache_dtype="float32")
    runner = llm.engine.core.runner
    assert runner.dtype == torch.float32 and runner.kv_dtype == torch.float32
    kernels = {type(m.kernel).__name__ for m in runner.model.modules() if hasattr(m, "kernel")}
    assert "CpuBf16Kernel" in kernels and "DenseKernel" not in kernels
    table = runner.model.model.embed_tokens  # bf16, or (tied) read from the head's panels
    assert table.weight is None if arch == "qwen3" else table.weight.dtype == torch.bfloat16
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True, logprobs=5,
                            prompt_logprobs=3)
    (out,) = llm.generate({"prompt_token_ids": PROMPT}, params, use_tqdm=False)
    ref = bf16_linears(hf)
    # The same computation, fp32 rounding apart: where the sums before a linear layer differ
    # in their last bit, x may round to the other bf16 neighbour (2^-9 relative), and a K/V
    # row rounded so moves every later position a little (up to ~2e-2 in these models);
    # without such a flip they agree to float32 precision (1e-6). Either way several times
    # closer than to the float32 model.
    same = sorted(logprob_diffs(out, PROMPT, ref))
    print(f"{arch}: |logprob - the formula's|: median {same[len(same) // 2]:.1e}, "
          f"mean {sum(same) / len(same):.1e}, max {same[-1]:.1e}")
    full = torch.tensor([PROMPT])
    with torch.no_grad():
        greedy = ref.generate(full, max_new_tokens=8, min_new_tokens=8, do_sample=False,
                              eos_token_id=None, pad_token_id=0)[0, len(PROMPT):].tolist()
    assert out.outputs[0].token_ids == greedy
    drifts = logprob_diffs(out, PROMPT, hf)
    # and near the float32 model: bf16 keeps 8 bits of mantissa (relative error 2^-9 per
    # rounding); these random-weight models' logprobs move by a few hundredths
    mean = sum(drifts) / len(drifts)
    print(f"{arch}: |logprob - float32's| mean {mean:.1e} max {max(drifts):.3f}")
    assert sum(same) / len(same) < mean / 4 and same[-1] < 3e-2
    assert max(drifts) < 0.25
