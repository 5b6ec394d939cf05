"""Pre-sharded parallel checkpoints, the read side: a folder's layout (`tokenmill_sharding.json`)
and one rank's file (`rank{i}.safetensors`) copied into the model built for that rank. The
files hold each rank's parameters under the names and shapes its model has after loading, so
nothing is sliced at load; convert/sharded.py writes them (the format is described there)."""

from __future__ import annotations

import json
import os
from typing import Any

import torch
from safetensors import safe_open
from torch import nn

from tokenmill.loading.file_checks import check_safetensors

SHARDING = "tokenmill_sharding.json"
FORMAT = "tokenmill-sharded"
ROW_ABSMAX = ".row_absmax"


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


def load_rank(model: nn.Module, path: str, keep_fp8: bool = False) -> set[str]:
    """Copies this rank's file into `model` (built for this process's place in its world);
    returns the parameter names loaded. Float8 layers get `Fp8BlockKernel` (`keep_fp8`) or
    their float weights. A folder sharded for another layout, a missing file or a tensor the
    model lacks is a clear error; tensors it leaves unread by choice (`unread`: DeepSeek's MTP
    layers when not speculating with them, an LM head stage 0 keeps for draft heads) are
    skipped."""
    from tokenmill.distributed.parallel_state import get_tp_group, get_world
    from tokenmill.layers.linear import Linear, RowParallelLinear, writable

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
    linears = {name: m for name, m in model.named_modules() if isinstance(m, Linear)}
    loaded: set[str] = set()
    fp8: dict[str, dict[str, torch.Tensor]] = {}  # layer -> qweight / scale
    check_safetensors(file)
    with safe_open(file, framework="pt") as f:
        for name in list(f.keys()):  # (safe_open is not iterable)
            layer, _, leaf = name.rpartition(".")
            if name.endswith(ROW_ABSMAX) and isinstance(linears.get(layer), RowParallelLinear):
                linears[layer].row_absmax = f.get_tensor(name).float()
                continue
            if leaf in _FP8_LEAVES and layer in linears:
                fp8.setdefault(layer, {})[leaf] = f.get_tensor(name)
                continue
            param = params.get(name)
            if param is None and model.unread(name):  # (e.g. MTP layers not speculated with)
                continue
            tensor = f.get_tensor(name)
            if param is None or param.shape != tensor.shape:
                _foreign(file, name, tensor, param)
            writable(model, name, param).data.copy_(tensor)  # (float8 kept: linears deferred)
            loaded.add(name)
    for layer, tensors in fp8.items():
        _load_fp8(linears[layer], tensors, keep_fp8, file, layer)
        loaded.add(f"{layer}.weight")
    return loaded


_FP8_LEAVES = ("qweight", "scale")


def _foreign(file: str, name: str, tensor: torch.Tensor, param) -> None:
    what = "matches no parameter" if param is None else \
        f"has shape {tuple(tensor.shape)}, expected {tuple(param.shape)}"
    raise ValueError(f"{file}: tensor {name!r} {what} (written by another tokenmill version "
                     "or for another model).")


def _load_fp8(layer, tensors: dict[str, torch.Tensor], keep: bool, file: str,
              name: str) -> None:
    """A float8 layer's kernel tensors, served as they are (`keep`) or as float weights."""
    from tokenmill.layers.linear import materialized
    from tokenmill.quantization.fp8_blocks import Fp8BlockKernel

    q, scale = tensors.get("qweight"), tensors.get("scale")
    shape = tuple(layer.weight.shape)
    if q is None or scale is None or q.dtype != torch.float8_e4m3fn or tuple(q.shape) != shape \
            or scale.dim() != 2 or scale.shape[0] != shape[0] or scale.shape[1] == 0 \
            or shape[1] % scale.shape[1]:
        got = {leaf: (str(t.dtype).removeprefix("torch."), tuple(t.shape))
               for leaf, t in tensors.items()}
        raise ValueError(f"{file}: layer {name!r} has float8 tensors {got}, expected a "
                         f"float8_e4m3fn qweight of {shape} and its scale per row and group "
                         "(written by another tokenmill version or for another model).")
    if keep:
        layer.use_kernel(Fp8BlockKernel({"qweight": q.to(layer.device),
                                         "scale": scale.float().to(layer.device)}))
    else:
        weight = materialized(layer)
        weight.data.copy_(Fp8BlockKernel({"qweight": q, "scale": scale.float()}).dequantize())
