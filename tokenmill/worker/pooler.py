"""A pooling model's last part (vLLM's `Pooler`): each step reduces a request's rows of
final hidden states (its prompt chunk) to one partial state, carried across chunks; once
its prompt is computed, that becomes its vector — an embedding through the
sentence-transformers `Dense` layers, truncated (`dimensions`) and normalized, or a
classifier's scores through its `score` head and activation.

`pool_slow` beside it is the reference: the whole prompt's rows at once."""

from __future__ import annotations

import os

import torch

from tokenmill.config.pooling import PoolerConfig
from tokenmill.core.scheduler import ScheduledRequest
from tokenmill.pooling_params import PoolingParams

_ACTIVATIONS = {"identity": lambda x: x, "tanh": torch.tanh, "sigmoid": torch.sigmoid}


def reduce_rows(rows: torch.Tensor, pooling_type: str) -> torch.Tensor:
    """One chunk's rows [n, hidden] -> its partial state (float32)."""
    rows = rows.float()
    if pooling_type == "LAST":
        return rows[-1]
    if pooling_type == "CLS":
        return rows[0]
    if pooling_type == "MAX":
        return rows.max(dim=0).values
    return rows.sum(dim=0)  # MEAN: divided by the prompt's length at the end


def combine(before: torch.Tensor, part: torch.Tensor, pooling_type: str) -> torch.Tensor:
    """The partial state of two consecutive chunks."""
    if pooling_type == "LAST":
        return part
    if pooling_type == "CLS":
        return before
    if pooling_type == "MAX":
        return torch.maximum(before, part)
    return before + part


def pool_slow(hidden: torch.Tensor, pooling_type: str) -> torch.Tensor:
    """The reference: a whole prompt's rows [n, hidden] pooled at once."""
    hidden = hidden.float()
    return {"LAST": lambda: hidden[-1], "CLS": lambda: hidden[0],
            "MAX": lambda: hidden.max(dim=0).values,
            "MEAN": lambda: hidden.mean(dim=0)}[pooling_type]()


class Pooler:
    """Rank 0's pooling state: request id -> its partial state over the chunks computed."""

    def __init__(self, config: PoolerConfig, model_path: str, device: torch.device) -> None:
        self.config = config
        self.partial: dict[str, torch.Tensor] = {}
        self.dense = [_load_dense(layer.path, layer.bias, device) + (layer.activation,)
                      for layer in config.dense]
        self.head = _load_head(model_path, config, device) if config.task == "classify" else None

    def reduce(self, hidden: torch.Tensor, query_start_loc: list[int],
               pool_seqs: list[int]) -> list[torch.Tensor]:
        """Each pooled sequence's partial state of this step (its rows of `hidden`)."""
        kind = self.config.pooling_type
        return [reduce_rows(hidden[query_start_loc[i]:query_start_loc[i + 1]], kind)
                for i in pool_seqs]

    def finish(self, scheduled: list[ScheduledRequest], pool_seqs: list[int],
               parts: list[torch.Tensor]) -> dict[str, list[float]]:
        """Carries each part into its request's state; the requests whose prompt this step
        completed -> their vectors."""
        kind, done = self.config.pooling_type, {}
        for i, part in zip(pool_seqs, parts):
            s = scheduled[i]
            request = s.request
            rid = request.request_id
            # (a first chunk starts afresh: a recompute after preemption too, and last-token
            # pooling's first chunk after a prefix-cache hit)
            before = self.partial.get(rid) if s.start else None
            state = part if before is None else combine(before, part, kind)
            if s.end < request.num_prompt_tokens:
                self.partial[rid] = state
                continue
            self.partial.pop(rid, None)
            if kind == "MEAN":
                state = state / request.num_prompt_tokens
            done[rid] = self.vector(state, request.pooling_params).tolist()
        return done

    def drop(self, request_ids) -> None:
        for rid in request_ids:
            self.partial.pop(rid, None)

    def vector(self, pooled: torch.Tensor, params: PoolingParams) -> torch.Tensor:
        """A request's pooled state [hidden] -> what it asked for."""
        if params.task == "classify":
            weight, bias = self.head
            logits = pooled @ weight.T + (bias if bias is not None else 0)
            if not params.use_activation:
                return logits
            return torch.sigmoid(logits) if len(logits) == 1 else torch.softmax(logits, -1)
        for weight, bias, activation in self.dense:
            pooled = _ACTIVATIONS[activation](pooled @ weight.T + (bias if bias is not None
                                                                    else 0))
        if params.dimensions is not None:
            pooled = pooled[:params.dimensions]
        normalize = self.config.normalize if params.normalize is None else params.normalize
        return torch.nn.functional.normalize(pooled, dim=-1) if normalize else pooled


def _load_dense(folder: str, bias: bool, device: torch.device):
    from safetensors.torch import load_file

    file = os.path.join(folder, "model.safetensors")
    if not os.path.isfile(file):  # (a pickled pytorch_model.bin is never read)
        raise ValueError(f"Dense module {folder} has no model.safetensors.")
    tensors = load_file(file, device=str(device))
    return (tensors["linear.weight"].float(),
            tensors["linear.bias"].float() if bias else None)


def _load_head(model_path: str, config: PoolerConfig, device: torch.device):
    """A classifier's head from the checkpoint: (weight [num_labels, hidden], bias)."""
    from tokenmill.layers.linear import whole
    from tokenmill.loading.checkpoint import POOLER_HEADS, iter_safetensors

    found = {}
    for name, tensor in iter_safetensors(model_path, lazy=True):  # (only the head is read)
        if name.startswith(POOLER_HEADS):
            found[name.split(".", 1)[1]] = whole(tensor).to(device=device, dtype=torch.float32)
    weight = found.get("weight")
    if weight is None or weight.shape != (config.num_labels, config.hidden_size):
        raise ValueError(f"Checkpoint {model_path!r} has no classifier head of "
                         f"{config.num_labels} labels x {config.hidden_size} (score.weight).")
    return weight, found.get("bias")
