"""Sleep mode and weight updates over HTTP (engine/sleep_mode.py), as RL trainers call vLLM
and SGLang: vLLM's `POST /sleep?level=1|2`, `POST /wake_up`, `GET /is_sleeping` (with
--enable-sleep-mode), and SGLang's `POST /update_weights_from_disk` ({"model_path"}:
another checkpoint of the same shape), `/init_weights_update_group`,
`/update_weights_from_distributed` (a trainer's tensors over torch.distributed:
engine/weight_sync.py) and `/destroy_weights_update_group`, which answer {"success",
"message"}. The engine's refusal (requests still running, LoRA adapters beside level 2,
another shape) is 409; a bad argument 400. While the engine sleeps every generating route
answers 503."""

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
        body = await _object(request)
        if isinstance(body, Response):
            return body
        path = body.get("model_path")
        if not isinstance(path, str) or not path or len(path) > _MAX_PATH:
            return _sglang(400, "'model_path' must be a non-empty string.")
        return _sglang(*await _control(request, "update_weights", path=path))

    # a trainer's weight-update group (SGLang's routes; engine/weight_sync.py)
    @app.post("/init_weights_update_group", dependencies=guarded)
    async def init_group(request: Request) -> Response:
        body = await _object(request)
        if isinstance(body, Response):
            return body
        address, backend = body.get("master_address"), body.get("backend", "gloo")
        numbers = [body.get(key) for key in ("master_port", "rank_offset", "world_size")]
        if (not isinstance(address, str) or not address or len(address) > 255
                or not all(isinstance(n, int) and 0 <= n < 65536 for n in numbers)
                or backend not in ("gloo", "nccl")):
            return _sglang(400, "Give master_address, master_port, rank_offset, world_size "
                                "(and backend gloo or nccl).")
        port, rank_offset, world_size = numbers
        return _sglang(*await _control(
            request, "init_weights_update_group", options={
                "address": address, "port": port, "rank_offset": rank_offset,
                "world_size": world_size, "backend": backend}))

    @app.post("/update_weights_from_distributed", dependencies=guarded)
    async def update_from_group(request: Request) -> Response:
        body = await _object(request)
        if isinstance(body, Response):
            return body
        names, dtypes, shapes = (body.get(key) for key in ("names", "dtypes", "shapes"))
        if not (isinstance(names, list) and isinstance(dtypes, list)
                and isinstance(shapes, list) and all(isinstance(n, str) for n in names)
                and all(isinstance(d, str) for d in dtypes)):
            return _sglang(400, "Give names, dtypes and shapes: lists of one length.")
        return _sglang(*await _control(
            request, "update_weights_from_distributed", options={
                "names": names, "dtypes": dtypes, "shapes": shapes}))

    @app.post("/destroy_weights_update_group", dependencies=guarded)
    async def destroy_group(request: Request) -> Response:
        return _sglang(*await _control(request, "destroy_weights_update_group"))


async def _object(request: Request) -> dict | Response:
    try:
        body = await read_body(request)
    except BodyError as exc:
        return _sglang(400, str(exc))
    return body if isinstance(body, dict) else _sglang(400, "The body must be a JSON object.")


async def _control(request: Request, action: str, level: int = 0, path: str = "",
                   options: dict | None = None) -> tuple[int, str]:
    """(status, message) of asking the engine."""
    state = request.app.state.server
    if action in ("sleep", "wake_up") and not state.config.engine.enable_sleep_mode:
        return 400, "Sleep mode is off: start the server with --enable-sleep-mode."
    try:
        await state.engine.control(action, level, path, options)
    except EngineRequestError as exc:
        return 409, str(exc)
    except EngineDeadError as exc:
        return 503, str(exc)
    return 200, _DONE.get(action, "")


_DONE = {"update_weights": "Weights updated.", "update_weights_from_distributed":
         "Weights updated.", "init_weights_update_group": "Joined the weight-update group.",
         "destroy_weights_update_group": "Left the weight-update group."}


def _reply(status: int, message: str) -> Response:
    return Response(status_code=200) if status == 200 else error_response(message, status)


def _sglang(status: int, message: str) -> JSONResponse:
    """SGLang's answer shape: {"success", "message"}."""
    return JSONResponse({"success": status == 200, "message": message}, status_code=status)
