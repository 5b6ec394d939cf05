"""What every tensor-parallel rank needs to run one step's forward, as plain lists: built by
rank 0 from the scheduler's output and broadcast once per step as msgpack bytes (no pickles;
the block table as what changed: worker/step_sync.py)."""

from __future__ import annotations

import msgspec
import numpy as np

from tokenmill import mm_inputs
from tokenmill.core.scheduler import ScheduledRequest
from tokenmill.lora.request import LoRARequest

Ints = list[int] | np.ndarray


class StepInputs(msgspec.Struct, array_like=True, frozen=True):
    token_ids: list[int]  # the step's new tokens, sequence after sequence
    starts: list[int]  # per sequence: its first position computed in this step
    ends: list[int]  # per sequence: one past its last position (its KV length after the step)
    # per sequence: its KV blocks (the scheduler's rows are int64 array views; the step's
    # message to other ranks sends what changed, worker/step_sync.py)
    block_ids: list[list[int]]
    sample_seqs: list[int]  # sequences whose last row is sampled from
    prompt_seqs: list[int]  # sequences whose prompt tokens are scored (prompt logprobs)
    prompt_rows: list[tuple[int, int]]  # per prompt_seqs entry: (first row, row count)
    # per sample_seqs entry: its last rows scored (1, or with draft tokens 1 + drafts)
    sample_counts: list[int]
    # LoRA: per sequence its adapter's id (0: the base model), and those adapters; empty
    # when no sequence of the step has one
    lora_ids: list[int] = []
    lora_requests: list[LoRARequest] = []
    # adapters rank 0 began reading off its step loop: the other ranks read them meanwhile
    # (their requests run in a later step), so no rank's step waits on the whole read
    lora_prefetch: list[LoRARequest] = []
    # a pooling model's sequences: every row of theirs is pooled (none is sampled)
    pool_seqs: list[int] = []
    # an image-text model's rows of image placeholders, in sequence and image order: the
    # first layer reads the images' rows there (rank 0 encodes them, and broadcasts them to
    # the other tensor-parallel ranks)
    image_rows: list[int] = []
    # M-RoPE (Qwen2-VL) with a sequence that holds images: every row's (temporal, height,
    # width) rotary positions, the three rows one after another ([3 x rows]; empty: the
    # rows rotate by their positions)
    rope_positions: list[int] = []  # (rank 0: an int64 array)
    # Gemma 3: (sequence, first position, end) of each image this step computes, whose rows
    # attend to each other both ways (AttentionMetadata.bidirectional)
    bidirectional: list[tuple[int, int, int]] = []
    # a model with state layers: per sequence its state slot (core/state_slots.py); empty
    # for a model without
    state_slots: list[int] = []
    # and which of its slot's rows holds its state (ScheduledRequest.state_row); empty
    # when every one is the first
    state_rows: list[int] = []

    @classmethod
    def of(cls, scheduled: list[ScheduledRequest],
           lora_prefetch: list[LoRARequest] | None = None,
           bidirectional_images: bool = False) -> StepInputs:
        """`bidirectional_images`: the model's image rows attend to each other both ways
        (the scheduler then computes each image in one step)."""
        token_ids: list[int] = []
        sample_seqs, prompt_seqs, prompt_rows, sample_counts, pool_seqs = [], [], [], [], []
        image_rows: list[int] = []
        spans: list[tuple[int, int, int]] = []
        for i, s in enumerate(scheduled):
            request, drafts = s.request, s.drafts
            first = len(token_ids)
            end = s.end - len(drafts)  # (drafts: after the request's tokens)
            num_tokens = request.num_tokens
            # a position past the host's tokens (asynchronous scheduling) holds 0 until the
            # runner fills in the token its previous step sampled
            known = min(end, num_tokens)
            token_ids += request.token_ids(s.start, known)
            if end > known:
                token_ids += [0] * (end - known)
            if drafts:
                token_ids += drafts
            for image in request.mm_inputs:  # (the rows of this chunk that are an image's)
                a, b = max(s.start, image.offset), min(end, image.end)
                image_rows += range(first + a - s.start, first + b - s.start)
                if bidirectional_images and a < b:
                    spans.append((i, image.offset, image.end))
            if request.pooling_params is not None:
                pool_seqs.append(i)
            elif end >= num_tokens:
                sample_seqs.append(i)
                sample_counts.append(1 + len(drafts))
            if request.sampling_params.prompt_logprobs is not None:
                # rows start .. last-1 predict prompt tokens start+1 .. last
                last = min(s.end, request.num_prompt_tokens - 1)
                if s.start < last:
                    prompt_seqs.append(i)
                    prompt_rows.append((first, last - s.start))
        adapters = {s.request.lora_id: s.request.lora_request for s in scheduled
                    if s.request.lora_request is not None}
        rope = []
        if any(mm_inputs.uses_mrope(s.request.mm_inputs) for s in scheduled):
            rope = np.concatenate([mm_inputs.rope_positions(s.request.mm_inputs, s.start, s.end)
                                   for s in scheduled], axis=1).ravel()
        return cls(token_ids, [s.start for s in scheduled], [s.end for s in scheduled],
                   [s.block_ids for s in scheduled], sample_seqs, prompt_seqs,
                   prompt_rows, sample_counts,
                   [s.request.lora_id for s in scheduled] if adapters else [],
                   list(adapters.values()), lora_prefetch or [], pool_seqs, image_rows, rope,
                   spans, *_state_rows(scheduled))

    @property
    def num_sampled_rows(self) -> int:
        return sum(self.sample_counts)

    @property
    def only_decodes(self) -> bool:
        """Every sequence computes one token, or a decode's token and its drafts."""
        counts = dict(zip(self.sample_seqs, self.sample_counts))
        return all(end - start in (1, counts.get(i)) for i, (start, end)
                   in enumerate(zip(self.starts, self.ends)))

    @property
    def uniform_rows(self) -> int:
        """q when every sequence computes q tokens and all of them are scored (decodes: q = 1;
        decodes carrying q - 1 drafts each) and nothing else is (what a CUDA-graph step runs);
        else 0."""
        n = len(self.starts)
        q, rest = divmod(len(self.token_ids), n) if n else (0, 1)
        if (rest or self.prompt_seqs or self.pool_seqs or self.image_rows
                or len(self.rope_positions) or len(self.sample_seqs) != n):
            return 0
        # (each sequence computes at least the rows it scores: all q, when they add up)
        return q if all(count == q for count in self.sample_counts) else 0

    def layout(self, block_size: int, rows: int = 0) -> tuple[Ints, Ints, np.ndarray]:
        """On the host: each new token's position, the cache slot its K/V goes to (its
        block's id x block_size + offset), and the block table padded with block 0 (an int64
        array of at least `rows` rows: a CUDA-graph bucket's padding rows all block 0).
        An all-decode step's positions and slots are lists (a list comprehension beats
        numpy's cost per call at a few dozen sequences); a step with prompt chunks computes
        them in numpy over its tokens (a 2k-token chunk a token at a time in Python took
        0.12 ms, and `torch.tensor` of those lists another 0.3 ms)."""
        n = len(self.starts)
        width = max(map(len, self.block_ids))
        table = np.zeros((max(rows, n), width), dtype=np.int64)
        for i, blocks in enumerate(self.block_ids):
            table[i, :len(blocks)] = blocks
        if len(self.token_ids) == n:  # one token per sequence (decodes)
            return self.starts, [int(blocks[p // block_size]) * block_size + p % block_size
                                 for p, blocks in zip(self.starts, self.block_ids)], table
        starts = np.array(self.starts, dtype=np.int64)
        lengths = np.array(self.ends, dtype=np.int64) - starts
        seqs = np.repeat(np.arange(n), lengths)  # each row's sequence
        first_rows = np.cumsum(lengths) - lengths
        positions = np.arange(len(self.token_ids)) + np.repeat(starts - first_rows, lengths)
        slots = table[seqs, positions // block_size] * block_size + positions % block_size
        return positions, slots, table

    def staged(self, block_size: int) -> tuple[np.ndarray, list[slice], np.ndarray]:
        """The step's token ids, positions, slots and sequence lengths in one int64 array
        (one copy to the device), each one's slice of it, and the block table. Each part
        starts at an even index, 16 bytes of int64: Triton specializes a kernel on its
        pointers' alignment, which must not depend on the length of the part before."""
        positions, slots, table = self.layout(block_size)
        pieces, parts, at = [], [], 0
        for part in (self.token_ids, positions, slots, self.ends):
            parts.append(slice(at, at + len(part)))
            pieces.append(part)
            if len(part) % 2:
                pieces.append(_PAD)
            at += len(part) + len(part) % 2
        return np.concatenate(pieces, dtype=np.int64), parts, table

    def encode(self) -> bytes:
        return _ENCODER.encode(self)

    @classmethod
    def decode(cls, data: bytes) -> StepInputs:
        return _DECODER.decode(data)


def _state_rows(scheduled: list[ScheduledRequest]) -> tuple[list[int], list[int]]:
    """(StepInputs.state_slots, StepInputs.state_rows)."""
    if not scheduled or scheduled[0].state_slot < 0:
        return [], []
    rows = [s.state_row for s in scheduled]
    return [s.state_slot for s in scheduled], rows if any(rows) else []


def as_list(obj):
    if isinstance(obj, np.ndarray):
        return obj.tolist()
    raise TypeError(f"cannot encode {type(obj).__name__}")


_PAD = np.zeros(1, dtype=np.int64)
_ENCODER = msgspec.msgpack.Encoder(enc_hook=as_list)
_DECODER = msgspec.msgpack.Decoder(StepInputs)
