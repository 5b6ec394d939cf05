"""The engine core's side of structured outputs. A constrained request waits here, out of
the scheduler, while a worker thread compiles its grammar (the engine loop never compiles);
then it enters the scheduler with a matcher. In each step the runner masks the logits of the
constrained rows only (sample/grammar_mask.py) and the engine core advances each matcher with
the token sampled (`advance`): unconstrained rows are never touched."""

from __future__ import annotations

import concurrent.futures
import logging
import threading
from typing import Any

from tokenmill.core.request import Request
from tokenmill.sampling_params import InvalidParameter

logger = logging.getLogger(__name__)


# CPU seconds one step's mask of one request may take: a grammar's next-token mask takes
# microseconds to milliseconds, but an ambiguous one (nested counted repetitions, as
# `((a{0,100}){0,100}){0,100}`) takes longer at every token, up to seconds a step with the
# whole batch waiting; past this its request is ended with an error. CPU time of the
# masking thread, not wall time: a busy machine slows every mask, and that is no reason.
MASK_CPU_LIMIT_S = 0.5
SLOW_MASK_ERROR = ("The structured-output constraint took too long to evaluate at one token "
                   "(over {:g} s); the request was stopped. Simplify the constraint.")


class GrammarState:
    """A constrained request's compiled grammar (a future until compiled) and matcher;
    with `after` (the end of a reasoning section), inactive until the output holds it.
    `mask_cpu_s`: the CPU time the request's mask took in the last step (grammar_mask.py)."""

    def __init__(self, future: concurrent.futures.Future | None,
                 after: list[int] | None = None) -> None:
        self.future = future
        self.matcher: Any = None
        self.after = list(after or [])
        self.active = not self.after
        self.mask_cpu_s = 0.0

    def slow_error(self) -> str | None:
        """The error that stops the request when its last mask took too long, else None."""
        return SLOW_MASK_ERROR.format(MASK_CPU_LIMIT_S) \
            if self.mask_cpu_s > MASK_CPU_LIMIT_S else None

    def start(self) -> None:
        import xgrammar as xgr

        self.matcher = xgr.GrammarMatcher(self.future.result())

    def rows_from(self, output: list[int], drafts: list[int]) -> int | None:
        """The first of the rows verifying `drafts` that the grammar constrains (0 when
        active; None when the marker is not complete within them)."""
        if self.active:
            return 0
        tail = output[max(0, len(output) - len(self.after) + 1):] if len(self.after) > 1 else []
        end = _marker_end(tail + drafts, self.after)
        return None if end is None else end - len(tail)


def _marker_end(tokens: list[int], marker: list[int]) -> int | None:
    """Index just past the first occurrence of `marker` in `tokens`, or None."""
    m = len(marker)
    for i in range(len(tokens) - m + 1):
        if tokens[i:i + m] == marker:
            return i + m
    return None


class StructuredOutputs:
    def __init__(self, tokenizer_path: str, vocab_size: int) -> None:
        self.tokenizer_path = tokenizer_path
        self.vocab_size = vocab_size
        self._grammars = None
        self._lock = threading.Lock()
        self._lanes = None  # CompileLanes, made on first use
        self.pending: list[Request] = []  # compiling, in arrival order

    def grammars(self, stop_token_ids: list[int], tokenizer: Any = None) -> Any:
        """The model's compiler (made on first use; an in-process front end that checks
        requests shares it, so their grammars come from its cache here)."""
        with self._lock:
            if self._grammars is None:
                from tokenmill.loading.checkpoint import load_tokenizer
                from tokenmill.structured_output.backend import Grammars

                self._grammars = Grammars(tokenizer or load_tokenizer(self.tokenizer_path),
                                          self.vocab_size, list(stop_token_ids))
            return self._grammars

    def _compile(self, request: Request) -> Any:
        params = request.sampling_params
        return self.grammars(params.eos_token_ids).compile(params.structured_outputs)

    def submit(self, request: Request) -> None:
        from tokenmill.structured_output.backend import CompileLanes

        spec = request.sampling_params.structured_outputs
        if self._lanes is None:
            self._lanes = CompileLanes("tokenmill-grammar")
        request.grammar = GrammarState(self._lanes.submit(spec, self._compile, request),
                                       spec.after_token_ids)
        self.pending.append(request)

    def ready(self, wait_s: float = 0.0) -> tuple[list[Request], list[tuple[Request, str]]]:
        """Requests whose grammar compiled (matchers started), and those that failed with
        the error to report; waits up to `wait_s` for a first one."""
        if wait_s and self.pending:
            concurrent.futures.wait([r.grammar.future for r in self.pending], wait_s,
                                    concurrent.futures.FIRST_COMPLETED)
        done = [r for r in self.pending if r.grammar.future.done()]
        if not done:
            return [], []
        self.pending = [r for r in self.pending if not r.grammar.future.done()]
        ok, failed = [], []
        for request in done:
            exc = request.grammar.future.exception()
            if exc is None:
                request.grammar.start()
                ok.append(request)
            else:
                if not isinstance(exc, InvalidParameter):
                    logger.error("grammar of request %s failed to compile: %r",
                                 request.request_id, exc)
                failed.append((request, str(exc) if isinstance(exc, InvalidParameter)
                               else "The structured-output grammar failed to compile."))
        return ok, failed

    def drop(self, request_ids: list[str]) -> None:
        """Forget pending requests (aborted); a compile not started yet never starts."""
        for request in self.pending:
            if request.request_id in request_ids:
                request.grammar.future.cancel()
        self.pending = [r for r in self.pending if r.request_id not in request_ids]

    def shutdown(self) -> None:
        if self._lanes is not None:
            self._lanes.shutdown()


def advance(request: Request, tokens: list[int]) -> bool | None:
    """The request's matcher takes the tokens sampled for it; True once its grammar is
    complete (it took a stop token), None if a token breaks it (a row whose every token was
    masked, as by bans or penalties that leave no finite score: the caller ends the request,
    never the engine). A grammar waiting for the end of a reasoning section starts with the
    tokens after it, once the output holds it."""
    state, matcher = request.grammar, request.grammar.matcher
    if not state.active:
        output = request.output_token_ids
        start = max(0, len(output) - len(tokens) - len(state.after) + 1)
        end = _marker_end(output[start:], state.after)
        if end is None:
            return False
        state.active = True
        tokens = output[start + end:]
    for token in tokens:
        if matcher.is_terminated():
            break
        if not matcher.accept_token(token):
            return None
    return matcher.is_terminated()
