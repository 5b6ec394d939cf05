"""Which GGUF block type each tensor of a converted file gets: one type for every 2-D weight
(`--outtype q8_0`, `q6_k`, ...), or llama.cpp's `Q4_K_M` / `Q5_K_M` mixes (llama-quantize's
rules for the tensors tokenmill's architectures have: the LM head in Q6_K, the value
projections and down projections of the layers `use_more_bits` picks in Q6_K, Q8_0 value /
key projections for 8-expert models), and the fallbacks llama.cpp takes for rows that are no
whole number of a type's blocks."""

from __future__ import annotations

import re

import gguf

T = gguf.GGMLQuantizationType
OUTTYPES = {"f32": None, "f16": T.F16, "bf16": T.BF16, "q8_0": T.Q8_0, "q4_0": T.Q4_0,
            "q4_1": T.Q4_1, "q5_0": T.Q5_0, "q5_1": T.Q5_1, "q2_k": T.Q2_K, "q3_k": T.Q3_K,
            "q4_k": T.Q4_K, "q5_k": T.Q5_K, "q6_k": T.Q6_K, "q4_k_m": T.Q4_K, "q5_k_m": T.Q5_K}
MIXES = ("q4_k_m", "q5_k_m")
# llama.cpp's type for a row that is no whole number of blocks (then float past that)
FALLBACK = {T.Q2_K: T.Q4_0, T.Q3_K: T.Q4_0, T.Q4_K: T.Q5_0, T.Q5_K: T.Q5_1, T.Q6_K: T.Q8_0}


def stays_float(name: str) -> bool:
    """Tensors llama.cpp's converter keeps in float32 whatever the outtype: those not named
    `.weight` (Mamba's A and D), norms (Mamba-2's is 2-D) and the state layers'
    convolutions (ggml's ssm_conv reads float32 only)."""
    return not name.endswith(".weight") or name.endswith(("_norm.weight",
                                                          "ssm_conv1d.weight"))


def fitting(kind, cols: int):
    """`kind`, or llama.cpp's fallback for rows of `cols` values, or None (stays float)."""
    while kind is not None and cols % gguf.GGML_QUANT_SIZES[kind][0]:
        kind = FALLBACK.get(kind)
    return kind


def use_more_bits(i: int, n: int) -> bool:
    """llama-quantize's choice of the layers that keep more bits: the first and last eighth
    and every third one between."""
    return i < n // 8 or i >= 7 * n // 8 or (i - n // 8) % 3 == 2


def _is_value(name: str) -> bool:  # (llama.cpp's attention-v-like tensors)
    return any(f"{part}.weight" in name for part in ("attn_v", "attn_qkv", "attn_kv_b"))


def plan(outtype: str, names: list[str], n_expert: int = 0) -> dict:
    """GGUF tensor name -> block type (before `fitting`), for the 2-D weights of a file."""
    base = OUTTYPES[outtype]
    out = {name: base for name in names}
    if outtype not in MIXES:
        return out
    tied = "output.weight" not in names
    values = [n for n in names if _is_value(n)]
    downs = [n for n in names if "ffn_down" in n]
    for name in names:
        if name == "output.weight" or (tied and name == "token_embd.weight"):
            out[name] = T.Q6_K
        elif _is_value(name):
            out[name] = T.Q8_0 if n_expert == 8 else \
                T.Q6_K if use_more_bits(values.index(name), len(values)) else base
        elif "attn_k.weight" in name and n_expert == 8:
            out[name] = T.Q8_0
        elif "ffn_down" in name:
            layer = _layer(name) if n_expert > 1 else downs.index(name)
            if use_more_bits(layer, len(downs)):
                out[name] = T.Q6_K
        elif "attn_output.weight" in name and n_expert == 8 and outtype == "q4_k_m":
            out[name] = T.Q5_K
    return out


def _layer(name: str) -> int:
    found = re.match(r"blk\.(\d+)\.", name)
    return int(found.group(1)) if found else 0


def file_type(outtype: str) -> int | None:
    """general.file_type for the outtype (llama.cpp's LlamaFileType), if it has one."""
    name = {"f32": "ALL_F32"}.get(outtype, "MOSTLY_" + outtype.upper())
    found = getattr(gguf.LlamaFileType, name, None)
    return int(found) if found is not None else None
