"""Sliding-window attention over the paged cache (Mistral v0.1, Qwen2's `use_sliding_window`
layers, Phi-3, Gemma's local layers): a query at position p sees the keys at positions
p - window + 1 .. p, as transformers' sliding mask. Only the blocks holding a step's
visible keys are read; each sequence attends through one masked SDPA call. (The compiled
CPU kernels take no window yet: models with one run their attention here.)"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from tokenmill.attention.backend import AttentionBackend, AttentionMetadata


def windowed_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                       meta: AttentionMetadata, scale: float, window: int) -> torch.Tensor:
    """[T, Hq, D] outputs of the step's queries (their K/V already in the cache)."""
    out = torch.empty_like(q)
    loc, bs = meta.query_start_loc, meta.block_size
    for s in range(meta.num_seqs):
        lo, hi = loc[s], loc[s + 1]
        context, seq_len = meta.context_lens[s], int(meta.seq_lens[s])
        first_block = max(0, context - window + 1) // bs  # the first query's oldest key
        start = first_block * bs
        blocks = meta.block_table[s, first_block: -(-seq_len // bs)]
        keys = AttentionBackend.gather_kv(k_cache, blocks, seq_len - start, q.dtype)
        values = AttentionBackend.gather_kv(v_cache, blocks, seq_len - start, q.dtype)
        position = torch.arange(context, context + hi - lo, device=q.device).unsqueeze(1)
        key = torch.arange(start, seq_len, device=q.device).unsqueeze(0)
        visible = (key <= position) & (key > position - window)
        out[lo:hi] = F.scaled_dot_product_attention(
            q[lo:hi].transpose(0, 1).unsqueeze(0), keys.transpose(0, 1).unsqueeze(0),
            values.transpose(0, 1).unsqueeze(0), attn_mask=visible, scale=scale,
            enable_gqa=True)[0].transpose(0, 1)
    return out
