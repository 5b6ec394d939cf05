"""Block-FP8 checkpoints on a GPU (issue 30; DeepSeek-V3 / R1's and Qwen3 FP8's format): 4
layers of Llama-2-7B's shape with random weights, their projections written as float8 with a
factor per 128 x 128 block, served kept as float8 (TOKENMILL_FP8_BLOCKS=auto: Fp8BlockKernel,
the weight-only Triton matmul, one byte a weight) beside the same checkpoint loaded as bf16
weights (TOKENMILL_FP8_BLOCKS=dequantize). For each: the weights' bytes, batch-1 decode
tok/s (and with asynchronous scheduling) against its own bandwidth roofline (the bytes a
token reads), 64 prompts of 128 tokens decoding 64 each (tok/s, prefill included), one
2048-token prompt's time, and the greedy tokens of one prompt (how many of
the first 32 agree between the two; bf16 rounding differs between the kernels).

    python bench/gpu_fp8_blocks.py --out bench/results/gpu-fp8-blocks-<card>-<date>.json
"""

from __future__ import annotations

import argparse
import datetime
import functools
import gc
import json
import os
import sys
import tempfile

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "tests"))
sys.path.insert(0, os.path.dirname(__file__))

from gpu_probes import (  # noqa: E402
    decode_rate,
    environment,
    generate,
    guarded,
    llama_7b_layers,
    timed,
)

BLOCK = 128


def write_checkpoint(path: str, device: str = "cuda", layers: int = 4) -> None:
    """The random model's safetensors with every projection in float8 blocks (built on
    `device`; also bench/fp8_blocks_memory.py's)."""
    import transformers as tf
    from helpers import make_tokenizer
    from safetensors.torch import save_file

    config = llama_7b_layers(layers)
    torch.manual_seed(0)
    with torch.device(device):
        model = tf.LlamaForCausalLM(config).to(torch.bfloat16)
    state = {}
    for name, w in model.state_dict().items():
        if not name.endswith("proj.weight"):
            state[name] = w.contiguous().cpu()
            continue
        n, k = w.shape  # (multiples of 128 in this shape)
        blocks = w.float().view(n // BLOCK, BLOCK, k // BLOCK, BLOCK)
        scale = blocks.abs().amax(dim=(1, 3)).clamp(min=1e-12) / 448.0
        q = (blocks / scale[:, None, :, None]).to(torch.float8_e4m3fn).view(n, k)
        state[name], state[name + "_scale_inv"] = q.cpu(), scale.cpu()
    del model
    os.makedirs(path, exist_ok=True)
    save_file(state, os.path.join(path, "model.safetensors"))
    config.architectures = ["LlamaForCausalLM"]
    config.quantization_config = {"quant_method": "fp8", "activation_scheme": "dynamic",
                                  "fmt": "e4m3", "weight_block_size": [BLOCK, BLOCK]}
    config.save_pretrained(path)
    make_tokenizer(path)


def serve(path: str, mode: str, copy_gbps: float) -> dict:
    from tokenmill import LLM, SamplingParams
    from tokenmill.quantization.model import weight_bytes

    one = SamplingParams(temperature=0, max_tokens=1, ignore_eos=True)
    prompt = torch.randint(2, 32000, (2048,), generator=torch.Generator().manual_seed(1))
    short = [prompt[:128].tolist()]
    with environment({"TOKENMILL_FP8_BLOCKS": mode}):
        llm = LLM(path, device="cuda", dtype="bfloat16", gpu_memory_utilization=0.5, seed=0,
                  enable_prefix_caching=False, max_num_batched_tokens=4096)
    model = llm.engine.core.runner.model
    kernels: dict[str, int] = {}
    for module in model.modules():
        if hasattr(module, "kernel"):
            kernels[module.kernel.name] = kernels.get(module.kernel.name, 0) + 1
    res = {"kernels": kernels, "weight_bytes": weight_bytes(model)}
    res["tokens"] = generate(llm, short, one.clone(max_tokens=32))[0].outputs[0].token_ids
    res["batch1_tok_s"] = decode_rate(llm, short, one)
    # (every weight but the embedding table is read per token)
    embed = model.model.embed_tokens.weight
    read = res["weight_bytes"] - embed.numel() * embed.element_size()
    res["batch1_roofline_tok_s"] = copy_gbps * 1e9 / read
    res["batch1_of_roofline"] = res["batch1_tok_s"] / res["batch1_roofline_tok_s"]
    batch = [prompt[i * 16:i * 16 + 128].tolist() for i in range(64)]
    many = one.clone(max_tokens=64)
    generate(llm, batch[:8], many)
    res["batch64_tok_s"] = 64 * 64 / timed(functools.partial(generate, llm, batch, many))
    run = functools.partial(generate, llm, [prompt.tolist()], one)
    run()
    res["prefill_2k_s"] = timed(run, 3)
    del llm, model, run
    gc.collect()
    torch.cuda.empty_cache()
    if mode == "auto":
        def asynchronous() -> dict:
            with environment({"TOKENMILL_FP8_BLOCKS": mode}):
                llm = LLM(path, device="cuda", dtype="bfloat16", gpu_memory_utilization=0.5,
                          seed=0, enable_prefix_caching=False, async_scheduling=True)
            rate = decode_rate(llm, short, one)
            return {"batch1_tok_s": rate, "batch1_of_roofline":
                    rate / res["batch1_roofline_tok_s"]}

        res["async_scheduling"] = guarded(asynchronous)
        gc.collect()
        torch.cuda.empty_cache()
    return res


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    from gpu_check import hardware

    result = {"date": datetime.date.today().isoformat(),
              "command": "python " + " ".join(sys.argv), "hardware": hardware()}
    path = os.path.join(tempfile.mkdtemp(), "llama7b_4layers_fp8")
    write_checkpoint(path)
    copy_gbps = result["hardware"]["copy_gbps"]
    for name, mode in (("fp8_kept", "auto"), ("bf16_dequantized", "dequantize")):
        result[name] = guarded(functools.partial(serve, path, mode, copy_gbps))
        print(json.dumps({name: result[name]}), flush=True)
    kept, full = result["fp8_kept"], result["bf16_dequantized"]
    if "tokens" in kept and "tokens" in full:
        result["greedy_tokens_agreeing"] = next(
            (i for i, (a, b) in enumerate(zip(kept["tokens"], full["tokens"])) if a != b),
            len(kept["tokens"]))
        result["decode_speedup"] = kept["batch1_tok_s"] / full["batch1_tok_s"]
    with open(args.out, "w") as f:
        json.dump(result, f, indent=1)
    print(json.dumps({k: v for k, v in result.items() if k != "hardware"}, indent=1))


if __name__ == "__main__":
    main()
