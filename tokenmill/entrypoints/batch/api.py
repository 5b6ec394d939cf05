"""OpenAI's Files and Batch APIs. `/v1/files`: upload a JSONL of request lines (multipart,
`purpose` "batch", at most `--max-batch-file-bytes`), list, retrieve, download its content,
delete. `/v1/batches`: create one over an uploaded file for one endpoint, retrieve, cancel,
list. A batch runs in the API process that created it (batch/lines.py: each line answered
as the live route answers it, a few at a time, at `BATCH_PRIORITY` under --scheduling-policy
priority so live requests go first); answered lines with status 200 go to its output file,
the others to its error file; `request_counts` follow as it runs. Cancelling stops it
between lines (any API process may ask: the runner reads the record as it goes)."""

from __future__ import annotations

import asyncio
import functools
import json
import logging
import os
import time
from typing import Any

from fastapi import Request
from fastapi.responses import FileResponse, JSONResponse, Response

from tokenmill.entrypoints.api.state import ServerState
from tokenmill.entrypoints.batch.lines import answer_all, served_urls
from tokenmill.entrypoints.batch.store import BatchStore, StoreError
from tokenmill.entrypoints.http.openai_errors import error_response

logger = logging.getLogger(__name__)
BATCH_PRIORITY = 100  # (lower runs first: live requests' default is 0)
MAX_LINES = 50_000  # a batch's request lines (OpenAI's limit)
CONCURRENCY = 8  # a batch's lines in the engine at once
_RUNNING: dict[str, asyncio.Task] = {}  # this process's batches, by id


def _error(exc: StoreError) -> JSONResponse:
    return error_response(exc.message, exc.status)


def _store(state: ServerState) -> BatchStore:
    from tokenmill.config.env import cache_dir

    return _store_at(state.config.batch_dir or os.path.join(cache_dir(), "batches"))


@functools.cache
def _store_at(root: str) -> BatchStore:
    return BatchStore(root)


class _Cancelled(Exception):
    """The batch's record says cancelling (asked through another API process)."""


# ---- files --------------------------------------------------------------------------------
async def upload(request: Request, state: ServerState) -> Response:
    try:
        form = await request.form(max_files=1, max_fields=4)
    except Exception:  # noqa: BLE001 - a malformed multipart body (the parser's own errors)
        return error_response("The body must be multipart/form-data with `file` and "
                              "`purpose`.", 400)
    try:
        upload_file, purpose = form.get("file"), form.get("purpose")
        if purpose != "batch":
            return error_response("purpose must be 'batch' (the only files this server "
                                  "takes).", 400, "purpose")
        if upload_file is None or isinstance(upload_file, str):
            return error_response("A `file` part is required.", 400, "file")
        store = _store(state)
        record, path = store.new_file(upload_file.filename or "", purpose)
        await asyncio.to_thread(_copy, upload_file.file, path)
        return JSONResponse(store.save_file(record))
    finally:
        await form.close()


def _copy(source, path: str) -> None:
    with open(path, "wb") as out:
        while chunk := source.read(1 << 20):
            out.write(chunk)


def file_route(kind: str):
    """The handler of `GET /v1/files` ("list") or of one file ("get", "delete",
    "content"; the path parameter declared, for /openapi.json)."""
    async def listing(request: Request) -> Response:
        return JSONResponse({"object": "list", "data": _store(request.app.state.server).files(),
                             "has_more": False})

    async def one(request: Request, file_id: str) -> Response:
        store = _store(request.app.state.server)
        try:
            if kind == "get":
                return JSONResponse(store.file(file_id))
            if kind == "delete":
                return JSONResponse(store.delete_file(file_id))
            store.file(file_id)
            return FileResponse(store.file_path(file_id), media_type="application/jsonl")
        except StoreError as exc:
            return _error(exc)
    return listing if kind == "list" else one


# ---- batches ------------------------------------------------------------------------------
async def create(body: dict, state: ServerState) -> Response:
    store = _store(state)
    endpoint, window = body.get("endpoint"), body.get("completion_window", "24h")
    metadata = body.get("metadata")
    served = served_urls(state.pooler is not None)
    if endpoint not in served:
        return error_response(f"endpoint must be one of {', '.join(served)} (what this model "
                              "serves).", 400, "endpoint")
    if window != "24h":
        return error_response("completion_window must be '24h'.", 400, "completion_window")
    if metadata is not None and (not isinstance(metadata, dict) or len(metadata) > 16 or not all(
            isinstance(k, str) and isinstance(v, str) and len(k) <= 64 and len(v) <= 512
            for k, v in metadata.items())):
        return error_response("metadata takes at most 16 string pairs (keys up to 64, "
                              "values up to 512 characters).", 400, "metadata")
    try:
        source = store.file(str(body.get("input_file_id", "")))
    except StoreError as exc:
        return error_response(exc.message, exc.status, "input_file_id")
    if source["purpose"] != "batch":
        return error_response("The input file's purpose is not 'batch'.", 400, "input_file_id")
    record = store.new_batch(source["id"], endpoint, window, metadata)
    _RUNNING[record["id"]] = asyncio.create_task(_run(record, state, store))
    return JSONResponse(record)


def batch_route(kind: str):
    """The handler of `GET /v1/batches` ("list") or of one batch ("get", "cancel")."""
    async def listing(request: Request) -> Response:
        return JSONResponse(_page(_store(request.app.state.server).batches(),
                                  request.query_params))

    async def one(request: Request, batch_id: str) -> Response:
        store = _store(request.app.state.server)
        try:
            record = store.batch(batch_id)
            if kind == "cancel" and record["status"] in ("validating", "in_progress"):
                record.update(status="cancelling", cancelling_at=int(time.time()))
                store.save_batch(record)
                if record["id"] in _RUNNING:  # (here: stopped now; elsewhere: between lines)
                    _RUNNING[record["id"]].cancel()
            return JSONResponse(record)
        except StoreError as exc:
            return _error(exc)
    return listing if kind == "list" else one


def _page(records: list[dict], query: Any) -> dict:
    """OpenAI's list page: newest first, `limit` (1-100, default 20) after `after`."""
    try:
        limit = min(max(int(query.get("limit", 20)), 1), 100)
    except ValueError:
        limit = 20
    after = query.get("after")
    if after:
        ids = [r["id"] for r in records]
        records = records[ids.index(after) + 1:] if after in ids else []
    page = records[:limit]
    return {"object": "list", "data": page, "first_id": page[0]["id"] if page else None,
            "last_id": page[-1]["id"] if page else None, "has_more": len(records) > limit}


async def _run(record: dict, state: ServerState, store: BatchStore) -> None:
    """Runs one batch to its end, keeping its record up to date."""
    counts = record["request_counts"]
    outputs: dict[str, tuple[dict, Any]] = {}

    def output(kind: str):  # (the output and error files, made when first written to)
        if kind not in outputs:
            file_record, path = store.new_file(f"{record['id']}_{kind}.jsonl", f"batch_{kind}")
            outputs[kind] = (file_record, open(path, "w", encoding="utf-8"))  # noqa: SIM115
        return outputs[kind][1]

    try:
        path = store.file_path(record["input_file_id"])
        lines = await asyncio.to_thread(_read_lines, path)
        if len(lines) > MAX_LINES:
            raise ValueError(f"The input file has {len(lines)} request lines; at most "
                             f"{MAX_LINES}.")
        record.update(status="in_progress", in_progress_at=int(time.time()))
        counts["total"] = len(lines)
        store.save_batch(record)
        priority = BATCH_PRIORITY if state.config.engine.scheduling_policy == "priority" \
            else None
        saved = time.monotonic()
        async for _, out in answer_all(lines, state, CONCURRENCY, priority,
                                       endpoint=record["endpoint"]):
            ok = out["response"] is not None and out["response"]["status_code"] == 200
            counts["completed" if ok else "failed"] += 1
            output("output" if ok else "error").write(_json(out) + "\n")
            if time.monotonic() - saved > 0.5:  # (progress, and a cancel from elsewhere)
                saved = time.monotonic()
                if store.batch(record["id"])["status"] == "cancelling":
                    raise _Cancelled
                store.save_batch(record)
        record.update(status="finalizing", finalizing_at=int(time.time()))
        store.save_batch(record)
        _close(outputs, store, record)
        record.update(status="completed", completed_at=int(time.time()))
    except (asyncio.CancelledError, _Cancelled):
        _close(outputs, store, record)
        record.update(status="cancelled", cancelled_at=int(time.time()),
                      cancelling_at=record["cancelling_at"] or int(time.time()))
    except (ValueError, OSError) as exc:
        _close(outputs, store, record)
        record.update(status="failed", failed_at=int(time.time()), errors={
            "object": "list", "data": [{"code": "invalid_file", "message": str(exc)[:500],
                                        "param": "input_file_id", "line": None}]})
    except Exception as exc:  # noqa: BLE001 - the batch fails, the server goes on
        logger.exception("batch %s failed", record["id"])
        _close(outputs, store, record)
        record.update(status="failed", failed_at=int(time.time()), errors={
            "object": "list", "data": [{"code": "server_error", "message": type(exc).__name__,
                                        "param": None, "line": None}]})
    finally:
        store.save_batch(record)
        _RUNNING.pop(record["id"], None)


def _read_lines(path: str) -> list[bytes]:
    with open(path, "rb") as f:
        return [raw for raw in f if raw.strip()]


def _json(value: dict) -> str:
    return json.dumps(value, ensure_ascii=False)


def _close(outputs: dict, store: BatchStore, record: dict) -> None:
    for kind, (file_record, handle) in outputs.items():
        if not handle.closed:
            handle.close()
            store.save_file(file_record)
            record[f"{kind}_file_id"] = file_record["id"]


def cancel_all() -> None:
    """Server shutdown: this process's batches stop (their records say cancelled)."""
    for task in list(_RUNNING.values()):
        task.cancel()


def add_routes(app: Any, guarded: list) -> None:
    """The Files and Batch routes on the service app (behind the API key, as inference)."""
    from tokenmill.entrypoints.api.json_body import BodyError
    from tokenmill.entrypoints.http.request_body import read_body

    async def upload_route(request: Request) -> Response:
        return await upload(request, request.app.state.server)

    async def create_route(request: Request) -> Response:
        try:
            body = await read_body(request)
        except BodyError as exc:
            return error_response(str(exc), 400)
        return await create(body, request.app.state.server)

    for path, route, method in (
            ("/v1/files", upload_route, "POST"), ("/v1/files", file_route("list"), "GET"),
            ("/v1/files/{file_id}", file_route("get"), "GET"),
            ("/v1/files/{file_id}", file_route("delete"), "DELETE"),
            ("/v1/files/{file_id}/content", file_route("content"), "GET"),
            ("/v1/batches", create_route, "POST"), ("/v1/batches", batch_route("list"), "GET"),
            ("/v1/batches/{batch_id}", batch_route("get"), "GET"),
            ("/v1/batches/{batch_id}/cancel", batch_route("cancel"), "POST")):
        app.add_api_route(path, route, methods=[method], dependencies=guarded)
