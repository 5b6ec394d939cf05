"""Pre-sharded parallel checkpoints (`tokenmill convert --tp-size N [--pp-size P]`), as
TensorRT-LLM's `rank{i}.safetensors`: one file per rank of a tp_size x pp_size world holding
exactly that rank's parameters (its tensor-parallel slice of its pipeline stage's layers),
under the names and shapes its model has after loading, so the rank copies them in as they
are: no slicing, no reading of other ranks' bytes, and a node of several fetches only its own
ranks' files (hub/download.py).

A folder of them is the source's config.json (without a quantization config: float8 blocks
are written dequantized), its tokenizer and chat template, `rank{i}.safetensors` and
`tokenmill_sharding.json` (the layout; a server with another layout refuses the folder). A
row-parallel layer's file keeps its unsplit rows' absolute maxima too (`*.row_absmax`), so
quantizing at load (`--quantization int8`) gives the scales the whole checkpoint would."""

from __future__ import annotations

import fnmatch
import json
import os
import shutil
from typing import Any

import torch
from safetensors import safe_open
from torch import nn

from tokenmill.hub.download import SMALL  # (configs, tokenizer, template: what travels along)

SHARDING = "tokenmill_sharding.json"
FORMAT = "tokenmill-sharded"
ROW_ABSMAX = ".row_absmax"
_NOT_COPIED = ("model.safetensors.index.json", SHARDING)


def rank_file(rank: int) -> str:
    return f"rank{rank}.safetensors"


def is_sharded(path: str) -> bool:
    return os.path.isfile(os.path.join(path, SHARDING))


def layout(path: str) -> dict[str, Any]:
    with open(os.path.join(path, SHARDING)) as f:
        found = json.load(f)
    if not isinstance(found, dict) or found.get("format") != FORMAT:
        raise ValueError(f"{os.path.join(path, SHARDING)} is not a tokenmill sharding file.")
    return found


def write(model: str, out: str, tp_size: int, pp_size: int = 1, expert_parallel: bool = False,
          dtype: torch.dtype | None = None) -> None:
    """Writes `out` from the float checkpoint `model` (HF folder or GGUF file), one rank at a
    time: the peak memory is one rank's share. `dtype`: the files' (default the source's
    torch_dtype, float32 for GGUF)."""
    from safetensors.torch import save_file

    from tokenmill.distributed.parallel_state import as_rank
    from tokenmill.loader import is_gguf, load_hf_config, load_model
    from tokenmill.quantization import checkpoint_quant_config

    if tp_size < 1 or pp_size < 1 or tp_size * pp_size < 2:
        raise ValueError("--tp-size x --pp-size must be 2 or more ranks.")
    if os.path.exists(out):
        raise ValueError(f"{out} exists; give a new folder.")
    hf_config = load_hf_config(model)
    if checkpoint_quant_config(hf_config) is not None:
        raise ValueError(f"{model} is a quantized tokenmill checkpoint; shard the float "
                         "weights and quantize at load (--quantization).")
    dtype = dtype or _source_dtype(hf_config)
    tmp = out.rstrip("/") + ".tmp"
    shutil.rmtree(tmp, ignore_errors=True)
    os.makedirs(tmp)
    world = tp_size * pp_size
    for rank in range(world):
        with as_rank(rank, tp_size, pp_size, expert_parallel):
            built = load_model(model, hf_config, dtype, torch.device("cpu"), 16,
                               float_weights=True)
            save_file(rank_tensors(built), os.path.join(tmp, rank_file(rank)),
                      metadata={"format": "pt", "rank": str(rank)})
            del built
    _write_config(model, tmp, hf_config, dtype, is_gguf(model))
    with open(os.path.join(tmp, SHARDING), "w") as f:
        json.dump({"format": FORMAT, "version": 1, "tensor_parallel_size": tp_size,
                   "pipeline_parallel_size": pp_size, "enable_expert_parallel": expert_parallel,
                   "dtype": str(dtype).removeprefix("torch."),
                   "files": [rank_file(r) for r in range(world)]}, f, indent=1)
    os.replace(tmp, out)  # (a half-written folder never has the final name)


def rank_tensors(model: nn.Module) -> dict[str, torch.Tensor]:
    """A loaded rank's parameters (before any kernel repacks them) and its row-parallel
    layers' whole-row maxima."""
    from tokenmill.layers.linear import RowParallelLinear

    tensors = {name: p.detach().contiguous() for name, p in model.named_parameters()}
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


def _write_config(model: str, out: str, hf_config: Any, dtype: torch.dtype, gguf: bool) -> None:
    from tokenmill.loader import load_tokenizer

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
    config.pop("quantization_config", None)  # (float8 blocks were written dequantized)
    config["dtype" if "dtype" in config else "torch_dtype"] = str(dtype).removeprefix("torch.")
    with open(os.path.join(out, "config.json"), "w") as f:
        json.dump(config, f, indent=2)


def load_rank(model: nn.Module, path: str) -> set[str]:
    """Copies this rank's file into `model` (built for this process's place in its world);
    returns the parameter names loaded. A folder sharded for another layout, a missing file
    or a tensor the model lacks is a clear error."""
    from tokenmill.distributed.parallel_state import get_tp_group, get_world
    from tokenmill.layers.linear import RowParallelLinear

    found, world, tp = layout(path), get_world(), get_tp_group()
    want = (found.get("tensor_parallel_size"), found.get("pipeline_parallel_size"),
            bool(found.get("enable_expert_parallel")))
    if want != (world.tp_size, world.pp_size, tp.expert_parallel):
        ep = " --enable-expert-parallel" if want[2] else ""
        raise ValueError(f"{path} is sharded for {want[0]} tensor-parallel x {want[1]} pipeline "
                         f"ranks{ep}: serve it with --tensor-parallel-size {want[0]} "
                         f"--pipeline-parallel-size {want[1]}{ep}, or shard the original "
                         "checkpoint again (tokenmill convert --tp-size).")
    file = os.path.join(path, rank_file(world.rank))
    if not os.path.isfile(file):
        raise ValueError(f"{file} is missing: each rank loads its own file (a node fetches "
                         "only its ranks': check the download's --nnodes / --node-rank).")
    params = dict(model.named_parameters())
    rows = {name: m for name, m in model.named_modules() if isinstance(m, RowParallelLinear)}
    loaded: set[str] = set()
    with safe_open(file, framework="pt") as f:
        for name in list(f.keys()):  # (safe_open is not iterable)
            if name.endswith(ROW_ABSMAX) and name[:-len(ROW_ABSMAX)] in rows:
                rows[name[:-len(ROW_ABSMAX)]].row_absmax = f.get_tensor(name).float()
                continue
            param = params.get(name)
            tensor = f.get_tensor(name)
            if param is None or param.shape != tensor.shape:
                what = "matches no parameter" if param is None else \
                    f"has shape {tuple(tensor.shape)}, expected {tuple(param.shape)}"
                raise ValueError(f"{file}: tensor {name!r} {what} (written by another "
                                 "tokenmill version or for another model).")
            param.data.copy_(tensor)
            loaded.add(name)
    return loaded
