"""Sleep mode on the model runner (vLLM's `--enable-sleep-mode`, what RL trainers use between
rollouts): `release` frees what an idle engine holds, `restore` brings it back.

- Level 1 frees the KV cache (and the state layers' slots); the weights stay where they are
  (on a CPU that is host memory, where a GPU's would be offloaded to; on a GPU they stay on
  the device). Waking binds fresh, zeroed caches of the same size and rebuilds what holds
  their addresses (the compiled decode step, graphs).
- Level 2 frees the weights too, and every part built over them (draft heads, the image
  tower, the pooler's layers); waking loads the model again, from the checkpoint or from
  the one the last weight update named, with the block count it had (the KV-cache manager
  is rebuilt with it: worker output equal to a fresh engine's).

The engine side (idle only, requests refused while asleep) is engine/sleep_mode.py."""

from __future__ import annotations

import dataclasses
import gc
import logging
from typing import Any

import torch

from tokenmill import heap
from tokenmill.config import kernels as kernel_switches
from tokenmill.worker import state_cache

logger = logging.getLogger(__name__)

_EMPTY = torch.empty(0)


def release(runner: Any, level: int) -> None:
    """Free the runner's caches (level 1), and its weights (level 2)."""
    for layer in runner._layers:
        layer.k_cache = layer.v_cache = _EMPTY
    for layer in state_cache.state_layers(runner.model) if runner.model is not None else ():
        layer.conv_state = layer.ssm_state = _EMPTY  # (None: a load that failed half-way)
    runner.decode_step = runner.graphs = runner.pieces = None  # (they hold the addresses)
    runner.paths = []
    if level == 2:
        runner.model = runner.heads = runner.target_states = None
        runner.pooler = runner.images = None
        runner._layers = []
    gc.collect()
    runner.platform.empty_cache()
    heap.trim()


def restore(runner: Any, level: int, model: Any) -> None:
    """Level 1: fresh caches of the sizes they had, and the step paths over them. Level 2:
    the runner built again over `model` (a ModelConfig), with the block count it had."""
    config = runner.config
    if level == 2:
        config = dataclasses.replace(config, num_kv_blocks=runner.num_blocks)
        with kernel_switches.using(config.kernels):
            runner._start(config, model)
        heap.trim()  # (what loading freed, as at start-up)
        return
    with kernel_switches.using(config.kernels):
        runner._bind_cache(runner.num_blocks)
        layers = state_cache.state_layers(runner.model)
        if layers:
            rows = runner.num_state_slots * state_cache.rows_per_slot(config)
            state_cache.bind_state_cache(layers, rows, runner.dtype, runner.device)
        runner.build_step_paths(model.max_model_len)
