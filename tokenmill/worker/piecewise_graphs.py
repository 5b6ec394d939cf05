"""Steps the uniform buckets (cuda_graphs.py) do not take: prompt chunks, prompts beside
decodes, decodes with uneven drafts. Eagerly such a step issues every layer's kernels from
Python (on an H100 the 0.5B model decoded at 57 tokens/s eagerly against 507 in graphs,
2026-11-27). Here, as vLLM's piecewise graphs, the forward over a bucket of T token rows is
captured as one graph per stretch between attention calls, and the attention calls, whose
launches depend on the step's sequences (how many, how long, how much context), run eagerly
between the replays with the step's own metadata: piece 0, attention 0, piece 1, ...,
attention L - 1, piece L.

A step of t rows runs in the smallest bucket >= t (up to the scheduler's token budget, 2048
at most); rows t.. are padding: their token and position are whatever the buffers held,
their cache slot -1 (written nowhere), their attention output 0, and no real row reads
them. While a bucket is captured (or run without a GPU) the layers' backend is a `Splitter`:
everything passes through to the backend but `attend` / `mla`, which end the piece there
and hand out the call's output rows (an `AttentionCall`, zeroed in the piece before).

Memory: a bucket's tensors passed between its pieces are kept as aliases that do not hold
their memory (vLLM's weak references), so the buckets' captures (the largest first) share
it; only one forward's pieces replay at a time. Without capture (`capture=False`: the CPU
tests) the same buckets, padding and attention calls run eagerly."""

from __future__ import annotations

import contextlib
import dataclasses
import logging
from typing import Any

import torch

from tokenmill.attention.backend import AttentionBackend, AttentionMetadata
from tokenmill.worker.aux_hidden import AuxHiddenStates
from tokenmill.worker.cuda_graphs import up_to

logger = logging.getLogger(__name__)

SIZES = (8, 16, 24, 32, 48, 64, 96, 128, 160, 192, 256, 320, 384, 512, 640, 768, 1024, 1280,
         1536, 2048)  # token rows captured (steps ~1.25x apart above 128)


def piece_sizes(budget: int) -> list[int]:
    """Buckets up to a step's token budget (and it; 2048 at most: larger steps run
    eagerly)."""
    return up_to(SIZES, min(budget, SIZES[-1]))


def alias(x: torch.Tensor) -> torch.Tensor:
    """A tensor over x's memory that does not keep it allocated."""
    storage = x.untyped_storage()
    weak = torch._C._construct_storage_from_data_pointer(storage.data_ptr(), x.device,
                                                          storage.nbytes())
    return x.new_empty(0).set_(weak, x.storage_offset(), x.shape, x.stride())


class AttentionCall:
    """One attention call of a bucket's forward: its query rows (and k, v) as the piece
    before writes them, the rest of its arguments but the metadata, and the output rows
    the piece after reads."""

    def __init__(self, method, rows: tuple, before: tuple, after: tuple,
                 out: torch.Tensor) -> None:
        """`method`: the backend's `attend` or `mla`, which takes `out=`."""
        self.method, self.rows, self.before, self.after, self.out = (method, rows, before,
                                                                     after, out)

    def run(self, meta: AttentionMetadata, t: int) -> None:
        """The call over the step's first t rows, with the step's metadata."""
        self.method(*(x[:t] for x in self.rows), *self.before, meta, *self.after,
                    out=self.out[:t])

    def weaken(self) -> None:
        """Keep its tensors only as aliases (captured: the memory pool may reuse them)."""
        self.rows, self.out = tuple(map(alias, self.rows)), alias(self.out)


class Splitter:
    """The layers' backend while a bucket is captured or run eagerly: what does not depend
    on the step's sequences passes through; attention calls go to `cut` (which returns
    their output rows)."""

    def __init__(self, backend: AttentionBackend, cut) -> None:
        self.backend, self.cut = backend, cut

    def __getattr__(self, name: str) -> Any:
        return getattr(self.backend, name)

    def attend(self, q, k, v, k_cache, v_cache, meta, scale, window=None, softcap=None,
               chunk=None, sinks=None):
        return self.cut(AttentionCall(self.backend.attend, (q, k, v), (k_cache, v_cache),
                                      (scale, window, softcap, chunk, sinks),
                                      q.new_zeros(q.shape)))

    def mla(self, q_latent, q_pe, cache, meta, rank, scale):
        return self.cut(AttentionCall(self.backend.mla, (q_latent, q_pe), (cache,),
                                      (rank, scale), q_latent.new_zeros(q_latent.shape)))


@dataclasses.dataclass
class Captured:
    """A captured bucket: its graphs (one more than its attention calls, which run
    between them) and its outputs (final hidden states, aux layers' inputs)."""

    pieces: list
    calls: list[AttentionCall]
    outputs: tuple[torch.Tensor, ...]


class PiecewiseGraphs:
    """The model's forward over `sizes` buckets of token rows in pieces; `run` gives a
    step's final hidden states (and sets the EAGLE-3 layer inputs, `aux`)."""

    def __init__(self, model: Any, backend: AttentionBackend, device: torch.device,
                 block_size: int, sizes: list[int], capture: bool, pool=None,
                 aux: AuxHiddenStates | None = None) -> None:
        self.model, self.backend, self.device = model, backend, device
        self.block_size, self.sizes, self.aux = block_size, sizes, aux
        top = sizes[-1]
        self.buffers = torch.tensor([[0] * top, [0] * top, [-1] * top], device=device)
        self.input_ids, self.positions, self.slot_mapping = self.buffers
        self.captured: dict[int, Captured] = {}  # bucket -> its graphs
        self.pool = self.capture_all(pool) if capture else None

    def fits(self, t: int) -> bool:
        """Whether a step of t token rows has a bucket."""
        return 0 < t <= self.sizes[-1]

    def bucket(self, t: int) -> int:
        return next(s for s in self.sizes if s >= t)

    def forward(self, size: int, meta: AttentionMetadata, cut) -> tuple[torch.Tensor, ...]:
        """Bucket `size`'s forward over the buffers (`meta`: a step's, of which only its K/V
        writes read the slots, the buffers'), its attention calls handed to `cut`: the
        final hidden states and the aux layers' inputs."""
        meta = dataclasses.replace(meta, slot_mapping=self.slot_mapping[:size])
        with self._split(Splitter(self.backend, cut)):
            hidden = self.model(self.input_ids[:size], self.positions[:size], meta)
        return hidden, *(self.aux.of_step() if self.aux is not None else ())

    @contextlib.contextmanager
    def _split(self, splitter: Splitter):
        layers = self.model.attention_layers()
        for layer in layers:
            layer.backend = splitter
        try:
            yield
        finally:
            for layer in layers:
                layer.backend = self.backend

    def run(self, input_ids: torch.Tensor, positions: torch.Tensor,
            meta: AttentionMetadata) -> torch.Tensor:
        """Final hidden states of a step of t = len(input_ids) rows (`fits`), its
        metadata prepared by the backend; the aux layers' inputs put in `aux`."""
        t = len(input_ids)
        size = self.bucket(t)
        self.input_ids[:t].copy_(input_ids)
        self.positions[:t].copy_(positions)
        self.slot_mapping[:t].copy_(meta.slot_mapping)
        self.slot_mapping[t:size].fill_(-1)  # (padding: written nowhere)
        if size in self.captured:
            captured = self.captured[size]
            for piece, call in zip(captured.pieces, captured.calls):
                piece.replay()
                call.run(meta, t)
            captured.pieces[-1].replay()
            outputs = captured.outputs
        else:  # (not captured: the CPU tests)
            outputs = self.forward(size, meta, self.eager(meta, t))
        hidden, *aux = (x[:t] for x in outputs)
        if self.aux is not None:
            self.aux.put(aux)
        return hidden

    @staticmethod
    def eager(meta: AttentionMetadata, t: int):
        """A `cut` that runs each attention call at once (over t rows, as `meta` says)."""
        return lambda call: call.run(meta, t) or call.out

    def padding_meta(self, size: int) -> AttentionMetadata:
        """A step of one sequence over the bucket's rows at no context, reading block 0
        (the warm-up before a capture)."""
        meta = AttentionMetadata(
            slot_mapping=self.slot_mapping[:size], query_start_loc=[0, size],
            context_lens=[0], seq_lens=torch.tensor([size], device=self.device),
            block_table=torch.zeros(1, -(-size // self.block_size), dtype=torch.int64,
                                    device=self.device),
            num_decodes=0, block_size=self.block_size)
        self.backend.prepare(meta)
        return meta

    def capture_all(self, pool=None):
        """Capture every bucket, the largest first, in `pool` (the decode graphs', or a new
        one); returns the pool."""
        pool = pool if pool is not None else torch.cuda.graph_pool_handle()
        stream = torch.cuda.current_stream(self.device)
        # captured on the stream torch.cuda.graph captured the decode graphs on: a pool's
        # freed memory goes only to allocations on the stream it was allocated on
        side = getattr(torch.cuda.graph, "default_capture_stream", None) or torch.cuda.Stream(
            self.device)
        for size in reversed(self.sizes):
            self.slot_mapping[:size].fill_(-1)
            meta = self.padding_meta(size)
            side.wait_stream(stream)
            with torch.cuda.stream(side):
                self.forward(size, meta, self.eager(meta, size))  # (compiles the kernels)
                torch.cuda.synchronize(self.device)
                self.capture(size, meta, pool, torch.cuda.CUDAGraph)
            stream.wait_stream(side)
        torch.cuda.synchronize(self.device)
        # the warm-ups' memory back to the card (the KV budget counted one step's peak, which
        # the pool now holds; the pool's own memory stays)
        torch.cuda.empty_cache()
        return pool

    def capture(self, size: int, meta: AttentionMetadata, pool, new_graph) -> None:
        """Bucket `size` as pieces made by `new_graph()` (torch.cuda.CUDAGraph) in `pool`
        (`meta`: `padding_meta`)."""
        pieces, calls = [new_graph()], []
        pieces[0].capture_begin(pool=pool)

        def cut(call: AttentionCall) -> torch.Tensor:
            pieces[-1].capture_end()
            calls.append(call)
            pieces.append(new_graph())
            pieces[-1].capture_begin(pool=pool)
            return call.out

        try:
            outputs = self.forward(size, meta, cut)
        except BaseException:
            with contextlib.suppress(Exception):  # (the capture is void: end it)
                pieces[-1].capture_end()
            raise
        pieces[-1].capture_end()
        for call in calls:
            call.weaken()
        self.captured[size] = Captured(pieces, calls, outputs)
