"""Weights from a trainer over a torch.distributed group, as RL trainers send them to SGLang
(`init_weights_update_group`, `update_weights_from_distributed`) and to vLLM (a weight-update
group, then a broadcast per tensor): the engine joins the trainer's group as rank
`rank_offset` (the trainer is rank 0, and hosts the group's TCPStore), and receives each
named tensor the trainer broadcasts. The tensors are staged as a checkpoint (the served
model's config.json and one safetensors file, in a temporary folder) and served through
`sleep_mode.update_weights`: the whole model built again over them, exactly as from disk
(the previous weights keep serving if they do not load: a tensor missing, a wrong shape).
The staged folder is the served checkpoint until the next update (sleep level 2 reloads
from it), then removed.

Bounded before memory is spent: at most `MAX_TENSORS` tensors of the dtypes a trainer sends,
in all at most 8x the served checkpoint's bytes on disk (a float32 copy of int4 weights).
Raw tensor bytes only: nothing is unpickled."""

from __future__ import annotations

import datetime
import logging
import math
import os
import shutil
import tempfile
from typing import Any

import torch
import torch.distributed as dist

from tokenmill.engine import sleep_mode

logger = logging.getLogger(__name__)

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
MAX_TENSORS = 100_000


class WeightGroup:
    def __init__(self, address: str, port: int, rank_offset: int, world_size: int,
                 backend: str, device: torch.device, timeout_s: float = 120.0) -> None:
        if backend not in ("gloo", "nccl"):
            raise ValueError(f"backend must be 'gloo' or 'nccl', got {backend!r}.")
        if not 0 < rank_offset < world_size:
            raise ValueError(f"rank_offset must be in 1 .. world_size - 1 (the trainer is rank "
                             f"0), got {rank_offset} of {world_size}.")
        timeout = datetime.timedelta(seconds=timeout_s)
        try:
            store = dist.TCPStore(address, int(port), None, is_master=False, timeout=timeout)
            if backend == "nccl":
                self.group = dist.ProcessGroupNCCL(store, rank_offset, world_size)
            else:
                from tokenmill.executor.multiproc import local_address_towards

                opts = dist.ProcessGroupGloo._Options()
                opts._devices = [dist.ProcessGroupGloo.create_device(
                    hostname=local_address_towards(address))]
                opts._timeout = timeout
                self.group = dist.ProcessGroupGloo(store, rank_offset, world_size, opts)
        except (RuntimeError, OSError) as exc:
            raise ValueError(f"Could not join the weight-update group at {address}:{port} "
                             f"({type(exc).__name__}): is the trainer's rank 0 there?") from None
        self.device = device if backend == "nccl" else torch.device("cpu")

    def receive(self, names: list[str], dtypes: list[str], shapes: list[list[int]],
                max_bytes: int) -> dict[str, torch.Tensor]:
        """The tensors rank 0 broadcasts, in this order (checked before any is received)."""
        if not (len(names) == len(dtypes) == len(shapes)) or not names:
            raise ValueError("names, dtypes and shapes must be lists of one length (> 0).")
        if len(names) > MAX_TENSORS or len(set(names)) != len(names):
            raise ValueError(f"At most {MAX_TENSORS} tensors, each named once.")
        total = 0
        for name, dtype, shape in zip(names, dtypes, shapes, strict=True):
            if dtype not in DTYPES:
                raise ValueError(f"{name}: dtype must be one of {sorted(DTYPES)}, got "
                                 f"{dtype!r}.")
            if not (isinstance(shape, list) and len(shape) <= 8
                    and all(isinstance(n, int) and n >= 0 for n in shape)):
                raise ValueError(f"{name}: a shape is a list of at most 8 sizes >= 0.")
            total += math.prod(shape) * DTYPES[dtype].itemsize
        if total > max_bytes:
            raise ValueError(f"The tensors hold {total} bytes, more than the {max_bytes} "
                             "allowed (8x the served checkpoint).")
        received = {}
        for name, dtype, shape in zip(names, dtypes, shapes, strict=True):
            tensor = torch.empty(shape, dtype=DTYPES[dtype], device=self.device)
            self.group.broadcast(tensor, 0).wait()
            received[name] = tensor.cpu()
        return received


def init_group(core: Any, options: dict) -> None:
    close_group(core)
    core.weight_group = WeightGroup(options["address"], options["port"],
                                    options["rank_offset"], options["world_size"],
                                    options.get("backend", "gloo"), core.runner.device)
    logger.info("Joined the weight-update group at %s:%s as rank %d of %d",
                options["address"], options["port"], options["rank_offset"],
                options["world_size"])


def close_group(core: Any, options: dict | None = None) -> None:
    core.weight_group = None  # (the group's connections close with it)


def update_from_group(core: Any, options: dict) -> None:
    group = getattr(core, "weight_group", None)
    if group is None:
        raise ValueError("No weight-update group: call init_weights_update_group first.")
    sleep_mode.check_for_update(core)
    served = core.model_config.path
    received = group.receive(options["names"], options["dtypes"], options["shapes"],
                             8 * _checkpoint_bytes(served) + (64 << 20))
    from safetensors.torch import save_file

    staging = tempfile.mkdtemp(prefix="tokenmill-weights-")
    try:
        with open(os.path.join(staging, "config.json"), "w") as f:
            f.write(core.hf_config.to_json_string())
        save_file({k: v.contiguous() for k, v in received.items()},
                  os.path.join(staging, "model.safetensors"))
        del received
        # (a success removes the folder the previous sync staged)
        sleep_mode.update_weights(core, staging, "The tensors received")
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    core.weight_staging = staging


def _checkpoint_bytes(path: str) -> int:
    if os.path.isfile(path):
        return os.path.getsize(path)
    return sum(os.path.getsize(os.path.join(path, name)) for name in os.listdir(path)
               if name.endswith((".safetensors", ".gguf", ".bin")))
