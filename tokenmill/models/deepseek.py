"""DeepSeek-V3 / R1: multi-head latent attention (MLA) and DeepSeek's mixture of experts on
the Llama-family decoder.

MLA caches, per token and layer, only the compressed latent (`kv_lora_rank`, normed) and the
rotated shared key part (`qk_rope_head_dim`): one row of kv_lora_rank + qk_rope_head_dim in
the paged cache, never per-head K/V. Attention runs with the up-projection absorbed: each
head's query is taken into the latent space (q_nope @ W_UK), scored against the cached
latents plus the rotary part, and the softmax-weighted latents are taken out through W_UV,
so the cache is never expanded (`mla_reference` expands it, for tests). Heads are split
across tensor-parallel ranks; the latent cache is every rank's whole."""

from __future__ import annotations

import logging
from typing import Any

import torch
from torch import nn

from tokenmill.attention.backend import AttentionMetadata, LogitsRows
from tokenmill.attention.mla import future_keys, sequence_rows
from tokenmill.layers.host_sync import HostSync
from tokenmill.layers.linear import ColumnParallelLinear, Linear, RowParallelLinear
from tokenmill.layers.moe import SparseMoE
from tokenmill.layers.norm import RMSNorm
from tokenmill.layers.rotary import StepRotary, rope_parameters, yarn_mscale
from tokenmill.models.deepseek_mtp import build_mtp, mtp_name
from tokenmill.models.llama import MLP, LlamaForCausalLM, holds_expert

logger = logging.getLogger(__name__)


class MLAttention(HostSync, nn.Module):
    stores_values = False  # the cache holds one latent row per token: no V cache

    @property
    def host_sync(self) -> bool:
        """The torch ops loop over sequences on the host; a graph-safe backend does not."""
        return self.backend is None or not self.backend.graph_safe

    def __init__(self, config: Any, scale: float, interleaved: bool) -> None:
        super().__init__()
        hidden, heads = config.hidden_size, config.num_attention_heads
        self.nope, self.rope_dim = config.qk_nope_head_dim, config.qk_rope_head_dim
        self.v_dim, self.rank = config.v_head_dim, config.kv_lora_rank
        self.interleaved = interleaved  # rotary on (x0, x1), (x2, x3) .. pairs
        q_width = heads * (self.nope + self.rope_dim)
        if config.q_lora_rank is None:
            self.q_proj = ColumnParallelLinear(hidden, q_width)
        else:
            self.q_a_proj = Linear(hidden, config.q_lora_rank, config.attention_bias)
            self.q_a_layernorm = RMSNorm(config.q_lora_rank, config.rms_norm_eps)
            self.q_b_proj = ColumnParallelLinear(config.q_lora_rank, q_width)
        self.kv_a_proj_with_mqa = Linear(hidden, self.rank + self.rope_dim,
                                         config.attention_bias)
        self.kv_a_layernorm = RMSNorm(self.rank, config.rms_norm_eps)
        # absorbed into the queries and outputs: its float weight is read, never multiplied
        self.kv_b_proj = ColumnParallelLinear(self.rank, heads * (self.nope + self.v_dim))
        self.kv_b_proj.keep_weight = True
        self.num_heads = self.kv_b_proj.out_features // (self.nope + self.v_dim)  # this rank's
        self.o_proj = RowParallelLinear(heads * self.v_dim, hidden, config.attention_bias)
        self.scale = scale
        # the paged cache's row: one "head" of latent | rotary key
        self.num_kv_heads, self.head_dim = 1, self.rank + self.rope_dim
        self.backend = None
        self.k_cache = torch.empty(0)
        self.v_cache = torch.empty(0)

    def _queries(self, x: torch.Tensor) -> torch.Tensor:
        if hasattr(self, "q_proj"):
            return self.q_proj(x)
        return self.q_b_proj(self.q_a_layernorm(self.q_a_proj(x)))

    def _rotate(self, rope: StepRotary, x: torch.Tensor) -> torch.Tensor:
        """Rotary on [T, heads, rope_dim]; DeepSeek-V3's interleaved pairs are first laid
        out as halves (the dot products the scores take are the same)."""
        if self.interleaved:
            x = torch.cat([x[..., 0::2], x[..., 1::2]], dim=-1)
        return rope(x.contiguous())

    def absorbed(self) -> tuple[torch.Tensor, torch.Tensor]:
        """W_UK [heads, nope, rank] and W_UV [heads, v, rank] of this rank's heads."""
        w = self.kv_b_proj.weight.view(self.num_heads, self.nope + self.v_dim, self.rank)
        return w[:, : self.nope], w[:, self.nope:]

    def forward(self, rope: StepRotary, x: torch.Tensor, meta: AttentionMetadata,
                logits_rows: LogitsRows | None = None) -> torch.Tensor:
        t = x.shape[0]
        latent = self.kv_a_proj_with_mqa(x)
        c = self.kv_a_layernorm(latent[:, : self.rank].contiguous())
        k_pe = self._rotate(rope, latent[:, self.rank:].reshape(t, 1, self.rope_dim))
        rows = torch.cat([c, k_pe.reshape(t, self.rope_dim)], dim=-1)
        self.backend.store_rows(self.k_cache.view(-1, self.head_dim), meta.slot_mapping, rows)
        if logits_rows is not None:
            if not logits_rows.count:
                return x.new_empty(0, x.shape[1])
            x, meta, t = x[logits_rows.rows], logits_rows.meta, logits_rows.count
            positions = rope.positions[logits_rows.rows]
            rope = rope.rotary.for_step(positions, rope.dtype)
        q = self._queries(x).view(t, self.num_heads, self.nope + self.rope_dim)
        q_pe = self._rotate(rope, q[..., self.nope:])
        w_uk, w_uv = self.absorbed()
        q_latent = torch.einsum("thn,hnr->thr", q[..., : self.nope], w_uk)
        out = self.backend.mla(q_latent, q_pe, self.k_cache, meta, self.rank, self.scale)
        out = torch.einsum("thr,hvr->thv", out, w_uv)
        return self.o_proj(out.reshape(t, self.num_heads * self.v_dim))


def mla_reference(layer: MLAttention, q: torch.Tensor, q_pe: torch.Tensor,
                  meta: AttentionMetadata) -> torch.Tensor:
    """The slow obvious MLA: expand every cached latent into per-head K and V through
    kv_b_proj and attend as multi-head attention ([T, heads, v_dim] out; for tests)."""
    w_uk, w_uv = layer.absorbed()
    out = q.new_empty(q.shape[0], layer.num_heads, layer.v_dim)
    loc = meta.query_start_loc
    for s in range(meta.num_seqs):
        start, end = loc[s], loc[s + 1]
        rows = sequence_rows(layer.k_cache, meta, s)
        c, k_pe = rows[:, : layer.rank], rows[:, layer.rank:]
        k_nope = torch.einsum("kr,hnr->khn", c, w_uk)
        v = torch.einsum("kr,hvr->khv", c, w_uv)
        n, length = end - start, rows.shape[0]
        scores = (torch.einsum("qhn,khn->hqk", q[start:end], k_nope)
                  + torch.einsum("qhd,kd->hqk", q_pe[start:end], k_pe)) * layer.scale
        mask = future_keys(n, length, scores.device)
        probs = torch.softmax(scores.masked_fill(mask, float("-inf")), dim=-1)
        out[start:end] = torch.einsum("hqk,khv->qhv", probs, v)
    return out


def mla_scale(config: Any) -> float:
    """1 / sqrt(qk head size), times YaRN's mscale(mscale_all_dim) squared when scaled."""
    scale = (config.qk_nope_head_dim + config.qk_rope_head_dim) ** -0.5
    params = rope_parameters(config)
    if params["rope_type"] != "default" and params.get("mscale_all_dim"):
        m = yarn_mscale(float(params["factor"]), float(params["mscale_all_dim"]))
        scale *= m * m
    return scale


def deepseek_mlp(config: Any, layer: int) -> nn.Module:
    """DeepSeek-V3's routing (sigmoid, grouped), or DeepSeek-V2's `topk_method` (softmax:
    `greedy`, or `group_limited_greedy`)."""
    if layer < config.first_k_dense_replace or layer % getattr(config, "moe_layer_freq", 1):
        return MLP(config)
    shared = (MLP(config, config.moe_intermediate_size * config.n_shared_experts, reduce=False)
              if config.n_shared_experts else None)
    method = getattr(config, "topk_method", "noaux_tc")
    router = {"greedy": "softmax", "group_limited_greedy": "softmax_grouped"}.get(
        method, "sigmoid_grouped")
    return SparseMoE(config.hidden_size, config.n_routed_experts, config.num_experts_per_tok,
                     bool(config.norm_topk_prob),
                     lambda split: MLP(config, config.moe_intermediate_size, reduce=False,
                                       split=split), shared,
                     router=router, grouped=(config.n_group or 1, config.topk_group or 1,
                                             float(config.routed_scaling_factor)))


class DeepseekV3ForCausalLM(LlamaForCausalLM):
    """DeepSeek-V3 / R1, and DeepSeek-V2 (its rotary pairs interleaved as V3's, routing by
    `topk_method`). The MTP layers (`mtp`, models/deepseek_mtp.py) live on the first pipeline
    stage, where draft heads run beside the sampler (worker/draft_heads.py)."""

    latent = True  # MLA (GLM-4.5: grouped-query attention beside the same experts)

    def __init__(self, config: Any, max_positions: int, make_attention=None,
                 **options) -> None:
        if make_attention is None:
            scale = mla_scale(config)
            interleaved = bool(getattr(config, "rope_interleave", True))

            def make_attention(config, layer):
                return MLAttention(config, scale, interleaved)
        super().__init__(config, max_positions, make_mlp=deepseek_mlp,
                         make_attention=make_attention, **options)
        self.mtp = (build_mtp(config, make_attention, deepseek_mlp)
                    if self.model.is_first_stage else nn.ModuleList())

    def mtp_layers(self) -> list[nn.Module]:
        return list(self.mtp)

    def holds(self, name: str) -> bool:
        ours = mtp_name(name, self.config.num_hidden_layers)
        if ours is None or not ours.startswith("mtp."):
            return ours is not None and super().holds(name)
        index = int(ours.split(".")[1])
        return index < len(self.mtp) and holds_expert(self.mtp[index].block.mlp, ours)

    def unread(self, name: str) -> bool:
        """(and the MTP layers when the engine does not speculate with them)"""
        return (name.startswith("mtp.") and not self.holds(name)) or super().unread(name)

    def checkpoint_target(self, name: str) -> tuple[str, int | None]:
        name = mtp_name(name, self.config.num_hidden_layers) or name
        if ".self_attn." in name and self.latent:  # MLA's own projections (no q|k|v)
            return name, None
        # DeepSeek's shared experts are `shared_experts` (plural)
        return super().checkpoint_target(name.replace(".shared_experts.", ".shared_expert."))

    def finish_loading(self, loaded: set[str]) -> None:
        if len(self.mtp) and not any(name.startswith("mtp.") for name in loaded):
            logger.info("The checkpoint has no multi-token-prediction layers' tensors "
                        "(num_nextn_predict_layers=%d): none kept.", len(self.mtp))
            self.mtp = nn.ModuleList()
