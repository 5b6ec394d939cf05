"""`HostKVStore`: the KV cache's host-memory tier (`--kv-offloading-size`): full blocks'
payloads (as `DiskKVStore` holds them) in this process's memory, keyed by their chained
token hash, bounded to `max_bytes` with the least recently used going first. In front of a
disk store (`below`), it writes through to it and keeps what it reads back from it. Nothing
here outlives the process, so no model key is needed: one engine, one model."""

from __future__ import annotations

import collections
import threading
from typing import Any


class HostKVStore:
    def __init__(self, max_bytes: int, block_bytes: int, below: Any = None) -> None:
        if max_bytes < block_bytes:
            raise ValueError(f"--kv-offloading-size holds no block: a block takes "
                             f"{block_bytes} bytes.")
        self.max_blocks = max_bytes // block_bytes
        self.block_bytes, self.below = block_bytes, below
        self._blocks: collections.OrderedDict[bytes, bytes] = collections.OrderedDict()
        self._lock = threading.Lock()
        self.num_saved = self.num_loaded = self.num_evicted = 0

    @property
    def num_blocks(self) -> int:
        return len(self._blocks)

    def contains(self, block_hash: bytes) -> bool:
        return block_hash in self._blocks or (self.below is not None
                                              and self.below.contains(block_hash))

    def save(self, block_hash: bytes, payload: bytes) -> bool:
        self._keep(block_hash, payload)
        if self.below is not None:
            self.below.save(block_hash, payload)
        return True

    def load(self, block_hash: bytes) -> bytes | None:
        with self._lock:
            payload = self._blocks.get(block_hash)
            if payload is not None:
                self._blocks.move_to_end(block_hash)
                self.num_loaded += 1
                return payload
        if self.below is None:
            return None
        payload = self.below.load(block_hash)
        if payload is not None:
            self._keep(block_hash, payload, saved=False)
        return payload

    def _keep(self, block_hash: bytes, payload: bytes, saved: bool = True) -> None:
        if len(payload) != self.block_bytes:
            raise ValueError(f"a block's payload is {self.block_bytes} bytes, got "
                             f"{len(payload)}")
        with self._lock:
            if block_hash in self._blocks:
                self._blocks.move_to_end(block_hash)
                return
            self._blocks[block_hash] = payload
            self.num_saved += saved
            while len(self._blocks) > self.max_blocks:
                self._blocks.popitem(last=False)
                self.num_evicted += 1
