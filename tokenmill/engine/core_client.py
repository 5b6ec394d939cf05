"""Clients of the engine core: in-process (runs steps in the caller's thread) and asyncio over
ZMQ to an engine-core process. Both offer add/abort/finish/get_output."""

from __future__ import annotations

import multiprocessing
import tempfile
import uuid
from multiprocessing.process import BaseProcess

import msgspec
import zmq
import zmq.asyncio

from tokenmill.config.engine import EngineConfig
from tokenmill.engine.engine_core import EngineCore
from tokenmill.engine.engine_core_proc import INFO, OUTPUTS, heartbeat_address, run_engine_core
from tokenmill.engine.liveness import EngineHeartbeat
from tokenmill.engine.protocol import (
    ControlRequest,
    EngineCoreInfo,
    EngineCoreOutput,
    EngineCoreOutputs,
    EngineCoreRequest,
    LoRAUpdate,
    RequestType,
)


class InprocClient:
    def __init__(self, core: EngineCore) -> None:
        self.core = core

    def add_request(self, request: EngineCoreRequest) -> None:
        self.core.add_request(request)  # ValueError here: refused

    def abort_requests(self, request_ids: list[str]) -> None:
        if request_ids:
            self.core.abort_requests(request_ids)

    def finish_requests(self, request_ids: list[str]) -> None:
        if request_ids:
            self.core.finish_requests(request_ids)

    def get_output(self) -> list[EngineCoreOutput]:
        return self.core.step()

    def has_unfinished_requests(self) -> bool:
        return self.core.has_unfinished_requests()


def start_engine_core_process(config: EngineConfig, model_path: str,
                              timeout_s: float = 600.0) -> tuple[BaseProcess, str, EngineCoreInfo]:
    """Spawn the engine-core process on a fresh unix socket; wait until its model is loaded.

    The socket lives in a private temporary directory, so two servers never collide."""
    address = f"ipc://{tempfile.mkdtemp(prefix='tokenmill-')}/engine.sock"
    ctx = multiprocessing.get_context("spawn")
    parent, child = ctx.Pipe(duplex=False)
    process = ctx.Process(target=run_engine_core, args=(config, model_path, address, child),
                          name="tokenmill-engine-core", daemon=True)
    process.start()
    child.close()
    if not parent.poll(timeout_s):
        process.kill()
        raise RuntimeError(f"The engine core did not start within {timeout_s:.0f} s.")
    try:
        status, payload = parent.recv()
    except EOFError:
        status, payload = "error", f"the engine core exited with code {process.exitcode}"
    if status != "ready":
        process.join(5)
        raise RuntimeError(f"The engine core failed to start: {payload}")
    return process, address, msgspec.msgpack.decode(payload, type=EngineCoreInfo)


class AsyncMPClient:
    """asyncio client of an engine-core process (one per API process). Outputs and
    heartbeats come tagged with the replica they are from (always 0 here; several replicas:
    engine/dp_client.py)."""

    num_replicas = 1

    def __init__(self, address: str) -> None:
        self.context = zmq.asyncio.Context()
        self.socket = self.context.socket(zmq.DEALER)
        self.socket.setsockopt(zmq.LINGER, 0)
        self.socket.setsockopt(zmq.ROUTING_ID, f"client-{uuid.uuid4().hex}".encode())
        self.socket.connect(address)
        self.heartbeats = self.context.socket(zmq.SUB)
        self.heartbeats.setsockopt(zmq.LINGER, 0)
        self.heartbeats.setsockopt(zmq.SUBSCRIBE, b"")
        self.heartbeats.setsockopt(zmq.CONFLATE, 1)  # only the latest matters
        self.heartbeats.connect(heartbeat_address(address))
        self.encoder = msgspec.msgpack.Encoder()
        self.decode_outputs = msgspec.msgpack.Decoder(EngineCoreOutputs).decode
        self.decode_heartbeat = msgspec.msgpack.Decoder(EngineHeartbeat).decode
        self.info: EngineCoreInfo | None = None

    async def connect(self) -> EngineCoreInfo:
        await self._send(RequestType.HELLO, b"")
        while self.info is None:
            kind, payload = await self.socket.recv_multipart()
            if kind == INFO:
                self.info = msgspec.msgpack.decode(payload, type=EngineCoreInfo)
        return self.info

    async def _send(self, kind: RequestType, payload: bytes) -> None:
        await self.socket.send_multipart([str(int(kind)).encode(), payload])

    async def add_request(self, request: EngineCoreRequest) -> None:
        await self._send(RequestType.ADD, self.encoder.encode(request))

    async def abort_requests(self, request_ids: list[str]) -> None:
        if request_ids:
            await self._send(RequestType.ABORT, self.encoder.encode(request_ids))

    async def finish_requests(self, request_ids: list[str]) -> None:
        if request_ids:
            await self._send(RequestType.FINISH, self.encoder.encode(request_ids))

    async def update_lora(self, update: LoRAUpdate, replica: int = 0) -> None:
        await self._send(RequestType.LORA, self.encoder.encode(update))

    async def control(self, request: ControlRequest, replica: int = 0) -> None:
        await self._send(RequestType.CONTROL, self.encoder.encode(request))

    async def get_output(self) -> tuple[int, EngineCoreOutputs]:
        while True:
            kind, payload = await self.socket.recv_multipart()
            if kind == OUTPUTS:
                return 0, self.decode_outputs(payload)

    async def get_heartbeat(self) -> tuple[int, EngineHeartbeat]:
        return 0, self.decode_heartbeat(await self.heartbeats.recv())

    async def shutdown_core(self) -> None:
        await self._send(RequestType.SHUTDOWN, b"")

    def close(self) -> None:
        self.heartbeats.close(0)
        self.socket.close(0)
        self.context.term()
