"""The KV cache's offloading tiers in the engine core: host memory (`--kv-offloading-size`,
kv_offload/host_store.py: for an engine whose cache is on a GPU) and a disk folder
(`--kv-cache-disk-dir`, kv_offload/disk_store.py), either or both (host memory in front).
Every full block a base-model request fills is written through: copied out after its step
(a memory copy; from a GPU, a device-to-host copy), stored by a thread, and dropped rather
than waited for when the writer falls behind. A new request whose prompt runs past its
prefix-cache hits into blocks a tier holds waits while a thread reads (and, from disk,
checks) them, then enters the scheduler with them in the prefix cache (put there on the
step loop: a copy into the cache), so their tokens are not computed again. The disk
outlives the engine and is shared by the replicas of one machine. One rank, no
speculative decoding, no pipelined steps (the blocks a step fills are read back right
after it)."""

from __future__ import annotations

import collections
import concurrent.futures
import hashlib
import json
import logging
import os
import threading
from typing import Any

from tokenmill.kv_offload.disk_store import DiskKVStore
from tokenmill.kv_offload.host_store import HostKVStore
from tokenmill.worker.kv_blocks import block_bytes, layout, read_blocks, write_blocks

logger = logging.getLogger(__name__)

MAX_QUEUED_BYTES = 256 << 20  # blocks copied out, not yet written: past it new ones drop


class KVOffloadTier:
    def __init__(self, store: HostKVStore | DiskKVStore, runner: Any, kv_cache: Any) -> None:
        self.store, self.runner, self.kv_cache = store, runner, kv_cache
        self.host = store if isinstance(store, HostKVStore) else None
        self.disk = store.below if self.host is not None else store
        kv_cache.new_full_blocks = []
        self.pending: dict[str, tuple[Any, list[bytes], concurrent.futures.Future]] = {}
        self.num_dropped = 0  # blocks not written: the writer was behind
        self.num_read_blocks = 0  # blocks brought back into the cache
        self._queue: collections.deque = collections.deque()
        self._queued_bytes = 0
        self._cond = threading.Condition()
        self._stop = False
        self._writer = threading.Thread(target=self._write, name="kv-offload-write", daemon=True)
        self._writer.start()
        self._reader = concurrent.futures.ThreadPoolExecutor(1, "kv-offload-read")

    @classmethod
    def build(cls, config: Any, core: Any) -> KVOffloadTier | None:
        """The tiers an EngineCore `core` asks for (None: neither --kv-offloading-size nor
        --kv-cache-disk-dir given)."""
        if not config.kv_cache_disk_dir and not config.kv_offloading_size:
            return None
        flag = "--kv-cache-disk-dir" if config.kv_cache_disk_dir else "--kv-offloading-size"
        if not core.kv_cache.enable_prefix_caching:
            raise ValueError(f"{flag} keeps prefix-cache blocks: this engine has none "
                             "(--no-enable-prefix-caching, or a model with state layers).")
        size = block_bytes(core.runner)
        store = None
        if config.kv_cache_disk_dir:
            store = DiskKVStore(config.kv_cache_disk_dir, int(config.kv_cache_disk_gib * 2**30),
                                model_key(config, core), size)
            logger.info("KV disk tier: %s (up to %.1f GiB, blocks of %d KiB)", store.dir,
                        config.kv_cache_disk_gib, size >> 10)
        if config.kv_offloading_size:
            store = HostKVStore(int(config.kv_offloading_size * 2**30), size, below=store)
            logger.info("KV host-memory tier: up to %d blocks of %d KiB (%.1f GiB)",
                        store.max_blocks, size >> 10, config.kv_offloading_size)
        return cls(store, core.runner, core.kv_cache)

    # ---- reading back -----------------------------------------------------------------
    def lookup(self, request: Any) -> bool:
        """Whether `request` waits for blocks read back (`ready` hands it on)."""
        hashes = []
        for block_hash in self.kv_cache.uncached_prefix(request):
            if not self.store.contains(block_hash):
                break
            hashes.append(block_hash)
        if not hashes:
            return False
        future = self._reader.submit(self._read, hashes)
        self.pending[request.request_id] = (request, hashes, future)
        return True

    def _read(self, hashes: list[bytes]) -> list[bytes]:
        """The payloads of the blocks that read back whole and checked, up to the first
        that does not."""
        out = []
        for block_hash in hashes:
            payload = self.store.load(block_hash)
            if payload is None:
                break
            out.append(payload)
        return out

    def ready(self, timeout: float = 0.0) -> tuple[list[Any], list]:
        """(The requests whose reads finished, their blocks in the prefix cache now; none
        refused: a failed read costs only compute), waiting up to `timeout` s for one."""
        if not self.pending:
            return [], []
        if timeout:
            concurrent.futures.wait([f for _, _, f in self.pending.values()], timeout,
                                    concurrent.futures.FIRST_COMPLETED)
        done = []
        for request_id, (request, hashes, future) in list(self.pending.items()):
            if not future.done():
                continue
            del self.pending[request_id]
            try:
                payloads = future.result()
            except Exception:  # noqa: BLE001 - a failed read costs only the blocks' compute
                logger.exception("KV offload tier: reading blocks failed; they are recomputed")
                payloads = []
            blocks = self.kv_cache.install(hashes[:len(payloads)], request)
            pairs = [(b.block_id, p) for b, p in zip(blocks, payloads) if b is not None]
            write_blocks(self.runner, [b for b, _ in pairs], [p for _, p in pairs])
            self.num_read_blocks += len(pairs)
            done.append(request)
        return done, []

    def drop(self, request_ids: list[str]) -> None:
        """Aborted while their blocks were read: forgotten (the read's result is dropped)."""
        for request_id in request_ids:
            self.pending.pop(request_id, None)

    # ---- writing through --------------------------------------------------------------
    def after_step(self) -> None:
        """After a step: the blocks it filled, copied out and queued for the writer."""
        new = self.kv_cache.take_new_full_blocks()
        if not new:
            return
        room = (MAX_QUEUED_BYTES - self._queued_bytes) // self.store.block_bytes
        if room < len(new):
            self.num_dropped += len(new) - max(room, 0)
            new = new[:max(room, 0)]
        if not new:
            return
        payloads = read_blocks(self.runner, [block_id for block_id, _ in new])
        with self._cond:
            self._queue.extend(zip([h for _, h in new], payloads))
            self._queued_bytes += sum(len(p) for p in payloads)
            self._cond.notify()

    def _write(self) -> None:
        while True:
            with self._cond:
                while not self._queue and not self._stop:
                    self._cond.wait()
                if not self._queue:
                    return
                block_hash, payload = self._queue.popleft()
            self.store.save(block_hash, payload)
            with self._cond:
                self._queued_bytes -= len(payload)
                self._cond.notify_all()

    def flush(self, timeout: float) -> bool:
        """Waits until every queued block is written (True) or `timeout` s pass."""
        with self._cond:
            return self._cond.wait_for(lambda: not self._queue and not self._queued_bytes,
                                       timeout)

    def shutdown(self, timeout: float = 30.0) -> None:
        """Writes what is queued (up to `timeout` s), then stops the threads (idempotent)."""
        with self._cond:
            if self._stop:
                return
            self._stop = True
            self._cond.notify_all()
        self._writer.join(timeout)
        self._reader.shutdown(wait=False, cancel_futures=True)


def model_key(config: Any, core: Any) -> dict:
    """What a block's KV depends on besides its tokens: the model's files (names, sizes,
    modification times), its config as loaded, the weights' and caches' dtypes and shapes,
    the block size and the quantization."""
    runner, path = core.runner, core.model_config.path
    config_json = json.dumps(core.model_config.hf_config.to_dict(), sort_keys=True,
                             default=str)
    return {"format": 1, "files": _fingerprint(path),
            "config": hashlib.sha256(config_json.encode()).hexdigest(),
            "dtype": str(runner.dtype), "quantization": config.quantization,
            "block_size": config.block_size, "caches": layout(runner)}


def _fingerprint(path: str) -> list:
    files = [path] if os.path.isfile(path) else sorted(
        os.path.join(path, name) for name in os.listdir(path)
        if name.endswith((".safetensors", ".bin", ".gguf", ".pt", ".json")))
    out = []
    for file in files:
        st = os.stat(file)
        out.append([os.path.basename(file), st.st_size, st.st_mtime_ns])
    return out
