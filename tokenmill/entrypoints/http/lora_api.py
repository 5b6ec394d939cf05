"""vLLM's run-time adapter routes, served with VLLM_ALLOW_RUNTIME_LORA_UPDATING and
--enable-lora: `/v1/load_lora_adapter` ({"lora_name", "lora_path"}) and
`/v1/unload_lora_adapter` ({"lora_name"}). The engine core reads and checks the adapter; every
API process learns the new list with the core's next stats (the asking one before it
answers). An adapter unloaded while requests use it serves them to their end."""

from __future__ import annotations

from fastapi.responses import PlainTextResponse, Response

from tokenmill.engine.async_engine import EngineRequestError
from tokenmill.entrypoints.api.state import ServerState
from tokenmill.entrypoints.http.openai_errors import error_response

_MAX_TEXT = 4096  # (a name or path longer than this is refused before any work)


def _field(body: dict, name: str) -> str | None:
    value = body.get(name)
    if not isinstance(value, str) or not value or len(value) > _MAX_TEXT:
        return None
    return value


async def load(body: object, state: ServerState) -> Response:
    if not isinstance(body, dict):
        return error_response("The body must be a JSON object.", 400)
    name, path = _field(body, "lora_name"), _field(body, "lora_path")
    if name is None or path is None:
        return error_response("Both 'lora_name' and 'lora_path' must be non-empty strings.",
                              400, "lora_name" if name is None else "lora_path")
    if name in state.config.model_names:
        return error_response(f"{name!r} is the served model's own name.", 400, "lora_name")
    try:
        await state.engine.update_lora(name, path)
    except (EngineRequestError, ValueError) as exc:
        return error_response(str(exc), 400)
    return PlainTextResponse(f"Success: LoRA adapter '{name}' added successfully.")


async def unload(body: object, state: ServerState) -> Response:
    if not isinstance(body, dict):
        return error_response("The body must be a JSON object.", 400)
    name = _field(body, "lora_name")
    if name is None:
        return error_response("'lora_name' must be a non-empty string.", 400, "lora_name")
    if name not in state.adapters:
        return error_response(f"The LoRA adapter {name!r} cannot be found.", 404, "lora_name")
    try:
        await state.engine.update_lora(name)
    except (EngineRequestError, ValueError) as exc:
        status = 404 if "cannot be found" in str(exc) else 400
        return error_response(str(exc), status)
    return PlainTextResponse(f"Success: LoRA adapter '{name}' removed successfully.")
