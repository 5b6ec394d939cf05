"""Whole KV blocks in and out of a runner's cache as bytes (the host-memory and disk tiers'
payloads): one block's every layer, K then V, each as the cache holds it (int8 rows with
their scales; MLA's latent rows alone); and the cache tensors themselves, in that order
(what a KV transfer registers and reads block by block)."""

from __future__ import annotations

from typing import Any

import torch


def cache_tensors(runner: Any) -> list[torch.Tensor]:
    """The runner's cache tensors in payload order ([blocks, block_size, heads, row] each;
    an empty V, as under MLA, is left out)."""
    return [t for layer in runner._layers for t in (layer.k_cache, layer.v_cache)
            if t.numel()]


def layout(runner: Any) -> list:
    """Each cache's block shape and dtype, in payload order."""
    return [[list(t.shape[1:]), str(t.dtype)] for t in cache_tensors(runner)]


def block_bytes(runner: Any) -> int:
    return sum(t[0].numel() * t.element_size() for t in cache_tensors(runner))


def read_blocks(runner: Any, block_ids: list[int]) -> list[bytes]:
    """Each block's payload."""
    index = torch.tensor(block_ids, device=runner.device)
    rows = torch.cat([t.index_select(0, index).reshape(len(block_ids), -1).view(torch.uint8)
                      for t in cache_tensors(runner)], dim=1).cpu()
    return [rows[i].numpy().tobytes() for i in range(len(block_ids))]


def write_blocks(runner: Any, block_ids: list[int], payloads: list[bytes]) -> None:
    """Each payload into its block (every payload `block_bytes` long)."""
    if not block_ids:
        return
    n = len(block_ids)
    rows = torch.frombuffer(bytearray(b"".join(payloads)), dtype=torch.uint8).view(n, -1)
    rows = rows.to(runner.device)
    index = torch.tensor(block_ids, device=runner.device)
    offset = 0
    for cache in cache_tensors(runner):
        width = cache[0].numel() * cache.element_size()
        part = rows[:, offset:offset + width].contiguous().view(cache.dtype)
        cache.index_copy_(0, index, part.view(n, *cache.shape[1:]))
        offset += width
