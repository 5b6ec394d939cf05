"""DeepSeek's latent attention (MLA) over the paged cache in torch ops: each cached row is
one latent (`rank` values) and one rotary key; queries come already absorbed into the latent
space. The backends' `mla` (attention/backend.py) runs this; the Triton backend runs its
kernel instead (attention/triton), checked against this."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:  # (the backend calls this module: only annotations name its metadata)
    from tokenmill.attention.backend import AttentionMetadata


def sequence_rows(cache: torch.Tensor, meta: AttentionMetadata, s: int) -> torch.Tensor:
    """Sequence s's cached rows [seq_len, row] (its blocks in order)."""
    length = int(meta.seq_lens[s])
    blocks = meta.block_table[s, : -(-length // meta.block_size)]
    return cache[blocks].reshape(-1, cache.shape[-1])[:length]


def future_keys(n: int, length: int, device: torch.device) -> torch.Tensor:
    """[n, length] True where a key lies after its query (the n queries are the sequence's
    last positions): masked out."""
    keys = torch.arange(length, device=device)
    return keys.unsqueeze(0) > keys[length - n:].unsqueeze(1)


def mla_attention(q_latent: torch.Tensor, q_pe: torch.Tensor, cache: torch.Tensor,
                  meta: AttentionMetadata, rank: int, scale: float, first: int = 0,
                  out: torch.Tensor | None = None) -> torch.Tensor:
    """Attention over the latent cache: [T, heads, rank] softmax-weighted latents for queries
    already in the latent space; each sequence's queries see its keys up to their own
    position (causal). One sequence at a time (the reference); `first`: from that sequence
    on, into `out` (the rows before are left as they are)."""
    out = torch.empty_like(q_latent) if out is None else out
    loc = meta.query_start_loc
    for s in range(first, meta.num_seqs):
        start, end = loc[s], loc[s + 1]
        rows = sequence_rows(cache, meta, s).to(q_latent.dtype)
        c, k_pe = rows[:, :rank], rows[:, rank:]
        scores = (torch.einsum("qhr,kr->hqk", q_latent[start:end], c)
                  + torch.einsum("qhd,kd->hqk", q_pe[start:end], k_pe)) * scale
        n, length = end - start, rows.shape[0]
        mask = future_keys(n, length, scores.device)
        probs = torch.softmax(scores.masked_fill(mask, float("-inf")).float(), dim=-1)
        out[start:end] = torch.einsum("hqk,kr->qhr", probs.to(c.dtype), c)
    return out


def mla_decodes(q_latent: torch.Tensor, q_pe: torch.Tensor, rows: torch.Tensor,
                mask: torch.Tensor, rank: int, scale: float) -> torch.Tensor:
    """B one-token queries at once (the decodes of a step): q_latent [B, heads, rank], q_pe
    [B, heads, rope] over their sequences' rows padded to one length [B, L, rank + rope]
    (`mask` [B, 1, L]: 0 where a row is the sequence's, -inf past its end) -> [B, heads,
    rank]. The same sums as `mla_attention`, in three batched products."""
    scores = torch.bmm(torch.cat([q_latent, q_pe], dim=-1), rows.transpose(1, 2))
    probs = torch.softmax((scores * scale).float() + mask, dim=-1)
    return torch.bmm(probs.to(rows.dtype), rows)[..., :rank]
