"""The Batch API's files and batch records on disk (`--batch-dir`), shared by every API
process of a server: `files/<id>` (the bytes) with `files/<id>.json` (OpenAI's file object),
`batches/<id>.json` (OpenAI's batch object). Ids are random (`file-`, `batch_` and 24 hex
digits) and checked before they become paths; every record is written beside its place and
renamed, so a reader never sees half of one."""

from __future__ import annotations

import json
import os
import re
import secrets
import time
from typing import Any

_FILE_ID = re.compile(r"file-[0-9a-f]{24}")
_BATCH_ID = re.compile(r"batch_[0-9a-f]{24}")
MAX_FILENAME = 255


class StoreError(ValueError):
    def __init__(self, message: str, status: int = 400) -> None:
        super().__init__(message)
        self.message, self.status = message, status


def _write_json(path: str, value: dict) -> None:
    partial = f"{path}.{secrets.token_hex(4)}.partial"
    with open(partial, "w", encoding="utf-8") as f:
        json.dump(value, f)
    os.replace(partial, path)


class BatchStore:
    def __init__(self, root: str) -> None:
        self.files_dir = os.path.join(root, "files")
        self.batches_dir = os.path.join(root, "batches")
        os.makedirs(self.files_dir, exist_ok=True)
        os.makedirs(self.batches_dir, exist_ok=True)

    # ---- files ------------------------------------------------------------------------
    def file_path(self, file_id: str) -> str:
        if not _FILE_ID.fullmatch(file_id or ""):
            raise StoreError(f"No such File object: {file_id[:64]!r}.", 404)
        return os.path.join(self.files_dir, file_id)

    def new_file(self, filename: str, purpose: str) -> tuple[dict, str]:
        """(its file object, not yet saved, the path to write its bytes to)."""
        file_id = f"file-{secrets.token_hex(12)}"
        record = {"id": file_id, "object": "file", "bytes": 0, "created_at": int(time.time()),
                  "filename": os.path.basename(filename or "")[:MAX_FILENAME] or "upload.jsonl",
                  "purpose": purpose, "status": "processed", "status_details": None}
        return record, self.file_path(file_id)

    def save_file(self, record: dict) -> dict:
        record["bytes"] = os.path.getsize(self.file_path(record["id"]))
        _write_json(self.file_path(record["id"]) + ".json", record)
        return record

    def file(self, file_id: str) -> dict:
        try:
            with open(self.file_path(file_id) + ".json", encoding="utf-8") as f:
                return json.load(f)
        except FileNotFoundError:
            raise StoreError(f"No such File object: {file_id}.", 404) from None

    def delete_file(self, file_id: str) -> dict:
        self.file(file_id)
        for path in (self.file_path(file_id), self.file_path(file_id) + ".json"):
            if os.path.exists(path):
                os.unlink(path)
        return {"id": file_id, "object": "file", "deleted": True}

    def files(self) -> list[dict]:
        found = []
        for name in os.listdir(self.files_dir):
            if name.endswith(".json") and _FILE_ID.fullmatch(name[:-5]):
                try:
                    found.append(self.file(name[:-5]))
                except StoreError:
                    continue  # (deleted meanwhile)
        return sorted(found, key=lambda r: (r["created_at"], r["id"]), reverse=True)

    # ---- batches ----------------------------------------------------------------------
    def _batch_path(self, batch_id: str) -> str:
        if not _BATCH_ID.fullmatch(batch_id or ""):
            raise StoreError(f"No such Batch object: {batch_id[:64]!r}.", 404)
        return os.path.join(self.batches_dir, f"{batch_id}.json")

    def new_batch(self, input_file_id: str, endpoint: str, window: str,
                  metadata: dict[str, Any] | None) -> dict:
        now = int(time.time())
        record = {"id": f"batch_{secrets.token_hex(12)}", "object": "batch",
                  "endpoint": endpoint, "errors": None, "input_file_id": input_file_id,
                  "completion_window": window, "status": "validating",
                  "output_file_id": None, "error_file_id": None, "created_at": now,
                  "in_progress_at": None, "expires_at": now + 24 * 3600,
                  "finalizing_at": None, "completed_at": None, "failed_at": None,
                  "expired_at": None, "cancelling_at": None, "cancelled_at": None,
                  "request_counts": {"total": 0, "completed": 0, "failed": 0},
                  "metadata": metadata}
        self.save_batch(record)
        return record

    def save_batch(self, record: dict) -> None:
        _write_json(self._batch_path(record["id"]), record)

    def batch(self, batch_id: str) -> dict:
        try:
            with open(self._batch_path(batch_id), encoding="utf-8") as f:
                return json.load(f)
        except FileNotFoundError:
            raise StoreError(f"No such Batch object: {batch_id}.", 404) from None

    def batches(self) -> list[dict]:
        found = []
        for name in os.listdir(self.batches_dir):
            if name.endswith(".json") and _BATCH_ID.fullmatch(name[:-5]):
                found.append(self.batch(name[:-5]))
        return sorted(found, key=lambda r: (r["created_at"], r["id"]), reverse=True)
