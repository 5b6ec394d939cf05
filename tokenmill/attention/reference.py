"""Slow, obviously right attention over the paged cache: one sequence, one head at a time."""

from __future__ import annotations

import math

import torch

from tokenmill.attention.backend import AttentionBackend, AttentionMetadata


class ReferenceBackend(AttentionBackend):
    """For tests only: every other backend is compared against this one."""

    def attend(self, q, k, v, k_cache, v_cache, meta: AttentionMetadata, scale: float,
               window: int | None = None, softcap: float | None = None,
               chunk: int | None = None, sinks: torch.Tensor | None = None):
        out = torch.empty_like(q)
        group = q.shape[1] // k.shape[1]
        for s in range(meta.num_seqs):
            lo, hi = meta.query_start_loc[s], meta.query_start_loc[s + 1]
            seq_len = int(meta.seq_lens[s])
            n_blocks = math.ceil(seq_len / meta.block_size)
            keys = self.gather_kv(k_cache, meta.block_table[s, :n_blocks], seq_len,
                                  torch.float32).float()
            values = self.gather_kv(v_cache, meta.block_table[s, :n_blocks], seq_len,
                                    torch.float32).float()
            context = meta.context_lens[s]
            spans = [(a, b) for seq, a, b in meta.bidirectional if seq == s]
            for i in range(hi - lo):
                position = context + i
                seen = [key <= position or any(a <= position < b and a <= key < b
                                               for a, b in spans) for key in range(seq_len)]
                if window is not None:  # (the window bounds the span's keys too)
                    seen = [ok and key > position - window for key, ok in enumerate(seen)]
                if chunk is not None:  # (only its own chunk's keys)
                    seen = [ok and key // chunk == position // chunk
                            for key, ok in enumerate(seen)]
                seen = torch.tensor(seen)
                for h in range(q.shape[1]):
                    kv_h = h // group
                    scores = keys[seen, kv_h] @ q[lo + i, h].float() * scale
                    if softcap is not None:
                        scores = softcap * torch.tanh(scores / softcap)
                    if sinks is not None:  # one more logit in the denominator, no value
                        scores = torch.cat([scores, sinks[h].float().view(1)])
                    probs = torch.softmax(scores, dim=0)
                    if sinks is not None:
                        probs = probs[:-1]
                    out[lo + i, h] = (probs @ values[seen, kv_h]).to(q.dtype)
        return out
