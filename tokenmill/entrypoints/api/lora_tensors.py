"""TensorRT-LLM's adapters sent with a request (Triton generate, the KServe `ensemble`): a
`lora_task_id` with `lora_weights` and `lora_config` registers that adapter under the task id
(its tensors kept as a folder in a private directory, lora/trtllm_format.py, and loaded by
the engine as a run-time adapter named `trtllm-task-<id>`); later requests name it by the id
alone, as the TensorRT-LLM backend caches them. At most `MAX_TASK_ADAPTERS` are kept: past
that the oldest is unloaded, and a request naming it alone is told to send its tensors
again, as TensorRT-LLM answers an adapter gone from its cache. A registered adapter's folder
goes when the engine lets the adapter go (lora/registry.py)."""

from __future__ import annotations

import asyncio
import atexit
import contextlib
import functools
import os
import shutil
import tempfile
import uuid
from typing import Any

from tokenmill.engine.async_engine import EngineRequestError
from tokenmill.lora import trtllm_format
from tokenmill.lora.request import LoRARequest

PREFIX = "trtllm-task-"
MAX_TASK_ADAPTERS = 64


def task_name(task_id: int) -> str:
    return f"{PREFIX}{task_id}"


@functools.cache
def _directory() -> str:
    """This process's private folder for adapters sent as tensors (removed at exit)."""
    path = tempfile.mkdtemp(prefix="tokenmill-lora-tensors-")
    atexit.register(shutil.rmtree, path, True)
    return path


class TaskAdapters:
    """One API process's registrations (the adapters themselves live in the engine, which
    every API process asks: one registered through another process is found by name)."""

    def __init__(self) -> None:
        self._lock = asyncio.Lock()

    async def register(self, state: Any, task_id: int, weights: Any, config: Any
                       ) -> LoRARequest:
        """The adapter of `task_id`, registered from the tensors unless it already is
        (ValueError: refused, with the reason)."""
        async with self._lock:
            held = state.adapters.get(task_name(task_id))
            if held is not None:
                return held
            weights, config = await asyncio.to_thread(trtllm_format.checked, weights, config)
            await self._make_room(state)
            folder = os.path.join(_directory(), f"task-{task_id}-{uuid.uuid4().hex[:8]}")
            await asyncio.to_thread(_write, weights, config, folder)
            try:
                await state.engine.update_lora(task_name(task_id), folder)
            except EngineRequestError as exc:
                shutil.rmtree(folder, ignore_errors=True)
                raise ValueError(str(exc)) from None
            return state.adapters[task_name(task_id)]

    @staticmethod
    async def _make_room(state: Any) -> None:
        held = sorted((a for a in state.adapters.values() if a.lora_name.startswith(PREFIX)),
                      key=lambda a: a.lora_int_id)
        for adapter in held[:max(0, len(held) - MAX_TASK_ADAPTERS + 1)]:
            # (unloaded already by another API process: nothing to do)
            with contextlib.suppress(EngineRequestError):
                await state.engine.update_lora(adapter.lora_name)


def _write(weights: Any, config: Any, folder: str) -> None:
    trtllm_format.write_folder(weights, config, folder)
    with open(os.path.join(folder, trtllm_format.OWNED_MARKER), "w"):
        pass
