"""Pre-sharded parallel checkpoints (`tokenmill convert --tp-size N [--pp-size P]`), as
TensorRT-LLM's `rank{i}.safetensors`: one file per rank of a tp_size x pp_size world holding
exactly that rank's parameters (its tensor-parallel slice of its pipeline stage's layers),
under the names and shapes its model has after loading, so the rank copies them in as they
are: no slicing, no reading of other ranks' bytes, and a node of several fetches only its own
ranks' files (hub/download.py).

A folder of them is the source's config.json, its tokenizer and chat template,
`rank{i}.safetensors` and `tokenmill_sharding.json` (the layout; a server with another layout
refuses the folder). A row-parallel layer's file keeps its unsplit rows' absolute maxima too
(`*.row_absmax`), so quantizing at load (`--quantization int8`) gives the scales the whole
checkpoint would.

A block-FP8 source (DeepSeek-R1) keeps its float8 weights (half of bf16's bytes): a layer
`Fp8BlockKernel` serves is written as its tensors (`X.qweight` float8, `X.scale` a float32
factor per row and group of inputs) and the config keeps its quantization config; a rank
serves them as float8 or dequantizes them, as TOKENMILL_FP8_BLOCKS says for its device.
TOKENMILL_FP8_BLOCKS=dequantize when converting writes float weights instead (which
`--quantization` can quantize at load: float8 files lack the whole rows' maxima)."""

from __future__ import annotations

import fnmatch
import json
import os
import shutil
from typing import Any

import torch
from torch import nn

from tokenmill.hub.download import SMALL  # (configs, tokenizer, template: what travels along)
from tokenmill.loading.sharded import FORMAT, ROW_ABSMAX, SHARDING, rank_file

_NOT_COPIED = ("model.safetensors.index.json", SHARDING)


def write(model: str, out: str, tp_size: int, pp_size: int = 1, expert_parallel: bool = False,
          dtype: torch.dtype | None = None) -> None:
    """Writes `out` from the float checkpoint `model` (HF folder or GGUF file), one rank at a
    time: the peak memory is one rank's share. `dtype`: the files' (default the source's
    torch_dtype, float32 for GGUF)."""
    from safetensors.torch import save_file

    from tokenmill.config import kernels as kernel_switches
    from tokenmill.config.quantization import checkpoint_quant_config
    from tokenmill.distributed.parallel_state import as_rank
    from tokenmill.loading.checkpoint import is_gguf, load_hf_config, load_model
    from tokenmill.quantization import fp8_blocks

    if tp_size < 1 or pp_size < 1 or tp_size * pp_size < 2:
        raise ValueError("--tp-size x --pp-size must be 2 or more ranks.")
    if os.path.exists(out):
        raise ValueError(f"{out} exists; give a new folder.")
    hf_config = load_hf_config(model)
    if checkpoint_quant_config(hf_config) is not None:
        raise ValueError(f"{model} is a quantized tokenmill checkpoint; shard the float "
                         "weights and quantize at load (--quantization).")
    dtype = dtype or _source_dtype(hf_config)
    keep_fp8 = fp8_blocks.block_size(hf_config) is not None \
        and kernel_switches.current().gpu.fp8_blocks_in_files()
    tmp = out.rstrip("/") + ".tmp"
    shutil.rmtree(tmp, ignore_errors=True)
    os.makedirs(tmp)
    world = tp_size * pp_size
    for rank in range(world):
        with as_rank(rank, tp_size, pp_size, expert_parallel):
            # (stage 0's file has the LM head too: draft heads may run there)
            built = load_model(model, hf_config, dtype, torch.device("cpu"), 16,
                               float_weights=True, keep_fp8=keep_fp8, head_on_first_stage=True)
            save_file(rank_tensors(built), os.path.join(tmp, rank_file(rank)),
                      metadata={"format": "pt", "rank": str(rank)})
            del built
    _write_config(model, tmp, hf_config, dtype, is_gguf(model), keep_fp8)
    with open(os.path.join(tmp, SHARDING), "w") as f:
        json.dump({"format": FORMAT, "version": 1, "tensor_parallel_size": tp_size,
                   "pipeline_parallel_size": pp_size, "enable_expert_parallel": expert_parallel,
                   "dtype": str(dtype).removeprefix("torch."), "fp8_blocks": keep_fp8,
                   "files": [rank_file(r) for r in range(world)]}, f, indent=1)
    os.replace(tmp, out)  # (a half-written folder never has the final name)


def rank_tensors(model: nn.Module) -> dict[str, torch.Tensor]:
    """A loaded rank's parameters (before any kernel repacks them), its float8 layers'
    kernel tensors and its row-parallel layers' whole-row maxima."""
    from tokenmill.layers.linear import RowParallelLinear
    from tokenmill.quantization.model import quantized_state_dict

    tensors = quantized_state_dict(model)  # (float8 layers: Fp8BlockKernel's only kernels)
    for name, module in model.named_modules():
        if isinstance(module, RowParallelLinear) and module.row_absmax is not None:
            tensors[name + ROW_ABSMAX] = module.row_absmax.contiguous()
    return tensors


def _source_dtype(hf_config: Any) -> torch.dtype:
    found = getattr(hf_config, "torch_dtype", None) or getattr(hf_config, "dtype", None)
    if isinstance(found, str):
        found = getattr(torch, found, None)
    return found if isinstance(found, torch.dtype) and found.is_floating_point \
        and found.itemsize >= 2 else torch.float32


def _write_config(model: str, out: str, hf_config: Any, dtype: torch.dtype, gguf: bool,
                  fp8: bool) -> None:
    from tokenmill.loading.checkpoint import load_tokenizer

    if gguf:
        hf_config.save_pretrained(out)
        load_tokenizer(model).save_pretrained(out)
    else:
        for name in sorted(os.listdir(model)):
            if os.path.isfile(os.path.join(model, name)) and not name.startswith(".") \
                    and name not in _NOT_COPIED \
                    and any(fnmatch.fnmatch(name, p) for p in SMALL):
                shutil.copyfile(os.path.join(model, name), os.path.join(out, name))
    with open(os.path.join(out, "config.json")) as f:
        config = json.load(f)
    if not fp8:  # (float8 blocks were written dequantized)
        config.pop("quantization_config", None)
    config["dtype" if "dtype" in config else "torch_dtype"] = str(dtype).removeprefix("torch.")
    with open(os.path.join(out, "config.json"), "w") as f:
        json.dump(config, f, indent=2)
