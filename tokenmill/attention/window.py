"""Attention over the paged cache with masks: a sliding window (Mistral v0.1, Qwen2's
`use_sliding_window` layers, Phi-3, Gemma's local layers: a query at position p sees the keys
at positions p - window + 1 .. p, as transformers' sliding mask), Llama 4's chunked local
attention (a query sees its own chunk's keys), Gemma 2's logit soft-capping (scores ->
cap * tanh(scores / cap)), gpt-oss' attention sinks (a logit per head in the softmax's
denominator) and Gemma 3's bidirectional image spans (`AttentionMetadata.bidirectional`: a
query in a span also sees the span's later keys, within the window: transformers'
AND(window, OR(causal, span))). The CPU's compiled decode kernel takes windows and sinks
itself (the prompts of such a step come here); the rest, and every step where it is not
used, comes here. Only the blocks holding a step's visible keys are read; each sequence
attends through one masked SDPA call, or, soft-capped or with sinks, explicit products."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from tokenmill.attention.backend import AttentionBackend, AttentionMetadata


def masked_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                     meta: AttentionMetadata, scale: float, window: int | None = None,
                     softcap: float | None = None, chunk: int | None = None,
                     sinks: torch.Tensor | None = None, first_seq: int = 0,
                     out: torch.Tensor | None = None) -> torch.Tensor:
    """[T, Hq, D] outputs of the step's queries (their K/V already in the cache); `chunk`:
    each query sees its own chunk's keys only; `sinks` [Hq]: a logit per head in each
    softmax's denominator. Sequences from `first_seq` on, into `out` where given (the earlier
    rows are the caller's)."""
    out = torch.empty_like(q) if out is None else out
    loc, bs = meta.query_start_loc, meta.block_size
    spans: dict[int, list[tuple[int, int]]] = {}
    for s, first, end in meta.bidirectional:
        spans.setdefault(s, []).append((first, end))
    for s in range(first_seq, meta.num_seqs):
        lo, hi = loc[s], loc[s + 1]
        context, seq_len = meta.context_lens[s], int(meta.seq_lens[s])
        # the first query's oldest key
        oldest = 0 if window is None else max(0, context - window + 1)
        if chunk is not None:
            oldest = max(oldest, context // chunk * chunk)
        first_block = oldest // bs
        start = first_block * bs
        blocks = meta.block_table[s, first_block: -(-seq_len // bs)]
        keys = AttentionBackend.gather_kv(k_cache, blocks, seq_len - start, q.dtype)
        values = AttentionBackend.gather_kv(v_cache, blocks, seq_len - start, q.dtype)
        position = torch.arange(context, context + hi - lo, device=q.device).unsqueeze(1)
        key = torch.arange(start, seq_len, device=q.device).unsqueeze(0)
        visible = key <= position
        for first, end in spans.get(s, ()):
            visible |= ((position >= first) & (position < end)
                        & (key >= first) & (key < end))
        if window is not None:
            visible &= key > position - window
        if chunk is not None:
            visible &= key >= position // chunk * chunk
        if softcap is not None or sinks is not None:
            out[lo:hi] = _explicit(q[lo:hi], keys, values, visible, scale, softcap, sinks)
            continue
        out[lo:hi] = F.scaled_dot_product_attention(
            q[lo:hi].transpose(0, 1).unsqueeze(0), keys.transpose(0, 1).unsqueeze(0),
            values.transpose(0, 1).unsqueeze(0), attn_mask=visible, scale=scale,
            enable_gqa=True)[0].transpose(0, 1)
    return out


def _explicit(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor,
              visible: torch.Tensor, scale: float, cap: float | None,
              sinks: torch.Tensor | None) -> torch.Tensor:
    """Scores as products: soft-capped, and/or softmaxed with each head's sink logit."""
    group = q.shape[1] // keys.shape[1]
    keys = keys.repeat_interleave(group, dim=1)
    values = values.repeat_interleave(group, dim=1)
    scores = torch.einsum("qhd,khd->hqk", q, keys) * scale
    if cap is not None:
        scores = torch.tanh(scores / cap) * cap
    scores = scores.masked_fill(~visible, float("-inf")).float()
    if sinks is not None:  # (a column of each head's sink, dropped after the softmax)
        sink = sinks.float().view(-1, 1, 1).expand(-1, scores.shape[1], 1)
        probs = torch.softmax(torch.cat([scores, sink], dim=-1), dim=-1)[..., :-1]
    else:
        probs = torch.softmax(scores, dim=-1)
    return torch.einsum("hqk,khd->qhd", probs.to(q.dtype), values)
