"""Typed messages between the API side and the engine core (msgspec: safe to send over ZMQ)."""

from __future__ import annotations

import enum
from typing import Any

import msgspec

from tokenmill.config.multimodal import MultiModalConfig
from tokenmill.config.pooling import PoolerConfig
from tokenmill.lora.request import LoRARequest
from tokenmill.mm_inputs import MultiModalInput
from tokenmill.pooling_params import PoolingParams
from tokenmill.sampling_params import SamplingParams

# (top ids, top logprobs, chosen logprob, chosen rank) of one position
PositionLogprobs = tuple[list[int], list[float], float, int]


class EngineCoreRequest(msgspec.Struct, array_like=True, omit_defaults=True):
    request_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    arrival_time: float = 0.0
    lora_request: LoRARequest | None = None  # None: the base model
    priority: int = 0  # (vLLM's: lower runs first under --scheduling-policy priority)
    pooling_params: PoolingParams | None = None  # a pooling model's request (no sampling)
    mm_inputs: list[MultiModalInput] = []  # an image-text model's images, in prompt order
    tenant: str = ""  # --scheduling-policy fair: whose share it runs in
    max_queue_time: float = 0.0  # seconds it may wait for its first step (0: the engine's)


class EngineCoreOutput(msgspec.Struct, array_like=True, omit_defaults=True):
    request_id: str
    new_token_ids: list[int]
    finish_reason: int | None = None  # tokenmill.core.request.FinishReason
    stop_reason: int | str | None = None
    new_logprobs: list[PositionLogprobs] | None = None
    # (first prompt position scored, logprobs per position)
    prompt_logprobs: tuple[int, list[PositionLogprobs]] | None = None
    num_cached_tokens: int = 0
    error: str | None = None  # the request was refused or failed; it is finished
    retry_after: float | None = None  # refused for load (429): seconds after which to retry
    queue_time: float | None = None  # on the first token: arrival -> first scheduled (s)
    # speculative decoding: (drafts verified, accepted) so far, once the request had some
    spec_tokens: tuple[int, int] | None = None
    # on the last output: (KV blocks from the prefix cache, blocks its tokens fill)
    kv_blocks: tuple[int, int] | None = None
    pooled: list[float] | None = None  # a pooling request's vector (with its finish)
    status: int = 0  # with `error`: the HTTP status it maps to (0: 400, or 429 with retry_after)
    # prefill/decode disaggregation: a prefill request's answer to pass to a decode instance
    kv_transfer_params: dict[str, Any] | None = None


class SchedulerStats(msgspec.Struct, array_like=True):
    """Engine-core gauges and counters, sent with every batch of outputs and as a heartbeat."""

    num_running: int = 0
    num_waiting: int = 0
    kv_blocks_used: int = 0
    kv_blocks_total: int = 0
    prefix_queried_tokens: int = 0  # cumulative
    prefix_hit_tokens: int = 0  # cumulative
    num_preemptions: int = 0  # cumulative
    # speculative decoding, cumulative: draft tokens verified, accepted, tokens emitted by
    # drafted steps, drafted steps
    spec_draft_tokens: int = 0
    spec_accepted_tokens: int = 0
    spec_emitted_tokens: int = 0
    spec_steps: int = 0
    # LoRA: the adapters served by name, those of running and of waiting requests, the slots
    loras: list[LoRARequest] = []
    running_loras: list[str] = []
    waiting_loras: list[str] = []
    max_loras: int = 0
    sleeping: int = 0  # sleep mode's level (0: awake; replicas added up: any asleep)
    num_admitted: int = 0  # requests scheduled for the first time (cumulative)
    # the KV disk tier (--kv-cache-disk-dir), cumulative: blocks read back, written, whose
    # file failed its checks, not written (the writer behind, or the disk refusing)
    kv_disk_read_blocks: int = 0
    kv_disk_written_blocks: int = 0
    kv_disk_rejected_blocks: int = 0
    kv_disk_dropped_blocks: int = 0
    # the KV host-memory tier (--kv-offloading-size), cumulative: blocks read back, stored,
    # evicted (least recently used, past the bound), not stored (the writer behind)
    kv_host_read_blocks: int = 0
    kv_host_written_blocks: int = 0
    kv_host_evicted_blocks: int = 0
    kv_host_dropped_blocks: int = 0
    # prefill/decode disaggregation (--kv-transfer-config), cumulative: blocks read from
    # prefill instances, requests whose read failed or was refused
    kv_transfer_read_blocks: int = 0
    kv_transfer_failed: int = 0

    @property
    def kv_usage(self) -> float:
        return self.kv_blocks_used / self.kv_blocks_total if self.kv_blocks_total else 0.0


class EngineCoreOutputs(msgspec.Struct, array_like=True, omit_defaults=True):
    outputs: list[EngineCoreOutput] = []
    stats: SchedulerStats | None = None
    timestamp: float = 0.0


class EngineCoreInfo(msgspec.Struct):
    """What the core tells a client when it connects (sent once, after the model loaded)."""

    max_model_len: int
    num_kv_blocks: int
    block_size: int
    vocab_size: int
    max_num_seqs: int = 256
    num_lookahead_tokens: int = 0  # KV slots a proposer uses past a request's tokens
    loras: list[LoRARequest] = []  # the LoRA adapters served by name at start-up
    pooler: PoolerConfig | None = None  # a pooling model's pooler; None: it generates
    multimodal: MultiModalConfig | None = None  # an image-text model's; None: text only


class RequestType(enum.IntEnum):
    HELLO = 0  # a client announces itself; the core answers with EngineCoreInfo
    ADD = 1  # EngineCoreRequest
    ABORT = 2  # list[str] request ids
    FINISH = 3  # list[str] request ids stopped by a stop string
    SHUTDOWN = 4
    LORA = 5  # LoRAUpdate: answered by an EngineCoreOutput of its request id (error or not)
    CONTROL = 6  # ControlRequest: answered the same way


class LoRAUpdate(msgspec.Struct, array_like=True):
    """Serve an adapter from `path` under `name`, or (`path` empty) stop serving it.
    `lora_id`: the id it gets (data-parallel replicas must agree); 0: the core's next."""

    request_id: str
    name: str
    path: str = ""
    lora_id: int = 0


# an engine core's refusal of a request while it sleeps (the API answers 503 with it)
SLEEPING = "The engine is sleeping: wake it up first (POST /wake_up, or LLM.wake_up())."


class ControlRequest(msgspec.Struct, array_like=True):
    """Sleep mode and weight updates (engine/sleep_mode.py): `action` "sleep" (at `level`),
    "wake_up", "update_weights" (from the checkpoint at `path`), or a trainer's weight-update
    group's "init_weights_update_group", "update_weights_from_distributed",
    "destroy_weights_update_group" (engine/weight_sync.py, with `options`)."""

    request_id: str
    action: str
    level: int = 0
    path: str = ""
    # "init_weights_update_group": address, port, rank_offset, world_size, backend;
    # "update_weights_from_distributed": names, dtypes, shapes (engine/weight_sync.py)
    options: dict[str, Any] = {}
