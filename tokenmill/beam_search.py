"""Beam search: transformers' `generate(num_beams=...)` algorithm, run over the engine.

Each step, every live beam is one engine request for one token with its top-K logprobs
(K = max(2, 1 + number of EOS ids) x beam_width, as transformers keeps); the prompt and each
beam's earlier tokens come from the prefix cache, so beams share the prompt's KV blocks (and
each other's common prefix) instead of recomputing them (vLLM's LLM.beam_search works the same
way). `BeamSearch` is the algorithm alone, one prompt, no engine: the offline
(`LLM.beam_search`) and API (`run_async`) drivers feed it.

The algorithm, as transformers 4.5x+ / 5.x: candidates are all (beam, token) pairs scored by
the beam's cumulative logprob plus the token's; the best K are kept; those that end (an EOS
token, or `max_tokens` reached) among the first `beam_width` of them join the finished set with
score `cum_logprob / generated_len ** length_penalty` (the best `beam_width` are kept); the
best `beam_width` candidates that do not end continue. The search stops when no running beam
can still beat the worst finished one (`early_stopping` False: judged at the current length;
"never": at `max_tokens` when `length_penalty` > 0; True: as soon as `beam_width` beams
finished), or every candidate ends."""

from __future__ import annotations

import asyncio
import itertools
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from tokenmill.outputs import OutputKind
from tokenmill.sampling_params import InvalidParameter, SamplingParams

_NEG = -1.0e9  # transformers' "cannot be chosen" offset


def _penalized(logprob: float, length: int, penalty: float) -> float:
    """`logprob / length ** penalty` (transformers' beam score), kept in the float range: a
    power past it (|penalty| in the hundreds) makes the quotient 0 or as large as floats go
    instead of raising OverflowError / ZeroDivisionError (a 500 on every route)."""
    try:
        return logprob / length ** penalty
    except OverflowError:  # the power beyond the largest float: the quotient is 0
        return -0.0 if logprob < 0 else 0.0
    except ZeroDivisionError:  # the power below the smallest float
        return -math.inf if logprob < 0 else 0.0


@dataclass
class BeamSearchParams:
    """vLLM's BeamSearchParams (plus transformers' `early_stopping`)."""

    beam_width: int
    max_tokens: int
    ignore_eos: bool = False
    length_penalty: float = 1.0
    early_stopping: bool | str = False  # False | True | "never"
    num_return_sequences: int | None = None  # default: beam_width
    eos_token_ids: list[int] | None = None  # default: the model's (TensorRT-LLM's end_id)

    def __post_init__(self) -> None:
        for name in ("beam_width", "max_tokens"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise InvalidParameter(name, f"{name} must be a positive integer, got {value!r}.")
        if self.num_return_sequences is None:
            self.num_return_sequences = self.beam_width
        if not 1 <= self.num_return_sequences <= self.beam_width:
            raise InvalidParameter("num_return_sequences", "num_return_sequences must be in "
                                   f"[1, beam_width], got {self.num_return_sequences}.")
        if self.early_stopping not in (False, True, "never"):
            raise InvalidParameter("early_stopping", "early_stopping must be true, false or "
                                   "\"never\".")
        if not isinstance(self.length_penalty, (int, float)) or isinstance(
                self.length_penalty, bool) or not -1e3 <= self.length_penalty <= 1e3:
            raise InvalidParameter("length_penalty", "length_penalty must be a number.")


@dataclass
class BeamSequence:
    """One returned beam: `tokens` = prompt + generated (vLLM's BeamSearchSequence)."""

    tokens: list[int]
    logprobs: list[float]  # of each generated token
    cum_logprob: float
    score: float  # cum_logprob / len(generated) ** length_penalty
    finish_reason: str  # stop (an EOS token) | length
    text: str | None = None


@dataclass
class BeamSearchOutput:
    sequences: list[BeamSequence]


@dataclass
class _Beam:
    tokens: list[int]  # generated
    score: float  # cumulative logprob (with _NEG when forced to continue)
    logprobs: list[float] = field(default_factory=list)


class BeamSearch:
    """One prompt's search: `pending()` lists the token sequences whose next-token logprobs
    are needed; `advance()` takes them (each the top `k` (token, logprob) pairs, best first)."""

    def __init__(self, prompt: list[int], params: BeamSearchParams,
                 eos_token_ids: Sequence[int]) -> None:
        self.prompt, self.params = list(prompt), params
        eos = eos_token_ids if params.eos_token_ids is None else params.eos_token_ids
        self.eos = set() if params.ignore_eos else set(eos)
        self.k = max(2, 1 + len(self.eos)) * params.beam_width
        self.running = [_Beam([], 0.0)]
        self.finished: list[tuple[float, _Beam]] = []  # (normalized score, beam), best first
        self.improvable = True
        self.done = False

    def pending(self) -> list[list[int]]:
        return [] if self.done else [self.prompt + b.tokens for b in self.running]

    def advance(self, tops: list[list[tuple[int, float]]]) -> None:
        p, width = self.params, self.params.beam_width
        candidates = sorted(
            ((beam.score + lp, b, token, lp) for b, (beam, top) in enumerate(zip(self.running,
                                                                                  tops))
             for token, lp in top[:self.k]),
            key=lambda c: (-c[0], c[1], c[2]))[:self.k]
        new_len = len(self.running[0].tokens) + 1
        ends = [token in self.eos or new_len >= p.max_tokens for _, _, token, _ in candidates]

        def extend(c) -> _Beam:
            value, b, token, lp = c
            beam = self.running[b]
            return _Beam(beam.tokens + [token], value, beam.logprobs + [lp])

        full = len(self.finished) == width
        if self.improvable and not (full and p.early_stopping is True):
            for rank, (c, end) in enumerate(zip(candidates, ends)):
                if rank < width and end:
                    self.finished.append((_penalized(c[0], new_len, p.length_penalty),
                                          extend(c)))
            self.finished.sort(key=lambda f: -f[0])
            del self.finished[width:]
        order = sorted(range(len(candidates)),
                       key=lambda i: (-(candidates[i][0] + _NEG * ends[i]), i))[:width]
        self.running = [extend(candidates[i]) for i in order]
        for beam, i in zip(self.running, order):
            beam.score += _NEG * ends[i]
        if len(self.finished) == width:
            length = p.max_tokens if p.early_stopping == "never" and p.length_penalty > 0 \
                else new_len
            best = _penalized(self.running[0].score, length, p.length_penalty)
            self.improvable = self.improvable and best > self.finished[-1][0]
        all_full = len(self.finished) == width and p.early_stopping is True
        self.done = not self.improvable or all_full or all(ends)

    def results(self, decode: Callable[[list[int]], str] | None = None) -> list[BeamSequence]:
        out = []
        for score, beam in self.finished[:self.params.num_return_sequences]:
            stop = bool(beam.tokens) and beam.tokens[-1] in self.eos
            out.append(BeamSequence(self.prompt + beam.tokens, beam.logprobs,
                                    sum(beam.logprobs), score, "stop" if stop else "length",
                                    decode(beam.tokens) if decode is not None else None))
        return out


def step_params(search: BeamSearch) -> SamplingParams:
    """One beam's engine request: one token (which does not matter), the top-k logprobs."""
    return SamplingParams(max_tokens=1, temperature=0.0, logprobs=search.k, ignore_eos=True,
                          skip_special_tokens=False)


def top_pairs(logprobs: dict, k: int) -> list[tuple[int, float]]:
    """A RequestOutput position's {token: Logprob} as its best k (token, logprob) pairs."""
    return sorted(((t, lp.logprob) for t, lp in logprobs.items()),
                  key=lambda x: (-x[1], x[0]))[:k]


async def run_async(engine, prompt: list[int], params: BeamSearchParams,
                    request_id: str, reservation=None, lora_request=None
                    ) -> list[BeamSequence]:
    """The search over an AsyncLLM: each step's beams as concurrent one-token requests
    (under `lora_request`'s adapter where given)."""
    search = BeamSearch(prompt, params, engine.eos_token_ids)
    counter = itertools.count()

    async def last(tokens: list[int]):
        final = None
        async for out in engine.generate(tokens, step_params(search),
                                         request_id=f"{request_id}-beam{next(counter)}",
                                         reservation=reservation,
                                         output_kind=OutputKind.FINAL_ONLY,
                                         lora_request=lora_request):
            final = out
        return top_pairs(final.outputs[0].logprobs[0], search.k)

    while not search.done:
        search.advance(await asyncio.gather(*(last(t) for t in search.pending())))
    return search.results(lambda ids: engine.tokenizer.decode(ids, skip_special_tokens=True))
