"""`LoRARegistry`: the adapters an engine serves by name (--lora-modules, then those loaded
and unloaded at run time). It hands out ids (never reused), and an adapter unloaded while
requests still use it stays in memory until the last of them finishes. A request whose
adapter is not in host memory can wait while a thread reads it (`submit` / `ready`), so the
engine's step loop goes on meanwhile."""

from __future__ import annotations

import concurrent.futures
from collections.abc import Iterable
from typing import Any

from tokenmill.lora import trtllm_format
from tokenmill.lora.manager import LoRAManager
from tokenmill.lora.request import LoRARequest, served_adapters


class LoRARegistry:
    def __init__(self, manager: LoRAManager | None,
                 modules: list[tuple[str, str, str | None]] | None) -> None:
        self.manager = manager
        self.adapters = served_adapters(modules)
        self._next_id = len(self.adapters) + 1
        self._unloaded: set[int] = set()  # ids of adapters unloaded (never served again)
        self._draining: set[int] = set()  # unloaded, still in memory for running requests
        self._paths: dict[int, str] = {}  # the folders of those draining
        # requests waiting for their adapter's read, in arrival order: (request, its future)
        self.pending: list[tuple[Any, concurrent.futures.Future]] = []
        self._reader: concurrent.futures.ThreadPoolExecutor | None = None

    def start(self) -> None:
        """Reads and checks the --lora-modules adapters (LoRAError: one is refused)."""
        for adapter in self.adapters.values():
            self._manager().add(adapter)

    def _manager(self) -> LoRAManager:
        if self.manager is None:
            raise ValueError("LoRA is not enabled: start the engine with --enable-lora.")
        return self.manager

    def check(self, request: LoRARequest) -> None:
        """A request's adapter, read and checked where not held (ValueError: refused)."""
        self._refuse_unloaded(request)
        self._manager().add(request)

    def _refuse_unloaded(self, request: LoRARequest) -> None:
        if request.lora_int_id in self._unloaded:
            raise ValueError(f"LoRA adapter {request.lora_name!r} was unloaded.")

    def held(self, request: LoRARequest) -> bool:
        """Whether the adapter is read and in host memory (a request for it can run now)."""
        return self._manager().holds(request)

    def submit(self, request: Any) -> None:
        """An engine request (core/request.py's) whose adapter a thread reads; `ready`
        hands it back once read (ValueError now: the adapter was unloaded)."""
        lora = request.lora_request
        self._refuse_unloaded(lora)
        if self._reader is None:
            self._reader = concurrent.futures.ThreadPoolExecutor(
                1, thread_name_prefix="tokenmill-lora")
        self.pending.append((request, self._reader.submit(self._manager().read, lora)))

    def ready(self, wait_s: float = 0.0) -> tuple[list[Any], list[tuple[Any, str]]]:
        """Requests whose adapter is now in host memory, and those whose adapter was
        refused with the reason; waits up to `wait_s` for a first one."""
        if not self.pending:
            return [], []
        if wait_s:
            concurrent.futures.wait([f for _, f in self.pending], wait_s,
                                    concurrent.futures.FIRST_COMPLETED)
        done = [(r, f) for r, f in self.pending if f.done()]
        self.pending = [(r, f) for r, f in self.pending if not f.done()]
        ok, failed = [], []
        for request, future in done:
            exc = future.exception()
            if exc is None:
                self._manager().keep(future.result())
                ok.append(request)
            elif isinstance(exc, ValueError):
                failed.append((request, str(exc)))
            else:
                raise exc
        return ok, failed

    def drop(self, request_ids: Iterable[str]) -> None:
        """Forget waiting requests (aborted)."""
        ids = set(request_ids)
        self.pending = [(r, f) for r, f in self.pending if r.request_id not in ids]

    def shutdown(self) -> None:
        if self._reader is not None:
            self._reader.shutdown(wait=False, cancel_futures=True)

    def load(self, name: str, path: str, lora_id: int = 0) -> LoRARequest:
        """A new adapter served under `name` (ValueError: refused, nothing loaded), with id
        `lora_id` (one no adapter ever had; 0: the next)."""
        manager = self._manager()
        if not name or not path:
            raise ValueError("lora_name and lora_path must be non-empty strings.")
        if name in self.adapters:
            raise ValueError(f"LoRA adapter {name!r} is already loaded.")
        if lora_id and (lora_id in self._unloaded or lora_id in {
                a.lora_int_id for a in self.adapters.values()}):
            raise ValueError(f"LoRA adapter id {lora_id} was given to another adapter.")
        request = LoRARequest(name, lora_id or self._next_id, path)
        manager.add(request)
        self._next_id = max(self._next_id, request.lora_int_id) + 1
        self.adapters[name] = request
        return request

    def unload(self, name: str) -> LoRARequest | None:
        """The adapter no longer served (None: no adapter has that name); its memory goes
        once no request uses it (`release`)."""
        self._manager()
        request = self.adapters.pop(name, None)
        if request is not None:
            self._unloaded.add(request.lora_int_id)
            self._draining.add(request.lora_int_id)
            self._paths[request.lora_int_id] = request.lora_path
        return request

    def release(self, in_use: Iterable[int]) -> None:
        """Frees the unloaded adapters no request in `in_use` (adapter ids) uses any more."""
        if not self._draining:
            return
        for lora_id in self._draining - set(in_use):
            self._draining.discard(lora_id)
            self._manager().remove(lora_id)
            trtllm_format.remove_if_owned(self._paths.pop(lora_id, ""))

    def served(self) -> list[LoRARequest]:
        return list(self.adapters.values())
