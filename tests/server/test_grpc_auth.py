"""--api-key on gRPC: inference RPCs need `authorization: Bearer <key>` metadata."""

import asyncio
import threading

import numpy as np
import pytest
import tritonclient.grpc as grpcclient
from tritonclient.utils import InferenceServerException

from tests.serving import free_port
from tokenmill.entrypoints.kserve import start_grpc_server


@pytest.fixture(scope="module")
def keyed_grpc():
    """A gRPC server with no model loaded yet (state None): auth is decided before that."""
    port = free_port()
    loop = asyncio.new_event_loop()
    started = threading.Event()
    holder = {}

    async def main():
        server = await start_grpc_server(lambda: None, "127.0.0.1", port, "s3cret")
        holder["stop"] = asyncio.Event()
        started.set()
        await holder["stop"].wait()
        await server.stop(0)

    thread = threading.Thread(target=loop.run_until_complete, args=(main(),), daemon=True)
    thread.start()
    assert started.wait(30)
    yield f"127.0.0.1:{port}"
    loop.call_soon_threadsafe(holder["stop"].set)
    thread.join(10)


def request_inputs():
    inp = grpcclient.InferInput("IN", [1], "BYTES")
    inp.set_data_from_numpy(np.array([b'[{"text": "hi", "req_id": "a"}]'], dtype=object))
    return [inp]


def test_inference_needs_the_key(keyed_grpc):
    client = grpcclient.InferenceServerClient(keyed_grpc)
    assert client.is_server_live()  # probes stay open
    for headers in (None, {"authorization": "Bearer wrong"}, {"authorization": "s3cret"}):
        with pytest.raises(InferenceServerException) as err:
            client.infer("model", request_inputs(), headers=headers)
        assert err.value.status() == "StatusCode.UNAUTHENTICATED"
        assert "s3cret" not in str(err.value)
    # With the key the request gets past authentication (and finds no model loaded yet).
    with pytest.raises(InferenceServerException) as err:
        client.infer("model", request_inputs(), headers={"authorization": "Bearer s3cret"})
    assert err.value.status() == "StatusCode.UNAVAILABLE"
    client.close()
