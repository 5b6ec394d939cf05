"""DeepSeek's multi-token-prediction layers as the proposer (method "mtp").

An MTP layer reads, at position i, the embedding of token i + 1 and the target's final
hidden state at i, and scores token i + 2. Its attention has its own KV cache, paged by the
target's block tables (the scheduler gives each request k slots past its tokens for the
drafts' rows), so after every target step the layer runs over the rows the target just
computed with known next tokens (prompt chunks included: its cache must hold the whole
context), and the last row of a request gives draft 1. Draft j + 1 comes from one more row
at the next position, fed draft j and the layer's own output before its final norm (as vLLM
chains them); with several MTP layers, draft j uses layer (j - 1) mod their count.

A prefix-cache hit reuses blocks whose MTP row at the block's last position saw another
request's next token: only the drafts' quality can suffer, never the output."""

from __future__ import annotations

import os

import torch

from tokenmill.layers.sampler import probabilities, sample
from tokenmill.spec_decode.config import SpeculativeConfig
from tokenmill.spec_decode.proposer import Proposer
from tokenmill.worker.step_inputs import StepInputs


def mtp_attention_layers(model, model_path: str) -> list:
    """The MTP layers' attention modules (they take KV caches beside the decoder's)."""
    layers = list(getattr(model, "mtp", None) or [])
    if not layers:
        raise ValueError(f"Speculative method 'mtp' needs a model with multi-token-prediction "
                         f"layers (DeepSeek-V3 / R1's num_nextn_predict_layers, with their "
                         f"weights); {os.path.basename(model_path.rstrip('/'))!r} has none.")
    return [layer.block.self_attn for layer in layers]


class MtpDrafter:
    """Runs in the target's model runner, right after a step's sampling."""

    def __init__(self, runner, config: SpeculativeConfig) -> None:
        self.runner = runner
        self.k = config.num_speculative_tokens
        self.layers = list(runner.model.mtp)

    def after_step(self, scheduled, inputs: StepInputs, hidden: torch.Tensor,
                   sampled: dict[str, list[int]]) -> dict[str, tuple[list[int], object]]:
        """request id -> (k drafts, their distributions or None), for the requests that got
        tokens this step; every computed row with a known next token goes through layer 0
        (`hidden`: the target's final hidden states of the step's rows, in order)."""
        ids, rows, feeds, drafting = [], [], [], []
        first = 0  # the sequence's first row in `hidden`
        for i, s in enumerate(scheduled):
            request, start, end = s.request, inputs.starts[i], inputs.ends[i]
            tokens = sampled.get(request.request_id)
            if tokens is None:  # a prompt chunk before the last: the next tokens are known
                count, nxt = end - start, request.token_ids(start + 1, end + 1)
            else:  # the rows computed from the request's own tokens (drafts: the accepted)
                count = len(tokens) if s.drafts else end - start
                nxt = (request.token_ids(start + 1, request.num_tokens) + tokens)[:count]
            if not request.status.finished:
                ids += nxt
                rows.append(torch.arange(first, first + count))
                feeds.append((start, inputs.block_ids[i]))
                if tokens is not None:
                    drafting.append((len(ids) - 1, request, start + count, inputs.block_ids[i]))
            first += end - start
        if not feeds:
            return {}
        step = StepInputs(ids, [start for start, _ in feeds],
                          [start + len(r) for (start, _), r in zip(feeds, rows)],
                          [b for _, b in feeds], [], [], [], [])
        out, chained = self._run(0, step, hidden[torch.cat(rows)])
        if not drafting:
            return {}
        last = [row for row, _, _, _ in drafting]
        h_out, h_chain = out[last], chained[last]
        requests = [r for _, r, _, _ in drafting]
        drafts: list[list[int]] = [[] for _ in drafting]
        probs: list[list[torch.Tensor]] = [[] for _ in drafting]
        for j in range(self.k):
            if j > 0:  # one more row per request, at the position after its last one
                step = StepInputs([d[-1] for d in drafts],
                                  [pos + j - 1 for _, _, pos, _ in drafting],
                                  [pos + j for _, _, pos, _ in drafting],
                                  [b for _, _, _, b in drafting], [], [], [], [])
                h_out, h_chain = self._run(j % len(self.layers), step, h_chain)
            tokens, q = self._pick(h_out, requests)
            for row, token in enumerate(tokens):
                drafts[row].append(token)
                if q is not None:
                    probs[row].append(q[row])
        return {r.request_id: (drafts[row], torch.stack(probs[row])
                               if probs[row] and r.sampling_params.temperature > 0 else None)
                for row, r in enumerate(requests)}

    def _pick(self, hidden: torch.Tensor, requests) -> tuple[list[int], torch.Tensor | None]:
        """Each row's draft (greedy, or drawn under the request's settings) and, with
        sampling rows, the distributions drawn from."""
        runner = self.runner
        logits = runner.model.compute_logits(hidden).float()
        batch = runner.sampling.batch(requests)
        batch.num_logprobs = [None] * len(requests)
        tokens = sample(logits, batch, runner.generator).token_ids.tolist()
        return tokens, None if batch.all_greedy else probabilities(logits, batch)

    def _run(self, index: int, step: StepInputs, previous: torch.Tensor):
        """One MTP layer over `step`'s rows: (final-normed, pre-norm) hidden states."""
        runner = self.runner
        ids, positions, meta = runner._prepare_inputs(step)
        model = runner.model.model
        embeds = model.embed_tokens(ids)
        rope = model.rotary.for_step(positions, embeds.dtype)
        return self.layers[index](rope, embeds, previous.to(embeds.dtype), meta, chained=True)


class MtpProposer(Proposer):
    """The engine core's side: drafts the runner's MTP pass computed, cut to each request's
    budget (`pending` set from each step's output)."""

    def draft(self, chosen) -> None:
        for request, k in chosen:
            got = self.pending.get(request.request_id)
            if got is not None:
                request.spec_token_ids = got[0][:k]
                request.spec_probs = got[1]
        self.pending = {}
