"""Which KV blocks each request owns: allocation per step, prefix-cache lookup, release."""

from __future__ import annotations

import numpy as np

from tokenmill.core.block_pool import Block, BlockPool, hash_block_tokens
from tokenmill.core.int_row import IntRow
from tokenmill.core.request import Request
from tokenmill.core.state_slots import StateSlots


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


class KVCacheManager:
    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True,
                 window: int | None = None, num_state_slots: int = 0):
        """`window`: every layer attends only to this many latest positions (Mistral v0.1):
        blocks wholly before a request's window go back to the pool as it moves on (its
        table keeps their places, as block 0, never read again). `num_state_slots`: a model
        with state layers (core/state_slots.py) keeps a slot per running request beside its
        blocks; a state summarizes every token before it, not a block's, so no block is
        shared (prefix caching is off)."""
        if block_size < 1:
            raise ValueError(f"block_size must be >= 1, got {block_size}.")
        self.states = StateSlots(num_state_slots) if num_state_slots else None
        if self.states is not None:
            enable_prefix_caching = False
        self.block_size = block_size
        self.window = window
        self._num_dropped: dict[str, int] = {}
        self.enable_prefix_caching = enable_prefix_caching
        self.pool = BlockPool(num_blocks, enable_prefix_caching)
        self._blocks: dict[str, list[Block]] = {}
        # each request's block ids as its step's table row takes them (dropped ones 0), kept
        # beside its blocks: a step reads them as a view (64 sequences of 32k tokens: 2.7 ms
        # a step converting lists)
        self._rows: dict[str, IntRow] = {}
        self._num_cached_blocks: dict[str, int] = {}
        # the offloading tiers (engine/kv_offload_tier.py) set a list: (block id, hash) of each
        # block cached from then on, base-model blocks only (an adapter's key is its name and path)
        self.new_full_blocks: list[tuple[int, bytes]] | None = None
        # Prefix-cache statistics, in tokens, for metrics.
        self.num_queried_tokens = 0
        self.num_hit_tokens = 0

    @property
    def num_blocks(self) -> int:
        return self.pool.num_blocks

    def usage(self) -> float:
        return self.pool.num_used_blocks / self.pool.num_blocks

    def block_row(self, request_id: str) -> np.ndarray:
        """The request's block ids as a view (what a step's table row takes); later
        allocations never change it, a sliding window's drops write 0 into it."""
        row = self._rows.get(request_id)
        return _NO_BLOCKS if row is None else row.view()

    def state_slot(self, request_id: str) -> int:
        """The request's state slot (-1: the model keeps none, or the request holds none)."""
        return -1 if self.states is None else self.states.get(request_id)

    def _update_block_hashes(self, request: Request, num_tokens: int) -> None:
        bs = self.block_size
        hashes = request.block_hashes
        for i in range(len(hashes), num_tokens // bs):
            parent = hashes[i - 1] if i else request.cache_root
            hashes.append(hash_block_tokens(parent, request.token_ids(i * bs, (i + 1) * bs)))

    def get_computed_blocks(self, request: Request) -> tuple[list[Block], int]:
        """Longest run of cached full blocks at the start of the request's tokens.

        At least one token is always left to compute: its logits give the next token."""
        if (not self.enable_prefix_caching or request.skip_prefix_cache
                or request.sampling_params.prompt_logprobs is not None):
            return [], 0
        max_blocks = (request.num_tokens - 1) // self.block_size
        self._update_block_hashes(request, max_blocks * self.block_size)
        hits: list[Block] = []
        for block_hash in request.block_hashes[:max_blocks]:
            block = self.pool.get_cached_block(block_hash)
            if block is None:
                break
            hits.append(block)
        return hits, len(hits) * self.block_size

    def uncached_prefix(self, request: Request) -> list[bytes]:
        """The hashes of the request's full prompt blocks past its prefix-cache hits (what
        another tier may hold); none for a request that reads no prefix cache or runs with
        an adapter."""
        hits, _ = self.get_computed_blocks(request)
        if request.lora_request is not None or not request.block_hashes:
            return []
        return request.block_hashes[len(hits):(request.num_tokens - 1) // self.block_size]

    def install(self, hashes: list[bytes], request: Request | None = None) -> list[Block | None]:
        """Blocks for KV brought back from another tier, cached under `hashes` in order while
        blocks are free (free themselves, recently used: the request that asked admits them
        as hits); None for a hash another request cached meanwhile. The blocks `request`
        already hits are not among those reused (they would break its run of hits)."""
        hits = self.get_computed_blocks(request)[0] if request is not None else []
        self.pool.touch(hits)
        out: list[Block | None] = []
        for block_hash in hashes[:self.pool.num_free_blocks]:
            cached = self.pool.get_cached_block(block_hash) is not None
            out.append(None if cached else self.pool.promote(block_hash))
        self.pool.free_blocks(reversed(hits))  # (back as the most recently used)
        return out

    def take_new_full_blocks(self) -> list[tuple[int, bytes]]:
        """(block id, hash) of the blocks cached since the last call that still hold them."""
        new, self.new_full_blocks = self.new_full_blocks or [], []
        return [(b, h) for b, h in new if self.pool.blocks[b].block_hash == h]

    def record_prefix_query(self, num_queried_tokens: int, num_hit_tokens: int) -> None:
        self.num_queried_tokens += num_queried_tokens
        self.num_hit_tokens += num_hit_tokens

    def can_ever_fit(self, num_tokens: int) -> bool:
        return cdiv(num_tokens, self.block_size) <= self.pool.num_blocks

    def allocate_slots(self, request: Request, num_new_tokens: int,
                       computed_blocks: list[Block] | None = None,
                       num_lookahead: int = 0) -> bool:
        """Give the request blocks for `num_new_tokens` more tokens (after any prefix hits),
        and `num_lookahead` slots past them (a proposer's rows).

        Returns False, changing nothing, when the pool is too small right now (or, with
        state layers, no state slot is free)."""
        if self.states is not None and self.states.get(request.request_id) < 0:
            if not self.states.take(request.request_id):
                return False
            if not self.allocate_slots(request, num_new_tokens, computed_blocks, num_lookahead):
                self.states.free(request.request_id)
                return False
            return True
        if not computed_blocks and self.window is None:
            # the common decode: its blocks hold the new token and no block fills up for the
            # prefix cache, so nothing changes (what the full path below would find, faster)
            blocks = self._blocks.get(request.request_id)
            if blocks:
                total = request.num_computed_tokens + num_new_tokens
                if total + num_lookahead <= len(blocks) * self.block_size and (
                        not self.enable_prefix_caching
                        or min(total, request.num_tokens) // self.block_size
                        <= self._num_cached_blocks.get(request.request_id, 0)):
                    return True
        computed_blocks = computed_blocks or []
        blocks = self._blocks.setdefault(request.request_id, [])
        num_computed = request.num_computed_tokens + len(computed_blocks) * self.block_size
        total = num_computed + num_new_tokens
        num_needed = (cdiv(total + num_lookahead, self.block_size) - len(blocks)
                      - len(computed_blocks))
        # Hits sitting on the free list stop being free once we take them.
        num_free_hits = sum(1 for b in computed_blocks if b.ref_cnt == 0)
        if num_needed > self.pool.num_free_blocks - num_free_hits:
            if not blocks:
                del self._blocks[request.request_id]
            return False
        self.pool.touch(computed_blocks)
        new = computed_blocks
        if num_needed > 0:
            new = computed_blocks + self.pool.get_new_blocks(num_needed)
        blocks.extend(new)
        row = self._rows.get(request.request_id)
        if row is None:
            row = self._rows[request.request_id] = IntRow()
        row.extend([b.block_id for b in new])
        if self.enable_prefix_caching:
            # KV for every token below `total` is written this step, so those full blocks can
            # serve other requests from the next step on (not positions past the request's
            # tokens: draft tokens, which verification may reject).
            num_full = min(total, request.num_tokens) // self.block_size
            self._update_block_hashes(request, num_full * self.block_size)
            start = self._num_cached_blocks.get(request.request_id, 0)
            new = self.new_full_blocks if request.lora_request is None else None
            for i in range(start, num_full):
                if self.pool.cache_full_block(blocks[i], request.block_hashes[i]) \
                        and new is not None:
                    new.append((blocks[i].block_id, request.block_hashes[i]))
            self._num_cached_blocks[request.request_id] = max(start, num_full)
        if self.window is not None:
            self._drop_out_of_window(request.request_id, blocks, num_computed)
        return True

    def _drop_out_of_window(self, request_id: str, blocks: list, first_position: int) -> None:
        """Give back the blocks wholly before the window of this step's first query (the
        step's other queries sit later, their windows too)."""
        end = max(0, first_position - self.window + 1) // self.block_size
        start = self._num_dropped.get(request_id, 0)
        dropped = [blocks[i] for i in range(start, end) if blocks[i] is not None]
        for i in range(start, end):
            blocks[i] = None
        if end > start:
            self._rows[request_id].array[start:end] = 0
            self._num_dropped[request_id] = end
        self.pool.free_blocks(reversed(dropped))

    def forget_unwritten(self, request: Request, start: int) -> None:
        """`request` was taken back out of the step that allocated its blocks: those from
        position `start` on never got their KV, so they leave the prefix cache."""
        for block in self._blocks.get(request.request_id, [])[start // self.block_size:]:
            if block is not None:
                self.pool.uncache(block)

    def free(self, request: Request) -> None:
        if self.states is not None:
            self.states.free(request.request_id)
        blocks = self._blocks.pop(request.request_id, None)
        self._rows.pop(request.request_id, None)
        self._num_cached_blocks.pop(request.request_id, None)
        self._num_dropped.pop(request.request_id, None)
        if blocks:
            self.pool.free_blocks(reversed([b for b in blocks if b is not None]))

    def reset_prefix_cache(self) -> bool:
        return self.pool.reset_prefix_cache()


_NO_BLOCKS = np.zeros(0, dtype=np.int64)
