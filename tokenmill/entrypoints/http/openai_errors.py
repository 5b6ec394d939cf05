"""OpenAI's error shapes (what the `openai` SDK parses), shared by every route that answers
in them: `ApiError` (a refusal with its status and field), the error body and response
(503s carry Retry-After, 429s the wait the server expects), pydantic's validation errors
as one sentence."""

from __future__ import annotations

import math

from fastapi.responses import JSONResponse
from pydantic import ValidationError

_ERROR_TYPES = {400: "BadRequestError", 401: "AuthenticationError", 404: "NotFoundError",
                408: "RequestTimeoutError", 409: "ConflictError", 413: "RequestTooLargeError",
                429: "RateLimitError",
                431: "RequestHeaderFieldsTooLargeError",
                500: "InternalServerError", 503: "ServiceUnavailableError",
                504: "TimeoutError"}
RETRY_AFTER_S = "1"  # sent with every 503: overload and shutdown are short-lived here


class ApiError(Exception):
    """A request the server refuses; `param` names the offending field when there is one."""

    def __init__(self, message: str, status: int = 400, param: str | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.status = status
        self.param = param


def error_body(message: str, status: int, param: str | None = None) -> dict:
    """OpenAI's error object (what the `openai` SDK parses)."""
    return {"error": {"message": message, "type": _ERROR_TYPES.get(status, "Error"),
                      "param": param, "code": status}}


def error_response(message: str, status: int = 400, param: str | None = None) -> JSONResponse:
    headers = {"Retry-After": RETRY_AFTER_S} if status == 503 else None
    return JSONResponse(error_body(message, status, param), status_code=status,
                        headers=headers)


def api_error(exc: Exception) -> JSONResponse:
    """An `ApiError`, or a `ValueError` from validation (`param` when it names one), or the
    engine's refusal for load (429)."""
    status = getattr(exc, "status", 400)
    message = getattr(exc, "message", None) or str(exc)
    return with_retry_after(error_response(message, status, getattr(exc, "param", None)), exc)


def with_retry_after(response, exc: BaseException):
    """`response` (any route's) with Retry-After when it is a 429 and `exc` says how long
    the server expects the queue to take (whole seconds, at least 1)."""
    seconds = getattr(exc, "retry_after", None)
    if seconds is not None and response.status_code == 429:
        response.headers["Retry-After"] = str(max(1, math.ceil(seconds)))
    return response


def validation_error(exc: ValidationError) -> ApiError:
    """pydantic's errors as one sentence (with the full paths); `param` = the top-level field
    of the first error, the one the client has to fix."""
    parts, params = [], []
    for err in exc.errors():
        where = ".".join(str(x) for x in err["loc"]) or "body"
        params.append(str(err["loc"][0]) if err["loc"] else None)
        parts.append(f"{where}: {err['msg']}")
    return ApiError("; ".join(parts), 400, params[0] if params else None)


def refusal(exc: Exception) -> tuple[int, dict]:
    """(status, OpenAI error body) of a request that failed: a refusal (`ApiError`, or a
    `ValueError` from validation), the engine's refusal (400) or its death (503). Any other
    exception is not a refusal and is raised again."""
    from tokenmill.engine.async_engine import EngineDeadError, EngineRequestError

    if isinstance(exc, (ApiError, ValueError)):
        status = getattr(exc, "status", 400)
        return status, error_body(getattr(exc, "message", None) or str(exc), status,
                                  getattr(exc, "param", None))
    if isinstance(exc, EngineRequestError):
        return exc.status, error_body(str(exc), exc.status)
    if isinstance(exc, EngineDeadError):
        return 503, error_body(str(exc), 503)
    raise exc


def parse_body(model_cls, body, state):
    """A route's body as `model_cls` (pydantic), its `model` one the server serves."""
    if not isinstance(body, dict):
        raise ApiError("The request body must be a JSON object.")
    try:
        req = model_cls.model_validate(body)
    except ValidationError as exc:
        raise validation_error(exc) from None
    if req.model is not None and req.model not in state.model_names:
        raise ApiError(f"The model `{req.model}` does not exist.", 404, "model")
    return req
