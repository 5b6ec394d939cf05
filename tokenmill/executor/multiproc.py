"""Starting the tensor-parallel ranks of one engine: rank 0 is the engine core's own process
(it schedules, broadcasts each step and samples); the other ranks of its node are worker
processes (`--distributed-executor-backend mp`), each running `tokenmill.executor.worker`.
On other nodes `tokenmill serve --node-rank N` starts that node's ranks and waits for them
(`serve_other_node`)."""

from __future__ import annotations

import contextlib
import logging
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import threading
import time

import msgspec

from tokenmill.config.engine import EngineConfig
from tokenmill.config.model import ModelConfig
from tokenmill.distributed.parallel_state import RanksMissing, get_tp_group, get_world
from tokenmill.distributed.shm_allreduce import create_segment
from tokenmill.executor.worker import WorkerSpec

logger = logging.getLogger(__name__)
# A node other than 0 silent this long counts as dead (its agent beats every second).
NODE_SILENCE_S = 15.0


def threads_per_rank(config: EngineConfig) -> int:
    """This node's cores shared out among its ranks of every data-parallel replica: one
    rank's threads never compete with another's."""
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    return max(1, (cores or 1) // config.ranks_on_machine)


def join_as_rank0(group, config: EngineConfig, shm_paths: list[str] | None = None) -> None:
    """Make this process rank 0 of `group`'s ranks (a WorkerGroup or RayWorkerGroup: its
    init_method, host, kill, exits); blocks until every rank has joined. On failure the
    group's workers are killed and the error names the missing ranks (and nodes) and how
    workers exited."""
    from tokenmill.distributed.parallel_state import init_parallel
    from tokenmill.platforms import resolve_device

    try:
        init_parallel(0, config.tensor_parallel_size, group.init_method,
                      config.distributed_timeout,
                      resolve_device(config.device, 0, config.ranks_per_node), shm_paths,
                      group.host, config.pipeline_parallel_size,
                      config.enable_expert_parallel)
    except Exception as exc:
        group.kill()
        nodes = ""
        if isinstance(exc, RanksMissing) and config.nnodes > 1:
            nodes = f" Node(s) {sorted({r // config.ranks_per_node for r in exc.missing})} " \
                    "never joined."
        exits = group.exits()
        raise RuntimeError(f"Tensor-parallel start-up failed: {exc}{nodes}"
                           + (f" ({exits})" if exits else "")) from None


def local_address_towards(addr: str) -> str:
    """This machine's address on the route to `addr` (a UDP connect sends nothing)."""
    with socket.socket(socket.AF_INET6 if ":" in addr else socket.AF_INET,
                       socket.SOCK_DGRAM) as s:
        s.connect((addr, 9))
        return s.getsockname()[0]


class WorkerGroup:
    """This node's worker ranks as child processes: ranks 1 .. of node 0, where `join` makes
    this process rank 0, or all ranks of another node.

    A worker that dies is noticed by a watcher thread: in the engine-core process
    (`exit_on_death`) that ends this process too, so the server's engine-death policy takes
    over; in-process (offline `LLM`), rank 0's next collective fails with gloo's error."""

    def __init__(self, config: EngineConfig, model: ModelConfig, exit_on_death: bool) -> None:
        per_node = config.ranks_per_node
        first = config.node_rank * per_node
        self._dir = tempfile.mkdtemp(prefix="tokenmill-tp-")
        if config.nnodes == 1:
            # Ranks of one machine meet through a file in a private directory (no socket) and
            # add their partial sums in shared memory.
            self.init_method = f"file://{self._dir}/rendezvous"
            self.host = "127.0.0.1"
            tp, cpu = config.tensor_parallel_size, config.device in ("auto", "cpu")
            made = [create_segment(tp) for _ in range(config.pipeline_parallel_size)]
            self.shm_paths = made if cpu and tp > 1 and all(made) else None
            for path in made if self.shm_paths is None else []:
                if path is not None:
                    os.unlink(path)
        else:
            self.init_method = f"tcp://{config.master_addr}:{config.master_port}"
            self.host = config.node_addr or local_address_towards(config.master_addr)
            self.shm_paths = None
        self.threads = threads_per_rank(config)
        self.procs: list[subprocess.Popen] = []
        self.ranks = [r for r in range(first, first + per_node) if r != 0]
        self._stopping = False
        for rank in self.ranks:
            spec = WorkerSpec(config, model.path, model.max_model_len, rank, self.init_method,
                              self.threads, parent_pid=os.getpid(), shm_paths=self.shm_paths,
                              host=self.host)
            proc = subprocess.Popen([sys.executable, "-m", "tokenmill.executor.worker"],
                                    stdin=subprocess.PIPE)
            proc.stdin.write(msgspec.json.encode(spec) + b"\n")
            proc.stdin.close()
            self.procs.append(proc)
        self._exit_on_death = exit_on_death
        threading.Thread(target=self._watch, name="tokenmill-worker-watch", daemon=True).start()

    def join(self, config: EngineConfig) -> None:
        """Join the group as rank 0 (blocks until every worker has joined)."""
        import torch

        torch.set_num_threads(self.threads)
        join_as_rank0(self, config, self.shm_paths)
        if config.nnodes > 1:
            threading.Thread(target=self._watch_nodes, args=(config.nnodes,),
                             name="tokenmill-node-watch", daemon=True).start()

    def exits(self, wait_s: float = 0.0) -> str:
        """Which workers have exited, and how ('' while all run); `wait_s`: how long to
        look for one (a peer's dropped connection shows before its exit can be read, and
        `Popen.poll` answers None while the watching thread reaps)."""
        deadline = time.monotonic() + wait_s
        while True:
            dead = ", ".join(f"rank {rank} exited with code {p.returncode}"
                             for rank, p in zip(self.ranks, self.procs)
                             if p.returncode is not None or p.poll() is not None)
            if dead or time.monotonic() >= deadline:
                return dead
            time.sleep(0.02)

    def _watch(self) -> None:
        while not self._stopping:
            # (code 0: rank 0 told it to stop; that is no death)
            dead = self.exits() if any(p.poll() not in (None, 0) for p in self.procs) else ""
            if dead:
                self._died(f"tensor-parallel worker died: {dead}")
                return
            time.sleep(0.2)

    def _watch_nodes(self, nnodes: int) -> None:
        """Node 0: every other node's agent bumps its counter in the rendezvous store each
        second (`_beat`); one that stops for NODE_SILENCE_S is dead, even while no step runs
        (a step would fail on its closed connections anyway)."""
        store = get_world().store
        seen = {node: (-1, time.monotonic()) for node in range(1, nnodes)}
        while not self._stopping:
            for node, (count, since) in seen.items():
                try:
                    now_count = store.add(f"beat/{node}", 0)
                except RuntimeError:
                    return  # the store is gone: this process is stopping
                if now_count != count:
                    seen[node] = (now_count, time.monotonic())
                elif time.monotonic() - since > NODE_SILENCE_S:
                    self._died(f"node {node} has not been heard from for {NODE_SILENCE_S:g} s")
                    return
            time.sleep(1.0)

    def _died(self, what: str) -> None:
        if self._stopping:
            return
        logger.error("%s", what)
        if self._exit_on_death:
            os._exit(1)
        shm = get_tp_group().shm
        if shm is not None:  # rank 0 may be waiting for the dead rank's sum
            shm.abort()

    def stop(self, timeout_s: float = 10.0) -> None:
        """After rank 0 told them to stop (ModelRunner.stop_workers): wait, then kill."""
        self._stopping = True
        for proc in self.procs:
            try:
                proc.wait(timeout_s)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        self._remove_files()

    def kill(self) -> None:
        self._stopping = True
        for proc in self.procs:
            if proc.poll() is None:
                proc.kill()
            proc.wait()
        self._remove_files()

    def _remove_files(self) -> None:
        shutil.rmtree(self._dir, ignore_errors=True)
        for path in self.shm_paths or []:  # (each stage's rank 0 unlinks its own once mapped)
            with contextlib.suppress(FileNotFoundError):
                os.unlink(path)


def serve_other_node(config: EngineConfig, model_path: str) -> int:
    """A node other than 0 (`tokenmill serve` there, same flags): start this node's ranks and
    wait. Returns 0 when they all end cleanly (node 0 told them to stop), 1 when one fails or
    node 0 goes away (its ranks' connections close): the others are then stopped too.
    SIGTERM / SIGINT stop them at once."""
    import signal

    from tokenmill.loading.checkpoint import load_hf_config
    from tokenmill.models.info import check_tensor_parallel, derive_max_model_len
    from tokenmill.platforms import check_kv_budget

    hf_config = load_hf_config(model_path)
    check_tensor_parallel(config, hf_config)
    check_kv_budget(config)
    model = ModelConfig.of(config, model_path, hf_config,
                           derive_max_model_len(config, hf_config))
    group = WorkerGroup(config, model, exit_on_death=False)
    stop, lost = threading.Event(), threading.Event()
    threading.Thread(target=_beat, args=(config, stop, lost), name="tokenmill-node-beat",
                     daemon=True).start()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stop.set())
    logger.info("node %d of %d: ranks %s, rendezvous with node 0 at %s:%d", config.node_rank,
                config.nnodes, group.ranks, config.master_addr, config.master_port)
    while not stop.is_set():
        codes = [p.poll() for p in group.procs]
        if lost.is_set() and any(c is None for c in codes):
            # Node 0 is gone: stopping cleanly (its stop message is on its way to our ranks)
            # or dead (our ranks' connections fail). Either way they end soon; wait a while.
            deadline = time.monotonic() + 10.0
            while time.monotonic() < deadline and any(p.poll() is None for p in group.procs):
                time.sleep(0.1)
            if all(p.poll() == 0 for p in group.procs):
                continue
            logger.error("node %d: node 0 is gone (%s); stopping this node's ranks",
                         config.node_rank, group.exits() or "ranks still running")
            group.kill()
            return 1
        if any(c not in (None, 0) for c in codes):
            logger.error("node %d: %s; stopping its other ranks", config.node_rank,
                         group.exits())
            group.kill()
            return 1
        if all(c == 0 for c in codes):
            group.stop()
            logger.info("node %d: every rank stopped", config.node_rank)
            return 0
        stop.wait(0.5)
    group.kill()
    return 1


def _beat(config: EngineConfig, stop: threading.Event, lost: threading.Event) -> None:
    """Bump this node's counter in node 0's store every second (node 0 watches it)."""
    import datetime

    import torch.distributed as dist

    try:
        store = dist.TCPStore(config.master_addr, config.master_port, None, is_master=False,
                              timeout=datetime.timedelta(seconds=config.distributed_timeout))
        while not stop.is_set():
            store.add(f"beat/{config.node_rank}", 1)
            stop.wait(1.0)
    except RuntimeError:  # (connecting timed out, or node 0 went away)
        lost.set()
