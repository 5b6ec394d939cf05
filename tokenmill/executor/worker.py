"""A tensor-parallel worker rank (ranks 1 .. tp-1): `python -m tokenmill.executor.worker`,
its spec as one JSON line on stdin. It joins the group, loads its shard of the model, then
runs every step rank 0 broadcasts until rank 0 says stop, or exits when rank 0's process
(its parent, on this node) is gone."""

from __future__ import annotations

import contextlib
import ctypes
import logging
import os
import signal
import sys
import threading
import time

import msgspec

from tokenmill.config.engine import EngineConfig
from tokenmill.config.model import ModelConfig
from tokenmill.logs import configure_logging

logger = logging.getLogger("tokenmill.executor.worker")


class WorkerSpec(msgspec.Struct, frozen=True):
    config: EngineConfig
    model_path: str
    max_model_len: int
    rank: int  # in the world of tensor_parallel_size x pipeline_parallel_size ranks
    init_method: str  # tcp://host:port of the rendezvous
    threads: int  # torch threads of this rank
    parent_pid: int | None = None  # exit when this process (rank 0's, here) is gone
    shm_paths: list[str] | None = None  # per stage: its shared-memory all-reduce segment
    host: str = "127.0.0.1"  # the address this rank's connections listen on


def _exit_with_parent(parent: int) -> None:
    """Rank 0 may die without a word (kill -9): nothing would end this process's wait for the
    next step. The kernel kills this process when its parent ends (PR_SET_PDEATHSIG), even
    one stopped in a stall; a thread watching the parent covers systems without prctl."""
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    if os.getppid() != parent:  # gone before the kernel was asked to tell us
        os._exit(1)

    def watch() -> None:
        while os.getppid() == parent:
            time.sleep(0.5)
        logger.error("rank 0's process is gone: exiting")
        os._exit(1)
    threading.Thread(target=watch, name="tokenmill-parent-watch", daemon=True).start()


def run(spec: WorkerSpec) -> None:
    import torch

    from tokenmill.distributed.parallel_state import destroy_parallel, init_parallel
    from tokenmill.loading.checkpoint import load_hf_config
    from tokenmill.loading.mmproj import mmproj_multimodal
    from tokenmill.platforms import resolve_device
    from tokenmill.worker.model_runner import ModelRunner

    torch.set_num_threads(spec.threads)
    device = resolve_device(spec.config.device, spec.rank, spec.config.ranks_per_node)
    init_parallel(spec.rank, spec.config.tensor_parallel_size, spec.init_method,
                  spec.config.distributed_timeout, device, spec.shm_paths, spec.host,
                  spec.config.pipeline_parallel_size, spec.config.enable_expert_parallel)
    config = spec.config
    runner = ModelRunner(config, ModelConfig.of(
        config, spec.model_path, load_hf_config(spec.model_path), spec.max_model_len,
        mmproj_multimodal(config.mmproj, spec.model_path, config.limit_mm_per_prompt,
                          spec.max_model_len)))
    runner.serve_steps()
    destroy_parallel()


def main() -> None:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: "
                                                   "%(message)s")  # (until the spec says)
    # Ctrl-C and `stop_server` reach the whole process group; rank 0 stops this one.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    spec = msgspec.json.decode(sys.stdin.buffer.readline(), type=WorkerSpec)
    configure_logging(spec.config.log_format, spec.config.log_level)
    sys.stdin.close()
    if spec.parent_pid is not None:
        _exit_with_parent(spec.parent_pid)
    try:
        run(spec)
    except Exception:  # noqa: BLE001 - logged with its traceback, then a non-zero exit
        logger.exception("tensor-parallel rank %d failed", spec.rank)
        raise SystemExit(1) from None


if __name__ == "__main__":
    main()
