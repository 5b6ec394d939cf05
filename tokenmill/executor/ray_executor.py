"""`--distributed-executor-backend ray`: the ranks other than 0 as Ray actors placed on a Ray
cluster's nodes (`ray start --head` on one node, `ray start --address` on the others,
`tokenmill serve` on the head node only). Rank 0 stays the engine core's own process; the
ranks meet through a TCP rendezvous on its node's address and talk over gloo, each on its
node's address (no shared-memory all-reduce: ranks may be anywhere).

Same interface as `executor.WorkerGroup` (join, exits, stop, kill). An actor that dies is
noticed by a watcher thread (`ray.wait` on its running task), with the same policy."""

from __future__ import annotations

import logging
import os
import socket
import threading
import time

import msgspec

from tokenmill.config.engine import EngineConfig
from tokenmill.config.model import ModelConfig
from tokenmill.executor.multiproc import join_as_rank0
from tokenmill.executor.worker import WorkerSpec

logger = logging.getLogger(__name__)


def _rank_actor(ray):
    @ray.remote
    class RankActor:
        """One worker rank in a Ray worker process."""

        def node_address(self) -> str:
            return ray.util.get_node_ip_address()

        def run(self, spec: bytes) -> None:
            from tokenmill.executor.worker import run

            run(msgspec.json.decode(spec, type=WorkerSpec))

    return RankActor


def _answers(address: str, timeout_s: float = 5.0) -> bool:
    host, _, port = address.removeprefix("ray://").rpartition(":")
    try:
        with socket.create_connection((host, int(port)), timeout=timeout_s):
            return True
    except (OSError, ValueError):
        return False


class RayWorkerGroup:
    def __init__(self, config: EngineConfig, model: ModelConfig, exit_on_death: bool) -> None:
        try:
            import ray
        except ImportError:
            raise ValueError("--distributed-executor-backend ray needs Ray: pip install "
                             "'tokenmill[ray]'.") from None
        self.ray = ray
        where = config.ray_address or "auto"
        unreachable = ValueError(
            f"--distributed-executor-backend ray: no Ray cluster is reachable at {where}; start "
            "one with `ray start --head` (and `ray start --address HEAD:PORT` on the other "
            "nodes), and set RAY_ADDRESS=HEAD:PORT where it is not on this machine.")
        if config.ray_address is not None and not _answers(config.ray_address):
            raise unreachable  # (ray.init itself would retry for minutes)
        try:
            ray.init(address=where, log_to_driver=True)
        except ConnectionError:
            raise unreachable from None
        size = config.world_size
        self.host = ray.util.get_node_ip_address()
        self.init_method = f"tcp://{self.host}:{config.master_port}"
        self.ranks = list(range(1, size))
        actor = _rank_actor(ray)
        self.actors = [actor.options(num_cpus=1).remote() for _ in self.ranks]
        self.refs = []
        for rank, handle in zip(self.ranks, self.actors):
            host = ray.get(handle.node_address.remote(), timeout=config.distributed_timeout)
            spec = WorkerSpec(config, model.path, model.max_model_len, rank, self.init_method, 1,
                              host=host)
            self.refs.append(handle.run.remote(msgspec.json.encode(spec)))
            logger.info("rank %d: a Ray actor on %s", rank, host)
        self.threads = 1
        self._exit_on_death = exit_on_death
        self._stopping = False
        self._dead: dict[int, str] = {}
        threading.Thread(target=self._watch, name="tokenmill-ray-watch", daemon=True).start()

    def join(self, config: EngineConfig) -> None:
        """Join the group as rank 0 (blocks until every actor's rank has joined)."""
        join_as_rank0(self, config)

    def exits(self, wait_s: float = 0.0) -> str:
        """Which ranks' actors ended, and how ('' while all run); `wait_s`: how long to
        look for one (the watching thread learns of it)."""
        deadline = time.monotonic() + wait_s
        while not self._dead and time.monotonic() < deadline:
            time.sleep(0.02)
        return ", ".join(f"rank {rank} {why}" for rank, why in sorted(self._dead.items()))

    def _watch(self) -> None:
        pending = list(self.refs)
        while pending and not self._stopping:
            done, pending = self.ray.wait(pending, num_returns=1, timeout=0.5)
            for ref in done:
                rank = self.ranks[self.refs.index(ref)]
                try:
                    self.ray.get(ref)
                    self._dead[rank] = "ended"
                except Exception as exc:  # noqa: BLE001 - the actor or its task failed
                    self._dead[rank] = f"failed ({type(exc).__name__})"
                if self._stopping:
                    return
                logger.error("tensor-parallel rank %d's Ray actor %s", rank, self._dead[rank])
                if self._exit_on_death:
                    os._exit(1)
                return

    def stop(self, timeout_s: float = 10.0) -> None:
        """After rank 0 told them to stop (ModelRunner.stop_workers): wait, then kill."""
        self._stopping = True
        self.ray.wait(self.refs, num_returns=len(self.refs), timeout=timeout_s)
        self.kill()

    def kill(self) -> None:
        self._stopping = True
        for handle in self.actors:
            try:
                self.ray.kill(handle)
            except Exception as exc:  # noqa: BLE001 - already gone
                logger.debug("ray.kill: %s", exc)
