"""Sleep mode and weight updates over HTTP (engine/sleep_mode.py), as RL trainers call vLLM
and SGLang: vLLM's `POST /sleep?level=1|2`, `POST /wake_up`, `GET /is_sleeping` (with
--enable-sleep-mode), and SGLang's `POST /update_weights_from_disk` ({"model_path"}:
another checkpoint of the same shape; answers {"success", "message"}). A refusal of the
engine's (requests still running, LoRA adapters beside level 2, another shape) is 409; a bad
argument 400. While the engine sleeps every generating route answers 503."""

from __future__ import annotations

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response

from tokenmill.engine.async_engine import EngineDeadError, EngineRequestError
from tokenmill.entrypoints.api.json_body import BodyError
from tokenmill.entrypoints.http.openai_errors import error_response
from tokenmill.entrypoints.http.request_body import read_body

_MAX_PATH = 4096


def add_routes(app: FastAPI, guarded: list) -> None:
    @app.post("/sleep", dependencies=guarded)
    async def sleep(request: Request) -> Response:
        level = request.query_params.get("level", "1")
        if level not in ("1", "2"):
            return error_response(f"level must be 1 or 2, got {level[:20]!r}.", 400, "level")
        return _reply(*await _control(request, "sleep", level=int(level)))

    @app.post("/wake_up", dependencies=guarded)
    async def wake_up(request: Request) -> Response:
        return _reply(*await _control(request, "wake_up"))

    @app.get("/is_sleeping", dependencies=guarded)
    async def is_sleeping(request: Request) -> dict:
        return {"is_sleeping": request.app.state.server.engine.sleeping}

    @app.post("/update_weights_from_disk", dependencies=guarded)
    async def update_weights(request: Request) -> Response:
        try:
            body = await read_body(request)
        except BodyError as exc:
            return _sglang(400, str(exc))
        path = body.get("model_path") if isinstance(body, dict) else None
        if not isinstance(path, str) or not path or len(path) > _MAX_PATH:
            return _sglang(400, "'model_path' must be a non-empty string.")
        return _sglang(*await _control(request, "update_weights", path=path))


async def _control(request: Request, action: str, level: int = 0,
                   path: str = "") -> tuple[int, str]:
    """(status, message) of asking the engine."""
    state = request.app.state.server
    if action != "update_weights" and not state.config.engine.enable_sleep_mode:
        return 400, "Sleep mode is off: start the server with --enable-sleep-mode."
    try:
        await state.engine.control(action, level, path)
    except EngineRequestError as exc:
        return 409, str(exc)
    except EngineDeadError as exc:
        return 503, str(exc)
    return 200, "Weights updated." if action == "update_weights" else ""


def _reply(status: int, message: str) -> Response:
    return Response(status_code=200) if status == 200 else error_response(message, status)


def _sglang(status: int, message: str) -> JSONResponse:
    """SGLang's answer shape: {"success", "message"}."""
    return JSONResponse({"success": status == 200, "message": message}, status_code=status)
