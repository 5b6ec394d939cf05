"""The attention-backend interface and the one metadata struct a step prepares for it."""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn.functional as F

from tokenmill import csrc
from tokenmill.host_to_device import on_device
from tokenmill.quantization.kv_cache import dequantize_kv, quantize_kv


@dataclass
class AttentionMetadata:
    """Built once per step by the model runner; every layer reads the same struct.

    The first `num_decodes` sequences have exactly one query token, so the backend can treat
    them as one batched gather (`leading_decodes`: the scheduler puts decodes first, but a
    decode with drafts, or a prompt chunk, may come before a plain decode; from there on every
    sequence takes the general path)."""

    slot_mapping: torch.Tensor  # [num_tokens] flat cache slot for each new token's K/V
    query_start_loc: list[int]  # [num_seqs + 1] offsets of each sequence's tokens in the batch
    context_lens: list[int]  # [num_seqs] tokens already in the cache before this step
    seq_lens: torch.Tensor  # [num_seqs] total KV length after this step (int64)
    block_table: torch.Tensor  # [num_seqs, max_blocks] block ids, padded with 0
    num_decodes: int
    block_size: int
    # (sequence, first position, end) of the spans whose queries see every key of the span
    # (Gemma 3's image rows attend to each other both ways; the step computes a span whole):
    # the masked path (window.py) takes a step that has any
    bidirectional: list[tuple[int, int, int]] = field(default_factory=list)
    # What the backend derives once per step for all layers (set by `AttentionBackend.prepare`).
    backend_data: Any = None
    # the state layers (layers/state_layer.py): [num_seqs] the row each sequence's state is
    # written to (its slot's first; int64); None: the model has none, or a throwaway step
    # (profiling)
    state_slots: torch.Tensor | None = None
    # [num_seqs] the rows they are read from where one differs (that after the last draft
    # a verification accepted); None: state_slots
    state_reads: torch.Tensor | None = None
    # per sequence the draft tokens it verifies (empty: none has any): the state after its
    # row i goes to its row + i
    state_drafts: list[int] = field(default_factory=list)
    # and those sequences by draft count, on the device (layers/state_layer.py
    # `verified_groups`: the first state layer of the step works them out)
    state_groups: list | None = None

    @property
    def num_seqs(self) -> int:
        return len(self.context_lens)


@dataclass
class LogitsRows:
    """The rows of a step whose final hidden states are used: the last token of each sequence
    that samples. Only these go past the last layer's K/V projection (a prompt of n tokens
    samples from one row, so the other n - 1 skip its attention, output projection and MLP);
    `meta` attends them as one-token queries over their sequences (the decode path)."""

    rows: torch.Tensor  # [n] row indices into the step's tokens
    meta: AttentionMetadata  # the n rows as n decodes

    @property
    def count(self) -> int:
        return self.meta.num_seqs

    @classmethod
    def last_of(cls, meta: AttentionMetadata, seqs: list[int],
                backend: AttentionBackend) -> LogitsRows:
        """The last rows of sequences `seqs` (indices into meta's sequences)."""
        loc = meta.query_start_loc
        dev = meta.seq_lens.device
        rows = on_device([loc[i + 1] - 1 for i in seqs], torch.int64, dev)
        chosen = on_device(seqs, torch.int64, dev)
        decodes = AttentionMetadata(
            slot_mapping=meta.slot_mapping[rows],
            query_start_loc=list(range(len(seqs) + 1)),
            context_lens=[meta.context_lens[i] + loc[i + 1] - loc[i] - 1 for i in seqs],
            seq_lens=meta.seq_lens[chosen],
            block_table=meta.block_table[chosen],
            num_decodes=len(seqs),
            block_size=meta.block_size,
        )
        backend.prepare(decodes)
        return cls(rows, decodes)


def leading_decodes(starts, ends) -> int:
    """How many sequences from the first have one query token each (`num_decodes`); counting
    every one-token sequence, wherever it stood, made a step [3 tokens, 1 token] look like a
    decode first."""
    n = 0
    for start, end in zip(starts, ends):
        if end - start != 1:
            break
        n += 1
    return n


def fresh_prompt_runs(meta: AttentionMetadata) -> list[tuple[int, int]]:
    """(first sequence, last + 1) runs of consecutive fresh prompts (no cached context) of
    equal length: their keys and values are exactly the step's own, attended as one batch."""
    runs: list[tuple[int, int]] = []
    loc = meta.query_start_loc
    for s in range(meta.num_decodes, meta.num_seqs):
        if meta.context_lens[s] != 0:
            continue
        if runs and runs[-1][1] == s and loc[s + 1] - loc[s] == loc[s] - loc[s - 1]:
            runs[-1] = (runs[-1][0], s + 1)
        else:
            runs.append((s, s + 1))
    return runs


def fresh_prompt_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                           out: torch.Tensor, loc: list[int], runs: list[tuple[int, int]],
                           scale: float) -> None:
    """out's rows of the fresh prompts in `runs` (`fresh_prompt_runs`): causal SDPA over the
    step's own k, v (cuDNN / flash kernels on a GPU), one call per run of equal lengths."""
    for first, end in runs:
        lo, hi, n = loc[first], loc[end], end - first
        t = (hi - lo) // n
        out[lo:hi] = F.scaled_dot_product_attention(
            q[lo:hi].view(n, t, *q.shape[1:]).transpose(1, 2),
            k[lo:hi].view(n, t, *k.shape[1:]).transpose(1, 2),
            v[lo:hi].view(n, t, *v.shape[1:]).transpose(1, 2),
            is_causal=True, scale=scale, enable_gqa=True,
        ).transpose(1, 2).reshape(hi - lo, *q.shape[1:])


class AttentionBackend(ABC):
    """Writes new K/V into the paged cache and attends each query over its sequence's cache.

    Backends: torch_sdpa.py (CPU, and the reference of the GPU path), triton/ (GPUs, and
    the CPU under TRITON_INTERPRET=1), reference.py (tests).
    Shapes: q [T, Hq, D], k/v [T, Hkv, D], caches [num_blocks, block_size, Hkv, D] (int8
    caches: D + 4 bytes per row, see quantization/kv_cache.py); returns [T, Hq, D].
    Causality is bottom-right aligned: query i of a sequence with context c sees keys
    0..c+i."""

    # Its launches read the step's metadata from tensors alone, so a CUDA graph can hold them.
    graph_safe = False
    # Its kernels are Triton's (a float8 cache needs Triton's float8: platforms/cuda.py).
    triton_kernels = False

    def prepare(self, meta: AttentionMetadata) -> None:
        """Called once per step before the forward: derive what every layer would otherwise
        recompute (masks, gather indices) into `meta.backend_data`. Default: nothing."""
        meta.backend_data = None

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                k_cache: torch.Tensor, v_cache: torch.Tensor, meta: AttentionMetadata,
                scale: float, window: int | None = None,
                softcap: float | None = None, chunk: int | None = None,
                sinks: torch.Tensor | None = None) -> torch.Tensor:
        """The new K/V written, then `attend`."""
        self.write_kv(k, v, k_cache, v_cache, meta.slot_mapping)
        return self.attend(q, k, v, k_cache, v_cache, meta, scale, window, softcap, chunk,
                           sinks)

    @abstractmethod
    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
               k_cache: torch.Tensor, v_cache: torch.Tensor, meta: AttentionMetadata,
               scale: float, window: int | None = None,
               softcap: float | None = None, chunk: int | None = None,
               sinks: torch.Tensor | None = None) -> torch.Tensor:
        """Attention output [T, Hq, D] for this step's queries, their K/V (k, v) already in
        the caches; `window`: a query at position p sees keys p - window + 1 .. p; `softcap`:
        scores -> softcap * tanh(scores / softcap) (Gemma 2); `chunk`: a query sees only the
        keys of its own `chunk`-token piece of the sequence (Llama 4's local layers);
        `sinks` [Hq]: a logit per head joining each softmax's denominator (gpt-oss)."""

    def rotate_and_write(self, rope, x: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor,
                         v_cache: torch.Tensor, slot_mapping: torch.Tensor,
                         q_heads: int) -> tuple[torch.Tensor, torch.Tensor]:
        """x [T, q_heads + Hkv, D] (q heads, then K heads, not rotated yet) rotated by `rope`
        (layers/rotary.py StepRotary) and the rotated K with v written to the caches: (q, k).
        Default: the rotation, then write_kv; a backend may do both in one kernel."""
        x = rope(x)
        q, k = x.split([q_heads, x.shape[1] - q_heads], dim=1)
        self.write_kv(k, v, k_cache, v_cache, slot_mapping)
        return q, k

    def mla(self, q_latent: torch.Tensor, q_pe: torch.Tensor, cache: torch.Tensor,
            meta: AttentionMetadata, rank: int, scale: float) -> torch.Tensor:
        """DeepSeek's latent attention: [T, heads, rank] softmax-weighted latents of the rows
        (latent | rotary key) cached before; queries q_latent [T, heads, rank] (absorbed)
        and q_pe [T, heads, rope]. Default: torch ops (attention/mla.py)."""
        from tokenmill.attention.mla import mla_attention

        return mla_attention(q_latent, q_pe, cache, meta, rank, scale)

    @staticmethod
    def write_kv(k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor,
                 v_cache: torch.Tensor, slot_mapping: torch.Tensor) -> None:
        if (csrc.usable(k) and k_cache.device.type == "cpu"
                and k_cache.dtype in csrc.KV_KINDS
                and csrc.heads_contiguous(k) and csrc.heads_contiguous(v)):
            csrc.write_kv(k, v, k_cache, v_cache, slot_mapping)
            return
        for new, cache in ((k, k_cache), (v, v_cache)):
            if cache.dtype == torch.int8:
                new = quantize_kv(new)
            AttentionBackend.store_rows(cache.view(-1, *cache.shape[2:]), slot_mapping, new)

    @staticmethod
    def store_rows(flat: torch.Tensor, slots: torch.Tensor, rows: torch.Tensor) -> None:
        """flat[slots] = rows in the cache's dtype (float8 copied as bytes: torch has no
        float8 index_copy_ on the CPU)."""
        rows = rows.to(flat.dtype)
        if flat.element_size() == 1 and flat.dtype != torch.int8:
            flat, rows = flat.view(torch.uint8), rows.view(torch.uint8)
        flat.index_copy_(0, slots, rows)

    @staticmethod
    def read_blocks(cache: torch.Tensor, block_ids: torch.Tensor,
                    dtype: torch.dtype) -> torch.Tensor:
        """The blocks' K or V, [n, block_size, Hkv, D] in `dtype` (dequantized from int8)."""
        blocks = cache.index_select(0, block_ids)
        return dequantize_kv(blocks, dtype) if cache.dtype == torch.int8 else blocks.to(dtype)

    @classmethod
    def gather_kv(cls, cache: torch.Tensor, block_ids: torch.Tensor, length: int,
                  dtype: torch.dtype) -> torch.Tensor:
        """Contiguous [length, Hkv, D] copy of one sequence's cached K or V."""
        blocks = cls.read_blocks(cache, block_ids, dtype)
        return blocks.reshape(-1, *blocks.shape[2:])[:length]
