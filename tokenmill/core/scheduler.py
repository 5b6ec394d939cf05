"""Continuous batching: each step, pick which requests run and how many tokens each computes."""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

from tokenmill.config.scheduler import SchedulerConfig
from tokenmill.core.image_chunks import image_chunk
from tokenmill.core.kv_cache_manager import KVCacheManager
from tokenmill.core.queue_policy import QueuePolicy
from tokenmill.core.request import Request, RequestStatus


@dataclass
class ScheduledRequest:
    request: Request
    start: int  # first position computed this step (== num_computed_tokens before the step)
    num_new_tokens: int
    # the request's whole block table: a view of its row as it is now
    # (KVCacheManager.block_row; a list where built by hand)
    block_ids: Any = field(default_factory=list)
    # the request's preemption count when scheduled: a result that comes back after the
    # request was preempted (a pipeline micro-batch still in flight then) is dropped
    preemptions: int = 0
    # speculative decoding: draft tokens computed after the request's last token (counted
    # in num_new_tokens); the step's verification keeps those the target agrees with
    drafts: list[int] = field(default_factory=list)
    draft_probs: Any = None  # the distributions they were drawn from (None: one-hot)
    padding: int = 0  # trailing drafts that only fill a CUDA-graph bucket (not counted)
    # asynchronous scheduling: a decode at the position of the token its request's step in
    # flight samples (the runner takes that token on the device)
    output_pending: bool = False
    state_slot: int = -1  # a model with state layers: the request's slot (core/state_slots.py)
    # which of the slot's rows holds the request's state: the drafts its last verification
    # accepted (a verified sequence keeps the state after each of its rows), else 0
    state_row: int = 0

    @property
    def end(self) -> int:
        return self.start + self.num_new_tokens


@dataclass
class SchedulerOutput:
    scheduled: list[ScheduledRequest]
    # Requests that left the engine since the previous step: the runner drops their state.
    finished_ids: set[str] = field(default_factory=set)

    @property
    def num_batched_tokens(self) -> int:
        return sum(s.num_new_tokens for s in self.scheduled)

    @property
    def empty(self) -> bool:
        return not self.scheduled


class Scheduler:
    """Running requests are served first (one token for decode, plus its draft tokens when
    it has some; a chunk for a long prompt), then waiting ones are admitted while the token
    budget, `max_num_seqs` and free blocks allow. Out of blocks: a running request is
    preempted and recomputed later: which one, the order requests wait in and whether one
    may take a running one's place are the `--scheduling-policy`'s (core/queue_policy.py:
    fcfs, priority, fair). A waiting request past its `deadline` is refused (`expire`)."""

    def __init__(self, config: SchedulerConfig, kv_cache: KVCacheManager) -> None:
        self.config = config
        self.kv_cache = kv_cache
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.requests: dict[str, Request] = {}
        self._finished_ids: set[str] = set()
        self.num_preemptions = 0
        # speculative decoding: draft tokens verified, accepted, tokens emitted by drafted
        # steps, and such steps (cumulative)
        self.num_draft_tokens = self.num_accepted_tokens = self.num_spec_emitted = 0
        self.num_spec_steps = 0
        self.policy = QueuePolicy(config.policy, config.tenant_weights)
        self.num_deadlines, self._next_deadline = 0, float("inf")  # (and their earliest)
        self.num_admitted = 0  # requests scheduled for the first time (cumulative)

    # ---- request lifetime -------------------------------------------------------------
    def add_request(self, request: Request) -> None:
        if request.request_id in self.requests:
            raise ValueError(f"Request id {request.request_id!r} is already in the engine.")
        self.requests[request.request_id] = request
        self.policy.arrived(request)
        if request.deadline is not None:
            self.num_deadlines += 1
            self._next_deadline = min(self._next_deadline, request.deadline)
        self.policy.wait(self.waiting, request)

    def _victim(self) -> Request:
        return self.policy.victim(self.running)

    def abort_requests(self, request_ids: Iterable[str]) -> list[Request]:
        return self.finish_requests(request_ids, RequestStatus.FINISHED_ABORTED)

    def finish_requests(self, request_ids: Iterable[str], status: RequestStatus) -> list[Request]:
        """Finish requests for reasons found outside the core: abort, stop strings."""
        finished = []
        for request_id in request_ids:
            request = self.requests.get(request_id)
            if request is None or request.status.finished:
                continue
            if request.status == RequestStatus.RUNNING:
                self.running.remove(request)
            else:
                self.waiting.remove(request)
            self._finish(request, status)
            finished.append(request)
        return finished

    def _finish(self, request: Request, status: RequestStatus) -> None:
        request.status = status
        self.kv_cache.free(request)
        del self.requests[request.request_id]
        self.policy.left(request)
        self.num_deadlines -= request.deadline is not None
        self._finished_ids.add(request.request_id)

    def _preempt(self, request: Request) -> None:
        self.kv_cache.free(request)
        request.status = RequestStatus.PREEMPTED
        request.num_computed_tokens = 0
        request.spec_token_ids, request.spec_probs, request.spec_padding = [], None, 0
        request.state_row = 0
        request.num_pending = 0  # (the result of a step in flight is dropped)
        request.num_preemptions += 1
        self.num_preemptions += 1
        self.policy.wait(self.waiting, request, front=True)

    @property
    def num_waiting(self) -> int:
        return len(self.waiting)

    @property
    def num_running(self) -> int:
        return len(self.running)

    def has_unfinished_requests(self) -> bool:
        return bool(self.waiting or self.running)

    def expire(self, now: float) -> list[Request]:
        """Waiting requests never scheduled, past their deadline at `now`: finished (aborted),
        out of the queue (read only once the earliest deadline has passed)."""
        if not self.num_deadlines or now <= self._next_deadline:
            return []
        timed = [r for r in self.waiting
                 if r.deadline is not None and r.first_scheduled_time is None]
        late = [r for r in timed if r.deadline < now]
        for request in late:
            self.waiting.remove(request)
            self._finish(request, RequestStatus.FINISHED_ABORTED)
        self._next_deadline = min((r.deadline for r in timed if r.deadline >= now),
                                  default=float("inf"))
        return late

    # ---- one step ---------------------------------------------------------------------
    def schedule(self, max_seqs: int | None = None, async_scheduling: bool = False
                 ) -> SchedulerOutput:
        """`max_seqs`: at most this many sequences in the step (a pipeline micro-batch's
        share). A running request whose last step is still in flight (its next token not on
        the host yet) is left out, unless `async_scheduling` and the request allows it
        (`Request.may_schedule_async`, and that token cannot be its last): then it decodes at
        that token's position, the runner taking the token from the device."""
        budget = self.config.max_num_batched_tokens
        encoder_budget = self.config.encoder_budget
        max_seqs = max_seqs or self.config.max_num_seqs
        lookahead = self.config.num_lookahead_tokens
        scheduled: list[ScheduledRequest] = []
        preempted = False

        i = 0
        self.policy.sort_running(self.running)
        running, allocate = self.running, self.kv_cache.allocate_slots
        while i < len(running) and budget > 0:
            request = running[i]
            pending = request.num_pending
            num_new = min(request.num_tokens + pending - request.num_computed_tokens, budget)
            if (num_new <= 0 or len(scheduled) >= max_seqs  # (< 0: drafts still in flight)
                    or pending and not (async_scheduling and self._schedulable_async(request))):
                i += 1
                continue
            drafts, probs = request.spec_token_ids, request.spec_probs
            padding = request.spec_padding
            if drafts or probs is not None:  # (proposers assign new lists, never append)
                request.spec_token_ids, request.spec_probs, request.spec_padding = [], None, 0
                if num_new == 1 and drafts:  # a decode: its drafts ride along, budget allowing
                    kept = drafts[:budget - 1]
                    padding = max(0, padding - (len(drafts) - len(kept)))  # (fillers last)
                    drafts = kept
                    num_new += len(drafts)
                else:
                    drafts, probs = [], None
            encoding, encoded = 0, request.num_encoded_images
            if request.mm_inputs:  # (a prompt chunk that may reach images)
                num_new, encoding, encoded = image_chunk(
                    request, request.num_computed_tokens, num_new, encoder_budget, self.config)
                if num_new <= 0:
                    i += 1
                    continue
            while not allocate(request, num_new, None, lookahead):
                victim = self._victim()
                running.remove(victim)
                budget += self._unschedule(scheduled, victim)
                self._preempt(victim)
                preempted = True
                if victim is request:
                    break
                i = running.index(request)  # (a victim ahead of it moved it up)
            else:
                scheduled.append(ScheduledRequest(request, request.num_computed_tokens, num_new,
                                                  drafts=drafts, draft_probs=probs,
                                                  padding=padding if drafts else 0,
                                                  output_pending=pending > 0))
                budget -= num_new
                encoder_budget -= encoding
                request.num_encoded_images = encoded
                i += 1
            # (else it preempted itself: FCFS, nothing after it is left; by priority, those
            # after it ranked ahead of it, and the next one is at i now)

        # Admitting new work right after preempting would only thrash the cache, unless it
        # ranks ahead of a running request (priority policy): then that one makes room.
        # LoRA: no more adapters among the running requests than the runner has slots; a
        # request for another adapter waits, the ones behind it are admitted meanwhile.
        adapters = {r.lora_id for r in self.running} - {0}
        passed: list[Request] = []
        favoured = None  # the waiting request running ones were preempted for
        order = self.policy.admission_order(self.waiting, scheduled) \
            if len(self.running) < self.config.max_num_seqs else None  # (full: none admitted)
        while self.waiting and budget > 0:
            request = self.waiting[0] if order is None else order.peek()
            ahead = self.policy.ranks_ahead(self.running, request)
            if preempted and not ahead and request is not favoured:
                break
            full_step = len(scheduled) >= max_seqs
            if full_step or len(self.running) >= self.config.max_num_seqs:
                # (a full step has room only if the one displaced is in it)
                if not ahead or full_step and not any(s.request is self._victim()
                                                      for s in scheduled):
                    break
                budget += self._displace(scheduled)
                preempted, favoured = True, request
                continue
            if (request.lora_id and request.lora_id not in adapters
                    and len(adapters) >= self.config.max_loras):
                passed.append(self._take(request, order, 0))
                continue
            hits, num_cached = self.kv_cache.get_computed_blocks(request)
            num_new = request.num_tokens - num_cached
            if num_new > budget and not self.config.enable_chunked_prefill:
                break
            num_new = min(num_new, budget)
            encoding, encoded = 0, 0
            if request.mm_inputs:
                num_new, encoding, encoded = image_chunk(request, num_cached, num_new,
                                                         encoder_budget, self.config)
                if num_new <= 0:
                    break
            if not self.kv_cache.allocate_slots(request, num_new, hits, lookahead):
                if not ahead:
                    break
                budget += self._displace(scheduled)
                preempted, favoured = True, request
                continue
            self._take(request, order, num_new)
            self.kv_cache.record_prefix_query(request.num_tokens, num_cached)
            request.status = RequestStatus.RUNNING
            request.num_computed_tokens = num_cached
            if request.num_cached_tokens < 0:
                request.num_cached_tokens = num_cached
                request.first_scheduled_time = time.monotonic()
                self.num_admitted += 1
            self.running.append(request)
            scheduled.append(ScheduledRequest(request, num_cached, num_new))
            budget -= num_new
            encoder_budget -= encoding
            request.num_encoded_images = encoded
            if request.lora_id:
                adapters.add(request.lora_id)
        self.waiting.extendleft(reversed(passed))  # (in their order, ahead of the rest)

        block_row, state_slot = self.kv_cache.block_row, self.kv_cache.state_slot
        for s in scheduled:
            request = s.request
            end = s.end
            if end - len(s.drafts) == request.num_tokens + request.num_pending:
                request.num_pending += 1  # (the step samples its next token)
            request.num_computed_tokens = end
            s.preemptions = request.num_preemptions
            s.block_ids = block_row(request.request_id)
            s.state_slot = state_slot(request.request_id)
            s.state_row, request.state_row = request.state_row, 0  # (a verification: set back)
            self.policy.charge(request, s.num_new_tokens)
        output = SchedulerOutput(scheduled, self._finished_ids)
        self._finished_ids = set()
        return output

    def _take(self, request: Request, order, tokens: int) -> Request:
        """`request`, first in admission order, out of the waiting queue."""
        if order is None:
            return self.waiting.popleft()
        order.take(request, tokens)
        self.waiting.remove(request)
        return request

    def _displace(self, scheduled: list[ScheduledRequest]) -> int:
        """Preempts the last running request in priority order; its tokens in the step."""
        victim = self._victim()
        self.running.remove(victim)
        tokens = self._unschedule(scheduled, victim)
        self._preempt(victim)
        return tokens

    def _unschedule(self, scheduled: list[ScheduledRequest], request: Request) -> int:
        """Takes `request` (a victim) out of this step's `scheduled`, its blocks the step
        would have filled out of the prefix cache; returns the tokens it had."""
        for k, s in enumerate(scheduled):
            if s.request is request:
                del scheduled[k]
                self.kv_cache.forget_unwritten(request, s.start)
                return s.num_new_tokens
        return 0

    def _schedulable_async(self, request: Request) -> bool:
        """Its pending token is not its last, and its next step needs none on the host."""
        outputs = len(request.output_token_ids) + request.num_pending
        max_tokens = request.sampling_params.max_tokens
        return ((max_tokens is None or outputs < max_tokens)
                and len(request.prompt_token_ids) + outputs < self.config.max_model_len
                and request.may_schedule_async)

    def update_from_output(self, output: SchedulerOutput,
                           sampled: dict[str, list[int]]) -> list[tuple[Request, int]]:
        """Append each request's sampled tokens (one; with drafts, the accepted ones and the
        target's next), apply token-level stop rules token by token, release finished
        requests. With drafts, the KV of the rejected ones is left to be overwritten: the
        request's computed tokens end after its last accepted one. Returns the requests that
        got tokens (finished ones included), each with how many."""
        updated: list[tuple[Request, int]] = []
        finished = False
        for s in output.scheduled:
            request = s.request
            tokens = sampled.get(request.request_id)
            if (tokens is None or request.status != RequestStatus.RUNNING
                    or request.num_preemptions != s.preemptions):
                continue  # a prompt chunk that is not the last one, or aborted meanwhile
            request.num_pending -= 1
            if request.pooling_params is not None:  # (its prompt is computed: pooled)
                self._finish(request, RequestStatus.FINISHED_STOPPED)
                finished = True
                updated.append((request, 0))
                continue
            if s.drafts:
                accepted = len(tokens) - 1
                request.num_computed_tokens = s.end - len(s.drafts) + accepted
                request.state_row = accepted  # (state layers: the state after that row)
                # (the metrics count proposed drafts: a filler accepted is not one)
                proposed = len(s.drafts) - s.padding
                self.num_draft_tokens += proposed
                self.num_accepted_tokens += min(accepted, proposed)
                request.num_draft_tokens += proposed
                request.num_accepted_tokens += min(accepted, proposed)
                self.num_spec_emitted += len(tokens)
                self.num_spec_steps += 1
            count = 0
            for token in tokens:
                request.output_token_ids.append(token)
                count += 1
                status = self._check_stop(request, token)
                if status is not None:
                    self._finish(request, status)
                    finished = True
                    break
            updated.append((request, count))
        if finished:
            self.running = [r for r in self.running if r.status == RequestStatus.RUNNING]
        return updated

    def _check_stop(self, request: Request, token: int) -> RequestStatus | None:
        params = request.sampling_params
        n_out = request.num_output_tokens
        if n_out >= params.min_tokens:
            if not params.ignore_eos and token in params.eos_token_ids:
                return RequestStatus.FINISHED_STOPPED
            if token in params.stop_token_ids:
                request.stop_reason = token
                return RequestStatus.FINISHED_STOPPED
        if params.max_tokens is not None and n_out >= params.max_tokens:
            return RequestStatus.FINISHED_LENGTH
        if request.num_tokens >= self.config.max_model_len:
            return RequestStatus.FINISHED_LENGTH
        return None
