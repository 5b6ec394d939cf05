"""LoRA adapters' cost: offline throughput of N requests spread over 1, 4 and 16 adapters
beside the base model alone (without --enable-lora) and the base under --enable-lora with no
adapter asked for, one process, each configuration a fresh engine, the rounds alternating.

    python bench/lora.py [--model default-f32|PATH] [--requests 32] [--prompt-len 128]
        [--output-len 64] [--rank 16] [--adapters 1,4,16] [--rounds 2] [--out FILE]

Adapters are random (all seven attention and MLP projections, `--rank`), written as PEFT
folders; requests go to them round robin, `--max-loras` = the adapter count (every adapter in
a step). Reports generated tokens/s and the ratio to the base alone."""

from __future__ import annotations

import argparse
import json
import os
import random
import sys
import tempfile
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from record import save  # noqa: E402

TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def write_adapter(folder: str, config, rank: int, seed: int) -> None:
    """A random PEFT adapter for a Llama-shaped `config` (every projection of every layer)."""
    from safetensors.torch import save_file

    hidden, inter = config.hidden_size, config.intermediate_size
    head_dim = getattr(config, "head_dim", None) or hidden // config.num_attention_heads
    kv = config.num_key_value_heads * head_dim
    shapes = {"q_proj": (hidden, config.num_attention_heads * head_dim), "k_proj": (hidden, kv),
              "v_proj": (hidden, kv), "o_proj": (config.num_attention_heads * head_dim, hidden),
              "gate_proj": (hidden, inter), "up_proj": (hidden, inter),
              "down_proj": (inter, hidden)}
    g = torch.Generator().manual_seed(seed)
    tensors = {}
    for layer in range(config.num_hidden_layers):
        for proj, (cols, rows) in shapes.items():
            part = "self_attn" if proj in TARGETS[:4] else "mlp"
            key = f"base_model.model.model.layers.{layer}.{part}.{proj}"
            tensors[f"{key}.lora_A.weight"] = torch.randn(rank, cols, generator=g) / cols ** 0.5
            tensors[f"{key}.lora_B.weight"] = torch.randn(rows, rank, generator=g) * 0.01
    os.makedirs(folder, exist_ok=True)
    save_file(tensors, os.path.join(folder, "adapter_model.safetensors"))
    with open(os.path.join(folder, "adapter_config.json"), "w") as f:
        json.dump({"peft_type": "LORA", "r": rank, "lora_alpha": 2 * rank,
                   "target_modules": TARGETS}, f)


def run(model: str, prompts: list[list[int]], output_len: int, adapters: list[str] | None,
        enable_lora: bool, rank: int) -> float:
    """Generated tokens per second of one configuration (a warm-up first)."""
    from tokenmill import LLM, SamplingParams
    from tokenmill.lora.request import LoRARequest

    kwargs = {}
    if enable_lora:
        count = max(1, len(adapters or ()))
        kwargs = {"enable_lora": True, "max_loras": count, "max_cpu_loras": count,
                  "max_lora_rank": rank}
    params = SamplingParams(temperature=0, max_tokens=output_len, ignore_eos=True)
    loras = [LoRARequest(f"a{i}", i + 1, path) for i, path in enumerate(adapters or ())]
    per_prompt = [loras[i % len(loras)] if loras else None for i in range(len(prompts))]
    with LLM(model, seed=0, enable_prefix_caching=False, max_model_len=1024, **kwargs) as llm:
        llm.generate([{"prompt_token_ids": p} for p in prompts[:len(loras) or 1]],
                     params.clone(max_tokens=2), use_tqdm=False,
                     lora_request=per_prompt[:len(loras) or 1])  # (warm-up, adapters read)
        start = time.perf_counter()
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False,
                            lora_request=per_prompt)
        elapsed = time.perf_counter() - start
    assert all(len(o.outputs[0].token_ids) == output_len for o in outs)
    return len(prompts) * output_len / elapsed


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="default-f32")
    ap.add_argument("--requests", type=int, default=32)
    ap.add_argument("--prompt-len", type=int, default=128)
    ap.add_argument("--output-len", type=int, default=64)
    ap.add_argument("--rank", type=int, default=16)
    ap.add_argument("--adapters", default="1,4,16")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--out")
    args = ap.parse_args()
    model = args.model
    if model == "default-f32":
        from spec_decode import default_f32

        model = default_f32()
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(model)
    rng = random.Random(0)
    prompts = [[rng.randrange(100, config.vocab_size) for _ in range(args.prompt_len)]
               for _ in range(args.requests)]
    counts = [int(c) for c in args.adapters.split(",")]
    results: dict[str, list[float]] = {}
    with tempfile.TemporaryDirectory() as tmp:
        folders = [os.path.join(tmp, f"a{i}") for i in range(max(counts))]
        for i, folder in enumerate(folders):
            write_adapter(folder, config, args.rank, seed=i)
        plan = [("base", None, False), ("enable-lora, base requests", None, True)] + [
            (f"{c} adapters", folders[:c], True) for c in counts]
        for _ in range(args.rounds):
            for name, adapters, enable in plan:
                rate = run(model, prompts, args.output_len, adapters, enable, args.rank)
                results.setdefault(name, []).append(rate)
                print(f"{name:28s} {rate:8.1f} tok/s", flush=True)
    base = max(results["base"])
    table = {name: {"tok_s": max(rates), "all": rates, "ratio": max(rates) / base}
             for name, rates in results.items()}
    print(f"\n{'configuration':28s} {'tok/s':>8s} {'x base':>7s}")
    for name, row in table.items():
        print(f"{name:28s} {row['tok_s']:8.1f} {row['ratio']:7.2f}")
    if args.out:
        save(args.out, model=args.model, requests=args.requests, prompt_len=args.prompt_len,
             output_len=args.output_len, rank=args.rank, results=table,
             git_commit=os.popen("git rev-parse --short HEAD").read().strip())


if __name__ == "__main__":
    main()
