"""Parameters each pipeline stage builds for a large model's shape, counted on meta tensors
(no memory, no weights): what a stage's card must hold before its KV cache.

    python bench/stage_memory.py --shape llama3-70b --pp 4 --out result.json

Run it under another checkout (PYTHONPATH=that checkout) to compare builds side by side."""

from __future__ import annotations

import argparse
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(__file__))
from record import save  # noqa: E402

# published configs, the fields the layer split and parameter count read
SHAPES = {
    "llama3-70b": dict(architectures=["LlamaForCausalLM"], hidden_size=8192,
                       intermediate_size=28672, num_hidden_layers=80, num_attention_heads=64,
                       num_key_value_heads=8, vocab_size=128256, tie_word_embeddings=False),
    "qwen2.5-32b": dict(architectures=["Qwen2ForCausalLM"], hidden_size=5120,
                        intermediate_size=27648, num_hidden_layers=64, num_attention_heads=40,
                        num_key_value_heads=8, vocab_size=152064, tie_word_embeddings=False),
}


def stage_params(shape: str, pp: int, **options) -> list[dict]:
    from transformers import LlamaConfig

    from tokenmill.distributed.parallel_state import as_rank
    from tokenmill.models.registry import build_model

    config = LlamaConfig(max_position_embeddings=8192, **SHAPES[shape])
    stages = []
    for rank in range(pp):
        with as_rank(rank, 1, pp), torch.device("meta"):
            model = build_model(config, 64, **options)
        count = sum(p.numel() for p in model.parameters())
        stages.append({"stage": rank, "layers": len(model.model.stage_layers),
                       "params_b": round(count / 1e9, 3), "bf16_gb": round(2 * count / 1e9, 2)})
    return stages


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--shape", choices=sorted(SHAPES), default="llama3-70b")
    ap.add_argument("--pp", type=int, default=4)
    ap.add_argument("--out", help="a JSON result file")
    args = ap.parse_args()
    stages = stage_params(args.shape, args.pp)
    for s in stages:
        print(f"stage {s['stage']}: {s['layers']} layers, {s['params_b']} B parameters, "
              f"{s['bf16_gb']} GB in bf16")
    if args.out:
        save(args.out, shape=args.shape, pp=args.pp, stages=stages)


if __name__ == "__main__":
    main()
