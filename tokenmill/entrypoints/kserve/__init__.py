"""The KServe v2 / Triton gRPC front end (`inference.GRPCInferenceService`)."""

from __future__ import annotations

from collections.abc import Callable

import grpc
from tritonclient.grpc import service_pb2_grpc as pb_grpc

from tokenmill.entrypoints.api.json_body import DEFAULT_MAX_BODY_BYTES
from tokenmill.entrypoints.api.state import ServerState
from tokenmill.entrypoints.auth import ApiKey

_GUARDED = ("/inference.GRPCInferenceService/ModelInfer",
            "/inference.GRPCInferenceService/ModelStreamInfer",
            "/inference.GRPCInferenceService/ModelMetadata",
            "/inference.GRPCInferenceService/ModelConfig")


class ApiKeyInterceptor(grpc.aio.ServerInterceptor):
    """With --api-key, inference and model-description RPCs need the metadata
    `authorization: Bearer <key>` (tritonclient: `headers={"authorization": ...}`), compared in
    constant time; liveness/readiness stay open like the HTTP probes."""

    def __init__(self, api_key: str, get_state: Callable[[], ServerState | None]) -> None:
        self.key = ApiKey(api_key)
        self.get_state = get_state

        async def deny(request, context):
            await context.abort(grpc.StatusCode.UNAUTHENTICATED,
                                "Unauthorized: a valid API key is required.")

        async def deny_stream(request_iterator, context):
            await context.abort(grpc.StatusCode.UNAUTHENTICATED,
                                "Unauthorized: a valid API key is required.")
            yield  # pragma: no cover - abort raises

        self.deny_unary = grpc.unary_unary_rpc_method_handler(deny)
        self.deny_stream = grpc.stream_stream_rpc_method_handler(deny_stream)

    async def intercept_service(self, continuation, details):
        if details.method in _GUARDED:
            given = dict(details.invocation_metadata or ()).get("authorization", "")
            if not self.key.accepts(given):
                state = self.get_state()
                if state is not None:
                    state.reject("unauthorized")
                return self.deny_stream if details.method.endswith("StreamInfer") \
                    else self.deny_unary
        return await continuation(details)


# Room for the protobuf framing around a request's payload.
_MESSAGE_OVERHEAD = 64 * 1024


async def start_grpc_server(get_state: Callable[[], ServerState | None], host: str,
                            port: int, api_key: str | None = None,
                            max_request_bytes: int = DEFAULT_MAX_BODY_BYTES) -> grpc.aio.Server:
    """Serve on host:port in the running event loop (sharing the engine client of the HTTP
    API in this process). `get_state()` is None until the server is ready. Messages larger
    than `max_request_bytes` (the HTTP body limit) are refused by gRPC itself
    (RESOURCE_EXHAUSTED) before any of our code reads them."""
    from tokenmill import __version__
    from tokenmill.entrypoints.kserve.service import InferenceService

    server = grpc.aio.server(
        interceptors=[ApiKeyInterceptor(api_key, get_state)] if api_key else None,
        options=[("grpc.max_receive_message_length", max_request_bytes + _MESSAGE_OVERHEAD),
                 ("grpc.so_reuseport", 0)])
    pb_grpc.add_GRPCInferenceServiceServicer_to_server(
        InferenceService(get_state, __version__), server)
    address = f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
    if server.add_insecure_port(address) == 0:
        raise RuntimeError(f"gRPC could not bind {address}")
    await server.start()
    return server
