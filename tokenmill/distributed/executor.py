"""Starting the tensor-parallel ranks of one engine: rank 0 is the engine core's own process
(it schedules, broadcasts each step and samples); ranks 1 .. tp-1 are worker processes on
this node (`--distributed-executor-backend mp`), each running `tokenmill.distributed.worker`."""

from __future__ import annotations

import contextlib
import logging
import os
import shutil
import subprocess
import sys
import tempfile
import threading
import time

import msgspec

from tokenmill.config import EngineConfig
from tokenmill.distributed.parallel_state import get_tp_group
from tokenmill.distributed.shm_allreduce import create_segment
from tokenmill.distributed.worker import WorkerSpec

logger = logging.getLogger(__name__)


def threads_per_rank(size: int) -> int:
    """This node's cores shared out: one rank's threads never compete with another's."""
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    return max(1, (cores or 1) // size)


class WorkerGroup:
    """Worker ranks 1 .. tp-1 as child processes; `join` makes this process rank 0.

    A worker that dies is noticed by a watcher thread: in the engine-core process
    (`exit_on_death`) that ends this process too, so the server's engine-death policy takes
    over; in-process (offline `LLM`), rank 0's next collective fails with gloo's error."""

    def __init__(self, config: EngineConfig, model_path: str, max_model_len: int,
                 exit_on_death: bool) -> None:
        size = config.tensor_parallel_size
        # Ranks on this node meet through a file in a private directory: no socket to bind.
        self._dir = tempfile.mkdtemp(prefix="tokenmill-tp-")
        self.init_method = f"file://{self._dir}/rendezvous"
        self.threads = threads_per_rank(size)
        self.shm_path = create_segment(size) if config.device in ("auto", "cpu") else None
        self.procs: list[subprocess.Popen] = []
        self._stopping = False
        for rank in range(1, size):
            spec = WorkerSpec(config, model_path, max_model_len, rank, size, self.init_method,
                              self.threads, parent_pid=os.getpid(), shm_path=self.shm_path)
            proc = subprocess.Popen([sys.executable, "-m", "tokenmill.distributed.worker"],
                                    stdin=subprocess.PIPE)
            proc.stdin.write(msgspec.json.encode(spec) + b"\n")
            proc.stdin.close()
            self.procs.append(proc)
        self._exit_on_death = exit_on_death
        threading.Thread(target=self._watch, name="tokenmill-worker-watch", daemon=True).start()

    def join(self, config: EngineConfig) -> None:
        """Join the group as rank 0 (blocks until every worker has joined)."""
        import torch

        from tokenmill.distributed.parallel_state import init_tensor_parallel
        from tokenmill.worker.model_runner import resolve_device

        torch.set_num_threads(self.threads)
        try:
            init_tensor_parallel(0, config.tensor_parallel_size, self.init_method,
                                 config.distributed_timeout, resolve_device(config.device),
                                 self.shm_path)
        except Exception as exc:
            self.kill()
            exits = self.exits()
            raise RuntimeError(f"Tensor-parallel start-up failed: {exc}"
                               + (f" ({exits})" if exits else "")) from None

    def exits(self) -> str:
        """Which workers have exited, and how ('' while all run)."""
        return ", ".join(f"rank {rank} exited with code {p.returncode}"
                         for rank, p in enumerate(self.procs, 1) if p.poll() is not None)

    def _watch(self) -> None:
        while not self._stopping:
            dead = self.exits()
            if dead:
                if self._stopping:
                    return
                logger.error("tensor-parallel worker died: %s", dead)
                if self._exit_on_death:
                    os._exit(1)
                shm = get_tp_group().shm
                if shm is not None:  # rank 0 may be waiting for the dead rank's sum
                    shm.abort()
                return
            time.sleep(0.2)

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
        if self.shm_path is not None:  # (rank 0 unlinks it once every rank has mapped it)
            with contextlib.suppress(FileNotFoundError):
                os.unlink(self.shm_path)
