"""What every handler of one API process shares (HTTP and gRPC): the engine front, tokenizer,
limits and admission (`ServerState`, built from `ApiSettings` by `build_state`), readiness."""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from typing import Any

from tokenmill.config.server import ServerConfig
from tokenmill.config.tenants import check_max_queue_time, metrics_label, tenant_of
from tokenmill.engine import request_log
from tokenmill.engine.async_engine import AsyncLLM, EngineOverloadedError
from tokenmill.engine.core_client import AsyncMPClient
from tokenmill.engine.dp_client import DataParallelClient
from tokenmill.engine.queue_wait import QueueWait
from tokenmill.entrypoints.api.images import ImageInputs
from tokenmill.entrypoints.api.lora_tensors import PREFIX as TASK_PREFIX
from tokenmill.entrypoints.api.lora_tensors import TaskAdapters, task_name
from tokenmill.entrypoints.api.prompts import PromptEncoder
from tokenmill.entrypoints.parsers.reasoning import ReasoningParser
from tokenmill.entrypoints.parsers.tool_registry import get_parser, parser_for_template
from tokenmill.loading.checkpoint import load_tokenizer
from tokenmill.lora.request import LoRARequest
from tokenmill.metrics import Metrics
from tokenmill.tokenizer import eos_token_ids

logger = logging.getLogger(__name__)

# A reservation not taken up by the engine within this time (its response was never
# started, e.g. the client left first) stops counting.
RESERVATION_TTL_S = 10.0


class Reservation:
    """Engine sequences promised to an admitted request until the engine has them: admission
    happens before tokenizing, so many requests can pass it before any reaches the engine;
    without this, a burst could all be admitted against the same free room."""

    def __init__(self, slots: int) -> None:
        self.slots = slots
        self.expires = time.monotonic() + RESERVATION_TTL_S

    def consume(self, n: int) -> None:
        """The engine registered `n` of the sequences (they count as in flight now)."""
        self.slots = max(self.slots - n, 0)

    def cancel(self) -> None:
        self.slots = 0


@dataclass
class ApiSettings:
    """Everything an API process needs to build its state (picklable, so workers can be
    spawned): the server's configuration as given (`config`, one object: nothing copied out of
    it), and what start-up found."""

    config: ServerConfig
    engine_address: str
    tokenizer_path: str
    model_path: str
    # data-parallel replicas beyond the first (engine_address): requests are routed among all
    more_engine_addresses: tuple[str, ...] = ()
    # OpenAI requests' unset sampling fields (config/generation.py); max_tokens caps theirs
    sampling_defaults: dict = field(default_factory=dict)
    chat_template_text: str | None = None  # --chat-template's text, over the tokenizer's


@dataclass
class ServerState:
    """One API process's state: its settings, the engine front, and what start-up derived
    from them (the context a request may fill, the parsers)."""

    settings: ApiSettings
    engine: AsyncLLM
    tokenizer: Any
    max_model_len: int  # the engine's, within what one replica's KV cache holds
    max_seq_len: int  # the seed's MAX_SEQ_LEN within it: cap on prompt tokens
    reasoning: Any = None  # a ReasoningParser (entrypoints/parsers/reasoning.py), or None
    tool_parser: Any = None  # a ToolParser (parsers/tool_calls.py): tool_choice auto, or None
    images: Any = None  # an image-text model's ImageInputs (api/images.py), or None
    draining: bool = False
    _reservations: list[Reservation] = field(default_factory=list)
    _grammar_checker: Any = None
    created: int = field(default_factory=lambda: int(time.time()))
    prompts: PromptEncoder = field(init=False)
    # adapters sent as TensorRT-LLM tensors with a request (Triton generate, KServe)
    task_adapters: TaskAdapters = field(default_factory=TaskAdapters)

    @property
    def config(self) -> ServerConfig:
        return self.settings.config

    def __post_init__(self) -> None:
        self.prompts = PromptEncoder(self.tokenizer, self.max_model_len)

    async def check_structured(self, params: Any, field_name: str | None) -> None:
        """A request's structured-output constraint compiles (else InvalidParameter naming
        the request's field), within a bounded time."""
        if params is None:
            return
        if self._grammar_checker is None:
            from tokenmill.structured_output.backend import GrammarChecker

            self._grammar_checker = GrammarChecker(self.tokenizer,
                                                   self.engine.client.info.vocab_size,
                                                   list(self.engine.eos_token_ids))
        await self._grammar_checker.check(params, field_name or "structured_outputs")

    @property
    def served_model_name(self) -> str:
        """The name reported (the first of those accepted in `model`)."""
        return self.config.model_names[0]

    @property
    def model_names(self) -> set[str]:
        """Names accepted in `model`: the base model's and the adapters'."""
        return set(self.config.model_names) | set(self.adapters)

    @property
    def adapters(self) -> dict[str, LoRARequest]:
        """The LoRA adapters served now, by name (--lora-modules, then those loaded and
        unloaded at run time: the engine core's list)."""
        return {adapter.lora_name: adapter for adapter in self.engine.loras}

    @property
    def pooler(self) -> Any:
        """A pooling model's PoolerConfig (config/pooling.py); None: it generates text."""
        return self.engine.client.info.pooler

    def lora_for(self, model: str | None) -> LoRARequest | None:
        """The adapter a request's `model` names; None: the base model."""
        return self.adapters.get(model) if model is not None else None

    def lora_of_task(self, task_id: int) -> LoRARequest | None:
        """The adapter of TensorRT-LLM's `lora_task_id`: one registered from a request's
        tensors under that id (api/lora_tensors.py), else the adapter whose id it is (its
        place in --lora-modules, from 1); None where no adapter has it."""
        adapters = self.adapters
        sent = adapters.get(task_name(task_id))
        if sent is not None:
            return sent
        return next((a for a in adapters.values() if a.lora_int_id == task_id
                     and not a.lora_name.startswith(TASK_PREFIX)), None)

    def priority_problem(self, priority: int) -> str | None:
        """Why a request's `priority` cannot be honoured here (None: it can)."""
        if priority and self.config.engine.scheduling_policy == "fcfs":
            return (f"priority {priority} needs --scheduling-policy priority or fair "
                    "(requests are served first come, first served).")
        return None

    def num_waiting(self) -> int:
        """Requests queued in the engine. The core's count arrives with each step; this
        process's own requests beyond the running slots count at once, so a burst between
        two steps cannot slip past the limit."""
        own_waiting = self.engine.num_in_flight() - self.engine.client.info.max_num_seqs
        return max(self.engine.stats.num_waiting, own_waiting)

    def queue_full(self, slots: int = 1) -> bool:
        """The seed's MAX_CACHED_TASK_NUM admission check, all or nothing: a request of
        `slots` engine sequences (prompts x n) is refused unless all of them fit beside the
        in-flight ones and those admitted but not yet in the engine."""
        now = time.monotonic()
        self._reservations = [r for r in self._reservations if r.slots and r.expires > now]
        in_flight = self.engine.num_in_flight_sequences() + sum(
            r.slots for r in self._reservations)
        max_waiting = self.config.max_cached_task_num
        room = self.engine.client.info.max_num_seqs + max_waiting - in_flight
        return self.engine.stats.num_waiting >= max_waiting or slots > room

    def try_admit(self, slots: int, priority: int = 0) -> Reservation | None:
        """Admission: a reservation of `slots` sequences, or None (queue full; counted).
        Reads the request's tenant and queue-time limit from its headers (ValueError: a bad
        one) onto its access record, where AsyncLLM.generate finds them; one the queue
        would keep waiting past its limit is refused (EngineOverloadedError: 429)."""
        tenant, limit = self._admission_headers()
        if self.queue_full(slots):
            self.reject("queue_full")
            return None
        wait = self.engine.queue_wait.estimate_s(tenant, priority, self.num_waiting()) \
            if limit else None
        if wait is not None and wait > limit:
            self.reject("queue_time")
            if self.engine.metrics is not None:
                self.engine.metrics.tenant_request(
                    metrics_label(tenant, self.config.engine.tenant_weights), "refused")
            raise EngineOverloadedError(
                f"The server is overloaded: the request would wait about {wait:.1f} s to "
                f"start, more than its max_queue_time ({limit:g} s). Retry later.",
                wait - limit)
        reservation = Reservation(slots)
        self._reservations.append(reservation)
        return reservation

    def _admission_headers(self) -> tuple[str, float | None]:
        """The current request's tenant (--tenant-header, else its API key's digest) and its
        queue-time limit (X-Max-Queue-Time within --max-queue-time), kept on its record."""
        record = request_log.current.get()
        headers = record.headers if record is not None and record.headers else {}

        def text(name: bytes) -> str | None:
            return headers[name].decode("latin-1") if name in headers else None

        bearer = (text(b"authorization") or "").partition(" ")[2].strip() \
            or text(b"x-api-key")
        tenant = tenant_of(text(self.config.api.tenant_header.lower().encode()), bearer)
        own = text(b"x-max-queue-time")
        try:
            own = check_max_queue_time(None if own is None else float(own), "X-Max-Queue-Time")
        except ValueError:
            raise ValueError("X-Max-Queue-Time must be a number of seconds > 0.") from None
        if record is not None:
            record.tenant, record.max_queue_time = tenant, own or 0.0
        limits = [x for x in (own, self.config.engine.max_queue_time) if x]
        return tenant, min(limits) if limits else None

    def reject(self, reason: str) -> None:
        """Counts a request refused before it reached the engine (metrics)."""
        if self.engine.metrics is not None:
            self.engine.metrics.rejected(reason)


async def build_state(settings: ApiSettings, metrics: Metrics | None = None) -> ServerState:
    config = settings.config
    tokenizer = load_tokenizer(settings.tokenizer_path)
    if settings.chat_template_text is not None:  # (--chat-template: every route renders it)
        tokenizer.chat_template = settings.chat_template_text
    # (checked before the engine client starts: a model without its markers is refused)
    reasoning = ReasoningParser(config.reasoning_parser, tokenizer) \
        if config.reasoning_parser else None
    if settings.more_engine_addresses:
        client = DataParallelClient([settings.engine_address, *settings.more_engine_addresses])
    else:
        client = AsyncMPClient(settings.engine_address)
    engine = AsyncLLM(client, tokenizer, eos_token_ids(tokenizer, settings.model_path),
                      dead_after_s=config.check_health_interval,
                      stall_after_s=config.engine_iteration_timeout, metrics=metrics,
                      stream_interval=config.api.stream_interval,
                      queue_wait=QueueWait(config.engine.scheduling_policy,
                                           config.engine.tenant_weights))
    await engine.start()
    # A request that can never fit the KV cache (of one replica) is refused like an
    # over-long one (400 naming the field), not queued forever.
    info = engine.client.info
    blocks = info.num_kv_blocks // client.num_replicas
    max_len = min(engine.max_model_len, blocks * info.block_size)
    tool_parser = config.tool_call_parser
    if tool_parser is None and (tool_parser := parser_for_template(tokenizer.chat_template)):
        logger.info("tool calls: the %s parser, as the chat template's tool-call format "
                    "(--tool-call-parser picks another)", tool_parser)
    return ServerState(settings=settings, engine=engine, tokenizer=tokenizer,
                       max_model_len=max_len,
                       max_seq_len=min(config.max_seq_len or max_len - 1, max_len - 1),
                       reasoning=reasoning,
                       images=ImageInputs(settings.model_path, info.multimodal,
                                          tuple(config.allowed_media_domains or ()),
                                          tokenizer)
                       if info.multimodal is not None else None,
                       tool_parser=get_parser(tool_parser).bind(tokenizer)
                       if tool_parser else None)


def readiness(state: ServerState | None) -> tuple[bool, str]:
    if state is None:
        return False, "model is loading"
    if state.draining:
        return False, "server is shutting down"
    if not state.engine.is_alive():
        return False, "engine is not responding"
    if state.engine.sleeping:
        return False, "engine is sleeping"
    return True, "ready"
