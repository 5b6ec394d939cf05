"""Mixture-of-experts feed-forward block: a router picks each token's top-k experts; tokens are
grouped by expert and each active expert runs once over its tokens, its weighted outputs added
back in place (on GPUs: two grouped Triton matmuls, layers/fused_moe.py). Experts are ordinary
MLPs of linear layers, so every kernel and quantization a
`Linear` has serves them, and a decode step reads only the active experts' weights. Under
tensor parallel each expert's intermediate size is split as an MLP's is, or, with expert
parallel, each rank holds whole experts (1/tp of them); either way the experts' (and the
shared expert's) partial sums meet in one all-reduce for the block."""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from tokenmill.distributed.parallel_state import get_tp_group
from tokenmill.layers.host_sync import HostSync
from tokenmill.layers.linear import Linear, default_weight_loader


def _best(scores: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The k largest of each row, largest first, the lower index first on ties (a stable
    sort: torch.topk leaves tie order open)."""
    values, ids = torch.sort(scores, dim=-1, descending=True, stable=True)
    return values[:, :k], ids[:, :k]


def _in_best_groups(group_scores: torch.Tensor, topk_group: int, per_group: int
                    ) -> torch.Tensor:
    """[T, experts] mask of the experts in each token's `topk_group` best groups."""
    t, n_group = group_scores.shape
    keep = torch.zeros(t, n_group, dtype=torch.bool, device=group_scores.device)
    keep.scatter_(1, _best(group_scores, topk_group)[1], True)
    return keep.unsqueeze(-1).expand(-1, -1, per_group).reshape(t, n_group * per_group)


def _finish(weights: torch.Tensor, renormalize: bool, scaling: float) -> torch.Tensor:
    if renormalize:
        weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
    return weights * scaling


def softmax_top_k(logits: torch.Tensor, top_k: int, renormalize: bool
                  ) -> tuple[torch.Tensor, torch.Tensor]:
    """(weights, expert ids) [T, k]: the k most probable experts of each token under a
    softmax over all of them (float32), their weights summing to 1 with `renormalize`;
    ties go to the lower expert index."""
    weights, ids = _best(torch.softmax(logits.float(), dim=-1), top_k)
    if renormalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights, ids


def grouped_top_k(logits: torch.Tensor, top_k: int, n_group: int, topk_group: int,
                  correction_bias: torch.Tensor | None, renormalize: bool,
                  scaling: float) -> tuple[torch.Tensor, torch.Tensor]:
    """DeepSeek-V3's routing: sigmoid scores (float32); the experts split into `n_group`
    groups, each scored by the sum of its two best (scores + `correction_bias`); the k best
    experts of the `topk_group` best groups chosen by those biased scores, weighted by their
    unbiased ones (renormalized), times `scaling`. Ties go to the lower index."""
    scores = torch.sigmoid(logits.float())
    choice = scores if correction_bias is None else scores + correction_bias.float()
    t, experts = choice.shape
    per_group = experts // n_group
    group_scores = _best(choice.view(t * n_group, per_group), 2)[0].sum(-1).view(t, n_group)
    keep = _in_best_groups(group_scores, topk_group, per_group)
    ids = _best(choice.masked_fill(~keep, float("-inf")), top_k)[1]
    return _finish(scores.gather(1, ids), renormalize, scaling), ids


def softmax_grouped_top_k(logits: torch.Tensor, top_k: int, n_group: int, topk_group: int,
                          renormalize: bool, scaling: float
                          ) -> tuple[torch.Tensor, torch.Tensor]:
    """DeepSeek-V2's `group_limited_greedy`: softmax scores; the experts of the `topk_group`
    groups with the highest single score compete for the k places; weights times
    `scaling`. Ties go to the lower index."""
    probs = torch.softmax(logits.float(), dim=-1)
    t, experts = probs.shape
    per_group = experts // n_group
    keep = _in_best_groups(probs.view(t, n_group, per_group).amax(dim=-1), topk_group,
                           per_group)
    weights, ids = _best(probs.masked_fill(~keep, 0.0), top_k)
    return _finish(weights, renormalize, scaling), ids


class OtherRankExpert(nn.Module):
    """An expert another rank holds whole (expert parallel): nothing here."""


def sigmoid_top_k(logits: torch.Tensor, top_k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Llama 4's routing: the k largest logits, each weighted by its sigmoid (float32)."""
    values, ids = _best(logits.float(), top_k)
    return torch.sigmoid(values), ids


def grouped_experts(x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor,
                    experts: nn.ModuleList, scale_inputs: bool = False) -> torch.Tensor:
    """sum over each token's experts of weight x expert(token) (`scale_inputs`: of
    expert(weight x token), Llama 4's): the assignments sorted by expert (tokens in order
    within one), each active expert run once over its rows, in expert order (as
    transformers adds them up); experts other ranks hold are left to them."""
    top_k = ids.shape[1]
    flat = ids.reshape(-1)
    order = torch.argsort(flat, stable=True)
    counts = torch.bincount(flat, minlength=len(experts)).tolist()
    rows = order // top_k
    scale = weights.reshape(-1)[order].to(x.dtype).unsqueeze(1)
    out = torch.zeros(x.shape[0], x.shape[1], dtype=x.dtype, device=x.device)
    start = 0
    for expert, count in enumerate(counts):
        if count and not isinstance(experts[expert], OtherRankExpert):
            mine, weight = rows[start:start + count], scale[start:start + count]
            if scale_inputs:
                out.index_add_(0, mine, experts[expert](x[mine] * weight))
            else:
                out.index_add_(0, mine, experts[expert](x[mine]) * weight)
        start += count
    return out


class SparseMoE(HostSync, nn.Module):
    """`make_expert(split)`: one expert, an MLP returning this rank's partial sums (the block
    adds them up once): split across the tensor-parallel ranks, or with expert parallel
    (`split=False`) whole on the rank that holds it (expert e on rank e % tp).
    `shared_expert` (split) runs on every token, scaled by sigmoid(`shared_expert_gate`) when
    `gated_shared` (Qwen2-MoE). `router`: "softmax"
    (top-k), "softmax_grouped" (DeepSeek-V2's group-limited greedy) or "sigmoid_grouped"
    (DeepSeek-V3's `grouped_top_k`; the router holds `e_score_correction_bias`); `grouped`:
    (n_group, topk_group, routed_scaling_factor) of the DeepSeek routers; "sigmoid_top_k"
    (Llama 4: `sigmoid_top_k`, each weight scaling its expert's input)."""

    def __init__(self, hidden: int, num_experts: int, top_k: int, renormalize: bool,
                 make_expert: Callable[[bool], nn.Module],
                 shared_expert: nn.Module | None = None,
                 gated_shared: bool = False, router: str = "softmax",
                 grouped: tuple[int, int, float] = (1, 1, 1.0),
                 router_bias: bool = False) -> None:
        super().__init__()
        self.top_k, self.renormalize = top_k, renormalize
        self.router, self.grouped = router, grouped
        self.tp = get_tp_group()
        # the router (gpt-oss': with a bias): every rank whole, never quantized
        self.gate = Linear(hidden, num_experts, router_bias)
        self.gate.keep_float = True
        if router == "sigmoid_grouped":
            self.gate.e_score_correction_bias = nn.Parameter(torch.zeros(num_experts),
                                                             requires_grad=False)
            self.gate.e_score_correction_bias.weight_loader = default_weight_loader
        self.expert_parallel = self.tp.expert_parallel and self.tp.size > 1
        self.experts = nn.ModuleList(
            make_expert(not self.expert_parallel) if self.holds_expert(e) else OtherRankExpert()
            for e in range(num_experts))
        self.shared_expert = shared_expert
        self.fused = None  # FusedExperts (layers/fused_moe.py), set by `fuse_experts`
        self.shared_expert_gate = Linear(hidden, 1) if gated_shared else None
        if self.shared_expert_gate is not None:
            self.shared_expert_gate.keep_float = True
            self.shared_expert_gate.keep_weight = True  # (one row: the decode step reads it)

    @property
    def host_sync(self) -> bool:
        """Whether the forward waits on the host (no CUDA graph): the per-expert loop does, and
        so does a fused form that says so (the CPU's, quantization/mxfp4_experts.py)."""
        return self.fused is None or getattr(self.fused, "host_sync", False)

    def fuse_experts(self, force: bool = False) -> None:
        """Run the experts as two grouped Triton matmuls where they can (GPU experts of
        float, int8, int4 or float8 weights held on this rank; `force`: on any device, for
        tests under TRITON_INTERPRET)."""
        from tokenmill.layers.fused_moe import FusedExperts

        if (self.expert_parallel or self.router == "sigmoid_top_k"
                or not FusedExperts.servable(self.experts)):
            return  # (the grouped matmuls weight outputs, not inputs)
        layer = self.experts[0].down_proj
        held = layer.weight if layer.weight is not None else layer.kernel.qweight
        if force or held.is_cuda:
            self.fused = FusedExperts(self.experts)

    def holds_expert(self, expert: int) -> bool:
        return not self.expert_parallel or expert % self.tp.size == self.tp.rank

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        logits = self.gate(x)
        n_group, topk_group, scaling = self.grouped
        if self.router == "sigmoid_grouped":
            weights, ids = grouped_top_k(logits, self.top_k, n_group, topk_group,
                                         self.gate.e_score_correction_bias, self.renormalize,
                                         scaling)
        elif self.router == "softmax_grouped":
            weights, ids = softmax_grouped_top_k(logits, self.top_k, n_group, topk_group,
                                                 self.renormalize, scaling)
        elif self.router == "sigmoid_top_k":
            weights, ids = sigmoid_top_k(logits, self.top_k)
        else:
            weights, ids = softmax_top_k(logits, self.top_k, self.renormalize)
            if scaling != 1.0:
                weights = weights * scaling
        if self.fused is not None:
            out = self.fused(x, weights, ids)
        else:
            out = grouped_experts(x, weights, ids, self.experts,
                                  scale_inputs=self.router == "sigmoid_top_k")
        if self.shared_expert is not None:
            shared = self.shared_expert(x)
            if self.shared_expert_gate is not None:
                shared = torch.sigmoid(self.shared_expert_gate(x)) * shared
            out = out + shared
        return self.tp.all_reduce(out)
