"""`SchedulerConfig`: what the scheduler may put in one step (sequences, tokens, context) and
the KV slots a proposer writes past each request, built from the engine's configuration."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from tokenmill.config.engine import EngineConfig


@dataclass
class SchedulerConfig:
    max_num_seqs: int = 256
    max_num_batched_tokens: int = 2048
    max_model_len: int = 2048
    enable_chunked_prefill: bool = True
    # slots past each scheduled request's tokens for a proposer that writes its drafts' KV
    # rows into the request's blocks (MTP, EAGLE)
    num_lookahead_tokens: int = 0
    # LoRA: adapters the running requests may use at once (the runner's slots; 0: no LoRA)
    max_loras: int = 0
    policy: str = "fcfs"  # or "priority", "fair" (EngineConfig.scheduling_policy)
    tenant_weights: dict[str, float] = field(default_factory=dict)  # "fair": 1 if not named
    max_queue_time: float | None = None  # seconds before the first step (None: no limit)
    # image rows the vision encoder may make in one step (vLLM's max_num_encoder_input_tokens;
    # one image always fits): a chunk stops before an image past it, for a later step
    encoder_budget: int = 2048
    # an image's rows go in one chunk (Gemma 3: they attend to each other both ways), the
    # token budget stretched for an image larger than it
    whole_images: bool = False

    @classmethod
    def of(cls, config: EngineConfig, max_model_len: int,
           whole_images: bool = False) -> SchedulerConfig:
        """The engine's: its token budget (checked against the context when prompts are not
        chunked) and the draft heads' lookahead."""
        budget = config.token_budget(max_model_len)
        if not config.enable_chunked_prefill and budget < max_model_len:
            raise ValueError(f"max_num_batched_tokens ({budget}) must be >= max_model_len "
                             f"({max_model_len}) when chunked prefill is off.")
        spec = config.speculative_config
        return cls(max_num_seqs=config.max_num_seqs, max_num_batched_tokens=budget,
                   max_model_len=max_model_len,
                   enable_chunked_prefill=config.enable_chunked_prefill,
                   num_lookahead_tokens=spec.num_lookahead_slots if spec is not None else 0,
                   max_loras=config.max_loras if config.enable_lora else 0,
                   policy=config.scheduling_policy, tenant_weights=config.tenant_weights,
                   max_queue_time=config.max_queue_time,
                   encoder_budget=config.max_num_encoder_input_tokens or budget,
                   whole_images=whole_images)
