"""`start_server` / `stop_server`: the seed's scripts, tracking our own process group by PID.

start_server [MODEL] [serve flags]: refuse occupied ports with the seed's message, start
`tokenmill serve` in the background in its own session (logs in `log/server.log`, PID in
`log/server.pid`). stop_server [TIMEOUT]: SIGTERM the server process (it drains in-flight
requests, then stops its engine and workers), wait up to TIMEOUT seconds (default 300), then
SIGKILL whatever is left of its process group; no name-matching kills."""

from __future__ import annotations

import argparse
import contextlib
import os
import signal
import subprocess
import sys
import time

from tokenmill.config.server import build_server_config, check_ports_free

PID_FILE = "server.pid"


def _pid_path(log_dir: str) -> str:
    return os.path.join(log_dir, PID_FILE)


def start_server_main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    try:
        config = build_server_config(
            argv, prog="start_server",
            description="Start `tokenmill serve` in the background (its own process group; "
                        "logs in LOG_DIR/server.log, PID in LOG_DIR/server.pid) with the same "
                        "flags and environment variables. Stop it with stop_server.")
        check_ports_free(config)
    except (ValueError, OSError) as exc:
        sys.stderr.write(f"{exc}\n")
        return 1
    os.makedirs(config.log_dir, exist_ok=True)
    log_path = os.path.join(config.log_dir, "server.log")
    with open(log_path, "ab") as log:
        process = subprocess.Popen(
            [sys.executable, "-m", "tokenmill.entrypoints.cli", "serve", *argv],
            stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
            start_new_session=True)  # its own process group: stop_server signals all of it
    with open(_pid_path(config.log_dir), "w") as f:
        f.write(str(process.pid))
    if config.engine.node_rank > 0:
        ports = (f"node {config.engine.node_rank} of {config.engine.nnodes}: tensor-parallel "
                 "ranks only, node 0 serves the ports")
    else:
        ports = (f"service port {config.port}, health port {config.health_port}, metrics "
                 f"port {config.metrics_port}, gRPC port {config.grpc_port}")
    sys.stdout.write(f"tokenmill server starting (pid {process.pid}); logs: {log_path}; "
                     f"{ports}. Stop it with stop_server.\n")
    return 0


def _group_alive(pgid: int) -> bool:
    """Any live (non-zombie) process left in the group? Zombies wait for a reaper that a
    container's PID 1 may never run, so they must not keep us waiting."""
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[2]) == pgid and fields[0] != "Z":
            return True
    return False


def _stop_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="stop_server",
        description="Stop the server start_server started (PID in LOG_DIR/server.pid): SIGTERM "
                    "(it drains in-flight requests), then after TIMEOUT seconds SIGKILL "
                    "whatever is left of its process group.")
    parser.add_argument("timeout", nargs="?", type=float, default=300.0,
                        help="seconds to wait for the drain before killing (default 300)")
    return parser


def stop_server_main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    args = _stop_parser().parse_args(argv)  # --help and a bad TIMEOUT exit here (0 / 2)
    timeout = args.timeout
    try:
        log_dir = build_server_config([]).log_dir
    except ValueError as exc:
        sys.stderr.write(f"stop_server: {exc}\n")
        return 1
    path = _pid_path(log_dir)
    try:
        with open(path) as f:
            pid = int(f.read().strip())
    except (OSError, ValueError):
        sys.stdout.write("no tokenmill server is running (no log/server.pid).\n")
        return 0
    sys.stdout.write("cleaning process, please wait ...\n")
    if _group_alive(pid):
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGTERM)
        deadline = time.monotonic() + timeout
        while _group_alive(pid) and time.monotonic() < deadline:
            time.sleep(0.1)
        if _group_alive(pid):
            sys.stdout.write("forcibly kill all process ...\n")
            os.killpg(pid, signal.SIGKILL)
            deadline = time.monotonic() + 10
            while _group_alive(pid) and time.monotonic() < deadline:
                time.sleep(0.1)
    os.remove(path)
    sys.stdout.write("all process terminated.\n")
    return 0
