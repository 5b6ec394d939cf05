import os
import sys

import pytest
import torch

from tests.serving import ServerThread, free_port

sys.path.insert(0, os.path.dirname(__file__))
# GPU kernels (Triton) run in Triton's interpreter on a machine without a GPU; set before
# anything imports triton.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")


def pytest_addoption(parser):
    parser.addoption("--long", action="store_true", default=False,
                     help="nightly mode: reliability soak and ramp run for minutes, not seconds")


@pytest.fixture(scope="session")
def tiny_models(tmp_path_factory):
    """arch -> (path, HF model) for every supported architecture, built once per session."""
    from helpers import make_model

    root = tmp_path_factory.mktemp("models")
    cache = {}

    def get(arch: str):
        if arch not in cache:
            path = str(root / arch)
            cache[arch] = (path, make_model(path, arch))
        return cache[arch]

    return get


# A service app in a thread over one engine-core process, shared by the server and
# reliability tests (tiny llama, max_model_len 512; served as "tiny").
@pytest.fixture(scope="session")
def engine_address(tiny_models):
    from tokenmill.config import EngineConfig
    from tokenmill.engine.core_client import start_engine_core_process

    path = tiny_models("llama")[0]
    config = EngineConfig(model=path, kv_cache_memory_gib=0.02, max_model_len=512)
    process, address, _ = start_engine_core_process(config, path)
    yield path, address
    process.kill()
    process.join(10)


@pytest.fixture(scope="session")
def server_thread(engine_address):
    """The running app (its `app.state.server` is the ServerState); served model 'tiny'."""
    from tokenmill.entrypoints.http.server import create_service_app
    from tokenmill.entrypoints.http.state import ApiSettings

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
