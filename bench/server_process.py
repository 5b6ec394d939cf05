"""A benchmarked engine's server as a process: started in a session of its own with its output
in a log file, ready when `/v1/models` answers, stopped with its whole process group."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import time
import urllib.request


def start_server(cmd: list[str], log_path: str, env: dict) -> subprocess.Popen:
    with open(log_path, "w") as log:
        return subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env,
                                start_new_session=True)


def wait_ready(proc: subprocess.Popen, base: str, timeout: float) -> str | None:
    """The first served model's id once `base`/v1/models answers; None if the process exits
    or `timeout` seconds pass first."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline and proc.poll() is None:
        try:
            with urllib.request.urlopen(base + "/v1/models", timeout=5) as resp:
                return json.loads(resp.read())["data"][0]["id"]
        except OSError:
            time.sleep(1)
    return None


def stop_server(proc: subprocess.Popen) -> None:
    """SIGTERM to the server's process group, SIGKILL after 60 s."""
    os.killpg(proc.pid, signal.SIGTERM)
    try:
        proc.wait(60)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
