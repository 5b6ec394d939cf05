"""`tokenmill quantize`: float checkpoint (HF directory or GGUF) in, quantized safetensors
checkpoint out, with the config.json, tokenizer and a `quantization_config` that
`tokenmill serve OUT` / `LLM(OUT)` load as they are."""

from __future__ import annotations

import argparse
import json
import logging
import os
import time
from typing import Any

import torch
from tqdm import tqdm

from tokenmill.config.quantization import METHODS, QuantConfig, parse_method

logger = logging.getLogger(__name__)


def make_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="tokenmill quantize",
                                description="Write a quantized copy of a model.")
    p.add_argument("--model", default=None,
                   help="HF directory or .gguf file (default: the bundled SmolLM2-135M)")
    p.add_argument("--out", required=True, help="output directory (created)")
    p.add_argument("--method", required=True, help=f"{', '.join(METHODS)} (or an alias such "
                   "as weight_only_int8)")
    p.add_argument("--group-size", type=int, default=None,
                   help="int4: inputs per scale (32, 64, 128; default 32); int8: per group "
                        "instead of per output channel")
    p.add_argument("--activation", choices=["dynamic", "static"], default="dynamic",
                   help="a8w8 / fp8 activation scales: per call, or calibrated (static)")
    p.add_argument("--alpha", type=float, default=0.5, help="a8w8 SmoothQuant strength")
    p.add_argument("--per-tensor", action="store_true", help="fp8: one weight scale per tensor")
    p.add_argument("--no-lm-head", action="store_true", help="keep the LM head in float")
    p.add_argument("--calib-data", default=None,
                   help="local .txt or .jsonl file for a8w8 smoothing / static scales")
    p.add_argument("--calib-samples", type=int, default=64)
    p.add_argument("--calib-seq-len", type=int, default=512)
    return p


def forward_prompt(model: torch.nn.Module, token_ids: list[int], block_size: int = 16) -> None:
    """One fresh sequence through the model and its LM head at every position: what
    calibration records."""
    from tokenmill.attention.backend import AttentionMetadata
    from tokenmill.attention.torch_sdpa import TorchSDPABackend

    n = len(token_ids)
    blocks = -(-n // block_size)
    backend = TorchSDPABackend()
    for layer in model.attention_layers():
        shape = (blocks, block_size, layer.num_kv_heads, layer.head_dim)
        layer.k_cache, layer.v_cache, layer.backend = torch.zeros(shape), torch.zeros(shape), \
            backend
    meta = AttentionMetadata(slot_mapping=torch.arange(n), query_start_loc=[0, n],
                             context_lens=[0], seq_lens=torch.tensor([n]),
                             block_table=torch.arange(blocks).unsqueeze(0), num_decodes=0,
                             block_size=block_size)
    backend.prepare(meta)
    model.compute_logits(model(torch.tensor(token_ids), torch.arange(n), meta))


def calibrate(model: torch.nn.Module, samples: list[list[int]], names: list[str]) -> dict:
    from tokenmill.quantization.calibration import record_activations

    stats, handles = record_activations(model, names)
    try:
        with torch.inference_mode():
            for ids in tqdm(samples, desc="calibrating"):
                forward_prompt(model, ids)
    finally:
        for handle in handles:
            handle.remove()
    return stats


def save_checkpoint(model: torch.nn.Module, hf_config: Any, tokenizer: Any, out: str,
                    config: QuantConfig) -> int:
    from safetensors.torch import save_file

    from tokenmill.quantization.model import quantized_state_dict

    os.makedirs(out, exist_ok=True)
    state = quantized_state_dict(model, checkpoint_norms=True)
    save_file(state, os.path.join(out, "model.safetensors"), metadata={"format": "pt"})
    hf_config.quantization_config = config.to_json()
    hf_config.save_pretrained(out)
    tokenizer.save_pretrained(out)
    return sum(t.numel() * t.element_size() for t in state.values())


def run(argv: list[str]) -> int:
    from tokenmill.config import generation as generation_config
    from tokenmill.loading.checkpoint import (
        load_hf_config,
        load_model,
        load_tokenizer,
        resolve_model_path,
    )
    from tokenmill.quantization.calibration import calibration_samples, read_calibration_text
    from tokenmill.quantization.model import quantizable_linears, quantize_linears

    args = make_parser().parse_args(argv)
    config = QuantConfig(parse_method(args.method) or "", group_size=args.group_size,
                         activation=args.activation, smoothquant_alpha=args.alpha,
                         fp8_per_channel=not args.per_tensor, lm_head=not args.no_lm_head)
    if config.activation == "static" and config.method in ("int8", "int4"):
        raise ValueError("--activation applies to a8w8 and fp8 only.")
    if config.activation == "static" and args.calib_data is None:
        raise ValueError("static activation scales need --calib-data FILE.")
    started = time.perf_counter()
    path = resolve_model_path(args.model)
    hf_config = load_hf_config(path)
    tokenizer = load_tokenizer(path)
    model = load_model(path, hf_config, torch.float32, torch.device("cpu"),
                       getattr(hf_config, "max_position_embeddings", None) or 2048,
                       float_weights=True)  # (Mamba-2: no positions)
    stats = None
    if args.calib_data is not None:
        if config.method in ("int8", "int4"):
            logger.warning("--calib-data is not used by weight-only %s.", config.method)
        else:
            samples = calibration_samples(read_calibration_text(args.calib_data), tokenizer,
                                          args.calib_samples, args.calib_seq_len)
            names = [name for name, _ in quantizable_linears(model, config)]
            stats = calibrate(model, samples, names)
    count = quantize_linears(model, config, stats, progress=True)
    size = save_checkpoint(model, hf_config, tokenizer, args.out, config)
    generation_config.copy_file(path, args.out)  # (the float model's EOS ids and defaults)
    print(json.dumps({"out": args.out, "method": config.method, "layers": count,
                      "bytes": size, "calibrated": stats is not None,
                      "seconds": round(time.perf_counter() - started, 1)}))
    return 0
