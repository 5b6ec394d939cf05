"""The engine core: owns the scheduler, the KV cache and the model runner; one step at a time."""

from __future__ import annotations

import collections
import logging
import time

from tokenmill import heap
from tokenmill.config.engine import EngineConfig
from tokenmill.config.model import ModelConfig
from tokenmill.config.scheduler import SchedulerConfig
from tokenmill.core.kv_cache_manager import KVCacheManager
from tokenmill.core.request import FinishReason, Request, RequestStatus
from tokenmill.core.scheduler import Scheduler, SchedulerOutput
from tokenmill.engine.admission import check_request, late_refusal, queue_limit
from tokenmill.engine.core_stats import core_stats
from tokenmill.engine.liveness import StepClock
from tokenmill.engine.protocol import (
    SLEEPING,
    EngineCoreOutput,
    EngineCoreRequest,
    SchedulerStats,
)
from tokenmill.loading.checkpoint import load_hf_config
from tokenmill.loading.mmproj import mmproj_multimodal
from tokenmill.lora.registry import LoRARegistry
from tokenmill.lora.request import LoRARequest
from tokenmill.models.info import check_tensor_parallel, derive_max_model_len, kv_window
from tokenmill.structured_output.manager import StructuredOutputs, advance

logger = logging.getLogger(__name__)


def _queue_time(request: Request) -> float | None:
    if request.num_output_tokens != 1 or request.first_scheduled_time is None:
        return None
    return max(0.0, request.first_scheduled_time - request.arrival_time)


class EngineCore:
    def __init__(self, config: EngineConfig, model_path: str,
                 exit_on_worker_death: bool = False) -> None:
        """`exit_on_worker_death`: a tensor-parallel worker's death ends this process (the
        engine-core process; the server then applies its engine-death policy)."""
        from tokenmill.engine.kv_offload_tier import KVOffloadTier
        from tokenmill.engine.kv_transfer import KVTransfer
        from tokenmill.executor.multiproc import WorkerGroup
        from tokenmill.executor.ray_executor import RayWorkerGroup
        from tokenmill.platforms import check_kv_budget  # torch only from here on
        from tokenmill.worker.model_runner import ModelRunner

        self.config = config
        hf_config = load_hf_config(model_path)
        check_tensor_parallel(config, hf_config)  # (one line, before any rank starts)
        check_kv_budget(config)
        max_len = derive_max_model_len(config, hf_config)
        self.model_config = model = ModelConfig.of(
            config, model_path, hf_config, max_len,
            mmproj_multimodal(config.mmproj, model_path, config.limit_mm_per_prompt, max_len))
        scheduler_config = SchedulerConfig.of(
            config, model.max_model_len,
            model.multimodal is not None and model.multimodal.bidirectional)
        # Tensor parallel: this process is rank 0 (it alone schedules and samples).
        self.workers = None
        self.batch_queue = None
        if config.data_parallel_size > 1 and config.world_size == 1:  # one replica's share
            import torch

            from tokenmill.executor.multiproc import threads_per_rank
            torch.set_num_threads(threads_per_rank(config))
        if config.world_size > 1:
            group = RayWorkerGroup if config.distributed_executor_backend == "ray" else WorkerGroup
            self.workers = group(config, model, exit_on_worker_death)
            self.workers.join(config)
        try:
            self.runner = ModelRunner(config, model)
        except BaseException:
            self.shutdown()
            raise
        self.loras = LoRARegistry(self.runner.lora, config.lora_modules)
        # a request whose adapter is not in host memory waits while a thread reads it (the
        # engine-core process sets this; in-process, `LLM` callers get a bad adapter's error
        # from generate itself)
        self.defer_lora_reads = False
        try:  # (--lora-modules: read and checked at start-up, a bad one stops it here)
            self.loras.start()
        except BaseException:
            self.shutdown()
            raise
        self.kv_cache = KVCacheManager(self.runner.num_blocks, config.block_size,
                                       config.enable_prefix_caching, kv_window(self.hf_config),
                                       self.runner.num_state_slots)
        self.scheduler = Scheduler(scheduler_config, self.kv_cache)
        self.offload_tier = KVOffloadTier.build(config, self)  # --kv-cache-disk-dir
        self.kv_transfer = KVTransfer.build(config, self)  # --kv-transfer-config
        # where a new request's prompt blocks may come from, besides computing them
        self.kv_tiers = [t for t in (self.kv_transfer, self.offload_tier) if t is not None]
        self.clock = StepClock()  # step timings for the engine's heartbeat
        self.sleeping = 0  # sleep mode's level (engine/sleep_mode.py)
        # pipeline parallel: the micro-batches in flight, oldest first, at most one per stage
        # (bench/tensor_parallel.py sets 1 to measure one at a time); asynchronous
        # scheduling: the step running and the next one, launched before it lands
        self.async_scheduling = config.async_scheduling
        self.all_async = True  # (every running request let the last launch go on without it)
        self.batch_queue = (collections.deque()
                            if self.runner.world.pp_size > 1 or self.async_scheduling else None)
        self.max_in_flight = self.runner.world.pp_size
        # structured outputs: constrained requests wait there while their grammar compiles
        self.structured = StructuredOutputs(config.tokenizer or model_path,
                                            self.hf_config.vocab_size)
        # speculative decoding: draft tokens for the running requests after each step
        self.proposer = None
        if config.speculative_config is not None:
            from tokenmill.spec_decode import make_proposer
            from tokenmill.spec_decode.proposer import NgramProposer
            try:
                self.proposer = make_proposer(config.speculative_config, config, model,
                                              self.runner.num_blocks, ModelRunner)
                graphs = self.runner.graphs  # (n-gram drafts filled up to k for its buckets)
                if isinstance(self.proposer, NgramProposer) and graphs is not None:
                    self.proposer.pad = (1 + config.speculative_config.num_speculative_tokens
                                         in graphs.widths)
            except BaseException:
                self.shutdown()
                raise
        heap.trim()  # (what loading freed: the GGUF reader's values, float copies)

    @property
    def hf_config(self):
        return self.model_config.hf_config

    @property
    def max_model_len(self) -> int:
        return self.model_config.max_model_len

    def shutdown(self) -> None:
        """Stop the tensor-parallel workers, if any (idempotent)."""
        staging = getattr(self, "weight_staging", None)  # (engine/weight_sync.py's folder)
        if staging is not None:
            import shutil

            shutil.rmtree(staging, ignore_errors=True)
        if getattr(self, "structured", None) is not None:
            self.structured.shutdown()
        for tier in getattr(self, "kv_tiers", ()):
            tier.shutdown()  # (the disk tier's queued blocks are written first)
        if getattr(self, "loras", None) is not None:
            self.loras.shutdown()
        workers, self.workers = self.workers, None
        if workers is None:
            return
        from tokenmill.distributed.parallel_state import destroy_parallel

        runner = getattr(self, "runner", None)
        while self.batch_queue and not workers.exits():  # let micro-batches in flight land
            try:
                runner.complete(self.batch_queue.popleft()[1])
            except RuntimeError:
                break
        # A step cut short (an exception, Ctrl-C) left the other ranks inside a collective:
        # a stop message would pair with the wrong one, so they are killed instead.
        if runner is not None and not runner.in_step and not workers.exits():
            try:
                runner.stop_workers()
            except RuntimeError:  # a worker died meanwhile: gloo saw its connection close
                workers.kill()
            workers.stop()
        else:
            workers.kill()
        destroy_parallel()

    def add_request(self, request: EngineCoreRequest) -> None:
        if self.sleeping:  # (sleep mode: engine/sleep_mode.py)
            raise ValueError(SLEEPING)
        check_request(request, self.max_model_len, self.hf_config.vocab_size,
                      self.kv_cache.num_blocks, self.config.block_size,
                      self.scheduler.config.num_lookahead_tokens, self.model_config.pooler,
                      self.model_config.multimodal)
        if request.priority and self.scheduler.config.policy == "fcfs":
            raise ValueError(f"priority {request.priority} needs --scheduling-policy priority "
                             "or fair (requests are served first come, first served).")
        lora, limit = request.lora_request, queue_limit(request, self.config.max_queue_time)
        new = Request(request.request_id, list(request.prompt_token_ids),
                      request.sampling_params, arrival_time=request.arrival_time,
                      lora_request=lora, priority=request.priority, tenant=request.tenant,
                      max_queue_time=limit,
                      deadline=None if limit is None else time.monotonic() + limit,
                      pooling_params=request.pooling_params, mm_inputs=request.mm_inputs,
                      skip_prefix_cache=request.pooling_params is not None
                      and self.model_config.pooler.pooling_type != "LAST")
        if lora is not None:
            if self.defer_lora_reads and not self.loras.held(lora):
                self.loras.submit(new)  # (read off the step loop; `_admit_compiled` admits)
                self.runner.lora.announce(lora)  # (the other ranks read it meanwhile)
                return
            self.loras.check(lora)  # (read now: a bad adapter refuses its request here)
        self._enqueue(new)

    def _enqueue(self, request: Request, read_back: bool = False) -> None:
        if not read_back and any(tier.lookup(request) for tier in self.kv_tiers):
            return  # (its blocks are read off the step loop; `_admit_compiled` goes on)
        if request.sampling_params.structured_outputs is not None:
            self.structured.submit(request)  # (enters the scheduler once compiled)
        else:
            self.scheduler.add_request(request)

    def load_lora(self, name: str, path: str, lora_id: int = 0) -> LoRARequest:
        """An adapter served from now on under `name` (ValueError: refused); `lora_id`: its
        id (0: the next)."""
        return self.loras.load(name, path, lora_id)

    def unload_lora(self, name: str) -> LoRARequest | None:
        """The adapter `name` served no more (None: there is none); requests using it
        finish with it."""
        unloaded = self.loras.unload(name)
        self._release_loras()
        return unloaded

    def _release_loras(self) -> None:
        self.loras.release(r.lora_id for r in self.scheduler.requests.values())

    def abort_requests(self, request_ids: list[str]) -> None:
        self.structured.drop(request_ids)
        self.loras.drop(request_ids)
        for tier in self.kv_tiers:
            tier.drop(request_ids)
        self.scheduler.abort_requests(request_ids)
        if self.proposer is not None:
            self.proposer.release(request_ids)

    def finish_requests(self, request_ids: list[str]) -> None:
        """Stopped by the API side (a stop string matched in the decoded text)."""
        self.scheduler.finish_requests(request_ids, RequestStatus.FINISHED_STOPPED)
        if self.proposer is not None:
            self.proposer.release(request_ids)

    def has_unfinished_requests(self) -> bool:
        return (self.scheduler.has_unfinished_requests() or bool(self.batch_queue)
                or bool(self.structured.pending) or bool(self.loras.pending)
                or any(tier.pending for tier in self.kv_tiers))

    def stats(self) -> SchedulerStats:
        return core_stats(self)

    def step(self) -> list[EngineCoreOutput]:
        """Schedule, run and sample one step. Under pipeline parallel up to one micro-batch
        per stage is in flight: a call launches one more while requests are left to schedule
        and a stage is free (returning nothing yet), else completes the oldest."""
        self._release_loras()  # (adapters unloaded whose last request finished)
        refused = self._admit_compiled()
        if refused:
            return refused
        queue = self.batch_queue
        if queue is None:
            step = self.scheduler.schedule()
            return self._outputs(step, self._timed(self.runner.execute, step,
                                                   step.num_batched_tokens))
        if self.async_scheduling:
            return self._step_async()
        if len(queue) < self.max_in_flight:
            # each micro-batch takes its share of the requests, so the next has some too
            share = -(-(self.scheduler.num_running + self.scheduler.num_waiting)
                      // self.max_in_flight)
            step = self.scheduler.schedule(max_seqs=max(1, share))
            launched = self._timed(self.runner.launch, step, step.num_batched_tokens)
            if launched is not None:
                queue.append((step, launched))
                if len(queue) < self.max_in_flight:
                    return []
        return self._complete_oldest()

    def _step_async(self) -> list[EngineCoreOutput]:
        """Asynchronous scheduling: schedule and launch the next step while the last one
        runs (its decodes take their pending tokens on the device), then wait for the last
        one. While a running request needs its tokens on the host to be scheduled or
        sampled (`Request.may_schedule_async`), steps run one at a time instead."""
        queue = self.batch_queue
        if not queue or self.all_async:
            step = self.scheduler.schedule(async_scheduling=True)
            # (an empty step launches nothing; the runner still forgets finished requests)
            launched = self._timed(self.runner.launch, step, step.num_batched_tokens)
            # Asked once per launch, the requests it admitted included: until the next one,
            # running requests can only finish, which never turns the answer to no.
            self.all_async = all(r.may_schedule_async for r in self.scheduler.running)
            if launched is not None:
                queue.append((step, launched))
                if len(queue) == 1 and self.all_async:
                    return []  # (the next call launches another, then completes this one)
        return self._complete_oldest()

    def _complete_oldest(self) -> list[EngineCoreOutput]:
        """Wait for the oldest step in flight (if any) and turn its results into outputs."""
        if not self.batch_queue:
            return []
        step, launched = self.batch_queue.popleft()
        return self._outputs(step, self._timed(self.runner.complete, launched,
                                               len(launched.inputs.token_ids)))

    def _admit_compiled(self) -> list[EngineCoreOutput]:
        """Requests whose adapter was read go on (to the scheduler, or to compile their
        grammar); constrained requests whose grammar compiled join the scheduler; those whose
        adapter or grammar failed finish with the error, waiting ones past their deadline
        with a 429's. With nothing else to run, waits a little for a read or a compile."""
        idle = not (self.scheduler.has_unfinished_requests() or self.batch_queue)
        waited = idle and bool(self.loras.pending)
        read, refused = self.loras.ready(0.05 if idle else 0.0)
        for request in read:
            self._enqueue(request)
        for tier in self.kv_tiers:  # (their blocks read: in the prefix cache now)
            read, failed = tier.ready(0.05 if idle else 0.0)
            for request in read:
                self._enqueue(request, read_back=True)
            refused += failed
        ready, failed = self.structured.ready(0.05 if idle and not waited else 0.0)
        for request in ready:
            self.scheduler.add_request(request)
        return [EngineCoreOutput(r.request_id, [], int(FinishReason.ABORT), error=message,
                                 status=status[0] if status else 0)
                for r, message, *status in refused + failed] + [  # (those that waited too long)
            late_refusal(r) for r in self.scheduler.expire(time.monotonic())]

    def _kv_blocks(self, request: Request) -> tuple[int, int]:
        size = self.config.block_size
        return max(request.num_cached_tokens, 0) // size, -(-request.num_tokens // size)

    def _timed(self, run, arg, tokens: int):
        self.clock.start(tokens)
        try:
            return run(arg)
        except RuntimeError as exc:
            # (a rank's death shows on the others' sockets before its exit can be read)
            exits = self.workers.exits(wait_s=2.0) if self.workers is not None else ""
            if exits:  # gloo's own message names a socket; say which rank is gone
                raise RuntimeError(f"A tensor-parallel worker died: {exits}.") from exc
            raise
        finally:
            self.clock.stop()

    def _outputs(self, step: SchedulerOutput, result) -> list[EngineCoreOutput]:
        for tier in self.kv_tiers:  # (the step's new blocks written through to disk; blocks
            tier.after_step()  # decode instances read let go)
        # (a micro-batch's requests may have been aborted or preempted while it ran: their
        # prompt logprobs are dropped)
        stale = {s.request.request_id for s in step.scheduled
                 if s.request.status.finished or s.request.num_preemptions != s.preemptions
                 } if result.prompt_logprobs else set()
        updated = self.scheduler.update_from_output(step, result.sampled)
        # Structured outputs: each grammar takes its request's new tokens; a grammar ends
        # only on a stop token, so a request ignoring EOS ends there too. A token the grammar
        # refuses (nothing was left to sample) ends its request as aborted.
        done, broken, errors = [], [], {}
        for request, count in updated:
            if request.grammar is not None and count:
                state = advance(request, request.output_token_ids[-count:])
                slow = request.grammar.slow_error()
                if slow is not None:
                    logger.warning("Request %s: its constraint's mask took %.2f s of CPU at "
                                   "one token; it is stopped.", request.request_id,
                                   request.grammar.mask_cpu_s)
                    errors[request.request_id] = slow
                    broken.append(request.request_id)
                elif state is None:
                    logger.warning("Request %s: its sampled token breaks its grammar (no "
                                   "allowed token was left); it is aborted.",
                                   request.request_id)
                    broken.append(request.request_id)
                elif state:
                    done.append(request.request_id)
        self.scheduler.finish_requests(done, RequestStatus.FINISHED_STOPPED)
        self.scheduler.finish_requests(broken, RequestStatus.FINISHED_ABORTED)
        if self.proposer is not None:
            self.proposer.pending = result.drafts
            self.proposer.propose([r for r, _ in updated], self.scheduler.num_running)
        outputs = []
        for request, count in updated:
            rid = request.request_id
            finish = request.finish_reason
            lp = result.logprobs.get(rid)
            outputs.append(EngineCoreOutput(
                request_id=rid, new_token_ids=request.output_token_ids[-count:],
                finish_reason=None if finish is None else int(finish),
                stop_reason=request.stop_reason,
                new_logprobs=None if lp is None else lp[:count],
                prompt_logprobs=None if rid in stale else result.prompt_logprobs.get(rid),
                num_cached_tokens=max(request.num_cached_tokens, 0),
                queue_time=_queue_time(request),
                spec_tokens=(request.num_draft_tokens, request.num_accepted_tokens)
                if request.num_draft_tokens else None,
                kv_blocks=None if finish is None else self._kv_blocks(request),
                pooled=result.pooled.get(rid), error=errors.get(rid),
                kv_transfer_params=None if finish is None or self.kv_transfer is None
                else self.kv_transfer.hold(request)))
        # Prompt logprobs of chunks that sampled nothing travel on an empty output.
        sent = {o.request_id for o in outputs}
        for rid, scored in result.prompt_logprobs.items():
            if rid not in sent and rid not in stale:
                outputs.append(EngineCoreOutput(request_id=rid, new_token_ids=[],
                                                prompt_logprobs=scored))
        return outputs
