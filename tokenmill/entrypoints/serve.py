"""`tokenmill serve`: engine-core process + service, health and metrics ports in one API process.

Start order follows the seed: the health port answers first (not ready while the model
loads), then the engine core starts, then the service and metrics ports open. SIGTERM/SIGINT:
readiness goes false at once, in-flight requests finish (bounded by the drain timeout), exit 0.
If the engine-core process dies, in-flight requests fail at once and the server exits with 1."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import signal
import time

import uvicorn
from prometheus_client import make_asgi_app

from tokenmill.config import ServerConfig, check_ports_free
from tokenmill.engine.async_engine import EngineDeadError
from tokenmill.engine.core_client import start_engine_core_process
from tokenmill.entrypoints.http.server import build_state, create_health_app, create_service_app
from tokenmill.entrypoints.http.state import ApiSettings, ServerState
from tokenmill.loader import resolve_model_path
from tokenmill.metrics import Metrics

logger = logging.getLogger(__name__)


class _Server(uvicorn.Server):
    """A uvicorn server that leaves signal handling to us (several share one loop)."""

    @contextlib.contextmanager
    def capture_signals(self):
        yield

    def install_signal_handlers(self) -> None:  # uvicorn < 0.29
        pass


def _uvicorn(app, host: str, port: int) -> _Server:
    return _Server(uvicorn.Config(app, host=host, port=port, log_level="warning",
                                  access_log=False, timeout_graceful_shutdown=5))


class ServeProcess:
    def __init__(self, config: ServerConfig) -> None:
        self.config = config
        self.state: ServerState | None = None
        self.exit_code = 0
        self.stop = asyncio.Event()

    async def run(self) -> int:
        config = self.config
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, self.stop.set)
        health = _uvicorn(create_health_app(lambda: self.state), config.host, config.health_port)
        servers = [health]
        tasks = [asyncio.create_task(health.serve())]
        model_path = resolve_model_path(config.engine.model)
        start = loop.run_in_executor(None, start_engine_core_process, config.engine, model_path)
        done, _ = await asyncio.wait([start, asyncio.create_task(self.stop.wait())],
                                     return_when=asyncio.FIRST_COMPLETED)
        if start not in done:  # asked to stop while loading
            await self._shutdown(servers, tasks)
            return 0
        process, address, info = start.result()
        try:
            metrics = Metrics(config.model_names[0], config.engine.max_num_seqs)
            settings = ApiSettings(
                engine_address=address, tokenizer_path=config.engine.tokenizer or model_path,
                model_path=model_path, served_model_names=config.model_names,
                max_dec_len=config.max_dec_len, max_seq_len=config.max_seq_len,
                max_waiting=config.max_cached_task_num,
                disable_streaming=config.disable_streaming, api_key=config.api_key,
                dead_after_s=config.check_health_interval)
            state = await build_state(settings, metrics)
            service = _uvicorn(create_service_app(settings, state), config.host, config.port)
            metrics_server = _uvicorn(make_asgi_app(metrics.registry), config.host,
                                      config.metrics_port)
            servers += [service, metrics_server]
            tasks += [asyncio.create_task(service.serve()),
                      asyncio.create_task(metrics_server.serve())]
            while not (service.started and metrics_server.started):
                if any(t.done() for t in tasks):
                    raise RuntimeError("an HTTP server failed to start")
                await asyncio.sleep(0.05)
            if config.use_warmup:
                await self._warmup(state)
            self.state = state
            logger.info("tokenmill serving %s on %s:%d (health %d, metrics %d)",
                        config.model_names[0], config.host, config.port,
                        config.health_port, config.metrics_port)
            watchdog = asyncio.create_task(self._watch_engine(process))
            await self.stop.wait()
            watchdog.cancel()
            await self._drain(state)
        finally:
            await self._shutdown(servers, tasks)
            if self.state is not None:
                await self.state.engine.shutdown(stop_core=True)
            process.join(5)
            if process.is_alive():
                process.kill()
                process.join(5)
        return self.exit_code

    async def _warmup(self, state: ServerState) -> None:
        from tokenmill.sampling_params import SamplingParams

        params = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
        async for _ in state.engine.generate([1] * 8, params, request_id="warmup"):
            pass

    async def _watch_engine(self, process) -> None:
        """Engine death: fail in-flight requests now, then stop with exit code 1."""
        while True:
            await asyncio.sleep(0.5)
            engine = self.state.engine
            await engine.check_health()
            if not process.is_alive() or engine.dead is not None:
                logger.error("engine core died (exit code %s)", process.exitcode)
                engine.fail_all(EngineDeadError("The engine core died."))
                self.exit_code = 1
                self.stop.set()
                return

    async def _drain(self, state: ServerState) -> None:
        state.draining = True  # readiness false, new requests refused with 503
        deadline = time.monotonic() + self.config.shutdown_timeout
        while state.engine.num_in_flight() and time.monotonic() < deadline:
            await asyncio.sleep(0.05)

    async def _shutdown(self, servers, tasks) -> None:
        for server in servers:
            server.should_exit = True
        await asyncio.gather(*tasks, return_exceptions=True)


def run_server(config: ServerConfig) -> int:
    logging.basicConfig(level=logging.INFO,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    check_ports_free(config)
    return asyncio.run(ServeProcess(config).run())
