"""One API process: the service app on uvicorn over its own engine client, draining on
SIGTERM. The supervisor (`serve.py`) runs it in-process for one HTTP worker, or spawns
PUSH_MODE_HTTP_WORKERS of these processes sharing one listening socket.

Signals from the supervisor: SIGTERM = drain (refuse new requests with 503, let in-flight ones
finish, bounded by the shutdown timeout) and exit; SIGUSR1 = the engine core died: fail every
in-flight request now and exit. SIGINT is left to the supervisor, which owns the shutdown."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import signal
import socket
import time
from multiprocessing.connection import Connection

import uvicorn

from tokenmill.engine.async_engine import EngineDeadError, ShutdownError
from tokenmill.entrypoints.api.state import ApiSettings, ServerState, build_state
from tokenmill.entrypoints.http.connection import BoundedHttpProtocol
from tokenmill.entrypoints.http.server import create_service_app
from tokenmill.logs import configure_logging

logger = logging.getLogger(__name__)


class QuietServer(uvicorn.Server):
    """A uvicorn server that leaves signal handling to us (several share one loop)."""

    @contextlib.contextmanager
    def capture_signals(self):
        yield

    def install_signal_handlers(self) -> None:  # uvicorn < 0.29
        pass


# Idle keep-alive connections are closed after this long. Longer than the pool expiry of
# common clients (httpx: 5 s): were it equal, the server would close a connection just as a
# client reuses it (its timer starts when the response is sent, the client's when it has
# been read), and that request would fail with a read error.
KEEP_ALIVE_S = 30


def make_server(app, host: str = "127.0.0.1", port: int = 0) -> QuietServer:
    """Every listening port's server: the request head bounded (http/connection.py), idle
    keep-alive connections closed after KEEP_ALIVE_S."""
    # (log_config None: uvicorn's own lines go through the process's logging, logs.py)
    return QuietServer(uvicorn.Config(app, host=host, port=port, log_level="warning",
                                      log_config=None, access_log=False,
                                      http=BoundedHttpProtocol,
                                      timeout_graceful_shutdown=5,
                                      timeout_keep_alive=KEEP_ALIVE_S))


async def wait_started(servers: list[QuietServer], tasks: list[asyncio.Task]) -> None:
    while not all(s.started for s in servers):
        if any(t.done() for t in tasks):
            raise RuntimeError("an HTTP server failed to start (is its port free?)")
        await asyncio.sleep(0.05)


async def drain(state: ServerState, timeout_s: float) -> None:
    """Readiness goes false and new requests get 503; wait for in-flight ones (bounded).
    Those still running at the deadline end with an error response (503 / a stream's error
    event), and their handlers get a moment to send it before the servers close."""
    state.draining = True
    started = time.monotonic()
    logger.info("draining: %d in-flight request(s), waiting up to %g s",
                state.engine.num_in_flight(), timeout_s)
    await _until_idle(state, started + timeout_s)
    if state.engine.num_in_flight():
        logger.warning("shutdown timeout: ending %d in-flight request(s)",
                       state.engine.num_in_flight())
        state.engine.end_all(ShutdownError("The server shut down before the request "
                                           "finished."))
        await _until_idle(state, time.monotonic() + 2.0)
    else:
        logger.info("drained in %.1f s", time.monotonic() - started)


async def _until_idle(state: ServerState, deadline: float) -> None:
    while state.engine.num_in_flight() and time.monotonic() < deadline:
        await asyncio.sleep(0.02)


def run_event_loop(main):
    """Runs the coroutine `main` on uvloop (libuv's event loop, as vLLM's API server), where
    it is installed, else on asyncio's own. With uvicorn's httptools parser (also chosen
    where installed) a streamed token costs the API process ~25 % less time than on
    asyncio's loop and h11 (bench/api_chunk_cost.py)."""
    try:
        import uvloop
    except ImportError:  # (not built for Windows)
        return asyncio.run(main)
    return uvloop.run(main)


def run_api_worker(settings: ApiSettings, sock: socket.socket, ready: Connection,
                   shutdown_timeout: float) -> None:
    """Process entry point of one HTTP worker."""
    configure_logging(settings.config.engine.log_format, settings.config.engine.log_level)
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    run_event_loop(_worker(settings, sock, ready, shutdown_timeout))


async def _worker(settings: ApiSettings, sock: socket.socket, ready: Connection,
                  shutdown_timeout: float) -> None:
    from tokenmill.metrics import Metrics

    loop = asyncio.get_running_loop()
    stop = asyncio.Event()
    engine_died = False
    supervisor = os.getppid()
    # Request families go to prometheus_client's multiprocess files (the supervisor set
    # PROMETHEUS_MULTIPROC_DIR); engine gauges are the supervisor's.
    metrics = Metrics(settings.config.model_names[0], 0, engine_gauges=False)
    state = await build_state(settings, metrics)

    def on_engine_death() -> None:
        nonlocal engine_died
        engine_died = True
        state.engine.fail_all(EngineDeadError("The engine core died."))
        stop.set()

    loop.add_signal_handler(signal.SIGTERM, stop.set)
    loop.add_signal_handler(signal.SIGUSR1, on_engine_death)
    server = make_server(create_service_app(settings, state))
    task = asyncio.create_task(server.serve(sockets=[sock]))
    await wait_started([server], [task])
    ready.send("ready")
    ready.close()
    while not stop.is_set():  # never outlive the supervisor
        with contextlib.suppress(asyncio.TimeoutError):
            await asyncio.wait_for(stop.wait(), 0.5)
        if os.getppid() != supervisor:
            logger.error("supervisor gone; stopping")
            break
        await state.engine.check_health()
    if not engine_died:
        await drain(state, shutdown_timeout)
    server.should_exit = True
    await asyncio.gather(task, return_exceptions=True)
    await state.engine.shutdown()
