"""`NoRopeAttention`: attention whose queries and keys are not rotated (NoPE): Llama 4's
global layers, Granite 4's attention layers (`position_embedding_type` other than rope)."""

from __future__ import annotations

import torch

from tokenmill.attention.backend import AttentionMetadata
from tokenmill.models.llama import Attention


class NoRopeAttention(Attention):
    def rotate_and_write(self, rope, qkv: torch.Tensor, v: torch.Tensor,
                         meta: AttentionMetadata) -> tuple[torch.Tensor, torch.Tensor]:
        """q and k as projected (q/k norms applied where the layer has them), K and V
        cached."""
        t = qkv.shape[0]
        q = qkv[:, : self.q_size].view(t, self.num_heads, -1)
        k = qkv[:, self.q_size: self.q_size + self.kv_size].view(t, self.num_kv_heads, -1)
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        self.backend.write_kv(k, v, self.k_cache, self.v_cache, meta.slot_mapping)
        return q, k
