"""A benchmark's result file with how it was made: the command, date, machine and CPU count
beside the script's own fields."""

from __future__ import annotations

import datetime
import json
import os
import platform
import sys


def save(path: str, **fields) -> None:
    script = os.path.relpath(sys.argv[0], os.path.join(os.path.dirname(__file__), ".."))
    with open(path, "w") as f:
        json.dump({"command": " ".join(["python", script, *sys.argv[1:]]),
                   "date": datetime.date.today().isoformat(),
                   "machine": platform.processor() or platform.machine(),
                   "cpus": os.cpu_count(), **fields}, f, indent=1)
