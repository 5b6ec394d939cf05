"""CPU attention: decodes read the paged cache in place (compiled kernel) or through one batched
gather + SDPA; prompts too (compiled kernel, float32 caches), else SDPA batched by length."""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from tokenmill import csrc
from tokenmill.attention.backend import (
    AttentionBackend,
    AttentionMetadata,
    fresh_prompt_attention,
    fresh_prompt_runs,
)
from tokenmill.attention.mla import mla_attention, mla_decodes
from tokenmill.attention.window import masked_attention


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


@dataclass
class _DecodeGather:
    """What the gather path for decodes needs, shared by all layers of a step."""

    blocks: torch.Tensor  # flat block ids of the decode rows [B * n_blocks]
    max_len: int  # longest decode sequence
    mask: torch.Tensor  # additive [B, 1, 1, max_len]: 0 visible, -inf padding


@dataclass
class _StepPlan:
    """Per-step work shared by all layers."""

    # (first seq, last seq + 1) runs of consecutive fresh prompts of equal length
    fresh_runs: list[tuple[int, int]]
    # per prompt sequence: first token row (from the first prompt's), query tokens, context;
    # built by the first layer that runs the compiled prompt kernel
    prompts: torch.Tensor | None = None
    decode_gather: _DecodeGather | None = None  # built by the first layer that needs it


# latent attention's decodes are gathered in groups of about this many bytes of rows
MLA_GATHER_BYTES = 2 << 20


class TorchSDPABackend(AttentionBackend):
    def __init__(self, use_compiled_decode: bool | None = None):
        # The compiled kernel attends decodes over the cache blocks where they lie; torch ops
        # must copy every sequence's K/V into a padded batch first (per layer, per step).
        self.use_compiled_decode = (csrc.available() if use_compiled_decode is None
                                    else use_compiled_decode)

    def _compiled_decode(self, q: torch.Tensor) -> bool:
        return (self.use_compiled_decode and q.device.type == "cpu"
                and q.dtype == torch.float32 and q.shape[-1] % 8 == 0)

    def _compiled_prompts(self, q: torch.Tensor, k_cache: torch.Tensor) -> bool:
        # the same switch as decodes: the compiled kernels are one choice
        return (self._compiled_decode(q) and k_cache.dtype in csrc.KV_KINDS
                and csrc.heads_contiguous(q))

    def prepare(self, meta: AttentionMetadata) -> None:
        meta.backend_data = _StepPlan(fresh_prompt_runs(meta))

    @staticmethod
    def _prompt_rows(meta: AttentionMetadata) -> torch.Tensor:
        plan: _StepPlan = meta.backend_data
        if plan.prompts is None:
            nd, loc = meta.num_decodes, meta.query_start_loc
            plan.prompts = torch.tensor(
                [[loc[s] - loc[nd], loc[s + 1] - loc[s], meta.context_lens[s]]
                 for s in range(nd, meta.num_seqs)], dtype=torch.int64)
        return plan.prompts

    @staticmethod
    def _decode_gather(meta: AttentionMetadata) -> _DecodeGather:
        plan: _StepPlan = meta.backend_data
        if plan.decode_gather is None:
            nd = meta.num_decodes
            seq_lens = meta.seq_lens[:nd]
            max_len = int(seq_lens.max())
            n_blocks = -(-max_len // meta.block_size)
            blocks = meta.block_table[:nd, :n_blocks].reshape(-1)
            # An additive float mask: SDPA converts a boolean one on every call.
            visible = torch.arange(max_len, device=seq_lens.device) < seq_lens.unsqueeze(1)
            mask = torch.zeros(visible.shape, device=seq_lens.device)
            mask.masked_fill_(~visible, float("-inf"))
            plan.decode_gather = _DecodeGather(blocks, max_len, mask.view(nd, 1, 1, max_len))
        return plan.decode_gather

    def attend(self, q, k, v, k_cache, v_cache, meta: AttentionMetadata, scale: float,
               window: int | None = None, softcap: float | None = None,
               chunk: int | None = None, sinks: torch.Tensor | None = None):
        nd = meta.num_decodes
        compiled = bool(nd) and self._compiled_decode(q) and k_cache.dtype in csrc.KV_KINDS
        banded = window is not None or sinks is not None  # (the compiled decodes take these)
        if (softcap is not None or chunk is not None or meta.bidirectional
                or (banded and not compiled)):
            return masked_attention(q, k_cache, v_cache, meta, scale, window, softcap, chunk,
                                    sinks)
        plan: _StepPlan = meta.backend_data
        num_kv_heads = k.shape[1]
        out = torch.empty_like(q)
        loc = meta.query_start_loc
        if compiled:
            # q may be a view of the qkv output (read in place); out's first rows are contiguous
            decodes = q[:nd] if csrc.heads_contiguous(q) else q[:nd].contiguous()
            csrc.paged_decode_attention(
                decodes, k_cache, v_cache, meta.block_table, meta.seq_lens[:nd], scale,
                out[:nd], window, None if sinks is None else sinks.float().contiguous())
            if banded:  # the prompts: the masked path
                return masked_attention(q, k_cache, v_cache, meta, scale, window, None, None,
                                        sinks, first_seq=nd, out=out)
        elif nd:
            out[:nd] = self._decode(q[:nd], k_cache, v_cache, self._decode_gather(meta),
                                    num_kv_heads, scale)
        if meta.num_seqs > nd and self._compiled_prompts(q, k_cache):
            lo = loc[nd]
            if csrc.prompt_attention(q[lo:], k_cache, v_cache, meta.block_table[nd:],
                                     self._prompt_rows(meta), scale, out[lo:]):
                return out
        # fresh prompts: their K/V are exactly this step's k, v; no cache read needed
        fresh_prompt_attention(q, k, v, out, loc, plan.fresh_runs, scale)
        for s in range(nd, meta.num_seqs):
            context = meta.context_lens[s]
            if context == 0:
                continue
            lo, hi = loc[s], loc[s + 1]
            seq_len = context + hi - lo
            n_blocks = -(-seq_len // meta.block_size)
            keys = self.gather_kv(k_cache, meta.block_table[s, :n_blocks], seq_len, q.dtype)
            values = self.gather_kv(v_cache, meta.block_table[s, :n_blocks], seq_len, q.dtype)
            # Bottom-right causal mask: query i sees keys 0..context+i.
            rows = torch.arange(hi - lo, device=q.device).unsqueeze(1) + context
            mask = torch.arange(seq_len, device=q.device).unsqueeze(0) <= rows  # [t, seq_len]
            g = q.shape[1] // num_kv_heads
            attn = F.scaled_dot_product_attention(
                _group_queries(q[lo:hi], num_kv_heads), keys.transpose(0, 1),
                values.transpose(0, 1), attn_mask=mask.repeat(g, 1), scale=scale)
            out[lo:hi] = _ungroup(attn, hi - lo)
        return out

    def mla(self, q_latent, q_pe, cache, meta: AttentionMetadata, rank: int, scale: float):
        """The step's decodes batched over their gathered rows (attention/mla.py's
        `mla_decodes`), its prompts one sequence at a time (`mla_attention`)."""
        nd = meta.num_decodes
        if not nd:
            return mla_attention(q_latent, q_pe, cache, meta, rank, scale)
        plan = self._decode_gather(meta)
        width = cache.shape[-1]
        blocks, mask = plan.blocks.view(nd, -1), plan.mask.view(nd, 1, -1)
        # on CPUs, sequences in groups whose gathered rows stay in the caches (one gather of
        # every row, written to memory and read back twice, was slower than the loop)
        group = nd if cache.device.type != "cpu" else max(
            1, MLA_GATHER_BYTES // (plan.max_len * width * q_latent.element_size()))
        out = torch.empty_like(q_latent)
        for lo in range(0, nd, group):
            hi = min(nd, lo + group)
            rows = self.read_blocks(cache, blocks[lo:hi].reshape(-1), q_latent.dtype)
            rows = rows.view(hi - lo, -1, width)[:, :plan.max_len]
            out[lo:hi] = mla_decodes(q_latent[lo:hi], q_pe[lo:hi], rows, mask[lo:hi], rank,
                                     scale)
        return mla_attention(q_latent, q_pe, cache, meta, rank, scale, first=nd, out=out)

    @classmethod
    def _decode(cls, q, k_cache, v_cache, plan: _DecodeGather, num_kv_heads, scale):
        b = q.shape[0]
        # [B * n_blocks, block_size, Hkv, D] -> [B, Hkv, L, D]
        # index_select, not k_cache[table]: several times faster on CPU for this gather.
        keys = cls.read_blocks(k_cache, plan.blocks, q.dtype)
        values = cls.read_blocks(v_cache, plan.blocks, q.dtype)
        keys, values = keys.view(b, -1, *keys.shape[2:]), values.view(b, -1, *values.shape[2:])
        keys = keys[:, : plan.max_len].transpose(1, 2)
        values = values[:, : plan.max_len].transpose(1, 2)
        attn = F.scaled_dot_product_attention(
            _group_queries(q.unsqueeze(1), num_kv_heads), keys, values,
            attn_mask=plan.mask, scale=scale)  # q: [B, 1, Hq, D] -> [B, Hkv, G, D]
        return _ungroup(attn, 1).squeeze(1)
