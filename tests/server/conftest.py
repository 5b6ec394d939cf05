"""A real service app on 127.0.0.1 (uvicorn in a thread) over a real engine-core process."""

import socket
import threading
import time

import pytest
import uvicorn

from tokenmill.config import EngineConfig
from tokenmill.engine.core_client import start_engine_core_process
from tokenmill.entrypoints.http.server import create_service_app
from tokenmill.entrypoints.http.state import ApiSettings


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class ServerThread:
    def __init__(self, app, port: int) -> None:
        self.port = port
        self.server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port,
                                                    log_level="warning"))
        self.thread = threading.Thread(target=self.server.run, daemon=True)

    def __enter__(self):
        self.thread.start()
        deadline = time.monotonic() + 60
        while not self.server.started:  # uvicorn sets this once lifespan ran and it listens
            if time.monotonic() > deadline or not self.thread.is_alive():
                raise RuntimeError("test server did not start")
            time.sleep(0.05)
        return self

    def __exit__(self, *exc):
        self.server.should_exit = True
        self.thread.join(30)


@pytest.fixture(scope="session")
def engine_address(tiny_models):
    path = tiny_models("llama")[0]
    config = EngineConfig(model=path, kv_cache_memory_gib=0.02, max_model_len=512)
    process, address, _ = start_engine_core_process(config, path)
    yield path, address
    process.kill()
    process.join(10)


@pytest.fixture(scope="session")
def server_thread(engine_address):
    """The running app (its `app.state.server` is the ServerState); served model 'tiny'."""
    path, address = engine_address
    settings = ApiSettings(engine_address=address, tokenizer_path=path, model_path=path,
                           served_model_names=["tiny", "tiny-alias"], max_dec_len=256,
                           max_seq_len=400, max_waiting=64)
    app = create_service_app(settings)
    with ServerThread(app, free_port()) as thread:
        thread.app = app
        yield thread


@pytest.fixture(scope="session")
def server(server_thread):
    """Base URL of the service app."""
    return f"http://127.0.0.1:{server_thread.port}"


@pytest.fixture(scope="session")
def offline_llm(engine_address):
    from tokenmill import LLM

    return LLM(engine_address[0], kv_cache_memory_gib=0.02)


def wait_until(predicate, timeout=30.0):
    """Poll a condition the server reaches asynchronously (bounded)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(0.05)
    return predicate()
