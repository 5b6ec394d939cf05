"""How every tokenmill process logs (`--log-format`, `--log-level`): text lines
(`time level logger: message`) or one JSON object per line (`time`, `level`, `logger`,
`message`, and an access line's fields). The serve process, its API workers, engine cores and
tensor-parallel workers all configure their root logger here, so a JSON run is JSON
throughout."""

from __future__ import annotations

import json
import logging

ACCESS_FIELDS = ("request_id", "method", "route", "status", "prompt_tokens", "output_tokens",
                 "ttft_s", "total_s", "prompt", "output")


class JsonFormatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        line = {"time": self.formatTime(record, "%Y-%m-%dT%H:%M:%S") + f".{int(record.msecs):03d}",
                "level": record.levelname, "logger": record.name,
                "message": record.getMessage()}
        for name in ACCESS_FIELDS:
            if hasattr(record, name):
                line[name] = getattr(record, name)
        if record.exc_info:
            line["exception"] = self.formatException(record.exc_info)
        return json.dumps(line, ensure_ascii=False)


def configure_logging(log_format: str = "text", level: str = "info") -> None:
    """The process's root logger: text (`time level logger: message`) or JSON lines."""
    handler = logging.StreamHandler()
    handler.setFormatter(JsonFormatter() if log_format == "json" else logging.Formatter(
        "%(asctime)s %(levelname)s %(name)s: %(message)s"))
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(level.upper())


def exception_line(exc: BaseException, frames: int = 4, max_chars: int = 200) -> str:
    """An exception as one log line: its type, its message cut to `max_chars`, and where it
    was raised (the innermost `frames` frames), so that an error a client provoked costs the
    log one line, never a thousand-frame traceback (a request nested 900 deep once wrote
    330 KiB)."""
    import os
    import traceback

    where = " <- ".join(f"{os.path.basename(f.filename)}:{f.lineno} {f.name}"
                        for f in reversed(traceback.extract_tb(exc.__traceback__)[-frames:]))
    text = " ".join(str(exc).split())
    if len(text) > max_chars:
        text = text[:max_chars] + "..."
    return f"{type(exc).__name__}: {text} (at {where})"
