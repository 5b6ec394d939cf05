"""Clients of the engine core; the in-process one runs the core's steps in the caller's thread.

A multi-process client (ZMQ, msgspec) offers the same methods, so `LLMEngine` and the servers
drive either without knowing which."""

from __future__ import annotations

from tokenmill.engine.engine_core import EngineCore
from tokenmill.engine.protocol import EngineCoreOutput, EngineCoreRequest


class InprocClient:
    def __init__(self, core: EngineCore) -> None:
        self.core = core

    def add_request(self, request: EngineCoreRequest) -> None:
        self.core.add_request(request)

    def abort_requests(self, request_ids: list[str]) -> None:
        if request_ids:
            self.core.abort_requests(request_ids)

    def finish_requests(self, request_ids: list[str]) -> None:
        if request_ids:
            self.core.finish_requests(request_ids)

    def get_output(self) -> list[EngineCoreOutput]:
        return self.core.step()

    def has_unfinished_requests(self) -> bool:
        return self.core.has_unfinished_requests()
