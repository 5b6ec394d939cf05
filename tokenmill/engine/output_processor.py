"""Turns engine-core outputs into user results: text, stop strings, logprobs, n-way fan-in."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

from tokenmill.core.request import FinishReason
from tokenmill.engine.protocol import EngineCoreOutput, PositionLogprobs
from tokenmill.outputs import CompletionOutput, Logprob, RequestOutput
from tokenmill.sampling_params import SamplingParams
from tokenmill.tokenizer import IncrementalDetokenizer


@dataclass
class _Completion:
    """One sampled sequence (one of a request's `n`)."""

    index: int
    params: SamplingParams
    detokenizer: IncrementalDetokenizer
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[dict[int, Logprob]] | None = None
    cumulative_logprob: float | None = None
    spec_tokens: tuple[int, int] = (0, 0)  # drafts verified, accepted
    kv_blocks: tuple[int, int] = (0, 0)  # from the prefix cache, filled (when finished)
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    # delta outputs: characters held back while running (they may become a stop string),
    # and the characters and tokens already handed out
    hold: int = 0
    sent_text: int = 0
    sent_ids: int = 0

    def output(self) -> CompletionOutput:
        logprobs = None if self.logprobs is None else list(self.logprobs)
        return CompletionOutput(self.index, self.detokenizer.text, list(self.token_ids),
                                self.finish_reason, logprobs, self.stop_reason,
                                self.cumulative_logprob)

    def delta(self) -> CompletionOutput:
        """What came since the last delta: the new text (less the last `hold` characters
        while running: a stop string found later never reaches the caller), ids and
        logprobs. O(new), however long the output."""
        detok, sent = self.detokenizer, self.sent_text
        end = detok.text_length if self.finish_reason is not None \
            else max(sent, detok.text_length - self.hold)
        text = detok.tail(sent)[:end - sent] if end > sent else ""
        first = self.sent_ids
        self.sent_text, self.sent_ids = end, len(self.token_ids)
        logprobs = None if self.logprobs is None else self.logprobs[first:]
        return CompletionOutput(self.index, text, self.token_ids[first:], self.finish_reason,
                                logprobs, self.stop_reason, self.cumulative_logprob)


@dataclass
class _RequestState:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    completions: list[_Completion]
    prompt_logprobs: list[dict[int, Logprob] | None] | None = None
    num_cached_tokens: int = 0
    delta: bool = False  # results carry what came since the last one (see _Completion.delta)
    # epoch seconds: arrival_time, first_scheduled_time, first_token_time, last_token_time
    times: dict[str, float] = field(default_factory=dict)
    pooled: list[float] | None = None  # a pooling request's vector, once computed
    kv_transfer_params: dict | None = None  # a prefill request's, once finished

    @property
    def finished(self) -> bool:
        return all(c.finish_reason is not None for c in self.completions)


def child_request_id(request_id: str, index: int, n: int) -> str:
    return request_id if n == 1 else f"{index}_{request_id}"


class OutputProcessor:
    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer
        self._requests: dict[str, _RequestState] = {}
        self._children: dict[str, tuple[_RequestState, _Completion]] = {}

    def add_request(self, request_id: str, prompt: str | None, prompt_token_ids: list[int],
                    params: SamplingParams, delta: bool = False) -> list[str]:
        """Registers a request; returns the engine-core ids of its `n` sequences. `delta`:
        its results carry only what is new since the previous one (a long output's results
        then cost the same at its end as at its start)."""
        state = _RequestState(request_id, prompt, prompt_token_ids, [], delta=delta,
                              times={"arrival_time": time.time()})
        hold = max((len(s) for s in params.stop), default=1) - 1
        if params.prompt_logprobs is not None:
            state.prompt_logprobs = [None]
        ids = []
        for i in range(params.n):
            completion = _Completion(i, params, IncrementalDetokenizer(
                self.tokenizer, prompt_token_ids, params.skip_special_tokens), hold=hold)
            if params.logprobs is not None:
                completion.logprobs, completion.cumulative_logprob = [], 0.0
            state.completions.append(completion)
            child_id = child_request_id(request_id, i, params.n)
            self._children[child_id] = (state, completion)
            ids.append(child_id)
        self._requests[request_id] = state
        return ids

    def parent_of(self, child_id: str) -> str | None:
        entry = self._children.get(child_id)
        return None if entry is None else entry[0].request_id

    def has_request(self, request_id: str) -> bool:
        return request_id in self._requests

    def child_ids(self, request_id: str) -> list[str]:
        state = self._requests.get(request_id)
        return [] if state is None else self._child_ids_of(state)

    def abort_request(self, request_id: str) -> RequestOutput | None:
        state = self._requests.pop(request_id, None)
        if state is None:
            return None
        for child_id in self._child_ids_of(state):
            self._children.pop(child_id, None)
        for c in state.completions:
            if c.finish_reason is None:
                c.finish_reason = str(FinishReason.ABORT)
        return self._request_output(state)

    @staticmethod
    def _child_ids_of(state: _RequestState) -> list[str]:
        n = len(state.completions)
        return [child_request_id(state.request_id, c.index, n) for c in state.completions]

    def process_outputs(self, outputs: list[EngineCoreOutput], final_only: bool = False
                        ) -> tuple[list[RequestOutput], list[str]]:
        """Returns the updated results (`final_only`: only the finished requests') and the
        engine-core ids stopped here by a stop string (the caller must finish them in the
        core)."""
        touched: dict[str, _RequestState] = {}
        finished: list[_RequestState] = []
        stopped: list[str] = []
        now = time.time()
        for out in outputs:
            entry = self._children.get(out.request_id)
            if entry is None:
                continue  # aborted meanwhile
            state, completion = entry
            touched[state.request_id] = state
            if out.prompt_logprobs is not None:
                self._add_prompt_logprobs(state, *out.prompt_logprobs)
            if out.num_cached_tokens:
                state.num_cached_tokens = out.num_cached_tokens
            if out.kv_transfer_params is not None:
                state.kv_transfer_params = out.kv_transfer_params
            self._note_metrics(state, completion, out, now)
            if out.pooled is not None:  # (a pooling request ends with its vector)
                state.pooled, completion.finish_reason = out.pooled, str(FinishReason.STOP)
            elif not out.new_token_ids:
                continue
            completion.token_ids.extend(out.new_token_ids)
            if out.new_logprobs is not None and completion.logprobs is not None:
                for token, lp in zip(out.new_token_ids, out.new_logprobs):
                    completion.logprobs.append(self._position_logprobs(token, lp))
                    completion.cumulative_logprob += lp[2]
            if out.pooled is None and self._update_text(completion, out):
                stopped.append(out.request_id)
            if completion.finish_reason is not None:
                del self._children[out.request_id]
                if state.finished:  # (its last completion ended: once per request)
                    finished.append(state)
        results = [self._request_output(state)
                   for state in (finished if final_only else touched.values())]
        for state in finished:
            del self._requests[state.request_id]
        return results, stopped

    @staticmethod
    def _note_metrics(state: _RequestState, completion: _Completion,
                      out: EngineCoreOutput, now: float) -> None:
        times = state.times
        if out.queue_time is not None and "first_scheduled_time" not in times:
            times["first_scheduled_time"] = times["arrival_time"] + out.queue_time
        if out.new_token_ids:
            times.setdefault("first_token_time", now)
            times["last_token_time"] = now
        if out.spec_tokens is not None:
            completion.spec_tokens = tuple(out.spec_tokens)
        if out.kv_blocks is not None:
            completion.kv_blocks = tuple(out.kv_blocks)

    def _update_text(self, completion: _Completion, out: EngineCoreOutput) -> bool:
        """Detokenize new tokens, apply stop strings; True if a stop string ended it here."""
        params = completion.params
        new_ids = out.new_token_ids
        if out.finish_reason is not None and not params.include_stop_str_in_output and (
                out.finish_reason == FinishReason.STOP and out.stop_reason is None
                or isinstance(out.stop_reason, int)):
            new_ids = new_ids[:-1]  # EOS / stop token: not part of the text
        detok = completion.detokenizer
        before = detok.text_length
        detok.add_tokens(new_ids, final=out.finish_reason is not None)
        if out.finish_reason is not None:
            completion.finish_reason = str(FinishReason(out.finish_reason))
            completion.stop_reason = out.stop_reason
        if not params.stop or completion.finish_reason is not None and out.stop_reason:
            return False
        if len(completion.token_ids) <= params.min_tokens:  # (vLLM: stop strings count only
            return False  # past min_tokens, as the stop tokens the sampler bans until then)
        longest = max(len(s) for s in params.stop)
        search_from = max(0, before - longest + 1)
        tail = detok.tail(search_from)  # (the new text and what a stop string may span)
        hits = [(search_from + i, s) for s in params.stop if (i := tail.find(s)) >= 0]
        if not hits:
            return False
        index, stop = min(hits)
        detok.text = detok.text[:index + (len(stop) if params.include_stop_str_in_output else 0)]
        already_finished = completion.finish_reason is not None
        completion.finish_reason = str(FinishReason.STOP)
        completion.stop_reason = stop
        return not already_finished

    def _position_logprobs(self, token: int, lp: PositionLogprobs) -> dict[int, Logprob]:
        top_ids, top_values, chosen, rank = lp
        entry = {token: Logprob(chosen, rank, self.tokenizer.decode([token]))}
        for i, (tid, value) in enumerate(zip(top_ids, top_values)):
            if tid not in entry:
                entry[tid] = Logprob(value, i + 1, self.tokenizer.decode([tid]))
        return entry

    def _add_prompt_logprobs(self, state: _RequestState, start: int,
                             scored: list[PositionLogprobs]) -> None:
        if state.prompt_logprobs is None:
            return
        for offset, lp in enumerate(scored):
            position = start + offset
            if position == len(state.prompt_logprobs):  # recompute after preemption repeats
                state.prompt_logprobs.append(
                    self._position_logprobs(state.prompt_token_ids[position], lp))

    def _request_output(self, state: _RequestState) -> RequestOutput:
        drafts = accepted = reused = filled = 0  # (one pass: this runs per stream per step)
        for c in state.completions:
            drafts, accepted = drafts + c.spec_tokens[0], accepted + c.spec_tokens[1]
            reused, filled = reused + c.kv_blocks[0], filled + c.kv_blocks[1]
        metrics = {**state.times, "num_draft_tokens": drafts, "num_accepted_tokens": accepted,
                   "kv_cache_reused_blocks": reused, "kv_cache_total_blocks": filled}
        outputs = [c.delta() if state.delta else c.output() for c in state.completions]
        return RequestOutput(state.request_id, state.prompt, state.prompt_token_ids,
                             outputs, state.finished,
                             state.prompt_logprobs, state.num_cached_tokens, metrics,
                             state.pooled, state.kv_transfer_params)
