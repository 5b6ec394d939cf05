"""`tokenmill serve`: the supervisor process. It owns the health and metrics ports, the engine
core process and the API process(es), and the shutdown.

Start order follows the seed: the health port answers first (not ready while the model
loads), then the engine core starts, then the API and metrics ports open. One HTTP worker
runs the API in this process; PUSH_MODE_HTTP_WORKERS > 1 spawns that many API processes
sharing one listening socket, each with its own engine client.
SIGTERM/SIGINT: readiness goes false at once, in-flight requests finish (bounded by the
shutdown timeout), exit 0. If the engine core dies, in-flight requests fail at once and the
server exits with 1 (a supervisor such as systemd or Kubernetes restarts it); so does the
death of an API process."""

from __future__ import annotations

import asyncio
import logging
import multiprocessing
import os
import shutil
import signal
import socket
import tempfile

from tokenmill.config.generation import log_defaults, sampling_defaults
from tokenmill.config.server import ServerConfig, check_ports_free, choose_free_ports
from tokenmill.engine.async_engine import EngineDeadError
from tokenmill.engine.core_client import start_engine_core_process
from tokenmill.entrypoints.api.state import ApiSettings, ServerState, build_state
from tokenmill.entrypoints.api_worker import (
    drain,
    make_server,
    run_api_worker,
    run_event_loop,
    wait_started,
)
from tokenmill.entrypoints.http.dashboard import metrics_app
from tokenmill.entrypoints.http.server import create_health_app, create_service_app
from tokenmill.entrypoints.kserve import start_grpc_server
from tokenmill.loading.checkpoint import resolve_model_path
from tokenmill.logs import configure_logging
from tokenmill.metrics import Metrics, multiprocess_registry
from tokenmill.tokenizer import load_chat_template

logger = logging.getLogger(__name__)


class ServeProcess:
    def __init__(self, config: ServerConfig) -> None:
        self.config = config
        self.state: ServerState | None = None  # set once everything is up: readiness
        self.exit_code = 0
        self.stop = asyncio.Event()
        self.workers: list[multiprocessing.Process] = []
        self.metrics_dir: str | None = None

    async def run(self) -> int:
        config = self.config
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, self.stop.set)
        health = make_server(create_health_app(lambda: self.state), config.host,
                             config.health_port)
        servers, tasks = [health], [asyncio.create_task(health.serve())]
        # (off the loop: a hub name may mean a long download, and the health port answers
        # liveness meanwhile)
        try:  # (a hub that cannot be reached, a bad generation config or chat template fail
            # before the engine loads: the servers closed first, the cause alone is printed)
            model_path = await asyncio.to_thread(served_model_path, config.engine)
            defaults = sampling_defaults(model_path, config.engine.generation_config,
                                         config.engine.override_generation_config)
            chat_template = load_chat_template(config.chat_template)
        except BaseException:
            await self._close(servers, tasks)
            raise
        log_defaults(defaults)
        logger.info("loading %s (health port %d answers meanwhile)", model_path,
                    config.health_port)
        start = asyncio.ensure_future(self._start_engines(model_path))
        stop_wait = asyncio.create_task(self.stop.wait())
        done, _ = await asyncio.wait([start, stop_wait], return_when=asyncio.FIRST_COMPLETED)
        if start not in done:  # asked to stop while loading
            await self._close(servers, tasks)
            for process, _ in await start:
                process.kill()
            return 0
        stop_wait.cancel()
        try:
            engines = start.result()
        except BaseException:  # (the servers closed first: the cause alone reaches the user)
            await self._close(servers, tasks)
            raise
        processes = [process for process, _ in engines]
        state = grpc_server = None
        try:
            settings = ApiSettings(
                config=config, engine_address=engines[0][1],
                more_engine_addresses=tuple(address for _, address in engines[1:]),
                tokenizer_path=config.engine.tokenizer or model_path, model_path=model_path,
                sampling_defaults=defaults, chat_template_text=chat_template)
            registry, metrics = self._metrics()
            state = await build_state(settings, metrics)
            if config.use_warmup:
                await self._warmup(state)
            if config.http_workers == 1:
                service = make_server(create_service_app(settings, state), config.host,
                                      config.port)
                servers.append(service)
                tasks.append(asyncio.create_task(service.serve()))
            else:
                await self._start_workers(settings)
            metrics_server = make_server(metrics_app(registry), config.host,
                                         config.metrics_port)
            servers.append(metrics_server)
            tasks.append(asyncio.create_task(metrics_server.serve()))
            # gRPC lives here, on this process's engine client, whatever the HTTP workers.
            grpc_server = await start_grpc_server(lambda: self.state, config.host,
                                                  config.grpc_port, config.api_key,
                                                  config.max_request_body_bytes)
            await wait_started(servers, tasks)
            self.state = state
            logger.info("tokenmill serving %s on %s:%d (%d HTTP worker(s)); ports: %s",
                        config.model_names[0], config.host, config.port,
                        config.http_workers, _ports_line(config))
            watchdog = asyncio.create_task(self._watch(processes, state))
            await self.stop.wait()
            watchdog.cancel()
            if self.exit_code == 0:
                logger.info("shutting down: readiness is false, new requests get 503")
            await self._drain(state)
        finally:
            if grpc_server is not None:
                await grpc_server.stop(grace=2)
            await self._close(servers, tasks)
            self._stop_workers(signal.SIGKILL)
            if state is not None:
                await state.engine.shutdown(stop_core=True)
            for process in processes:
                process.join(5)
                if process.is_alive():
                    process.kill()
                    process.join(5)
            if self.metrics_dir:
                shutil.rmtree(self.metrics_dir, ignore_errors=True)
        return self.exit_code

    async def _start_engines(self, model_path: str) -> list:
        """Every data-parallel replica's engine-core process, started side by side:
        [(process, address)]. If one fails to start, the others are stopped."""
        loop = asyncio.get_running_loop()
        starts = [loop.run_in_executor(None, start_engine_core_process, self.config.engine,
                                       model_path)
                  for _ in range(self.config.engine.data_parallel_size)]
        results = await asyncio.gather(*starts, return_exceptions=True)
        failed = [r for r in results if isinstance(r, BaseException)]
        if failed:
            for r in results:
                if not isinstance(r, BaseException):
                    r[0].kill()
            raise failed[0]
        return [(process, address) for process, address, _ in results]

    def _metrics(self):
        config = self.config
        name, max_seqs = config.model_names[0], config.engine.max_num_seqs
        if config.http_workers == 1:
            metrics = Metrics(name, max_seqs)
            return metrics.registry, metrics
        # Workers write request families to files here; this process adds engine gauges.
        path = self.metrics_dir = tempfile.mkdtemp(prefix="tokenmill-metrics-")
        registry = multiprocess_registry(path)
        return registry, Metrics(name, max_seqs, registry=registry, request_metrics=False)

    async def _start_workers(self, settings: ApiSettings) -> None:
        config = self.config
        sock = socket.socket(socket.AF_INET6 if ":" in config.host else socket.AF_INET)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((config.host, config.port))
        sock.listen(2048)
        ctx = multiprocessing.get_context("spawn")
        pipes = []
        for i in range(config.http_workers):
            parent, child = ctx.Pipe(duplex=False)
            worker = ctx.Process(target=run_api_worker, name=f"tokenmill-api-{i}",
                                 args=(settings, sock, child, config.shutdown_timeout))
            worker.start()
            child.close()
            self.workers.append(worker)
            pipes.append(parent)
        loop = asyncio.get_running_loop()
        for worker, pipe in zip(self.workers, pipes):
            ok = await loop.run_in_executor(None, pipe.poll, 300)
            if not ok or not worker.is_alive():
                raise RuntimeError(f"HTTP worker {worker.name} failed to start")
            pipe.recv()
        sock.close()  # the workers hold it now; no connection may wait on ours

    def _stop_workers(self, sig: int) -> None:
        for worker in self.workers:
            if worker.is_alive():
                os.kill(worker.pid, sig)

    async def _warmup(self, state: ServerState) -> None:
        from tokenmill.outputs import OutputKind
        from tokenmill.pooling_params import PoolingParams
        from tokenmill.sampling_params import SamplingParams

        params = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
        pooler = state.pooler  # (a pooling model warms up pooling a prompt)
        pooling = PoolingParams(task=pooler.task) if pooler is not None else None
        async for _ in state.engine.generate([1] * 8, params, request_id="warmup",
                                             output_kind=OutputKind.FINAL_ONLY,
                                             pooling_params=pooling):
            pass

    async def _watch(self, processes, state: ServerState) -> None:
        """Engine death (any replica's): fail in-flight requests now (here and in the
        workers), exit 1. An API process that died: exit 1 too."""
        while True:
            await asyncio.sleep(0.5)
            await state.engine.check_health()
            dead = [p for p in processes if not p.is_alive()]
            if dead or state.engine.dead is not None:
                logger.error("engine core died (exit code %s)",
                             dead[0].exitcode if dead else None)
                state.engine.fail_all(EngineDeadError("The engine core died."))
                self._stop_workers(signal.SIGUSR1)
                break
            gone = [w for w in self.workers if not w.is_alive()]
            if gone:
                logger.error("HTTP worker %s exited (code %s)", gone[0].name, gone[0].exitcode)
                break
        self.exit_code = 1
        self.stop.set()

    async def _drain(self, state: ServerState) -> None:
        """Workers drain their own HTTP requests; this process drains its own (gRPC, and
        HTTP when it serves the API itself)."""
        state.draining = True
        self._stop_workers(signal.SIGTERM)
        await drain(state, self.config.shutdown_timeout)
        loop = asyncio.get_running_loop()
        for worker in self.workers:
            await loop.run_in_executor(None, worker.join, self.config.shutdown_timeout + 10)

    async def _close(self, servers, tasks) -> None:
        for server in servers:
            server.should_exit = True
        await asyncio.gather(*tasks, return_exceptions=True)


def _ports_line(config: ServerConfig) -> str:
    """Every port this server listens on, named: the start-up line's list."""
    engine = config.engine
    ports = [f"API {config.port}", f"gRPC {config.grpc_port}", f"health {config.health_port}",
             f"metrics {config.metrics_port}"]
    if engine.world_size > 1 and (engine.nnodes > 1 or
                                  engine.distributed_executor_backend == "ray"):
        ports.append(f"rendezvous {engine.master_port}")
    return ", ".join(ports)


def served_model_path(engine) -> str:
    """The model to load: a path, or a hub name fetched (at --revision, into --download-dir;
    of a pre-sharded checkpoint, this node's share)."""
    node = (engine.node_rank, engine.nnodes) if engine.nnodes > 1 else None
    return resolve_model_path(engine.model, node, engine.revision, engine.download_dir)


def run_server(config: ServerConfig) -> int:
    configure_logging(config.engine.log_format, config.engine.log_level)
    for flag, why in config.ignored_flags:
        logger.info("%s: accepted, no effect here (%s)", flag, why)
    if config.engine.node_rank > 0:  # ranks only: node 0 serves every port
        from tokenmill.executor.multiproc import serve_other_node
        return serve_other_node(config.engine, served_model_path(config.engine))
    check_ports_free(config)
    choose_free_ports(config)
    code = run_event_loop(ServeProcess(config).run())
    logger.info("tokenmill stopped (exit code %d)", code)
    return code
