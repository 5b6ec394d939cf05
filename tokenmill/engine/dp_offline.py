"""Offline data parallel (`LLM(..., data_parallel_size=N)`): N engine-core processes behind
one synchronous client with `InprocClient`'s interface, so `LLMEngine` runs unchanged. Requests
are routed as the server routes them (`PrefixRouter`) and checked here first with the engine
core's own admission checks, so a refusal is still a ValueError at `add_request`."""

from __future__ import annotations

import time
import uuid

import msgspec
import zmq

from tokenmill.config.engine import EngineConfig
from tokenmill.engine.admission import check_request
from tokenmill.engine.core_client import start_engine_core_process
from tokenmill.engine.dp_client import PrefixRouter
from tokenmill.engine.engine_core_proc import INFO, OUTPUTS
from tokenmill.engine.protocol import (
    EngineCoreInfo,
    EngineCoreOutput,
    EngineCoreOutputs,
    EngineCoreRequest,
    RequestType,
)


class ReplicaClient:
    def __init__(self, config: EngineConfig, model_path: str) -> None:
        self.processes, self.sockets = [], []
        self.context = zmq.Context()
        self.encoder = msgspec.msgpack.Encoder()
        self.decode_outputs = msgspec.msgpack.Decoder(EngineCoreOutputs).decode
        try:
            for _ in range(config.data_parallel_size):
                process, address, info = start_engine_core_process(config, model_path)
                self.processes.append(process)
                self.sockets.append(self._connect(address))
        except BaseException:
            self.close()
            raise
        self.info: EngineCoreInfo = info
        self.router = PrefixRouter(len(self.sockets), info.block_size)
        self.poller = zmq.Poller()
        for sock in self.sockets:
            self.poller.register(sock, zmq.POLLIN)

    def _connect(self, address: str) -> zmq.Socket:
        sock = self.context.socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.ROUTING_ID, f"offline-{uuid.uuid4().hex}".encode())
        sock.connect(address)
        self._send(sock, RequestType.HELLO, b"")
        while sock.recv_multipart()[0] != INFO:
            pass
        return sock

    @staticmethod
    def _send(sock: zmq.Socket, kind: RequestType, payload: bytes) -> None:
        sock.send_multipart([str(int(kind)).encode(), payload])

    @property
    def max_model_len(self) -> int:
        return self.info.max_model_len

    def add_request(self, request: EngineCoreRequest) -> None:
        info = self.info
        check_request(request, info.max_model_len, info.vocab_size, info.num_kv_blocks,
                      info.block_size, info.num_lookahead_tokens, info.pooler,
                      info.multimodal)  # ValueError
        replica = self.router.assign(request.request_id, request.prompt_token_ids)
        self._send(self.sockets[replica], RequestType.ADD, self.encoder.encode(request))

    def _leave(self, kind: RequestType, request_ids: list[str]) -> None:
        for replica, ids in self.router.release(request_ids).items():
            self._send(self.sockets[replica], kind, self.encoder.encode(ids))

    def abort_requests(self, request_ids: list[str]) -> None:
        self._leave(RequestType.ABORT, request_ids)

    def finish_requests(self, request_ids: list[str]) -> None:
        self._leave(RequestType.FINISH, request_ids)

    def has_unfinished_requests(self) -> bool:
        return bool(self.router.owner)

    def get_output(self) -> list[EngineCoreOutput]:
        """The outputs the replicas have sent, waiting for at least one (a replica that dies
        meanwhile: RuntimeError)."""
        outputs: list[EngineCoreOutput] = []
        while not outputs:
            ready = dict(self.poller.poll(500))
            if not ready:
                dead = [i for i, p in enumerate(self.processes) if not p.is_alive()]
                if dead:
                    raise RuntimeError(f"Data-parallel replica {dead[0]} died (exit code "
                                       f"{self.processes[dead[0]].exitcode}).")
                continue
            for replica, sock in enumerate(self.sockets):
                while sock in ready and sock.poll(0):
                    kind, payload = sock.recv_multipart()
                    if kind == OUTPUTS:
                        outputs += self._arrived(replica, self.decode_outputs(payload).outputs)
        return outputs

    def _arrived(self, replica: int, outputs: list[EngineCoreOutput]) -> list[EngineCoreOutput]:
        kept = []
        for out in outputs:
            if out.request_id not in self.router.owner:
                continue  # aborted or stopped here already
            if out.error is not None:  # (checked here first: only a replica's own surprise)
                raise RuntimeError(f"Data-parallel replica {replica} refused request "
                                   f"{out.request_id}: {out.error}")
            if out.finish_reason is not None:
                self.router.finished(out.request_id)
            kept.append(out)
        return kept

    def close(self) -> None:
        """Stop every replica (SHUTDOWN, then kill what is left); idempotent."""
        if self.context.closed:
            return
        for sock in self.sockets:
            self._send(sock, RequestType.SHUTDOWN, b"")
        deadline = time.monotonic() + 10
        for process in self.processes:
            process.join(max(0.0, deadline - time.monotonic()))
            if process.is_alive():
                process.kill()
                process.join(5)
        for sock in self.sockets:
            sock.close(0)
        self.context.term()
        self.processes, self.sockets = [], []
