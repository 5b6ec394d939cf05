"""Size and allocate the paged K/V tensors: per layer [num_blocks, block_size, Hkv, D]
(int8: D + 4 bytes per row, values and their scale)."""

from __future__ import annotations

import logging

import torch

from tokenmill.quantization.kv_cache import SCALE_BYTES, row_bytes


def bytes_per_block(num_layers: int, block_size: int, num_kv_heads: int, head_dim: int,
                    dtype: torch.dtype, values: bool = True) -> int:
    """`values=False`: one cache a layer (DeepSeek's latent rows), not K and V."""
    caches = 2 if values else 1
    return caches * num_layers * block_size * num_kv_heads * row_bytes(head_dim, dtype)


logger = logging.getLogger(__name__)


def log_size(num_blocks: int, block_size: int, block_bytes: int, dtype: torch.dtype,
             ranks_here: int, max_model_len: int) -> None:
    tokens = num_blocks * block_size
    logger.info("KV cache: %d blocks of %d tokens (%.2f GiB%s, %s): %d tokens, %.1f full "
                "contexts of %d", num_blocks, block_size, num_blocks * block_bytes / 2**30,
                f" on each of {ranks_here} ranks here" if ranks_here > 1 else "", dtype,
                tokens, tokens / max_model_len, max_model_len)


def num_blocks_for_budget(budget_bytes: int, block_bytes: int) -> int:
    return max(0, budget_bytes // block_bytes)


def allocate_kv_cache(num_layers: int, num_blocks: int, block_size: int, num_kv_heads: int,
                      head_dim: int, dtype: torch.dtype, device: torch.device,
                      values: bool = True) -> list[tuple[torch.Tensor, torch.Tensor]]:
    # Zeroed, not empty: padded decode reads of unused slots are masked out of the softmax,
    # but garbage NaNs in V would still poison `probs @ V`.
    row = head_dim + SCALE_BYTES if dtype == torch.int8 else head_dim
    shape = (num_blocks, block_size, num_kv_heads, row)
    zeros = _untouched_zeros if device.type == "cpu" else torch.zeros
    return [(zeros(shape, dtype=dtype, device=device),
             zeros(shape if values else (0,), dtype=dtype, device=device))
            for _ in range(num_layers)]


def _untouched_zeros(shape: tuple[int, ...], dtype: torch.dtype,
                     device: torch.device) -> torch.Tensor:
    """Zeros in host memory of a fresh anonymous map: the OS hands its pages out zeroed as
    they are first written, so a KV cache is resident only as far as its blocks have been
    used (a server that has seen a few requests holds a few blocks' pages, not the whole
    budget; torch.zeros writes every byte at start-up). A map of its own, never the heap:
    calloc would reuse memory the process freed before, and zero it by writing."""
    import mmap

    import numpy as np

    width = torch.empty((), dtype=dtype).element_size()
    count = int(np.prod(shape))
    if count == 0:
        return torch.zeros(shape, dtype=dtype, device=device)
    pages = mmap.mmap(-1, count * width)  # (page-aligned: rows on cache lines too)
    words = np.frombuffer(pages, dtype={1: np.uint8, 2: np.uint16, 4: np.uint32,
                                        8: np.uint64}[width], count=count)
    return torch.from_numpy(words.reshape(shape)).view(dtype)
