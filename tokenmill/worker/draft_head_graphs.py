"""Draft heads' passes as CUDA graphs, beside the target's (worker/cuda_graphs.py), so a
drafted step on a GPU is a few graph launches rather than one eager Python pass per draft.

- The first pass over a uniform target step (every sequence's q rows: a decode, or a decode
  with its k drafts) runs the head over all n x q rows, in the target step's buckets. Rows
  past a request's accepted tokens are padding: they read the rejected rows' states and
  token 0, and write the head's cache at positions the next passes write again before any
  pass reads them (draft j writes position p + j - 1 before attending to it; the next step's
  first pass starts at p). The eager pass, which skips them, is the reference.
- The chain passes (drafts 2 .. k: one row a drafting request) run in buckets of one row a
  sequence, one set of graphs per head layer they use, with the LM head in the graph.

Padding sequences write nowhere, as the target's do."""

from __future__ import annotations

from typing import Any

import torch

from tokenmill.worker.cuda_graphs import StepGraphs
from tokenmill.worker.step_inputs import StepInputs


class HeadPassGraphs(StepGraphs):
    """One head layer's passes, its input states (`previous`) in a static buffer too.
    Outputs: (hidden states for the logits, or the logits with `logits`; the states the
    next draft reads)."""

    def __init__(self, drafter: Any, index: int, widths: dict[int, list[int]],
                 logits: bool, max_len: int) -> None:
        """`max_len`: the longest context of the target's graphs."""
        target = drafter.target
        super().__init__(target.backend, target.device, target.block_size, max_len, widths)
        self.drafter, self.layer, self.logits = drafter, drafter.layers[index], logits
        rows = self.buffers.shape[1]
        self.previous = torch.zeros(rows, target.hidden_size, dtype=target.dtype,
                                    device=target.device)

    def forward(self, n: int, q: int, variant: int) -> tuple[torch.Tensor, torch.Tensor]:
        target = self.drafter.target
        embeds = target.embed(self.input_ids[:n * q])
        rope = target.rope(self.positions[:n * q], embeds.dtype)
        out, chained = self.layer(rope, embeds, self.previous[:n * q],
                                  self.meta(n, q, variant), chained=True)
        return (self.drafter._logits(out) if self.logits else out), chained

    def run(self, q: int, step: StepInputs, previous: torch.Tensor,
            ids: torch.Tensor | None = None):
        """The pass over `step`'s n sequences of q rows each (`previous`: their input
        states, n x q rows; `ids`: their tokens on the device instead of step's): its
        outputs' first n x q rows."""
        n = len(step.starts)
        size, variant = self.load(q, step)
        if ids is not None:
            self.input_ids[:n * q].copy_(ids)
        self.previous[:n * q].copy_(previous)
        return tuple(out[:n * q] for out in self.replay(size, q, variant))


class HeadGraphs:
    """The first pass (head 0, in the target's buckets) and the chain passes (one row a
    drafting request, up to the target's drafted bucket sizes) of a `HeadDrafter`."""

    def __init__(self, drafter: Any, target: Any, capture: bool) -> None:
        """`target`: the target's decode graphs, whose buckets and memory pool these share."""
        self.first = HeadPassGraphs(drafter, 0, target.widths, False, target.max_len)
        drafted = target.widths.get(1 + drafter.k, [])
        layers = {j % len(drafter.layers) for j in range(1, drafter.k)}
        self.chain = {i: HeadPassGraphs(drafter, i, {1: drafted}, True, target.max_len)
                      for i in sorted(layers)} if drafted else {}
        if capture:
            pool = self.first.capture_all(target.pool)
            for graphs in self.chain.values():
                pool = graphs.capture_all(pool)

    def first_pass(self, q: int, inputs: StepInputs, ids: list[int], target_hidden: torch.Tensor):
        """Head 0 over every row of a uniform target step of q rows a sequence (`inputs`, one
        `self.first.bucket_rows`; `ids`: each row's next token, 0 past the accepted ones;
        `target_hidden`: what it reads of each row)."""
        step = StepInputs(ids, inputs.starts, inputs.ends, inputs.block_ids, [], [], [], [])
        return self.first.run(q, step, target_hidden)

    def chain_fits(self, n: int, longest: int, block_ids) -> bool:
        """Whether every later draft's pass of n requests, up to `longest` keys, has a graph."""
        return (len(self.chain) > 0
                and all(g.fits(n, 1, [longest], block_ids) for g in self.chain.values()))

    def chain_pass(self, index: int, step: StepInputs, previous: torch.Tensor,
                   ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(logits, states for the next draft) of head `index` over `step`'s one row a
        request, fed `ids` (the drafts before, on the device; `chain_fits` said it fits)."""
        return self.chain[index].run(1, step, previous, ids)
