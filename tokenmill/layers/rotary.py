"""Rotary position embedding (default, linear, Llama-3, LongRoPE and YaRN scaling, or a GGUF's
per-frequency factors) with a cos/sin table; M-RoPE (Qwen2-VL's multimodal rotary) over the
same table."""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import nn

from tokenmill import csrc
from tokenmill.layers import triton_ops


def rope_parameters(config: Any) -> dict[str, Any]:
    """One dict {rope_type, rope_theta, ...} from either transformers 5's `rope_parameters` or
    the older `rope_theta` + `rope_scaling` pair."""
    params = dict(getattr(config, "rope_parameters", None) or {})
    scaling = getattr(config, "rope_scaling", None) or {}
    params = {**scaling, **params}
    params.setdefault("rope_theta", getattr(config, "rope_theta", None) or 10000.0)
    params["rope_type"] = params.get("rope_type", params.get("type", "default"))
    if params["rope_type"] == "su":  # Phi-3's first name for LongRoPE
        params["rope_type"] = "longrope"
    if params["rope_type"] == "mrope":  # (Qwen2-VL's first name: its `mrope_section` says it)
        params["rope_type"] = "default"
    if params.get("original_max_position_embeddings") is None:
        original = getattr(config, "original_max_position_embeddings", None)
        if original is not None:
            params["original_max_position_embeddings"] = original
    partial = params.get("partial_rotary_factor", getattr(config, "partial_rotary_factor", 1.0))
    params["partial_rotary_factor"] = float(partial or 1.0)
    return params


def rotary_dim(head_dim: int, params: dict[str, Any]) -> int:
    """The dimensions of each head that rotate (Phi-2, GLM: `partial_rotary_factor` < 1)."""
    return int(head_dim * params.get("partial_rotary_factor", 1.0))


def head_order(head_dim: int, rotated: int, interleaved: bool) -> torch.Tensor | None:
    """The order a head's q and k dimensions are laid out in before a full-width Neox
    rotation that equals the checkpoint's (None: as they are). Partial rotary (the first
    `rotated` dimensions turn): their halves go to [0, r/2) and [D/2, D/2 + r/2), where the
    table's rows turn them; the rest fill the gaps, where the table holds cos 1 and sin 0.
    Interleaved pairs (GLM's (x0, x1), (x2, x3) ..) go to i and D/2 + i the same way. q and k
    take the same order, so their dot products, the scores, are the checkpoint's."""
    if rotated == head_dim and not interleaved:
        return None
    half = rotated // 2
    if interleaved:
        first, second = list(range(0, rotated, 2)), list(range(1, rotated, 2))
    else:
        first, second = list(range(half)), list(range(half, rotated))
    rest = list(range(rotated, head_dim))
    gap = head_dim // 2 - half
    return torch.tensor(first + rest[:gap] + second + rest[gap:])


def rope_parameters_by_layer_type(config: Any) -> dict[str, dict[str, Any]] | None:
    """Gemma 3's rotary settings per layer type ({"full_attention": ..., "sliding_attention":
    ...}), each as `rope_parameters` gives them; None for one setting for every layer."""
    params = getattr(config, "rope_parameters", None) or {}
    if not isinstance(params.get("full_attention"), dict):
        return None
    out = {}
    for kind, own in params.items():
        own = dict(own)
        own["rope_type"] = own.get("rope_type", own.get("type", "default"))
        own.setdefault("rope_theta", 10000.0)
        out[kind] = own
    return out


def longrope_length(params: dict[str, Any]) -> int | None:
    """The context LongRoPE's short factors serve (None for other rope types): transformers
    switches to the long ones when a sequence passes it; a table for longer sequences takes
    the long ones for every position (models/info.py derive_max_model_len)."""
    if params["rope_type"] != "longrope":
        return None
    return int(params["original_max_position_embeddings"])


def yarn_mscale(factor: float, mscale: float = 1.0) -> float:
    return 1.0 if factor <= 1 else 0.1 * mscale * math.log(factor) + 1.0


def attention_factor(params: dict[str, Any], max_position_embeddings: int) -> float:
    """What cos and sin are scaled by: LongRoPE's sqrt(1 + ln(factor) / ln(original
    context)), factor = max_position_embeddings / original; YaRN's mscale (DeepSeek's:
    mscale(factor, mscale) / mscale(factor, mscale_all_dim)); 1 for the other types."""
    if params["rope_type"] not in ("longrope", "yarn"):
        return 1.0
    if params.get("attention_factor") is not None:
        return float(params["attention_factor"])
    if params["rope_type"] == "yarn":
        factor = _yarn_factor(params, max_position_embeddings)
        mscale, all_dim = params.get("mscale"), params.get("mscale_all_dim")
        if mscale and all_dim:
            return yarn_mscale(factor, mscale) / yarn_mscale(factor, all_dim)
        return yarn_mscale(factor)
    original = params["original_max_position_embeddings"]
    factor = params.get("factor") or max_position_embeddings / original
    return 1.0 if factor <= 1.0 else math.sqrt(1 + math.log(factor) / math.log(original))


def inverse_frequencies(head_dim: int, params: dict[str, Any], max_position_embeddings: int,
                        max_positions: int | None = None) -> torch.Tensor:
    """`max_positions`: the longest sequence the table serves (LongRoPE: its long factors
    past the original context, see longrope_length)."""
    inv_freq = _scaled_frequencies(head_dim, params, max_position_embeddings, max_positions)
    factors = params.get("freq_factors")  # a GGUF's rope_freqs: per frequency, its divisor
    if factors is not None:
        if len(factors) != head_dim // 2:
            raise ValueError(f"rope_freqs has {len(factors)} factors; the heads' {head_dim} "
                             f"dimensions rotate {head_dim // 2} frequencies.")
        inv_freq = inv_freq / torch.tensor(factors, dtype=torch.float32)
    return inv_freq


def _scaled_frequencies(head_dim: int, params: dict[str, Any], max_position_embeddings: int,
                        max_positions: int | None) -> torch.Tensor:
    base = float(params["rope_theta"])
    exponents = torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim
    inv_freq = 1.0 / (base ** exponents)
    rope_type = params["rope_type"]
    if rope_type == "default":
        return inv_freq
    if rope_type == "linear":
        return inv_freq / float(params["factor"])
    if rope_type == "longrope":
        long = max_positions is not None and max_positions > longrope_length(params)
        factors = params["long_factor" if long else "short_factor"]
        return inv_freq / torch.tensor(factors, dtype=torch.float32)
    if rope_type == "yarn":
        return _yarn_frequencies(head_dim, params, max_position_embeddings, inv_freq)
    if rope_type == "llama3":
        factor = float(params["factor"])
        low, high = float(params["low_freq_factor"]), float(params["high_freq_factor"])
        old_len = params.get("original_max_position_embeddings") or max_position_embeddings
        low_wavelen, high_wavelen = old_len / low, old_len / high
        wavelen = 2 * math.pi / inv_freq
        # Long wavelengths are slowed by `factor`, short ones kept, the band between blended.
        scaled = torch.where(wavelen > low_wavelen, inv_freq / factor, inv_freq)
        smooth = (old_len / wavelen - low) / (high - low)
        blended = (1 - smooth) * scaled / factor + smooth * scaled
        medium = ~(wavelen < high_wavelen) * ~(wavelen > low_wavelen)
        return torch.where(medium, blended, scaled)
    raise ValueError(f"Unsupported rope scaling type {rope_type!r}; supported: default, linear, "
                     "llama3, longrope, yarn.")


def _yarn_factor(params: dict[str, Any], max_position_embeddings: int) -> float:
    if params.get("factor") is not None:
        return float(params["factor"])
    return max_position_embeddings / params["original_max_position_embeddings"]


def _yarn_frequencies(head_dim: int, params: dict[str, Any], max_position_embeddings: int,
                      extrapolated: torch.Tensor) -> torch.Tensor:
    """YaRN: frequencies that turn fewer than `beta_slow` times over the original context
    are interpolated (divided by the factor), those turning more than `beta_fast` times kept,
    a linear ramp between."""
    base, factor = float(params["rope_theta"]), _yarn_factor(params, max_position_embeddings)
    original = params.get("original_max_position_embeddings") or max_position_embeddings
    beta_fast, beta_slow = params.get("beta_fast") or 32, params.get("beta_slow") or 1

    def dimension(rotations: float) -> float:
        return (head_dim * math.log(original / (rotations * 2 * math.pi))) / (2 * math.log(base))

    low, high = dimension(beta_fast), dimension(beta_slow)
    if params.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, head_dim - 1)
    if low == high:
        high += 0.001
    ramp = ((torch.arange(head_dim // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)
    kept = 1 - ramp  # the share of each frequency left as it is
    return extrapolated / factor * (1 - kept) + extrapolated * kept


class RotaryEmbedding(nn.Module):
    """Neox-style rotary embedding, HF's `x * cos + rotate_half(x) * sin` element for element.

    `rotate_half(x) * sin` is computed as `roll(x, D/2) * signed_sin` (the first half of the
    sin table negated): the same products, since negation is exact. Partial rotary: the table
    is full width, its rows for the dimensions that do not turn cos 1 and sin 0 (exact), in
    the layout `head_order` gives. `for_step` prepares what every layer of a step shares."""

    def __init__(self, head_dim: int, max_positions: int, params: dict[str, Any],
                 max_position_embeddings: int) -> None:
        super().__init__()
        rotated = rotary_dim(head_dim, params)
        inv_freq = inverse_frequencies(rotated, params, max_position_embeddings, max_positions)
        freqs = torch.arange(max_positions, dtype=torch.float).unsqueeze(1) * inv_freq
        scale = attention_factor(params, max_position_embeddings)
        cos = torch.ones(max_positions, head_dim)
        sin = torch.zeros(max_positions, head_dim)
        half, turned = head_dim // 2, rotated // 2
        for start in (0, half):
            cos[:, start:start + turned] = freqs.cos() * scale
            sin[:, start:start + turned] = freqs.sin() * scale
        sin[:, :half].neg_()
        self.register_buffer("cos", cos, persistent=False)
        self.register_buffer("signed_sin", sin, persistent=False)

    def for_step(self, positions: torch.Tensor, dtype: torch.dtype) -> StepRotary:
        return StepRotary(self, positions, dtype)


class MRotaryEmbedding(RotaryEmbedding):
    """M-RoPE (Qwen2-VL): the frequencies in three sections (`mrope_section`), rotated by a
    token's temporal, height and width position each. A step given positions [3, rows]
    gathers its rows' cos / signed sin from the table, each column at its section's
    position, and rotates with those as a table of its own (so every kernel that reads a
    table serves it); given positions [rows] (text: the three are equal) it is the plain
    rotation."""

    def __init__(self, head_dim: int, max_positions: int, params: dict[str, Any],
                 max_position_embeddings: int) -> None:
        super().__init__(head_dim, max_positions, params, max_position_embeddings)
        sections = [int(n) for n in params["mrope_section"]]
        if sum(sections) != head_dim // 2 or len(sections) != 3:
            raise ValueError(f"mrope_section {sections} must be three sections of the "
                             f"{head_dim // 2} rotated frequencies.")
        column = torch.repeat_interleave(torch.arange(3), torch.tensor(sections))
        self.register_buffer("section_of", torch.cat((column, column)), persistent=False)

    def for_step(self, positions: torch.Tensor, dtype: torch.dtype) -> StepRotary:
        if positions.dim() == 1:
            return StepRotary(self, positions, dtype)
        index = positions[self.section_of].t()  # [rows, head_dim]: each column's position
        table = _StepTable(self.cos.gather(0, index), self.signed_sin.gather(0, index))
        return StepRotary(table, torch.arange(len(index), device=positions.device), dtype)


class _StepTable:
    """A step's own cos / signed-sin rows, read at row i by token i (M-RoPE)."""

    def __init__(self, cos: torch.Tensor, signed_sin: torch.Tensor) -> None:
        self.cos, self.signed_sin = cos, signed_sin


class StepRotary:
    """One step's rotation, shared by all layers: float32 on the CPU rotates in place with the
    compiled kernel (reading the tables at each token's position); otherwise the cos / signed
    sin rows of the step's positions are gathered once and applied with torch ops (on GPUs:
    one Triton kernel reading the tables, triton_ops.py)."""

    def __init__(self, rotary: RotaryEmbedding | _StepTable, positions: torch.Tensor,
                 dtype: torch.dtype) -> None:
        self.rotary, self.positions, self.dtype = rotary, positions, dtype
        self.compiled = (dtype == torch.float32 and csrc.usable(rotary.cos)
                         and positions.device.type == "cpu")
        self._rows: tuple[torch.Tensor, torch.Tensor] | None = None

    def tables(self, x: torch.Tensor):
        """(cos, signed_sin, positions) for a kernel that rotates x [T, H, D] itself (rows of
        D contiguous, a full-width table), else None."""
        cos = self.rotary.cos
        if x.stride(-1) != 1 or cos.shape[-1] != x.shape[-1] or cos.device != x.device:
            return None
        return cos, self.rotary.signed_sin, self.positions

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        """x [T, H, D] rotated by each token's position (q and k heads can go together); may
        rotate x in place and return it."""
        if self.compiled and csrc.heads_contiguous(x):
            csrc.rotary_(x, self.rotary.cos, self.rotary.signed_sin, self.positions)
            return x
        if (triton_ops.usable(x) and x.stride(-1) == 1
                and self.rotary.cos.shape[-1] == x.shape[-1]):
            return triton_ops.rotary(x, self.rotary.cos, self.rotary.signed_sin, self.positions)
        if self._rows is None:  # [T, 1, D] each, gathered by the first layer that needs them
            self._rows = tuple(table[self.positions].unsqueeze(1).to(self.dtype)
                               for table in (self.rotary.cos, self.rotary.signed_sin))
        cos, signed_sin = self._rows
        return x * cos + x.roll(x.shape[-1] // 2, dims=-1) * signed_sin
