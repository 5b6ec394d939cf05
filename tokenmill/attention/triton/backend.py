"""`TritonBackend`: every step's attention in one launch of the Triton kernel (kernels.py),
decodes and prompt chunks together, from tensors alone (the block table, sequence lengths
and query offsets), so a decode step can be captured in a CUDA graph and replayed. A step of
fresh prompts of one length only (no decodes, no cached context) may go to SDPA instead
(`fresh_sdpa`: the CUDA platform's choice, where SDPA runs cuDNN / flash kernels)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from tokenmill.attention.backend import (
    AttentionBackend,
    AttentionMetadata,
    fresh_prompt_attention,
    fresh_prompt_runs,
)
from tokenmill.attention.triton import kernels
from tokenmill.attention.window import masked_attention
from tokenmill.host_to_device import on_device


@dataclass
class TritonStep:
    """What every layer's launch of a step shares."""

    q_start: torch.Tensor  # [num_seqs + 1] int32: each sequence's first query row
    max_query_len: int
    splits: int  # key ranges per query block (flash-decoding); 1 unless every query is short
    fresh_runs: list[tuple[int, int]] | None = None  # fresh prompts of one length: SDPA's


def decode_splits(num_seqs: int, longest: int) -> int:
    """Key ranges per sequence for a decode-only step: enough programs to fill a GPU while
    few sequences run, each range at least one key block (32 keys); one range for many
    sequences. Splitting pays from short contexts on: on an H200 a batch-1 step of the 0.5B
    model at ~137 keys took 1.00 ms with 16 ranges (5 of them holding keys) and 1.09 ms with
    one (`bench/results/README.md`, 2026-11-27)."""
    splits = 1
    while splits < 16 and num_seqs * splits < 64 and longest // (splits * 2) >= 32:
        splits *= 2
    return splits


class TritonBackend(AttentionBackend):
    graph_safe = True  # reads only tensors: a CUDA graph can hold its launches
    triton_kernels = True  # (float8 caches only where Triton has float8: platforms/cuda.py)

    def __init__(self, fresh_sdpa: bool = False) -> None:
        # a step of fresh prompts of one length (a long prompt's first chunk, a batch of equal
        # prompts) through one SDPA call per layer over the step's own K/V: on an H100 cuDNN's
        # causal SDPA took 0.039 ms for a 2048-token prompt's layer, the kernel 0.071 ms
        # (bench/attention_sweep.py). Prompts of several lengths stay on the kernel's one
        # launch (one SDPA call per length would multiply the launches); the kernel stays
        # the reference beside it
        self.fresh_sdpa = fresh_sdpa

    def prepare(self, meta: AttentionMetadata) -> None:
        loc = meta.query_start_loc
        max_query_len = max((b - a for a, b in zip(loc, loc[1:])), default=0)
        splits = 1
        if max_query_len <= kernels.SHORT:  # (decodes, and decodes with their drafts)
            splits = decode_splits(meta.num_seqs,
                                   max(meta.context_lens, default=0) + max_query_len)
        runs = None
        if self.fresh_sdpa and max_query_len > 1 and meta.num_decodes == 0:
            runs = fresh_prompt_runs(meta)  # SDPA takes the step if it is one call per layer
            if runs != [(0, meta.num_seqs)]:
                runs = None
        meta.backend_data = TritonStep(
            on_device(loc, torch.int32, meta.seq_lens.device), max_query_len, splits, runs)

    @staticmethod
    def graph_variant(num_seqs: int, longest: int, rows: int = 1) -> int:
        """Which launch a captured batch of `num_seqs` sequences of `rows` query rows each
        and up to `longest` keys runs best as: its split count (any count is correct for any
        length; one for long queries, which the kernel's query blocks take)."""
        return decode_splits(num_seqs, longest) if rows <= kernels.SHORT else 1

    @staticmethod
    def graph_step(q_start: torch.Tensor, variant: int, rows: int = 1) -> TritonStep:
        """The step data of a captured batch (`rows` query rows per sequence, offsets in the
        static `q_start`) as launch `variant` (`graph_variant`)."""
        return TritonStep(q_start, rows, variant)

    @staticmethod
    def write_kv(k, v, k_cache, v_cache, slot_mapping) -> None:
        kernels.write_kv(k, v, k_cache, v_cache, slot_mapping)

    def rotate_and_write(self, rope, x, v, k_cache, v_cache, slot_mapping, q_heads):
        # one launch for the rotation and the K/V write where the rotation is a table lookup
        tables = rope.tables(x)
        if tables is None or v.stride(-1) != 1:
            return super().rotate_and_write(rope, x, v, k_cache, v_cache, slot_mapping,
                                            q_heads)
        out = kernels.rotary_write_kv(x, v, *tables, k_cache, v_cache, slot_mapping, q_heads)
        return out.split([q_heads, x.shape[1] - q_heads], dim=1)

    @staticmethod
    def store_rows(flat, slots, rows) -> None:
        kernels.write_rows(rows.contiguous(), flat, slots)

    @staticmethod
    def _attend(q, k_cache, v_cache, out, meta: AttentionMetadata, scale: float,
                window: int | None = None, softcap: float | None = None) -> torch.Tensor:
        step: TritonStep = meta.backend_data
        if meta.num_seqs == 0:
            return out
        return kernels.paged_attention(q, k_cache, v_cache, out, meta.block_table,
                                       meta.seq_lens, step.q_start, step.max_query_len,
                                       scale, window, softcap, step.splits)

    # (`out`: rows to write the output into, as a piecewise graph's attention call gives)
    def mla(self, q_latent, q_pe, cache, meta: AttentionMetadata, rank: int, scale: float,
            out: torch.Tensor | None = None):
        # one query row of latent | rotary parts against the cache rows; values: the latents
        q = torch.cat([q_latent, q_pe.to(q_latent.dtype)], dim=-1)
        out = q_latent.new_empty(q_latent.shape) if out is None else out
        return self._attend(q, cache, cache, out, meta, scale)

    def attend(self, q, k, v, k_cache, v_cache, meta: AttentionMetadata, scale: float,
               window: int | None = None, softcap: float | None = None,
               chunk: int | None = None, sinks: torch.Tensor | None = None,
               out: torch.Tensor | None = None):
        if meta.bidirectional or chunk is not None or sinks is not None:
            # (Gemma 3's image spans, Llama 4's chunks, gpt-oss' sinks: the torch path)
            result = masked_attention(q, k_cache, v_cache, meta, scale, window, softcap,
                                      chunk, sinks)
            if out is None:
                return result
            out.copy_(result)
            return out
        out = q.new_empty(q.shape) if out is None else out
        runs = meta.backend_data.fresh_runs if meta.num_seqs else None
        if runs is not None and window is None and softcap is None:
            fresh_prompt_attention(q, k, v, out, meta.query_start_loc, runs, scale)
            return out
        if q.stride(-1) != 1:
            q = q.contiguous()
        return self._attend(q, k_cache, v_cache, out, meta, scale, window, softcap)
