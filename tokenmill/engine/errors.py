"""The engine's errors as the front ends see them: one request refused or failed (its
route's 400, or 429 with Retry-After when refused for load), or the engine gone (503)."""

from __future__ import annotations


class EngineRequestError(ValueError):
    """The engine refused or failed one request (others are unaffected); `status`: what its
    route answers, `retry_after`: seconds a client should wait first (a 429's)."""

    status = 400
    retry_after: float | None = None


class EngineOverloadedError(EngineRequestError):
    """Refused for load: it waited, or would wait, past its `max_queue_time` (429)."""

    status = 429

    def __init__(self, message: str, retry_after: float) -> None:
        super().__init__(message)
        self.retry_after = retry_after


class DuplicateRequestError(EngineRequestError):
    """A request with this id is already in flight."""


class EngineDeadError(RuntimeError):
    """The engine core stopped answering; every in-flight request fails with this."""


class ShutdownError(EngineDeadError):
    """The server stopped (drain timeout over) before the request finished."""


class EngineSleepingError(EngineDeadError):
    """Sleep mode: the engine sleeps (every front end answers 503 with its message)."""


def request_error(message: str, retry_after: float | None = None, status: int = 0,
                  sleeping: bool = False) -> Exception:
    """The error an engine core's refusal of one request raises on the API side."""
    if sleeping:
        return EngineSleepingError(message)
    if retry_after is not None:
        return EngineOverloadedError(message, retry_after)
    error = EngineRequestError(message)
    if status:
        error.status = status
    return error
