"""The tensor-parallel group of this process: its rank and size, and the collectives the
parallel layers and the step broadcast use (torch.distributed: gloo on CPU, NCCL on CUDA).

A process joins at most one group, once, before it builds a model (`init_tensor_parallel`);
layers read it when they are constructed (to size their shards) and keep it. A process that
never joins one is rank 0 of a group of one, where every collective is the identity."""

from __future__ import annotations

import dataclasses
import datetime
import logging
import os
import socket
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class TensorParallelGroup:
    rank: int = 0
    size: int = 1
    group: Any = None  # the torch.distributed process group (None: a group of one)
    device: torch.device = torch.device("cpu")  # noqa: RUF009 - where collectives' tensors live
    shm: Any = None  # ShmAllReduce of ranks on one node (CPU float32 sums), else gloo/NCCL

    @property
    def is_first(self) -> bool:
        return self.rank == 0

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """Sum of `x` over the ranks, in place (gloo's ring order is fixed, so the same inputs
        give the same bits on every run)."""
        if self.size == 1:
            return x
        if self.shm is not None and self.shm.supports(x):
            return self.shm(x)
        dist.all_reduce(x, group=self.group)
        return x

    def all_reduce_min(self, value: int) -> int:
        if self.size == 1:
            return value
        t = torch.tensor([value], dtype=torch.int64, device=self.device)
        dist.all_reduce(t, op=dist.ReduceOp.MIN, group=self.group)
        return int(t.item())

    def gather_last_dim(self, x: torch.Tensor) -> torch.Tensor | None:
        """Every rank's `x` side by side along the last dimension, on rank 0 only (None on the
        others): the vocabulary shards of the logits meet once, where the sampler runs."""
        if self.size == 1:
            return x
        x = x.contiguous()
        parts = [torch.empty_like(x) for _ in range(self.size)] if self.is_first else None
        dist.gather(x, parts, dst=self._global(0), group=self.group)
        return torch.cat(parts, dim=-1) if self.is_first else None

    def broadcast_bytes(self, data: bytes | None) -> bytes:
        """Rank 0's `data` on every rank (others pass None): one small length message, then
        the bytes. Only bytes travel, never pickles: the receiver decodes them with msgspec."""
        if self.size == 1:
            assert data is not None
            return data
        length = torch.tensor([len(data) if self.is_first else 0], dtype=torch.int64,
                              device=self.device)
        dist.broadcast(length, src=self._global(0), group=self.group)
        if not length.item():
            return b""
        if self.is_first:
            buffer = torch.frombuffer(bytearray(data), dtype=torch.uint8).to(self.device)
        else:
            buffer = torch.empty(int(length.item()), dtype=torch.uint8, device=self.device)
        dist.broadcast(buffer, src=self._global(0), group=self.group)
        return data if self.is_first else buffer.cpu().numpy().tobytes()

    def _global(self, rank: int) -> int:
        return dist.get_global_rank(self.group, rank) if self.group is not None else rank


_GROUP = TensorParallelGroup()


def get_tp_group() -> TensorParallelGroup:
    return _GROUP


_CPU = torch.device("cpu")


# Collectives wait this long: a worker rank idles in its wait for the next step for as long as
# the server idles. A rank that stalls is caught by the engine's liveness rule, and one that
# dies by its peers' closed connections, not by this timeout.
_OP_TIMEOUT = datetime.timedelta(days=3650)


def init_tensor_parallel(rank: int, size: int, rendezvous: str, timeout_s: float,
                         device: torch.device = _CPU,
                         shm_path: str | None = None) -> TensorParallelGroup:
    """Join the `size`-rank group as `rank`, meeting at `rendezvous`: file:///path (ranks on
    one node: no socket, and gloo kept on the loopback interface) or tcp://host:port (node
    0's store). Blocks until every rank has joined; past `timeout_s`, fails naming the ranks
    that did not. `shm_path`: the shared-memory all-reduce segment rank 0 made (ranks on one
    node). Once per process."""
    global _GROUP
    if _GROUP.size > 1 or dist.is_initialized():
        raise RuntimeError("This process already belongs to a tensor-parallel group.")
    if size == 1:
        return _GROUP
    timeout = datetime.timedelta(seconds=timeout_s)
    if rendezvous.startswith("file://"):
        store = dist.FileStore(rendezvous.removeprefix("file://"), size)
        store.set_timeout(timeout)
        interface = _loopback_interface()
        if interface is not None:
            os.environ.setdefault("GLOO_SOCKET_IFNAME", interface)
    else:
        host, _, port = rendezvous.removeprefix("tcp://").rpartition(":")
        store = dist.TCPStore(host, int(port), size, is_master=rank == 0, timeout=timeout,
                              wait_for_workers=False)
    store.set(f"joined/{rank}", "1")
    keys = [f"joined/{r}" for r in range(size)]
    try:
        store.wait(keys, timeout)
    except RuntimeError:
        missing = [r for r, key in enumerate(keys) if not store.check([key])]
        raise TimeoutError(f"tensor-parallel rank(s) {missing} did not join within "
                           f"{timeout_s:g} s (--distributed-timeout).") from None
    backend = "nccl" if device.type == "cuda" else "gloo"
    dist.init_process_group(backend, store=store, rank=rank, world_size=size,
                            timeout=_OP_TIMEOUT)
    _GROUP = TensorParallelGroup(rank, size, dist.group.WORLD,
                                 device if backend == "nccl" else _CPU)
    shm = _attach_shm(shm_path, rank, size) if backend == "gloo" else None
    if shm is not None:
        _GROUP = dataclasses.replace(_GROUP, shm=shm)
    logger.info("Tensor-parallel rank %d of %d joined (%s%s)", rank, size, backend,
                " + shared-memory all-reduce" if shm is not None else "")
    return _GROUP


def _attach_shm(path: str | None, rank: int, size: int):
    """Every rank maps the segment, or none uses it; then rank 0 unlinks its name."""
    from tokenmill.distributed.shm_allreduce import ShmAllReduce

    shm = None
    if path is not None:
        try:
            shm = ShmAllReduce(path, rank, size)
        except (OSError, RuntimeError) as exc:
            logger.warning("rank %d cannot map the shared-memory all-reduce (%s)", rank, exc)
    everyone = _GROUP.all_reduce_min(int(shm is not None))
    if rank == 0 and path is not None:
        os.unlink(path)
    return shm if everyone else None


def _loopback_interface() -> str | None:
    names = {name for _, name in socket.if_nameindex()}
    return next((n for n in ("lo", "lo0") if n in names), None)


def destroy_tensor_parallel() -> None:
    global _GROUP
    if dist.is_initialized():
        dist.destroy_process_group()
    _GROUP = TensorParallelGroup()


def divide(total: int, parts: int, what: str) -> int:
    if total % parts:
        raise ValueError(f"tensor parallel size {parts} (--tensor-parallel-size / MP_NUM) must "
                         f"divide the model's {what} ({total}).")
    return total // parts
