"""The KServe v2 / Triton gRPC front end (`inference.GRPCInferenceService`)."""

from __future__ import annotations

from collections.abc import Callable

import grpc
from tritonclient.grpc import service_pb2_grpc as pb_grpc

from tokenmill.entrypoints.http.state import ServerState


async def start_grpc_server(get_state: Callable[[], ServerState | None], host: str,
                            port: int) -> grpc.aio.Server:
    """Serve on host:port in the running event loop (sharing the engine client of the HTTP
    API in this process). `get_state()` is None until the server is ready."""
    from tokenmill import __version__
    from tokenmill.entrypoints.kserve.service import InferenceService

    server = grpc.aio.server(options=[("grpc.max_receive_message_length", 64 << 20),
                                      ("grpc.so_reuseport", 0)])
    pb_grpc.add_GRPCInferenceServiceServicer_to_server(
        InferenceService(get_state, __version__), server)
    address = f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
    if server.add_insecure_port(address) == 0:
        raise RuntimeError(f"gRPC could not bind {address}")
    await server.start()
    return server
