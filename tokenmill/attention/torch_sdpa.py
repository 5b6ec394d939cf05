"""CPU attention with torch SDPA: one batched gather for decodes, per-sequence SDPA for prompts."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from tokenmill.attention.backend import AttentionBackend, AttentionMetadata


def _group_queries(q: torch.Tensor, num_kv_heads: int) -> torch.Tensor:
    """[..., T, Hq, D] -> [..., Hkv, G*T, D]: the G query heads sharing a KV head become extra
    query rows, so grouped-query attention runs as plain attention without copying K/V."""
    *lead, t, hq, d = q.shape
    g = hq // num_kv_heads
    q = q.view(*lead, t, num_kv_heads, g, d).movedim(-4, -2)  # [..., Hkv, G, T, D]
    return q.reshape(*lead, num_kv_heads, g * t, d)


def _ungroup(out: torch.Tensor, t: int) -> torch.Tensor:
    """Inverse of `_group_queries`: [..., Hkv, G*T, D] -> [..., T, Hq, D]."""
    *lead, hkv, gt, d = out.shape
    g = gt // t
    out = out.view(*lead, hkv, g, t, d).movedim(-2, -4)  # [..., T, Hkv, G, D]
    return out.reshape(*lead, t, hkv * g, d)


class TorchSDPABackend(AttentionBackend):
    def forward(self, q, k, v, k_cache, v_cache, meta: AttentionMetadata, scale: float):
        self.write_kv(k, v, k_cache, v_cache, meta.slot_mapping)
        num_kv_heads = k.shape[1]
        out = torch.empty_like(q)
        nd = meta.num_decodes
        if nd:
            out[:nd] = self._decode(q[:nd], k_cache, v_cache, meta, num_kv_heads, scale)
        for s in range(nd, meta.num_seqs):
            lo, hi = meta.query_start_loc[s], meta.query_start_loc[s + 1]
            context = meta.context_lens[s]
            if context == 0:
                # Fresh prompt: its K/V are exactly this step's k, v; no cache read needed.
                out[lo:hi] = F.scaled_dot_product_attention(
                    q[lo:hi].transpose(0, 1), k[lo:hi].transpose(0, 1),
                    v[lo:hi].transpose(0, 1), is_causal=True, scale=scale, enable_gqa=True,
                ).transpose(0, 1)
                continue
            seq_len = context + hi - lo
            n_blocks = -(-seq_len // meta.block_size)
            keys = self.gather_kv(k_cache, meta.block_table[s, :n_blocks], seq_len)
            values = self.gather_kv(v_cache, meta.block_table[s, :n_blocks], seq_len)
            # Bottom-right causal mask: query i sees keys 0..context+i.
            rows = torch.arange(hi - lo, device=q.device).unsqueeze(1) + context
            mask = torch.arange(seq_len, device=q.device).unsqueeze(0) <= rows  # [t, seq_len]
            g = q.shape[1] // num_kv_heads
            attn = F.scaled_dot_product_attention(
                _group_queries(q[lo:hi], num_kv_heads), keys.transpose(0, 1),
                values.transpose(0, 1), attn_mask=mask.repeat(g, 1), scale=scale)
            out[lo:hi] = _ungroup(attn, hi - lo)
        return out

    def _decode(self, q, k_cache, v_cache, meta, num_kv_heads, scale):
        seq_lens = meta.seq_lens[: meta.num_decodes]
        max_len = int(seq_lens.max())
        n_blocks = -(-max_len // meta.block_size)
        table = meta.block_table[: meta.num_decodes, :n_blocks]
        b = table.shape[0]
        # [B, n_blocks, block_size, Hkv, D] -> [B, Hkv, L, D]
        # index_select, not k_cache[table]: several times faster on CPU for this gather.
        flat = table.reshape(-1)
        keys = k_cache.index_select(0, flat).view(b, -1, *k_cache.shape[2:])
        values = v_cache.index_select(0, flat).view(b, -1, *v_cache.shape[2:])
        keys = keys[:, :max_len].transpose(1, 2)
        values = values[:, :max_len].transpose(1, 2)
        mask = torch.arange(max_len, device=q.device) < seq_lens.unsqueeze(1)
        mask = mask.view(b, 1, 1, max_len)
        attn = F.scaled_dot_product_attention(
            _group_queries(q.unsqueeze(1), num_kv_heads), keys, values, attn_mask=mask,
            scale=scale)  # q: [B, 1, Hq, D] -> [B, Hkv, G, D]
        return _ungroup(attn, 1).squeeze(1)
