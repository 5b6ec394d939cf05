"""`LoRARegistry`: the adapters an engine serves by name (--lora-modules, then those loaded
and unloaded at run time). It hands out ids (never reused), and an adapter unloaded while
requests still use it stays in memory until the last of them finishes."""

from __future__ import annotations

from collections.abc import Iterable

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
        if request.lora_int_id in self._unloaded:
            raise ValueError(f"LoRA adapter {request.lora_name!r} was unloaded.")
        self._manager().add(request)

    def load(self, name: str, path: str) -> LoRARequest:
        """A new adapter served under `name` (ValueError: refused, nothing loaded)."""
        manager = self._manager()
        if not name or not path:
            raise ValueError("lora_name and lora_path must be non-empty strings.")
        if name in self.adapters:
            raise ValueError(f"LoRA adapter {name!r} is already loaded.")
        request = LoRARequest(name, self._next_id, path)
        manager.add(request)
        self._next_id += 1
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
        return request

    def release(self, in_use: Iterable[int]) -> None:
        """Frees the unloaded adapters no request in `in_use` (adapter ids) uses any more."""
        if not self._draining:
            return
        for lora_id in self._draining - set(in_use):
            self._draining.discard(lora_id)
            self._manager().remove(lora_id)

    def served(self) -> list[LoRARequest]:
        return list(self.adapters.values())
