"""Fixed pool of KV blocks: reference counts, an LRU free list, and the prefix-cache hash map."""

from __future__ import annotations

import hashlib
from array import array
from collections import OrderedDict
from collections.abc import Iterable, Sequence


def hash_block_tokens(parent_hash: bytes | None, token_ids: Sequence[int]) -> bytes:
    """Chained hash of one full block: equal only if the whole prefix up to it is equal.

    A cryptographic digest, not Python's `hash`, so crafted prompts cannot collide on purpose
    and read another request's KV."""
    h = hashlib.sha256(parent_hash or b"tokenmill-root")
    h.update(array("q", token_ids).tobytes())
    return h.digest()


class Block:
    __slots__ = ("block_id", "ref_cnt", "block_hash")

    def __init__(self, block_id: int) -> None:
        self.block_id = block_id
        self.ref_cnt = 0
        self.block_hash: bytes | None = None

    def __repr__(self) -> str:
        cached = self.block_hash is not None
        return f"Block(id={self.block_id}, ref={self.ref_cnt}, cached={cached})"


class BlockPool:
    """Invariants: a block is in `_free` iff its ref_cnt is 0; a block is in `_cached` iff it
    holds the KV of a full block whose hash is `block_hash` (in use or free but not yet reused).
    Free blocks are reused least-recently-freed first, so hot prefixes survive longest."""

    def __init__(self, num_blocks: int, enable_caching: bool = True) -> None:
        if num_blocks < 1:
            raise ValueError(f"num_blocks must be >= 1, got {num_blocks}.")
        self.num_blocks = num_blocks
        self.enable_caching = enable_caching
        self.blocks = [Block(i) for i in range(num_blocks)]
        self._free: OrderedDict[int, Block] = OrderedDict((b.block_id, b) for b in self.blocks)
        self._cached: dict[bytes, Block] = {}

    @property
    def num_free_blocks(self) -> int:
        return len(self._free)

    @property
    def num_used_blocks(self) -> int:
        return self.num_blocks - len(self._free)

    def get_cached_block(self, block_hash: bytes) -> Block | None:
        return self._cached.get(block_hash) if self.enable_caching else None

    def get_new_blocks(self, n: int) -> list[Block]:
        if n > len(self._free):
            raise ValueError(f"Cannot allocate {n} blocks: only {len(self._free)} free.")
        out = []
        for _ in range(n):
            _, block = self._free.popitem(last=False)
            self._evict(block)
            block.ref_cnt = 1
            out.append(block)
        return out

    def touch(self, blocks: Iterable[Block]) -> None:
        """Take a reference on prefix-cache hits, pulling free ones off the free list."""
        for block in blocks:
            if block.ref_cnt == 0:
                del self._free[block.block_id]
            block.ref_cnt += 1

    def free_blocks(self, blocks: Iterable[Block]) -> None:
        """Drop a reference; callers pass a request's blocks tail-first so that when reuse
        starts, a prefix's last blocks go before its first ones (the first are shared most)."""
        for block in blocks:
            block.ref_cnt -= 1
            if block.ref_cnt == 0:
                self._free[block.block_id] = block

    def cache_full_block(self, block: Block, block_hash: bytes) -> bool:
        """Whether `block` now serves `block_hash` (False: caching is off, or it or another
        block already does)."""
        if not self.enable_caching or block.block_hash is not None:
            return False
        if block_hash in self._cached:
            # Another request computed the same block concurrently; keep the first copy.
            return False
        block.block_hash = block_hash
        self._cached[block_hash] = block
        return True

    def promote(self, block_hash: bytes) -> Block | None:
        """A free block for `block_hash`'s KV brought back from another tier: the least
        recently freed one (its own hash dropped), cached under `block_hash`, moved to the
        recently-freed end; None when no block is free."""
        if not self._free:
            return None
        _, block = self._free.popitem(last=False)
        self._evict(block)
        block.block_hash = block_hash
        self._cached[block_hash] = block
        self._free[block.block_id] = block
        return block

    def uncache(self, block: Block) -> None:
        """`block` holds no KV worth finding: out of the prefix cache."""
        self._evict(block)

    def _evict(self, block: Block) -> None:
        if block.block_hash is not None:
            if self._cached.get(block.block_hash) is block:
                del self._cached[block.block_hash]
            block.block_hash = None

    def reset_prefix_cache(self) -> bool:
        """Forget every cached hash; only allowed when no block is in use."""
        if self.num_used_blocks:
            return False
        for block in self.blocks:
            block.block_hash = None
        self._cached.clear()
        return True

    def check_integrity(self) -> None:
        """Assert the invariants above; cheap enough for tests and idle-time checks."""
        for block in self.blocks:
            assert block.ref_cnt >= 0, block
            assert (block.ref_cnt == 0) == (block.block_id in self._free), block
        for block_hash, block in self._cached.items():
            assert block.block_hash == block_hash, block
