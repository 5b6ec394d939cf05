"""The parallel groups of this process (torch.distributed's gloo on CPU, NCCL on CUDA): the
`World` of every rank of the engine (step broadcast, pipeline hand-offs) and the
`TensorParallelGroup` of this rank's pipeline stage (the parallel layers' sums and gathers).

A process joins once, before it builds a model (`init_parallel`); layers read the groups when
they are constructed (to size their shards) and keep them. A process that never joins is rank
0 of a world of one, where every collective is the identity.

The gloo backend is built directly (not through `init_process_group`) so that it listens on
the address this rank was given: 127.0.0.1 for ranks of one machine, the node's own address
across nodes; never on every interface."""

from __future__ import annotations

import contextlib
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
    backend: Any = None  # a torch.distributed ProcessGroupGloo / NCCL (None: a group of one)
    device: torch.device = torch.device("cpu")  # noqa: RUF009 - where collectives' tensors live
    shm: Any = None  # ShmAllReduce of ranks on one node (CPU float32 sums), else the backend's
    expert_parallel: bool = False  # MoE layers: whole experts per rank (layers/moe.py)
    # on GPUs: a gloo group of the same ranks for the host's bytes (a step's inputs), so
    # sending them never waits for the device (NCCL's length would be read with .item())
    host: Any = None

    @property
    def is_first(self) -> bool:
        return self.rank == 0

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """Sum of `x` over the ranks, in place (the same inputs give the same bits on every
        run: gloo's ring and the shared-memory sum both add in a fixed order)."""
        if self.size == 1:
            return x
        if self.shm is not None and self.shm.supports(x):
            return self.shm(x)
        self.backend.allreduce([x]).wait()
        return x

    def all_reduce_min(self, value: int) -> int:
        return _all_reduce_min(self.backend, self.size, value, self.device)

    def broadcast_bytes(self, data: bytes | None) -> bytes:
        """Rank 0's `data` on every rank of the group (others pass None): one small length
        message, then the bytes. Only bytes travel, never pickles: the receiver decodes them
        with msgspec."""
        if self.size == 1:
            assert data is not None
            return data
        backend, device = (self.host, _CPU) if self.host is not None else (self.backend,
                                                                            self.device)
        length = torch.tensor([len(data) if self.is_first else 0], dtype=torch.int64,
                              device=device)
        backend.broadcast(length, 0).wait()
        if not length.item():
            return b""
        if self.is_first:
            buffer = torch.frombuffer(bytearray(data), dtype=torch.uint8).to(device)
        else:
            buffer = torch.empty(int(length.item()), dtype=torch.uint8, device=device)
        backend.broadcast(buffer, 0).wait()
        return data if self.is_first else buffer.cpu().numpy().tobytes()

    def broadcast(self, x: torch.Tensor) -> torch.Tensor:
        """Rank 0's `x` into every rank's `x` (same shape and dtype), in place; on GPUs
        ordered on the stream, the host not waiting."""
        if self.size > 1:
            self.backend.broadcast(x, 0).wait()
        return x

    def gather_last_dim(self, x: torch.Tensor) -> torch.Tensor | None:
        """Every rank's `x` side by side along the last dimension, on rank 0 only (None on the
        others): the vocabulary shards of the logits meet once, where the sampler runs."""
        if self.size == 1:
            return x
        x = x.contiguous()
        parts = [torch.empty_like(x) for _ in range(self.size)] if self.is_first else []
        opts = dist.GatherOptions()
        opts.rootRank = 0
        self.backend.gather([parts] if self.is_first else [], [x], opts).wait()
        return torch.cat(parts, dim=-1) if self.is_first else None


@dataclass(frozen=True)
class World:
    """Every rank of the engine, tensor-parallel size x pipeline stages: rank = stage x
    tp_size + tp_rank. Rank 0 (stage 0) schedules and samples; it broadcasts each step's
    inputs to its stage, and stage s hands them on with its hidden states to stage s + 1
    (same tp rank); the last stage's logits come back to rank 0 (distributed/pipeline.py)."""

    rank: int = 0
    tp_size: int = 1
    pp_size: int = 1
    backend: Any = None  # every rank's (None: a world of one)
    store: Any = None  # the rendezvous store (kept alive: rank 0's serves the others)
    device: torch.device = torch.device("cpu")  # noqa: RUF009

    @property
    def size(self) -> int:
        return self.tp_size * self.pp_size

    @property
    def stage(self) -> int:
        return self.rank // self.tp_size

    @property
    def is_first_stage(self) -> bool:
        return self.stage == 0

    @property
    def is_last_stage(self) -> bool:
        return self.stage == self.pp_size - 1

    def peer(self, stage: int) -> int:
        """The rank of `stage` with this rank's tensor-parallel index."""
        return stage * self.tp_size + self.rank % self.tp_size

    def layers(self, num_layers: int, head_cost: float = 0.0) -> range:
        """This stage's decoder layers: shares of equal work, where the last stage's LM head
        costs `head_cost` layers (the slowest stage sets a pipeline's pace); every stage at
        least one layer."""
        if num_layers < self.pp_size:
            raise ValueError(f"--pipeline-parallel-size {self.pp_size} exceeds the model's "
                             f"{num_layers} layers.")
        share = (num_layers + head_cost) / self.pp_size
        bounds = [0]
        for stage in range(1, self.pp_size):
            end = round(stage * share)
            bounds.append(min(max(end, bounds[-1] + 1), num_layers - (self.pp_size - stage)))
        bounds.append(num_layers)
        return range(bounds[self.stage], bounds[self.stage + 1])

    def all_reduce_min(self, value: int) -> int:
        return _all_reduce_min(self.backend, self.size, value, self.device)

    def isend(self, tensors: list[torch.Tensor], dst: int, tag: int = 0) -> list[Any]:
        """Start sending `tensors` (contiguous; kept alive by the caller until the returned
        works are waited on) to rank `dst`, in order."""
        return [self.backend.send([t], dst, tag) for t in tensors]

    def irecv(self, tensors: list[torch.Tensor], src: int, tag: int = 0) -> list[Any]:
        """Start receiving into `tensors` from rank `src`, in order."""
        return [self.backend.recv([t], src, tag) for t in tensors]

    def recv(self, tensors: list[torch.Tensor], src: int, tag: int = 0) -> list[torch.Tensor]:
        for work in self.irecv(tensors, src, tag):
            work.wait()
        return tensors


def _all_reduce_min(backend: Any, size: int, value: int, device: torch.device) -> int:
    if size == 1:
        return value
    t = torch.tensor([value], dtype=torch.int64, device=device)
    opts = dist.AllreduceOptions()
    opts.reduceOp = dist.ReduceOp.MIN
    backend.allreduce([t], opts).wait()
    return int(t.item())


class RanksMissing(TimeoutError):
    def __init__(self, message: str, missing: list[int]) -> None:
        super().__init__(message)
        self.missing = missing


_GROUP = TensorParallelGroup()
_WORLD = World()
_CPU = torch.device("cpu")
# Collectives wait this long: a worker rank idles in its wait for the next step for as long as
# the server idles. A rank that stalls is caught by the engine's liveness rule, and one that
# dies by its peers' closed connections, not by this timeout.
_OP_TIMEOUT = datetime.timedelta(days=3650)


def get_tp_group() -> TensorParallelGroup:
    return _GROUP


@contextlib.contextmanager
def as_rank(rank: int = 0, tp_size: int = 1, pp_size: int = 1, expert_parallel: bool = False):
    """Layers built inside are those of `rank` of a tp_size x pp_size world, without joining
    one (no collectives: nothing may run them). A world of one: a speculative draft model that
    rank 0 runs alone beside a tensor-parallel target (`single_rank`); any rank: the shard
    files `tokenmill convert --tp-size` writes, one rank after another in one process."""
    global _GROUP, _WORLD
    saved = _GROUP, _WORLD
    _GROUP = TensorParallelGroup(rank % tp_size, tp_size, expert_parallel=expert_parallel)
    _WORLD = World(rank, tp_size, pp_size)
    try:
        yield
    finally:
        _GROUP, _WORLD = saved


def single_rank():
    """Layers built inside see a world of one rank (whole weights, no collectives)."""
    return as_rank()


def get_world() -> World:
    return _WORLD


def init_parallel(rank: int, tp_size: int, rendezvous: str, timeout_s: float,
                  device: torch.device = _CPU, shm_paths: list[str] | None = None,
                  host: str = "127.0.0.1", pp_size: int = 1,
                  expert_parallel: bool = False) -> World:
    """Join the engine's tp_size x pp_size ranks as `rank`, meeting at `rendezvous`:
    file:///path (ranks of one machine: no socket) or tcp://addr:port (rank 0 serves the
    store there, listening on that address only). `host`: the address this rank's gloo
    connections listen on. Blocks until every rank has joined; past `timeout_s`, fails
    naming the ranks that did not. `shm_paths`: per stage, the shared-memory all-reduce
    segment rank 0 made (ranks of one machine). Once per process."""
    global _GROUP, _WORLD
    if _WORLD.size > 1:
        raise RuntimeError("This process already belongs to a tensor-parallel group.")
    size = tp_size * pp_size
    if size == 1:
        return _WORLD
    timeout = datetime.timedelta(seconds=timeout_s)
    store = _store(rendezvous, rank, size, timeout)
    store.set(f"joined/{rank}", "1")
    keys = [f"joined/{r}" for r in range(size)]
    try:
        store.wait(keys, timeout)
    except RuntimeError:
        missing = [r for r, key in enumerate(keys) if not store.check([key])]
        raise RanksMissing(f"tensor-parallel rank(s) {missing} did not join within "
                           f"{timeout_s:g} s (--distributed-timeout).", missing) from None
    cuda = device.type == "cuda"
    if cuda:
        torch.cuda.set_device(device)  # NCCL's communicator: this rank's GPU
    device = device if cuda else _CPU
    world = _backend(dist.PrefixStore("world", store), rank, size, cuda, host)
    _WORLD = World(rank, tp_size, pp_size, world, store, device)
    stage, tp_rank = divmod(rank, tp_size)
    tp = world if pp_size == 1 else _backend(dist.PrefixStore(f"tp{stage}", store), tp_rank,
                                             tp_size, cuda, host)
    host_group = (_backend(dist.PrefixStore(f"host{stage}", store), tp_rank, tp_size, False,
                           host) if cuda else None)
    _GROUP = TensorParallelGroup(tp_rank, tp_size, tp, device,
                                 expert_parallel=expert_parallel, host=host_group)
    path = shm_paths[stage] if shm_paths else None
    shm = _attach_shm(path, tp_rank, tp_size) if tp_size > 1 and not cuda else None
    if shm is not None:
        _GROUP = dataclasses.replace(_GROUP, shm=shm)
    logger.info("Rank %d of %d joined: stage %d of %d, tensor-parallel rank %d of %d (%s%s)",
                rank, size, stage, pp_size, tp_rank, tp_size,
                "nccl" if cuda else f"gloo on {host}",
                " + shared-memory all-reduce" if shm is not None else "")
    return _WORLD


def _backend(store: Any, rank: int, size: int, cuda: bool, host: str) -> Any:
    if cuda:
        return dist.ProcessGroupNCCL(store, rank, size)
    opts = dist.ProcessGroupGloo._Options()
    opts._devices = [dist.ProcessGroupGloo.create_device(hostname=host)]
    opts._timeout = _OP_TIMEOUT
    return dist.ProcessGroupGloo(store, rank, size, opts)


def _store(rendezvous: str, rank: int, size: int, timeout: datetime.timedelta):
    if rendezvous.startswith("file://"):
        store = dist.FileStore(rendezvous.removeprefix("file://"), size)
        store.set_timeout(timeout)
        return store
    addr, _, port = rendezvous.removeprefix("tcp://").rpartition(":")
    if rank != 0:
        return dist.TCPStore(addr, int(port), None, is_master=False, timeout=timeout)
    listener = socket.socket(socket.AF_INET6 if ":" in addr else socket.AF_INET)
    listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        listener.bind((addr, int(port)))
    except OSError as exc:
        listener.close()
        raise OSError(f"PORT: {port} occupied! Please change the port! (the tensor-parallel "
                      f"rendezvous on {addr}, --master-port: {exc.strerror})") from None
    listener.listen(128)
    store = dist.TCPStore(addr, int(port), size, is_master=True, timeout=timeout,
                          wait_for_workers=False, master_listen_fd=listener.fileno())
    listener.detach()  # the store owns the socket now
    return store


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


def destroy_parallel() -> None:
    global _GROUP, _WORLD
    _GROUP, _WORLD = TensorParallelGroup(), World()


def divide(total: int, parts: int, what: str) -> int:
    if total % parts:
        raise ValueError(f"tensor parallel size {parts} (--tensor-parallel-size / MP_NUM) must "
                         f"divide the model's {what} ({total}).")
    return total // parts
