"""Draft heads that run inside the target's model runner, on its final hidden states:
DeepSeek's and Qwen3-Next's multi-token-prediction layers (method "mtp") and EAGLE heads
("eagle", models/eagle.py). The engine core's side is spec_decode/proposer.py's `HeadProposer`.

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
(`HeadDrafter.follow`) until an empty message ends the step's drafting.

Under pipeline parallel the heads live on stage 0, beside the sampler (DeepSeek builds its MTP
layers there, beside the embedding; stage 0 keeps the LM head too): what head 0 reads of a step
(`TargetHiddenStates`) comes back from the last stage with the logits, and stage 0 drafts when rank
0 completes the micro-batch. Its other ranks meanwhile run later micro-batches, so rank 0's
head messages are marked (`HEAD`) apart from step messages, and they draft for their oldest
micro-batch when one comes."""

from __future__ import annotations

import logging
import os
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import msgspec
import torch

from tokenmill.config.speculative import SpeculativeConfig
from tokenmill.layers.host_sync import waits_on_host
from tokenmill.sample.request_sampling import RequestSampling
from tokenmill.worker.aux_hidden import AuxHiddenStates
from tokenmill.worker.step_inputs import StepInputs
from tokenmill.worker.step_sync import with_rows

logger = logging.getLogger(__name__)

HEAD = b"H"  # first byte of a head message under pipeline parallel (a step message's is not)


class TargetHiddenStates:
    """What head 0 reads of a step: the target's final hidden states (MTP, EAGLE-1), or the
    states entering an EAGLE-3 head's target layers (`aux`, ascending). Under pipeline
    parallel each stage carries those of earlier stages and its own to the next, and the last
    stage sends them to stage 0."""

    def __init__(self, model, aux: tuple[int, ...]) -> None:
        self.aux = tuple(sorted(set(aux)))
        self.count = len(self.aux) or 1  # tensors per step
        held = model.model.stage_layers
        self._before = sum(i < held.start for i in self.aux)
        # this stage's aux layers' inputs, kept by hooks on the target's layers
        self.aux_hidden = (AuxHiddenStates(model.model.layers, tuple(
            i for i in self.aux if i in held)) if self.aux else None)

    @classmethod
    def of(cls, config: SpeculativeConfig, model) -> TargetHiddenStates:
        aux = ()
        if config.method == "eagle3":  # (the target keeps those layers' inputs)
            from tokenmill.loading.eagle import eagle3_aux_layers

            aux = eagle3_aux_layers(config.model, model)
        return cls(model, aux)

    def carried_in(self) -> int:
        """How many EAGLE-3 states the previous stage hands on with its hidden states."""
        return self._before

    def carry(self, before: list[torch.Tensor]) -> list[torch.Tensor]:
        """The EAGLE-3 states of a step this stage hands on: `before` and its own."""
        return before + (self.aux_hidden.of_step() if self.aux_hidden else [])

    def of_step(self, before: list[torch.Tensor], hidden: torch.Tensor) -> list[torch.Tensor]:
        """The last stage: what head 0 reads of the step just run (`hidden`: its final hidden
        states)."""
        return self.carry(before) if self.aux else [hidden]

    def taken(self, tensors: list[torch.Tensor]):
        """`of_step`'s tensors as the heads take them: the final hidden states, or the
        EAGLE-3 states by layer."""
        return dict(zip(self.aux, tensors, strict=True)) if self.aux else tensors[0]

    def split(self, got: list[torch.Tensor]) -> tuple[list[torch.Tensor], object]:
        """Stage 0: a micro-batch's tensors from the last stage as (logits, `taken`)."""
        return got[:-self.count], self.taken(got[-self.count:])


def draft_heads(config: SpeculativeConfig, model, model_path: str, dtype, device) -> list:
    """The heads of `config.method` for the target `model` (their attention modules take
    KV caches beside the decoder's): its MTP layers, or the EAGLE head loaded here."""
    if config.method in ("eagle", "eagle3"):
        from tokenmill.loading.eagle import load_eagle_head

        return [load_eagle_head(config.model, model, dtype, device, config.quantization,
                                3 if config.method == "eagle3" else 1)]
    layers = model.mtp_layers()
    if not layers:
        name = os.path.basename(model_path.rstrip("/"))
        raise ValueError(f"Speculative method 'mtp' needs a model with multi-token-prediction "
                         f"layers (DeepSeek-V3 / R1's num_nextn_predict_layers, Qwen3-Next's "
                         f"mtp.*, with their weights); {name!r} has none.")
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


@dataclass(frozen=True)
class TargetView:
    """What the draft heads read of the target's model runner, and nothing else: its
    embedding, rotary tables and LM head, how it turns a step into tensors, its sampler and
    draws, and where its steps run."""

    model: torch.nn.Module
    prepare_inputs: Callable[[StepInputs], tuple]  # a step's (ids, positions, metadata)
    sampling: RequestSampling
    generator: torch.Generator
    backend: Any
    device: torch.device
    dtype: torch.dtype
    block_size: int
    hidden_size: int
    tp: Any  # the tensor-parallel group
    pipelined: bool  # under pipeline parallel (head messages between step messages)

    @classmethod
    def of(cls, runner) -> TargetView:
        return cls(runner.model, runner.prepare_inputs, runner.sampling, runner.generator,
                   runner.backend, runner.device, runner.dtype, runner.block_size,
                   runner.hidden_size, runner.tp, runner.world.pp_size > 1)

    def embed(self, ids: torch.Tensor) -> torch.Tensor:
        return self.model.model.embed_tokens(ids)

    def rope(self, positions: torch.Tensor, dtype: torch.dtype):
        return self.model.model.rotary.for_step(positions, dtype)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor | None:
        return self.model.compute_logits(hidden)


class HeadDrafter:
    """Runs in the target's model runner, right after a step's sampling."""

    def __init__(self, target: TargetView, config: SpeculativeConfig, heads: list) -> None:
        self.target = target
        self.k = config.num_speculative_tokens
        self.limit = config.disable_by_batch_size
        self.layers = heads
        self.tp = target.tp
        self.marked = target.pipelined  # (head messages between step messages)
        self.graphs = None  # HeadGraphs, where the target's steps run as graphs (`capture`)

    def capture(self, target_graphs, capture: bool) -> None:
        """The heads' passes beside the target's CUDA graphs (draft_head_graphs.py;
        `capture` False: the same buckets run eagerly, the CPU tests), unless a head's
        forward waits on the host, or under tensor parallel (the other ranks follow rank 0's
        passes one message at a time, eagerly)."""
        from tokenmill.worker.draft_head_graphs import HeadGraphs

        if self.tp.size > 1 or waits_on_host(*self.layers):
            return
        try:
            self.graphs = HeadGraphs(self, target_graphs, capture)
        except RuntimeError as exc:  # (the target's graphs stay)
            logger.warning("CUDA graph capture of the draft heads failed (%s); they run "
                           "eagerly", exc)

    def _send(self, step: StepInputs | None = None, layer: int = 0, seqs: list[int] = (),
              rows: list[int] = (), last: list[int] = ()) -> None:
        """Rank 0: the next pass to the other ranks, its block table as the target step's
        sequences it takes rows of (None: the step's drafting is over)."""
        if self.tp.size == 1:
            return
        data = b""
        if step is not None:
            bare = msgspec.structs.replace(step, block_ids=[]).encode()
            data = msgspec.msgpack.encode(HeadPass(bare, layer, list(seqs), list(rows),
                                                   list(last)))
        self.tp.broadcast_bytes(HEAD + data if self.marked else data)

    def _receive(self) -> bytes:
        data = self.tp.broadcast_bytes(None)
        return data[len(HEAD):] if self.marked else data

    def ends_step(self, data: bytes) -> bool:
        """Whether a message rank 0 broadcast is a head message (pipeline parallel: it
        comes when rank 0 completes the oldest micro-batch in flight)."""
        return self.marked and data[:len(HEAD)] == HEAD

    def follow(self, hidden, target: StepInputs, data: bytes | None = None) -> None:
        """Ranks other than 0, after each target step (`target`; `hidden`: what head 0 reads
        of it; `data`: its first head message, if already received): run the passes rank 0
        runs."""
        data = self._receive() if data is None else data[len(HEAD):]
        if not data:
            return
        first = _PASS.decode(data)
        out, chained = self._run(0, _received(first, target), self._features(hidden)[first.rows])
        if not first.last:
            return
        h_out, h_chain = out[first.last], chained[first.last]
        while True:
            self._logits(h_out)  # (its vocabulary shards meet on rank 0)
            data = self._receive()
            if not data:
                return
            step = _PASS.decode(data)
            h_out, h_chain = self._run(step.layer, _received(step, target), h_chain)

    def after_step(self, scheduled, inputs: StepInputs, hidden,
                   sampled: dict[str, list[int]]) -> dict[str, tuple[list[int], object]]:
        """request id -> (k drafts, their distributions or None), for the requests that got
        tokens this step; every computed row with a known next token goes through head 0
        (`hidden`: what it reads of the step's rows, `TargetHiddenStates.taken`)."""
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
        last = [row for row, _, _, _ in drafting]
        speculate = len(scheduled) <= self.limit  # (off: the head's cache rows only)
        graphed = None
        if self.graphs is not None and len(drafting) == len(scheduled):
            graphed = self._graphed_first(inputs, ids, rows, hidden)
        if graphed is not None:
            out, chained, last = graphed
        else:  # the rows with known next tokens alone
            step = StepInputs(ids, [start for start, _ in feeds],
                              [start + len(r) for (start, _), r in zip(feeds, rows)],
                              [inputs.block_ids[i] for _, i in feeds], [], [], [], [])
            order = torch.cat(rows)
            self._send(step, 0, [i for _, i in feeds], order.tolist(), last if speculate else [])
            out, chained = self._run(0, step, self._features(hidden)[order])
        if not (speculate and last):
            return {}
        requests, drafts, probs = self._draft(out[last], chained[last], drafting, inputs)
        self._send(None)
        return {r.request_id: (drafts[row], torch.stack(probs[row])
                               if probs[row] and r.sampling_params.temperature > 0 else None)
                for row, r in enumerate(requests)}

    def _draft(self, h_out, h_chain, drafting, inputs: StepInputs):
        """Drafts 1 .. k of each drafting request from head 0's rows (`h_out` for its logits,
        `h_chain` for the next draft): (requests, drafts, their distributions). Draft j + 1
        is one more row a request at the position after its last. Where every later pass has
        a graph, the drafts stay on the device until the last one (one read to the host, not
        one a draft)."""
        requests = [r for _, r, _, _ in drafting]
        seqs = [i for _, _, _, i in drafting]
        blocks = [inputs.block_ids[i] for i in seqs]
        at = [pos for _, _, pos, _ in drafting]
        graphs = self.graphs if self.graphs is not None and self.graphs.chain_fits(
            len(at), max(at) + self.k - 1, blocks) else None
        columns, probs = [], [[] for _ in drafting]  # (columns: each draft of every request)
        logits = self._logits(h_out)
        for j in range(1, self.k + 1):
            tokens, q = self.target.sampling.draft(logits.float(), requests,
                                                   self.target.generator, host=graphs is None)
            columns.append(tokens)
            for row in range(len(requests) if q is not None else 0):
                probs[row].append(q[row])
            if j == self.k:
                break
            layer = j % len(self.layers)
            step = StepInputs([0] * len(at) if graphs else tokens, [p + j - 1 for p in at],
                              [p + j for p in at], blocks, [], [], [], [])
            if graphs is not None:  # (the tokens filled in on the device, the LM head in it)
                logits, h_chain = graphs.chain_pass(layer, step, h_chain, tokens)
            else:
                self._send(step, layer, seqs)
                h_out, h_chain = self._run(layer, step, h_chain)
                logits = self._logits(h_out)
        drafts = (torch.stack(columns, 1).tolist() if graphs is not None
                  else [list(row) for row in zip(*columns)])
        return requests, drafts, probs

    def _graphed_first(self, inputs: StepInputs, ids: list[int], rows, hidden):
        """The first pass in the graph buckets of a uniform step whose every sequence drafts
        (`ids`: the tokens after each one's accepted rows `rows`): rows past them padded with
        token 0 (draft_head_graphs.py). (out, chained, each sequence's last accepted row), or None
        when the step has no bucket."""
        q = self.graphs.first.bucket_rows(inputs)
        if not q:
            return None
        padded, at = [], 0
        for r in rows:
            padded += ids[at:at + len(r)] + [0] * (q - len(r))
            at += len(r)
        out, chained = self.graphs.first_pass(q, inputs, padded, self._features(hidden))
        return out, chained, [i * q + len(r) - 1 for i, r in enumerate(rows)]

    def _logits(self, hidden: torch.Tensor) -> torch.Tensor | None:
        """The target's LM head, unless the head has its own (EAGLE-3); None on ranks other
        than 0 under tensor parallel."""
        return self.layers[0].logits(hidden, self.target.compute_logits)

    def _features(self, hidden) -> torch.Tensor:
        """Head 0's input rows of the target's step: its final hidden states, or (EAGLE-3)
        the states entering three of its layers, joined and projected."""
        return self.layers[0].target_features(hidden)

    def _run(self, index: int, step: StepInputs, previous: torch.Tensor):
        """One head over `step`'s rows: (hidden states for the logits, for the next draft)."""
        ids, positions, meta = self.target.prepare_inputs(step)
        embeds = self.target.embed(ids)
        rope = self.target.rope(positions, embeds.dtype)
        return self.layers[index](rope, embeds, previous.to(embeds.dtype), meta, chained=True)
