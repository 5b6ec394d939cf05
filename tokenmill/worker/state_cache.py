"""The state layers' tensors (layers/state_layer.py): per layer a convolution state and a
recurrent state of `num_slots` rows, the slots core/state_slots.py hands out (one per
running request: `max_num_seqs`, within half the KV budget where the model has attention
layers too, all of it where not). Allocated once beside the paged KV cache, whose budget
they come out of; their size does not grow with the context. Speculative decoding gives each
slot a row per draft (`rows_per_slot`)."""

from __future__ import annotations

import logging
import math
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from tokenmill.layers.state_layer import StateLayer

logger = logging.getLogger(__name__)


def build(model: nn.Module, config: Any, dtype: torch.dtype, device: torch.device,
          world: Any, budget_bytes: Callable[[], int]) -> int:
    """The model's state layers' tensors (an EngineConfig `config`): a slot for each of
    `max_num_seqs` requests, as far as `budget_bytes()` holds them (at least one: requests
    past the slots wait, as for blocks), `rows_per_slot` rows each; the slot count every rank
    of `world` agrees on (a pipeline stage without state layers counts them too; 0: no rank
    has any). What state layers do not take is refused here, by name."""
    layers = state_layers(model)
    slots = 0
    if layers:
        if config.enable_lora:  # (adapters on their projections: not built)
            raise ValueError("--enable-lora is not built for models with state layers "
                             "(Mamba-2, Qwen3-Next's linear attention): drop --enable-lora.")
        rows = rows_per_slot(config)
        per_slot = bytes_per_slot(layers, dtype) * rows
        slots = max(1, min(config.max_num_seqs, budget_bytes() // per_slot))
        bind_state_cache(layers, slots * rows, dtype, device)
        logger.info("State cache: %d slots for up to %d running requests (%.2f GiB) beside "
                    "the KV cache", slots, config.max_num_seqs, slots * per_slot / 2**30)
    if world.size == 1:
        return slots
    if world.all_reduce_min(0 if layers else 1):  # (no rank has state layers)
        return 0
    return world.all_reduce_min(slots if layers else config.max_num_seqs)


def rows_per_slot(config: Any) -> int:
    """A slot's rows: its request's state, and with speculative decoding the state after
    each draft a step verifies (the next step reads the last accepted one's)."""
    spec = config.speculative_config
    return 1 + (spec.num_speculative_tokens if spec is not None else 0)


def state_layers(model: nn.Module) -> list[StateLayer]:
    """This rank's state layers (those of its pipeline stage)."""
    return [m for m in model.modules() if isinstance(m, StateLayer)]


def bytes_per_slot(layers: list[StateLayer], dtype: torch.dtype) -> int:
    """One slot's bytes over all `layers`: the convolution state in `dtype`, the recurrent
    state in float32."""
    width = torch.empty((), dtype=dtype).element_size()
    return sum(math.prod(conv) * width + math.prod(ssm) * 4
               for conv, ssm in (layer.state_shapes() for layer in layers))


def bind_state_cache(layers: list[StateLayer], num_rows: int, dtype: torch.dtype,
                     device: torch.device) -> None:
    for layer in layers:
        conv, ssm = layer.state_shapes()
        layer.conv_state = torch.zeros(num_rows, *conv, dtype=dtype, device=device)
        layer.ssm_state = torch.zeros(num_rows, *ssm, dtype=torch.float32, device=device)
