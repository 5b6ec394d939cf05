"""Draft heads that run inside the target's model runner, on its final hidden states:
DeepSeek's multi-token-prediction layers (method "mtp") and EAGLE heads ("eagle",
spec_decode/eagle.py).

A head reads, at position i, the embedding of token i + 1 and the target's final hidden state
at i, and scores token i + 2. Its attention has its own KV cache, paged by the target's block
tables (the scheduler gives each request k slots past its tokens for the drafts' rows), so
after every target step the head runs over the rows the target just computed with known next
tokens (prompt chunks included: its cache must hold the whole context), and the last row of a
request gives draft 1. Draft j + 1 comes from one more row at the next position, fed draft j
and the head's own output before any final norm (as vLLM chains them); with several MTP
layers, draft j uses layer (j - 1) mod their count.

A prefix-cache hit reuses blocks whose head row at the block's last position saw another
request's next token: only the drafts' quality can suffer, never the output.

Under tensor parallel every rank runs each head pass (their layers' collectives pair up):
rank 0, which samples, sends the other ranks each pass's rows (`HeadPass`), and they follow
(`HeadDrafter.follow`) until an empty message ends the step's drafting."""

from __future__ import annotations

import os

import msgspec
import torch

from tokenmill.spec_decode.config import SpeculativeConfig
from tokenmill.spec_decode.proposer import Proposer
from tokenmill.worker.step_inputs import StepInputs
from tokenmill.worker.step_sync import with_rows


def draft_heads(config: SpeculativeConfig, model, model_path: str, dtype, device) -> list:
    """The heads of `config.method` for the target `model` (their attention modules take
    KV caches beside the decoder's): its MTP layers, or the EAGLE head loaded here."""
    if config.method in ("eagle", "eagle3"):
        from tokenmill.spec_decode.eagle import load_eagle_head

        return [load_eagle_head(config.model, model, dtype, device, config.quantization,
                                3 if config.method == "eagle3" else 1)]
    layers = list(getattr(model, "mtp", None) or [])
    if not layers:
        raise ValueError(f"Speculative method 'mtp' needs a model with multi-token-prediction "
                         f"layers (DeepSeek-V3 / R1's num_nextn_predict_layers, with their "
                         f"weights); {os.path.basename(model_path.rstrip('/'))!r} has none.")
    return layers


class HeadPass(msgspec.Struct, array_like=True, frozen=True):
    """One head pass, from rank 0 to the other tensor-parallel ranks."""
    step: bytes  # StepInputs.encode() of the pass's rows, without their block table
    layer: int  # which head runs it
    seqs: list[int]  # per sequence: its place in the target's step (whose table row it takes)
    rows: list[int] = []  # first pass: the target's rows the head reads
    last: list[int] = []  # first pass: each drafting request's last row (none: no drafts)


_PASS = msgspec.msgpack.Decoder(HeadPass)


def _received(message: HeadPass, target: StepInputs) -> StepInputs:
    """A pass's rows as rank 0 built them, their block table taken from the target step's."""
    return with_rows(StepInputs.decode(message.step), target, message.seqs)


class HeadDrafter:
    """Runs in the target's model runner, right after a step's sampling."""

    def __init__(self, runner, config: SpeculativeConfig, heads: list) -> None:
        self.runner = runner
        self.k = config.num_speculative_tokens
        self.limit = config.disable_by_batch_size
        self.layers = heads
        self.tp = runner.tp

    def _send(self, step: StepInputs | None = None, layer: int = 0, seqs: list[int] = (),
              rows: list[int] = (), last: list[int] = ()) -> None:
        """Rank 0: the next pass to the other ranks, its block table as the target step's
        sequences it takes rows of (None: the step's drafting is over)."""
        if self.tp.size == 1:
            return
        if step is None:
            self.tp.broadcast_bytes(b"")
            return
        bare = msgspec.structs.replace(step, block_ids=[]).encode()
        self.tp.broadcast_bytes(msgspec.msgpack.encode(
            HeadPass(bare, layer, list(seqs), list(rows), list(last))))

    def follow(self, hidden: torch.Tensor, target: StepInputs) -> None:
        """Ranks other than 0, after each target step (`target`): run the passes rank 0
        runs."""
        data = self.tp.broadcast_bytes(None)
        if not data:
            return
        first = _PASS.decode(data)
        out, chained = self._run(0, _received(first, target), self._features(hidden)[first.rows])
        if not first.last:
            return
        h_out, h_chain = out[first.last], chained[first.last]
        while True:
            self._logits(h_out)  # (its vocabulary shards meet on rank 0)
            data = self.tp.broadcast_bytes(None)
            if not data:
                return
            step = _PASS.decode(data)
            h_out, h_chain = self._run(step.layer, _received(step, target), h_chain)

    def after_step(self, scheduled, inputs: StepInputs, hidden: torch.Tensor,
                   sampled: dict[str, list[int]]) -> dict[str, tuple[list[int], object]]:
        """request id -> (k drafts, their distributions or None), for the requests that got
        tokens this step; every computed row with a known next token goes through head 0
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
                feeds.append((start, i))
                if tokens is not None:
                    drafting.append((len(ids) - 1, request, start + count, i))
            first += end - start
        if not feeds:
            self._send(None)
            return {}
        step = StepInputs(ids, [start for start, _ in feeds],
                          [start + len(r) for (start, _), r in zip(feeds, rows)],
                          [inputs.block_ids[i] for _, i in feeds], [], [], [], [])
        order = torch.cat(rows)
        # (speculation off: the head's cache rows only)
        last = [row for row, _, _, _ in drafting] if len(scheduled) <= self.limit else []
        self._send(step, 0, [i for _, i in feeds], order.tolist(), last)
        out, chained = self._run(0, step, self._features(hidden)[order])
        if not last:
            return {}
        h_out, h_chain = out[last], chained[last]
        requests = [r for _, r, _, _ in drafting]
        drafts: list[list[int]] = [[] for _ in drafting]
        probs: list[list[torch.Tensor]] = [[] for _ in drafting]
        for j in range(self.k):
            if j > 0:  # one more row per request, at the position after its last one
                step = StepInputs([d[-1] for d in drafts],
                                  [pos + j - 1 for _, _, pos, _ in drafting],
                                  [pos + j for _, _, pos, _ in drafting],
                                  [inputs.block_ids[i] for _, _, _, i in drafting],
                                  [], [], [], [])
                self._send(step, j % len(self.layers), [i for _, _, _, i in drafting])
                h_out, h_chain = self._run(j % len(self.layers), step, h_chain)
            tokens, q = self._pick(h_out, requests)
            for row, token in enumerate(tokens):
                drafts[row].append(token)
                if q is not None:
                    probs[row].append(q[row])
        self._send(None)
        return {r.request_id: (drafts[row], torch.stack(probs[row])
                               if probs[row] and r.sampling_params.temperature > 0 else None)
                for row, r in enumerate(requests)}

    def _pick(self, hidden: torch.Tensor, requests) -> tuple[list[int], torch.Tensor | None]:
        """Each row's draft (greedy, or drawn under the request's settings) and, with
        sampling rows, the distributions drawn from."""
        logits = self._logits(hidden)
        return self.runner.sampling.draft(logits.float(), requests, self.runner.generator)

    def _logits(self, hidden: torch.Tensor) -> torch.Tensor | None:
        """The target's LM head, unless the head has its own (EAGLE-3); None on ranks other
        than 0 under tensor parallel."""
        own = getattr(self.layers[0], "logits", None)
        return own(hidden) if own is not None else self.runner.model.compute_logits(hidden)

    def _features(self, hidden: torch.Tensor) -> torch.Tensor:
        """What head 0 reads of the target's step: its final hidden states, unless the head
        takes others (EAGLE-3: the states entering three of its layers)."""
        own = getattr(self.layers[0], "target_features", None)
        return hidden if own is None else own(self.runner.model)

    def _run(self, index: int, step: StepInputs, previous: torch.Tensor):
        """One head over `step`'s rows: (hidden states for the logits, for the next draft)."""
        runner = self.runner
        ids, positions, meta = runner._prepare_inputs(step)
        model = runner.model.model
        embeds = model.embed_tokens(ids)
        rope = model.rotary.for_step(positions, embeds.dtype)
        return self.layers[index](rope, embeds, previous.to(embeds.dtype), meta, chained=True)


class HeadProposer(Proposer):
    """The engine core's side: drafts the runner's heads computed, cut to each request's
    budget (`pending` set from each step's output)."""

    def draft(self, chosen) -> None:
        for request, k in chosen:
            got = self.pending.get(request.request_id)
            if got is not None:
                request.spec_token_ids = got[0][:k]
                request.spec_probs = got[1]
        self.pending = {}
