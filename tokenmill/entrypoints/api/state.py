"""What every handler of one API process shares (HTTP and gRPC): the engine front, tokenizer,
limits and admission (`ServerState`, built from `ApiSettings` by `build_state`), readiness."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

from tokenmill.config.api import ApiOptions
from tokenmill.engine.async_engine import AsyncLLM
from tokenmill.engine.core_client import AsyncMPClient
from tokenmill.engine.dp_client import DataParallelClient
from tokenmill.entrypoints.api.prompts import PromptEncoder
from tokenmill.entrypoints.parsers.reasoning import ReasoningParser
from tokenmill.entrypoints.parsers.tool_calls import get_parser
from tokenmill.loading.checkpoint import load_tokenizer
from tokenmill.metrics import Metrics
from tokenmill.tokenizer import eos_token_ids

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
    """Everything an API worker process needs to build its state (picklable, so workers can be
    spawned): where the engine core listens and the request limits."""

    engine_address: str
    tokenizer_path: str
    model_path: str
    served_model_names: list[str]
    max_dec_len: int
    max_seq_len: int | None  # None: max_model_len - 1
    max_waiting: int
    disable_streaming: bool = False
    # OpenAI requests' unset sampling fields (config/generation.py); max_tokens caps theirs
    sampling_defaults: dict = field(default_factory=dict)
    chat_template: str | None = None  # the template's text, over the tokenizer's
    api: ApiOptions = field(default_factory=ApiOptions)  # (vLLM's front-end flags)
    api_key: str | None = None
    dead_after_s: float = 10.0  # engine heartbeat silence that counts as dead
    max_request_body_bytes: int = 2 * 1024 * 1024
    trust_request_chat_template: bool = False
    reasoning_parser: str | None = None
    tool_call_parser: str | None = None
    log_requests: bool = False  # access lines carry the prompt and output text
    otlp_traces_endpoint: str | None = None  # one span per request (tracing.py)
    log_format: str = "text"  # text | json (API worker processes configure their logging)
    log_level: str = "info"
    # data-parallel replicas beyond the first (engine_address): requests are routed among all
    more_engine_addresses: tuple[str, ...] = ()


@dataclass
class ServerState:
    engine: AsyncLLM
    tokenizer: Any
    served_model_names: list[str]  # accepted in `model`; the first is reported
    max_model_len: int
    max_dec_len: int  # seed MAX_DEC_LEN: cap on requested new tokens
    max_seq_len: int  # seed MAX_SEQ_LEN: cap on prompt tokens
    max_waiting: int  # seed MAX_CACHED_TASK_NUM: requests queued in the engine beyond running
    disable_streaming: bool = False
    trust_request_chat_template: bool = False
    reasoning: Any = None  # a ReasoningParser (entrypoints/parsers/reasoning.py), or None
    tool_parser: Any = None  # a ToolParser (parsers/tool_calls.py): tool_choice auto, or None
    log_requests: bool = False  # access lines (HTTP and gRPC) carry prompt and output text
    sampling_defaults: dict = field(default_factory=dict)  # (ApiSettings')
    api: ApiOptions = field(default_factory=ApiOptions)  # (ApiSettings')
    draining: bool = False
    _reservations: list[Reservation] = field(default_factory=list)
    _grammar_checker: Any = None
    created: int = field(default_factory=lambda: int(time.time()))
    prompts: PromptEncoder = field(init=False)

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
        return self.served_model_names[0]

    @property
    def model_names(self) -> set[str]:
        return set(self.served_model_names)

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
        room = self.engine.client.info.max_num_seqs + self.max_waiting - in_flight
        return self.engine.stats.num_waiting >= self.max_waiting or slots > room

    def try_admit(self, slots: int) -> Reservation | None:
        """Admission: a reservation of `slots` sequences, or None (queue full; counted)."""
        if self.queue_full(slots):
            self.reject("queue_full")
            return None
        reservation = Reservation(slots)
        self._reservations.append(reservation)
        return reservation

    def reject(self, reason: str) -> None:
        """Counts a request refused before it reached the engine (metrics)."""
        if self.engine.metrics is not None:
            self.engine.metrics.rejected(reason)


async def build_state(settings: ApiSettings, metrics: Metrics | None = None) -> ServerState:
    tokenizer = load_tokenizer(settings.tokenizer_path)
    if settings.chat_template is not None:  # (--chat-template: every route renders with it)
        tokenizer.chat_template = settings.chat_template
    if settings.more_engine_addresses:
        client = DataParallelClient([settings.engine_address, *settings.more_engine_addresses])
    else:
        client = AsyncMPClient(settings.engine_address)
    engine = AsyncLLM(client, tokenizer, eos_token_ids(tokenizer, settings.model_path),
                      dead_after_s=settings.dead_after_s, metrics=metrics,
                      stream_interval=settings.api.stream_interval)
    await engine.start()
    # A request that can never fit the KV cache (of one replica) is refused like an
    # over-long one (400 naming the field), not queued forever.
    info = engine.client.info
    blocks = info.num_kv_blocks // client.num_replicas
    max_len = min(engine.max_model_len, blocks * info.block_size)
    return ServerState(engine=engine, tokenizer=tokenizer,
                       served_model_names=settings.served_model_names,
                       max_model_len=max_len, max_dec_len=settings.max_dec_len,
                       max_seq_len=min(settings.max_seq_len or max_len - 1, max_len - 1),
                       max_waiting=settings.max_waiting,
                       disable_streaming=settings.disable_streaming,
                       trust_request_chat_template=settings.trust_request_chat_template,
                       reasoning=ReasoningParser(settings.reasoning_parser)
                       if settings.reasoning_parser else None,
                       tool_parser=get_parser(settings.tool_call_parser).bind(tokenizer)
                       if settings.tool_call_parser else None,
                       log_requests=settings.log_requests,
                       sampling_defaults=settings.sampling_defaults,
                       api=settings.api)


def readiness(state: ServerState | None) -> tuple[bool, str]:
    if state is None:
        return False, "model is loading"
    if state.draining:
        return False, "server is shutting down"
    if not state.engine.is_alive():
        return False, "engine is not responding"
    return True, "ready"
