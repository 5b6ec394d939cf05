"""Sleep mode and weight updates on the engine core, as RL trainers drive vLLM and SGLang
between rollouts: `sleep` (level 1: the KV cache freed; level 2: the weights too), `wake_up`,
and `update_weights` (the model loaded again from another checkpoint of the same shape, the
prefix cache dropped). Each needs an idle engine (no request running or waiting: a refusal
says how many there are); while asleep, requests are refused with `SLEEPING` (the API
answers 503). The runner's side is worker/sleep_mode.py.

Not built: tensor / pipeline parallel engines (refused at start-up with
--enable-sleep-mode), and level 2 or weight updates beside LoRA adapters or a draft model
(each holds weights of its own)."""

from __future__ import annotations

import dataclasses
import logging
import os
import shutil
from typing import Any

from tokenmill.core.kv_cache_manager import KVCacheManager
from tokenmill.engine.protocol import SLEEPING
from tokenmill.models.info import kv_window
from tokenmill.worker import sleep_mode as runner_sleep

logger = logging.getLogger(__name__)

__all__ = ["SLEEPING", "sleep", "update_weights", "wake_up"]

# config.json fields two checkpoints must share for one to replace the other's weights (the
# KV cache's layout, the vocabulary the tokenizer serves)
_SHAPE = ("model_type", "hidden_size", "num_hidden_layers", "num_attention_heads",
          "num_key_value_heads", "head_dim", "vocab_size")


def sleep(core: Any, level: int) -> None:
    if not core.config.enable_sleep_mode:
        raise ValueError("Sleep mode is off: start the engine with --enable-sleep-mode "
                         "(LLM(enable_sleep_mode=True)).")
    if level not in (1, 2):
        raise ValueError(f"The sleep level must be 1 or 2, got {level!r}.")
    if level <= core.sleeping:
        return
    if level == 2:
        _check_own_weights(core, "Sleep level 2")
    _check_idle(core, "Sleeping")
    core.kv_cache.reset_prefix_cache()
    runner_sleep.release(core.runner, level)
    core.sleeping = level
    logger.info("Asleep (level %d): %s freed", level,
                "the KV cache" if level == 1 else "the KV cache and the weights")


def wake_up(core: Any) -> None:
    """Caches and weights back; a model that no longer loads (its checkpoint moved, say)
    leaves the engine asleep at level 2, and the refusal says why."""
    level = core.sleeping
    if not level:
        return
    try:
        runner_sleep.restore(core.runner, level, core.model_config)
    except Exception as exc:
        logger.warning("Waking up failed (%s); asleep at level 2", exc)
        runner_sleep.release(core.runner, 2)
        core.sleeping = 2
        reason = _reason(exc, core.model_config.path)
        raise ValueError(f"Waking up failed: the model did not load ({reason}); the engine "
                         "sleeps at level 2 (restore the checkpoint and wake it up again, or "
                         "update the weights).") from None
    if level == 2:
        _new_kv_cache(core)
    core.sleeping = 0
    logger.info("Awake")


def update_weights(core: Any, path: str, source: str | None = None) -> None:
    """Serve the weights of the checkpoint at `path` (a folder or GGUF file of the same
    architecture and shapes); on a failure to load them the previous weights serve again
    and the error is raised (naming `source`, default the path, as what failed)."""
    from tokenmill.loading.checkpoint import load_hf_config, resolve_model_path

    check_for_update(core)
    try:  # (a local checkpoint only: never a hub download)
        if not os.path.exists(path):
            raise FileNotFoundError(path)
        path = resolve_model_path(path)
        hf_config = load_hf_config(path)
    except (OSError, ValueError):
        raise ValueError(f"No checkpoint to update the weights from at {path!r}: give a "
                         "local folder with config.json and weights, or a .gguf file.") from None
    served = core.hf_config
    for key in _SHAPE:
        ours, theirs = getattr(served, key, None), getattr(hf_config, key, None)
        if ours != theirs:
            raise ValueError(f"The checkpoint's {key} is {theirs!r}, the served model's "
                             f"{ours!r}: weights must come from a model of the same shape.")
    if core.sleeping < 2:
        core.kv_cache.reset_prefix_cache()
        runner_sleep.release(core.runner, 2)
    model = dataclasses.replace(core.model_config, path=path, hf_config=hf_config)
    try:
        runner_sleep.restore(core.runner, 2, model)
    except Exception as exc:
        logger.warning("Loading the weights of %s failed (%s); the previous weights serve",
                       path, exc)
        runner_sleep.release(core.runner, 2)
        runner_sleep.restore(core.runner, 2, core.model_config)
        _new_kv_cache(core)
        core.sleeping = 0
        raise ValueError(f"{source or f'The weights at {path!r}'} could not be loaded "
                         f"({_reason(exc, path)}); the previous weights serve.") from None
    core.model_config = model
    _new_kv_cache(core)
    core.sleeping = 0
    staged = getattr(core, "weight_staging", None)  # (a trainer's last tensors: replaced)
    if staged is not None and staged != path:
        shutil.rmtree(staged, ignore_errors=True)
        core.weight_staging = None
    logger.info("Weights updated from %s", path)


def _reason(exc: Exception, path: str) -> str:
    """Why a load failed, in one line without the checkpoint's path: our own ValueErrors'
    text, another exception's kind."""
    if not isinstance(exc, ValueError):
        return type(exc).__name__
    return (str(exc).replace(f"Checkpoint {path!r}", "the checkpoint")
            .replace(repr(path), "the checkpoint").replace(path, "it"))


def check_for_update(core: Any) -> None:
    """What a weight update needs: nothing else holding weights, an idle engine."""
    _check_own_weights(core, "A weight update")
    _check_idle(core, "A weight update")


def _check_idle(core: Any, what: str) -> None:
    scheduler = core.scheduler
    busy = scheduler.num_running + scheduler.num_waiting
    if busy:
        raise ValueError(f"{what} needs an idle engine: {busy} request(s) are running or "
                         "waiting; let them finish, or abort them.")


def _check_own_weights(core: Any, what: str) -> None:
    """Level 2 and weight updates reload the model: nothing else may hold its weights."""
    if core.config.enable_lora:
        raise ValueError(f"{what} is not built beside LoRA adapters (--enable-lora).")
    spec = core.config.speculative_config
    if spec is not None and spec.method == "draft_model":
        raise ValueError(f"{what} is not built beside a draft model (--speculative-config "
                         "method draft_model).")


def _new_kv_cache(core: Any) -> None:
    """The KV-cache manager over the rebuilt runner's blocks and state slots (its prefix
    counters carried on: they are cumulative)."""
    runner, config, old = core.runner, core.config, core.kv_cache
    new = core.kv_cache = core.scheduler.kv_cache = KVCacheManager(
        runner.num_blocks, config.block_size, config.enable_prefix_caching,
        kv_window(core.hf_config), runner.num_state_slots)
    new.num_queried_tokens, new.num_hit_tokens = old.num_queried_tokens, old.num_hit_tokens
