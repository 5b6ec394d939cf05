import os
import sys

import pytest
import torch

from tests.serving import HOLD_TOKENS, engine_process, service_over_engine, service_thread

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
    path = tiny_models("llama")[0]
    process, address = engine_process(path, max_model_len=512)
    yield path, address
    process.kill()
    process.join(10)


@pytest.fixture(scope="session")
def server_thread(engine_address):
    """The running app (its `app.state.server` is the ServerState); served model 'tiny'."""
    path, address = engine_address
    with service_thread(path, address, served_model_name=["tiny", "tiny-alias"],
                        max_dec_len=256, max_seq_len=400) as thread:
        yield thread


@pytest.fixture(scope="session")
def long_server(tiny_models):
    """Like `server_thread`, over the tiny long-context model with room for HOLD_TOKENS:
    for tests that need a request still running when they look (disconnects, timeouts)."""
    from tokenmill.metrics import Metrics

    with service_over_engine(tiny_models("llama_long")[0], metrics=Metrics("tiny", 256),
                             max_dec_len=HOLD_TOKENS) as thread:
        yield thread


@pytest.fixture(scope="session")
def server(server_thread):
    """Base URL of the service app."""
    return f"http://127.0.0.1:{server_thread.port}"


@pytest.fixture(scope="session")
def served_llama(tiny_models, tmp_path_factory):
    """One `tokenmill serve` process tree over the tiny llama (64 sequences), shared by the
    test modules that only talk to it (each process start costs seconds, minutes on a busy
    machine); tests that stop, kill or reconfigure a server start their own."""
    from tests.serving import Served

    with Served(tiny_models("llama")[0], tmp_path_factory.mktemp("served"),
                "--max-num-seqs", "64").running() as served:
        yield served


@pytest.fixture(scope="session")
def offline_llm(engine_address):
    from tokenmill import LLM

    return LLM(engine_address[0], kv_cache_memory_gib=0.02)


@pytest.fixture(autouse=True)
def _ranks_need_gpus(monkeypatch):
    """On a GPU machine each parallel rank takes a GPU of its own: an engine of more ranks
    per node than the machine has GPUs skips its test (it runs where there is no GPU, every
    rank on the CPU)."""
    if torch.cuda.is_available():
        from tokenmill.config.engine import EngineConfig

        post_init = EngineConfig.__post_init__

        def check(config):
            post_init(config)
            if (config.device in ("auto", "cuda")
                    and config.ranks_per_node > torch.cuda.device_count()):
                pytest.skip(f"{config.ranks_per_node} parallel ranks need as many GPUs")

        monkeypatch.setattr(EngineConfig, "__post_init__", check)


@pytest.fixture(autouse=True, scope="session")
def _float32_on_gpu():
    """The references are float32; a GPU's "auto" dtype would be bfloat16. Session-wide, so
    engines built by module- and session-scoped fixtures (set up before any function-scoped
    one) get it too: a module's float32 engines once met a bf16 baseline built by its
    fixture, whose rounding differs by batch shape."""
    if not torch.cuda.is_available():
        yield
        return
    from tokenmill.worker import model_runner

    resolve = model_runner.resolve_dtype
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(model_runner, "resolve_dtype", lambda name, *a: resolve(
            "float32" if name == "auto" else name, *a))
        yield
