"""The engine core as its own process: a busy loop behind one ZMQ ROUTER socket.

API processes connect DEALER sockets (one per HTTP worker); every message is msgspec-encoded,
never pickled. The core remembers which client owns each request and sends each client only
its outputs, plus its stats while idle. A thread of its own publishes an `EngineHeartbeat`
every HEARTBEAT_S on a second socket (PUB), however long a step runs, so clients can tell a
busy engine from a dead or stalled one (`engine/liveness.py`)."""

from __future__ import annotations

import logging
import os
import signal
import threading
import time
from multiprocessing.connection import Connection

import msgspec
import zmq

from tokenmill.config.engine import EngineConfig
from tokenmill.core.request import FinishReason
from tokenmill.engine.engine_core import EngineCore
from tokenmill.engine.liveness import HEARTBEAT_S
from tokenmill.engine.protocol import (
    ControlRequest,
    EngineCoreInfo,
    EngineCoreOutput,
    EngineCoreOutputs,
    EngineCoreRequest,
    LoRAUpdate,
    RequestType,
)
from tokenmill.logs import configure_logging

logger = logging.getLogger(__name__)

OUTPUTS, INFO = b"O", b"I"  # first frame of core -> client messages


def heartbeat_address(address: str) -> str:
    """Where the heartbeats of the engine core at `address` are published."""
    if address.startswith("ipc://"):
        return address.rsplit("/", 1)[0] + "/heartbeat.sock"
    host, port = address.rsplit(":", 1)
    return f"{host}:{int(port) + 1}"


class EngineCoreProc:
    def __init__(self, core: EngineCore, address: str) -> None:
        self.core = core
        core.defer_lora_reads = True  # (an adapter's read never holds the other requests up)
        self.socket = zmq.Context.instance().socket(zmq.ROUTER)
        self.socket.setsockopt(zmq.LINGER, 0)
        self.socket.bind(address)
        self.encoder = msgspec.msgpack.Encoder()
        self.decode_request = msgspec.msgpack.Decoder(EngineCoreRequest).decode
        self.decode_ids = msgspec.msgpack.Decoder(list[str]).decode
        self.clients: set[bytes] = set()
        self.owner: dict[str, bytes] = {}  # request id -> client identity
        self.info = EngineCoreInfo(max_model_len=core.max_model_len,
                                   num_kv_blocks=core.kv_cache.num_blocks,
                                   block_size=core.config.block_size,
                                   vocab_size=core.hf_config.vocab_size,
                                   max_num_seqs=core.config.max_num_seqs,
                                   num_lookahead_tokens=core.scheduler.config
                                   .num_lookahead_tokens, loras=core.loras.served(),
                                   pooler=core.model_config.pooler,
                                   multimodal=core.model_config.multimodal)
        self._last_sent = 0.0
        self._beating = threading.Event()
        self._beater = threading.Thread(target=self._beat, args=(heartbeat_address(address),),
                                        name="tokenmill-heartbeat", daemon=True)
        self._beater.start()

    def _beat(self, address: str) -> None:
        """The heartbeat thread: its own PUB socket (ZMQ sockets are not shared across
        threads); it only reads the step clock's current tuple."""
        socket = zmq.Context.instance().socket(zmq.PUB)
        socket.setsockopt(zmq.LINGER, 0)
        socket.bind(address)
        encode = msgspec.msgpack.Encoder().encode
        while not self._beating.wait(HEARTBEAT_S):
            socket.send(encode(self.core.clock.heartbeat()))
        socket.close(0)

    def stop_heartbeat(self) -> None:
        self._beating.set()
        self._beater.join(2 * HEARTBEAT_S)

    def run(self) -> None:
        parent = os.getppid()
        while True:
            busy = self.core.has_unfinished_requests()
            timeout = 0 if busy else int(HEARTBEAT_S * 1000)
            while self.socket.poll(timeout):
                frames = self.socket.recv_multipart()
                try:
                    keep_going = self._handle(*frames)
                except (TypeError, ValueError, msgspec.DecodeError) as exc:
                    # Only typed msgpack is read (never pickle); anything else is dropped.
                    logger.warning("dropped a malformed message on the engine socket (%s)",
                                   type(exc).__name__)
                    continue
                if not keep_going:
                    return
                timeout = 0
            if self.core.has_unfinished_requests():
                self._send(self.core.step())
            elif time.monotonic() - self._last_sent >= HEARTBEAT_S:
                if os.getppid() != parent:  # the server is gone: never linger as an orphan
                    logger.error("parent process gone; engine core exiting")
                    return
                self._send([])

    def _handle(self, identity: bytes, kind: bytes, payload: bytes) -> bool:
        kind = RequestType(int(kind))
        if kind == RequestType.HELLO:
            self.clients.add(identity)
            self.socket.send_multipart([identity, INFO, self.encoder.encode(self.info)])
        elif kind == RequestType.ADD:
            request = self.decode_request(payload)
            try:
                self.core.add_request(request)
                self.owner[request.request_id] = identity
            except ValueError as exc:
                refused = EngineCoreOutput(request.request_id, [], int(FinishReason.ABORT),
                                           error=str(exc))
                self._send_to(identity, [refused])
        elif kind in (RequestType.ABORT, RequestType.FINISH):
            ids = self.decode_ids(payload)
            if kind == RequestType.ABORT:
                self.core.abort_requests(ids)
            else:
                self.core.finish_requests(ids)
            for request_id in ids:
                self.owner.pop(request_id, None)
        elif kind == RequestType.LORA:
            self._update_lora(identity, msgspec.msgpack.decode(payload, type=LoRAUpdate))
        elif kind == RequestType.CONTROL:
            self._control(identity, msgspec.msgpack.decode(payload, type=ControlRequest))
        elif kind == RequestType.SHUTDOWN:
            return False
        return True

    def _update_lora(self, identity: bytes, update: LoRAUpdate) -> None:
        """Loads or unloads an adapter; the answer (with the stats that list the adapters)
        to the asking client, the new list to the others."""
        error = None
        try:
            if update.path:
                self.core.load_lora(update.name, update.path, update.lora_id)
            elif self.core.unload_lora(update.name) is None:
                error = f"The LoRA adapter {update.name!r} cannot be found."
        except ValueError as exc:
            error = str(exc)
        self._send_to(identity, [EngineCoreOutput(update.request_id, [], int(FinishReason.STOP),
                                                  error=error)])
        self._send([])

    def _control(self, identity: bytes, request: ControlRequest) -> None:
        """Sleep, wake up or update the weights; the answer (error or not, with the stats
        that say whether it sleeps) to the asking client, the stats to the others."""
        from tokenmill.engine.control import control  # (torch: only when asked)

        error = None
        try:
            control(self.core, request.action, request.level, request.path, request.options)
        except (ValueError, KeyError, TypeError) as exc:
            error = str(exc) if isinstance(exc, ValueError) else "Malformed options."
        self._send_to(identity, [EngineCoreOutput(request.request_id, [],
                                                  int(FinishReason.STOP), error=error)])
        self._send([])

    def _send(self, outputs: list[EngineCoreOutput]) -> None:
        by_client: dict[bytes, list[EngineCoreOutput]] = {c: [] for c in self.clients}
        for out in outputs:
            identity = self.owner.get(out.request_id)
            if identity is None:
                continue
            by_client.setdefault(identity, []).append(out)
            if out.finish_reason is not None:
                del self.owner[out.request_id]
        for identity, outs in by_client.items():
            self._send_to(identity, outs)
        self._last_sent = time.monotonic()

    def _send_to(self, identity: bytes, outputs: list[EngineCoreOutput]) -> None:
        message = EngineCoreOutputs(outputs, self.core.stats(), time.time())
        self.socket.send_multipart([identity, OUTPUTS, self.encoder.encode(message)])


def run_engine_core(config: EngineConfig, model_path: str, address: str,
                    ready: Connection) -> None:
    """Process entry point: load the model, report readiness (or the error), then loop."""
    configure_logging(config.log_format, config.log_level)
    # Ctrl-C and `stop_server` reach the whole process group; the server that owns this
    # process drains first and then stops it with a SHUTDOWN message (or kills it).
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    try:
        proc = EngineCoreProc(EngineCore(config, model_path, exit_on_worker_death=True), address)
    except Exception as exc:  # noqa: BLE001 - any start-up failure is reported, then we exit
        if isinstance(exc, ValueError):  # (an expected refusal: its one line; debug: where)
            logger.error("engine core failed to start: %s", exc)
            logger.debug("where it failed", exc_info=True)
        else:
            logger.exception("engine core failed to start")
        ready.send(("error", f"{type(exc).__name__}: {exc}"))
        raise SystemExit(1) from None
    ready.send(("ready", msgspec.msgpack.encode(proc.info)))
    ready.close()
    try:
        proc.run()
    finally:
        proc.stop_heartbeat()
        proc.core.shutdown()
