"""Token embedding and LM head split over the vocabulary across tensor-parallel ranks.

Rank r holds rows [r * V', (r + 1) * V') of the table, V' = ceil(vocab / tp) (rows past the
vocabulary are zero padding). A lookup sums every rank's contribution (one all-reduce: each
token's row lives on exactly one rank); the LM head's logits shards meet once, on rank 0,
where the sampler runs. With one rank both are a plain lookup and a plain matmul."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from tokenmill.distributed.parallel_state import get_tp_group
from tokenmill.layers.linear import ColumnParallelLinear, _narrowed


def padded_vocab(vocab_size: int, tp_size: int) -> int:
    return -(-vocab_size // tp_size) * tp_size


class VocabParallelEmbedding(nn.Module):
    def __init__(self, vocab_size: int, hidden: int) -> None:
        super().__init__()
        self.tp = get_tp_group()
        self.vocab_size = vocab_size
        self.rows = padded_vocab(vocab_size, self.tp.size) // self.tp.size
        self.first = self.tp.rank * self.rows
        self.weight = nn.Parameter(torch.empty(self.rows, hidden), requires_grad=False)
        self.weight.weight_loader = _narrowed(0, self.first, self.rows)
        self.head = None  # a tied LM head whose quantized rows the lookups read instead
        self.out_dtype: torch.dtype | None = None  # rows converted to it (a bf16 table)
        # LoRA adapters' slots for the table (lora/layers.py's EmbeddingLoRA), once one
        # targets it
        self.lora = None

    def share_rows(self, head: nn.Module) -> None:
        """Look rows up in the tied LM head's quantized kernel (the same rows on each rank)
        instead of a float copy of the table: the table's float weight is dropped."""
        self.head = head
        self.weight = None

    def _lookup(self, ids: torch.Tensor) -> torch.Tensor:
        if self.head is None:
            rows = F.embedding(ids, self.weight)
            return rows if self.out_dtype is None else rows.to(self.out_dtype)
        flat = ids.reshape(-1)
        return self.head.kernel.rows(flat).view(*ids.shape, -1)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        if self.tp.size == 1:
            out = self._lookup(input_ids)
            return out if self.lora is None else self.lora.add(input_ids, out)
        local = input_ids - self.first
        mine = (local >= 0) & (local < self.rows)
        local = local.clamp(0, self.rows - 1)
        out = self._lookup(local)
        if self.lora is not None:
            out = self.lora.add(local, out)
        out.masked_fill_(~mine.unsqueeze(-1), 0.0)
        return self.tp.all_reduce(out)


class ParallelLMHead(ColumnParallelLinear):
    """The LM head as a column-parallel linear over the padded vocabulary; it may share its
    weight with a `VocabParallelEmbedding` (tied embeddings: the same rows on each rank)."""

    def __init__(self, hidden: int, vocab_size: int, bias: bool = False) -> None:
        """`bias`: Phi-2's LM head has one."""
        tp = get_tp_group()
        super().__init__(hidden, vocab_size, bias, padded_vocab(vocab_size, tp.size))
        self.vocab_size = vocab_size

    def logits(self, hidden: torch.Tensor) -> torch.Tensor | None:
        """[rows, vocab] on rank 0; None on the other ranks (after sending their shard)."""
        full = self.tp.gather_last_dim(self(hidden))
        if full is None or full.shape[-1] == self.vocab_size:
            return full
        return full[..., : self.vocab_size]
