"""Linear layers whose parameters know how to load themselves from checkpoint shards."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


def default_weight_loader(param: nn.Parameter, loaded: torch.Tensor) -> None:
    if param.shape != loaded.shape:
        raise ValueError(f"Checkpoint tensor has shape {tuple(loaded.shape)}, "
                         f"expected {tuple(param.shape)}.")
    param.data.copy_(loaded)


class Linear(nn.Module):
    def __init__(self, in_features: int, out_features: int, bias: bool = False) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(out_features, in_features), requires_grad=False)
        self.weight.weight_loader = default_weight_loader
        if bias:
            self.bias = nn.Parameter(torch.empty(out_features), requires_grad=False)
            self.bias.weight_loader = default_weight_loader
        else:
            self.register_parameter("bias", None)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight, self.bias)


class MergedLinear(Linear):
    """Several projections of the same input stored as one matrix (q|k|v, gate|up), so one GEMM
    does the work of several. Checkpoint shards load into their row slice by shard index."""

    def __init__(self, in_features: int, output_sizes: list[int], bias: bool = False) -> None:
        super().__init__(in_features, sum(output_sizes), bias)
        self.output_sizes = output_sizes
        self.weight.weight_loader = self._load_shard
        if bias:
            self.bias.weight_loader = self._load_shard

    def _load_shard(self, param: nn.Parameter, loaded: torch.Tensor, shard: int) -> None:
        start = sum(self.output_sizes[:shard])
        default_weight_loader(param.data.narrow(0, start, self.output_sizes[shard]), loaded)
