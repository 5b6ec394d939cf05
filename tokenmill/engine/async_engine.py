"""asyncio front of the engine for API servers: per-request output streams, abort on cancel."""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import secrets
import time
from collections.abc import AsyncIterator
from typing import Any

import msgspec

from tokenmill.config.tenants import metrics_label
from tokenmill.engine import request_log
from tokenmill.engine.core_client import AsyncMPClient
from tokenmill.engine.errors import (  # noqa: F401 - the front ends import them from here
    DuplicateRequestError,
    EngineDeadError,
    EngineOverloadedError,
    EngineRequestError,
    EngineSleepingError,
    ShutdownError,
    request_error,
)
from tokenmill.engine.liveness import Liveness
from tokenmill.engine.output_processor import OutputProcessor
from tokenmill.engine.protocol import (
    SLEEPING,
    ControlRequest,
    EngineCoreOutput,
    EngineCoreRequest,
    LoRAUpdate,
    SchedulerStats,
)
from tokenmill.engine.queue_wait import QueueWait
from tokenmill.engine.request_stream import RequestStream, RequestTimer
from tokenmill.lora.request import LoRARequest
from tokenmill.metrics import Metrics
from tokenmill.outputs import OutputKind, OutputSum, RequestOutput
from tokenmill.pooling_params import PoolingParams
from tokenmill.sampling_params import SamplingParams
from tokenmill.tokenizer import bad_words_token_ids

logger = logging.getLogger(__name__)

# check_health runs every 0.5 s (the supervisor's and each API worker's watch): a gap longer
# than this between two checks means this process's loop was held, not the engine silent.
_OWN_STALL_S = 2.0


class AsyncLLM:
    """Owns one client of the engine core (or of several data-parallel replicas, each watched
    on its own). `generate` yields cumulative `RequestOutput`s; leaving the iterator early
    (client gone, task cancelled) aborts the request in the core."""

    def __init__(self, client: AsyncMPClient, tokenizer: Any, eos_token_ids: list[int],
                 dead_after_s: float = 10.0, stall_after_s: float | None = None,
                 metrics: Metrics | None = None, stream_interval: int = 1,
                 queue_wait: QueueWait | None = None) -> None:
        """`stream_interval`: a delta reader (a stream) is handed its first tokens at once,
        then results once they hold this many new tokens, and its last at once (vLLM's and
        SGLang's `--stream-interval`); `queue_wait`: the expected queue time's estimate."""
        if not isinstance(stream_interval, int) or stream_interval < 1:
            raise ValueError(f"stream_interval must be an integer >= 1, got {stream_interval!r}.")
        self.stream_interval = stream_interval
        self.metrics = metrics
        self.queue_wait = queue_wait or QueueWait()
        self.client = client
        self.tokenizer = tokenizer
        self.eos_token_ids = eos_token_ids
        self.processor = OutputProcessor(tokenizer)
        self.stats = SchedulerStats()  # over every replica
        self.replica_stats = [SchedulerStats() for _ in range(client.num_replicas)]
        self.liveness = [Liveness(dead_after_s, stall_after_s)
                         for _ in range(client.num_replicas)]
        self._checked_at: float | None = None  # the last check_health (this loop's pulse)
        self._queues: dict[str, RequestStream] = {}
        self._counter = itertools.count()
        self._loop_task: asyncio.Task | None = None
        self._heartbeat_task: asyncio.Task | None = None
        self.dead: BaseException | None = None
        self._num_sequences = 0  # engine sequences (n per request) of in-flight requests
        self.num_aborted = 0  # requests left before they finished (client gone, cancelled)
        self.loras: list[LoRARequest] = []  # the adapters served by name (the core's list)
        # control requests (LoRA load / unload, sleep mode, weight updates): id -> answer
        self._answers: dict[str, asyncio.Future] = {}

    @property
    def max_model_len(self) -> int:
        return self.client.info.max_model_len

    async def start(self) -> None:
        info = await self.client.connect()
        self.loras = list(info.loras)
        self.stats = SchedulerStats(kv_blocks_total=info.num_kv_blocks)
        share = info.num_kv_blocks // len(self.replica_stats)
        self.replica_stats = [SchedulerStats(kv_blocks_total=share) for _ in self.replica_stats]
        if self.metrics is not None:  # every gauge has a value before the first heartbeat
            for i, stats in enumerate(self.replica_stats):
                self.metrics.observe_stats(stats, i)
            self.metrics.observe_totals(self.stats)
        for liveness in self.liveness:
            liveness.seen()
        self._loop_task = asyncio.create_task(self._output_loop())
        self._heartbeat_task = asyncio.create_task(self._heartbeat_loop())

    def is_alive(self) -> bool:
        """Not dead, every replica heard from lately, and no step past its stall limit."""
        return self.dead is None and self._problem() is None

    def _problem(self) -> str | None:
        for i, liveness in enumerate(self.liveness):
            problem = liveness.problem()
            if problem is not None:
                return problem if len(self.liveness) == 1 else f"replica {i}: {problem}"
        return None

    def step_running_s(self) -> float | None:
        """How long the longest-running engine step has run (None when every one is idle)."""
        running = [s for s in (lv.step_running_s() for lv in self.liveness) if s is not None]
        return max(running, default=None)

    async def _heartbeat_loop(self) -> None:
        while True:
            try:
                replica, heartbeat = await self.client.get_heartbeat()
                self.liveness[replica].beat(heartbeat)
            except msgspec.DecodeError:  # not a heartbeat: ignore it
                continue

    async def generate(self, prompt_token_ids: list[int], params: SamplingParams,
                       request_id: str | None = None, prompt: str | None = None,
                       reservation: Any = None,
                       output_kind: OutputKind = OutputKind.CUMULATIVE,
                       lora_request: LoRARequest | None = None, priority: int = 0,
                       pooling_params: PoolingParams | None = None,
                       mm_inputs: list | None = None, tenant: str = "",
                       max_queue_time: float = 0.0) -> AsyncIterator[RequestOutput]:
        """`reservation`: the API's admission reservation (`consume(n)`), handed over once
        the request counts as in flight here. `output_kind`: cumulative results, deltas
        (what streaming APIs send: each costs O(new) however long the output; deltas a slow
        reader missed come as one), or only the final result. `pooling_params`: a pooling
        model's request (`params` then only its bookkeeping): its result's `pooled`.
        `mm_inputs`: an image-text model's images (mm_inputs.py). `tenant`, `max_queue_time`
        (s to start, else EngineOverloadedError): an API request's admission's if not given."""
        if self.dead is not None:
            raise EngineDeadError("The engine is not running.")
        if self.sleeping:
            raise EngineSleepingError(SLEEPING)
        request_id = f"req-{next(self._counter)}" if request_id is None else request_id
        if request_id in self._queues:
            raise DuplicateRequestError(f"Request id {request_id!r} is already in flight.")
        bad_ids = bad_words_token_ids(self.tokenizer, params.bad_words)
        params = params.clone(eos_token_ids=list(self.eos_token_ids),
                              bad_words_token_ids=bad_ids)
        if not tenant and not max_queue_time:
            tenant, max_queue_time = request_log.admission()
        timer = RequestTimer(self.metrics, len(prompt_token_ids),
                             metrics_label(tenant, self.queue_wait.weights))
        # delta results, or the error that ends it
        queue = self._queues[request_id] = RequestStream(
            timer, self.stream_interval if output_kind is OutputKind.DELTA else 1)
        self._num_sequences += params.n
        if reservation is not None:
            reservation.consume(params.n)
        finished = False
        # (a delta reader needs no sum: only its count, unless the request log keeps texts)
        total = OutputSum(count_only=output_kind is OutputKind.DELTA
                          and not request_log.keeps_text())
        request_log.started(prompt_token_ids, params)
        child_ids: list[str] = []
        try:
            child_ids = self.processor.add_request(request_id, prompt, prompt_token_ids, params,
                                                   delta=True)
            for i, child_id in enumerate(child_ids):
                child_params = params.for_child(i)
                self.queue_wait.entered(child_id, tenant, priority)
                await self.client.add_request(EngineCoreRequest(
                    child_id, list(prompt_token_ids), child_params, time.monotonic(),
                    lora_request, priority, pooling_params, mm_inputs or [], tenant,
                    max_queue_time))
            while not finished:
                deltas = await queue.take()  # (several: what came while the reader was busy)
                for item in deltas:
                    if isinstance(item, BaseException):
                        finished = True
                        timer.finish("refused" if isinstance(item, EngineOverloadedError)
                                     else "error")
                        raise item
                    total.add(item)
                    finished = item.finished
                request_log.produced(total, finished)
                if output_kind is OutputKind.DELTA:
                    yield deltas[0] if len(deltas) == 1 else _summed(deltas)
                elif finished or output_kind is OutputKind.CUMULATIVE:
                    yield total.output()
        finally:
            for child_id in child_ids:
                self.queue_wait.left(child_id)
            self._queues.pop(request_id, None)
            self._num_sequences -= params.n
            timer.ended(disconnected=not finished)
            if not finished:
                self.num_aborted += 1
                timer.finish("abort")
                await self.abort(request_id)

    def num_in_flight(self) -> int:
        return len(self._queues)

    def num_in_flight_sequences(self) -> int:
        return self._num_sequences

    def has_request(self, request_id: str) -> bool:
        return request_id in self._queues

    async def abort(self, request_id: str) -> None:
        children = self.processor.child_ids(request_id)
        self.processor.abort_request(request_id)
        if children and self.dead is None:
            with contextlib.suppress(Exception):
                await self.client.abort_requests(children)

    async def _output_loop(self) -> None:
        try:
            while True:
                replica, batch = await self.client.get_output()
                self.liveness[replica].seen()
                if batch.stats is not None:
                    self.replica_stats[replica] = batch.stats
                    self.stats = sum_stats(self.replica_stats)
                    if replica == 0:  # (every replica serves the same adapters)
                        self.loras = batch.stats.loras
                    self.queue_wait.observe(self.stats, time.monotonic())
                    if self.metrics is not None:
                        self.metrics.observe_stats(batch.stats, replica)
                        self.metrics.observe_totals(self.stats)
                for out in batch.outputs:
                    if out.queue_time is not None:  # (its first step: it waits no more)
                        self.queue_wait.left(out.request_id)
                        if self.metrics is not None:
                            self.metrics.queued(out.queue_time)
                outputs = [o for o in batch.outputs
                           if not self._answered(o) and not self._fail_if_error(o)]
                results, stopped = self.processor.process_outputs(outputs)
                for result in results:
                    queue = self._queues.get(result.request_id)
                    if queue is not None:
                        queue.put(result)
                await self.client.finish_requests(stopped)
                # readers run before the next batch (a batch already received would not
                # let them: each would then get several steps' deltas as one)
                await asyncio.sleep(0)
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # noqa: BLE001 - any failure here means no more outputs
            logger.exception("engine output loop failed")
            self.fail_all(EngineDeadError(f"The engine output loop failed: {exc}"))

    async def update_lora(self, name: str, path: str = "", timeout: float = 300.0) -> None:
        """Serve the adapter at `path` as `name`, or (no path) stop serving `name`; once
        this returns, `loras` says so. EngineRequestError: the core refused (its reason).
        Data-parallel replicas are asked in turn, a new adapter with one id drawn here for
        all (API processes never share a counter); one refusing undoes the others' load."""
        if self.dead is not None:
            raise EngineDeadError("The engine is not running.")
        replicas = getattr(self.client, "num_replicas", 1)
        lora_id = (1 << 20) + secrets.randbelow(1 << 29) if replicas > 1 and path else 0
        errors = []
        for replica in range(replicas):
            error = await self._ask_lora(name, path, lora_id, replica, timeout)
            if error is not None and path:
                for done in range(replica):
                    await self._ask_lora(name, "", 0, done, timeout)
                raise EngineRequestError(error)
            errors.append(error)
        if all(e is not None for e in errors):  # (an unload: refused only where none had it)
            raise EngineRequestError(errors[0])

    async def _ask_lora(self, name: str, path: str, lora_id: int, replica: int,
                        timeout: float) -> str | None:
        return await self._ask(lambda request_id: self.client.update_lora(
            LoRAUpdate(request_id, name, path, lora_id), replica), timeout)

    async def control(self, action: str, level: int = 0, path: str = "",
                      options: dict | None = None, timeout: float = 1800.0) -> None:
        """Sleep mode and weight updates (engine/sleep_mode.py's `action`s), on every
        replica in turn; EngineRequestError: one refused (its reason; those before it
        went through)."""
        if self.dead is not None:
            raise EngineDeadError("The engine is not running.")
        replicas = getattr(self.client, "num_replicas", 1)
        if options and replicas > 1:  # (each replica would need a rank of its own)
            raise EngineRequestError("A trainer's weight-update group is not built for "
                                     "data-parallel replicas.")
        for replica in range(replicas):
            error = await self._ask(lambda request_id, replica=replica: self.client.control(
                ControlRequest(request_id, action, level, path, options or {}), replica),
                timeout)
            if error is not None:
                raise EngineRequestError(error)

    @property
    def sleeping(self) -> bool:
        return self.stats.sleeping > 0

    async def _ask(self, send, timeout: float) -> str | None:
        """Sends a control request (`send(request_id)`); its answer: None or an error."""
        request_id = f"ctl-{next(self._counter)}"
        answer = self._answers[request_id] = asyncio.get_running_loop().create_future()
        try:
            await send(request_id)
            return await asyncio.wait_for(answer, timeout)
        finally:
            self._answers.pop(request_id, None)

    def _answered(self, out: EngineCoreOutput) -> bool:
        answer = self._answers.get(out.request_id)
        if answer is None:
            return False
        if not answer.done():
            answer.set_result(out.error)
        return True

    def _fail_if_error(self, out: EngineCoreOutput) -> bool:
        if out.error is None:
            return False
        parent = self.processor.parent_of(out.request_id)
        if parent is not None:
            queue = self._queues.get(parent)
            if queue is not None:
                queue.put(request_error(out.error, out.retry_after, out.status,
                                        out.error == SLEEPING))
            siblings = [c for c in self.processor.child_ids(parent) if c != out.request_id]
            self.processor.abort_request(parent)
            if siblings:
                asyncio.get_running_loop().create_task(self.client.abort_requests(siblings))
        return True

    def fail_all(self, error: BaseException) -> None:
        self.dead = error
        self.end_all(error)

    def end_all(self, error: BaseException) -> None:
        """Every in-flight request ends with `error` (its handler aborts it in the core), and
        every control request (adapter load or unload, sleep mode) waiting for its answer."""
        for queue in self._queues.values():
            queue.put(error)
        for answer in self._answers.values():
            if not answer.done():
                answer.set_exception(error)

    async def check_health(self) -> None:
        """Marks the engine dead when its heartbeats stopped or a step stalled (see
        `engine/liveness.py`); in-flight requests get the error."""
        now = time.monotonic()
        last, self._checked_at = self._checked_at, now
        if last is not None and now - last > _OWN_STALL_S:
            # This process's own loop did not run for a while (a busy machine, a long
            # native call): the heartbeats that came meanwhile are still unread, and the
            # silence is ours. Judged at the next check, once they have been read.
            logger.info("event loop was held %.1f s; engine liveness judged at the next "
                        "check", now - last)
            return
        problem = self._problem() if self.dead is None else None
        if problem is not None:
            logger.error("engine core declared dead: %s", problem)
            self.fail_all(EngineDeadError("The engine core stopped responding."))

    async def shutdown(self, stop_core: bool = False) -> None:
        if stop_core and self.dead is None:
            with contextlib.suppress(Exception):
                await self.client.shutdown_core()
        for task in (self._loop_task, self._heartbeat_task):
            if task is not None:
                task.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await task
        self.client.close()


def _summed(deltas: list[RequestOutput]) -> RequestOutput:
    summed = OutputSum()
    for delta in deltas:
        summed.add(delta)
    return summed.output()


def sum_stats(parts: list[SchedulerStats]) -> SchedulerStats:
    """One view of several replicas: every gauge and counter added up."""
    if len(parts) == 1:
        return parts[0]
    return SchedulerStats(*(
        sum(values) if not isinstance(values[0], list) else  # (LoRA names: every replica's)
        parts[0].loras if f == "loras" else sorted(set().union(*values))
        for f in SchedulerStats.__struct_fields__
        for values in [[getattr(p, f) for p in parts]]))
