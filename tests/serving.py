"""Shared by the server and reliability tests: loopback ports, polling, a service app in a
thread, and `tokenmill serve` as a real process tree (`Served`) with its probes and metrics."""

import contextlib
import os
import signal
import socket
import subprocess
import sys
import threading
import time

import httpx
from prometheus_client.parser import text_string_to_metric_families

# A request a test must still find running when it looks: on the tiny long-context model
# (`tiny_models("llama_long")`) 30,000 tokens take ~30 s of decoding, and the test ends the
# request (cancel, disconnect, kill) once it has looked. Counts of a few hundred tokens were
# outrun as the engine got faster (~0.35 ms a token on the tiny model).
HOLD_TOKENS = 30_000
# A request a test lets finish but needs in flight for a few seconds first (drain on
# shutdown): ~1 s of decoding there (2026-11-28), against the few ms between the stream
# opening and the signal in the tests that use it.
DRAIN_TOKENS = 3_000


# Ports for test servers come from below the kernel's ephemeral range (32768+ here), walked
# once per process: asking the kernel for port 0 can hand out the same port twice in a row (a
# CI run started a server whose metrics and gRPC ports were one port), and any client socket
# may take an ephemeral port between the pick and the server's bind. TOKENMILL_TEST_PORTS=LOW-HIGH
# moves the range (services of yours live there, or two suites run at once).


def _port_range(text: str) -> tuple[int, int]:
    try:
        low, high = (int(x) for x in text.split("-"))
    except ValueError:
        raise ValueError(f"TOKENMILL_TEST_PORTS must be LOW-HIGH, e.g. 20000-32000, got "
                         f"{text!r}") from None
    if not 1024 <= low < high <= 65536 or high - low < 64:
        raise ValueError(f"TOKENMILL_TEST_PORTS {text!r}: need 1024 <= LOW, LOW + 64 <= HIGH "
                         "<= 65536")
    return low, high


_PORT_LOW, _PORT_HIGH = _port_range(os.environ.get("TOKENMILL_TEST_PORTS") or "20000-32000")
_next_port = _PORT_LOW + (os.getpid() * 97) % (_PORT_HIGH - _PORT_LOW)
_port_lock = threading.Lock()


def free_port() -> int:
    """A loopback port no other call in this process has returned, and free right now."""
    global _next_port
    with _port_lock:
        for _ in range(_PORT_HIGH - _PORT_LOW):
            port = _next_port
            _next_port = _PORT_LOW + (port + 1 - _PORT_LOW) % (_PORT_HIGH - _PORT_LOW)
            if port_free(port):
                return port
    raise RuntimeError("no free loopback port left for tests")


class ServerThread:
    def __init__(self, app, port: int) -> None:
        self.port = port
        from tokenmill.entrypoints.api_worker import make_server

        self.server = make_server(app, port=port)  # the production server (head limits)
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


def wait_until(predicate, timeout=30.0):
    """Poll a condition the server reaches asynchronously (bounded)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(0.05)
    return predicate()


def engine_process(path: str, **engine):
    """One engine-core process over the model at `path`: (process, address)."""
    from tokenmill.config.engine import EngineConfig
    from tokenmill.engine.core_client import start_engine_core_process

    config = EngineConfig(model=path, kv_cache_memory_gib=0.02, **engine)
    process, address, _ = start_engine_core_process(config, path)
    return process, address


def api_settings(path: str, address: str, sampling_defaults: dict | None = None,
                 engine_config=None, **config):
    """An API process's settings for the model at `path` behind the engine at `address`:
    `config` holds ServerConfig's fields (served model 'tiny', 64 waiting requests unless
    given); `engine_config` the EngineConfig (default: the model's, all else default)."""
    from tokenmill.config.engine import EngineConfig
    from tokenmill.config.server import ServerConfig
    from tokenmill.entrypoints.api.state import ApiSettings

    config = ServerConfig(engine=engine_config or EngineConfig(model=path), **{
        "served_model_name": ["tiny"], "max_cached_task_num": 64, **config})
    return ApiSettings(config=config, engine_address=address, tokenizer_path=path,
                       model_path=path, sampling_defaults=sampling_defaults or {})


def service_thread(path: str, address: str, metrics=None, **config) -> ServerThread:
    """The service app over the engine at `address`, in a thread (served model 'tiny';
    `config`: `api_settings`'); the thread carries its `app`, `metrics` and `base` URL."""
    from tokenmill.entrypoints.http.server import create_service_app

    app = create_service_app(api_settings(path, address, **config), metrics=metrics)
    thread = ServerThread(app, free_port())
    thread.app, thread.metrics = app, metrics
    thread.base = f"http://127.0.0.1:{thread.port}"
    return thread


@contextlib.contextmanager
def service_over_engine(path: str, metrics=None, engine: dict | None = None, **settings):
    """An engine-core process (`engine_process`, options `engine`) and the service app over it
    in a thread (`service_thread`); both stop afterwards."""
    process, address = engine_process(path, **(engine or {}))
    try:
        with service_thread(path, address, metrics, **settings) as thread:
            yield thread
    finally:
        process.kill()
        process.join(10)


def children(pid: int) -> list[int]:
    found = []
    for task in os.listdir(f"/proc/{pid}/task"):
        with open(f"/proc/{pid}/task/{task}/children") as f:
            found += [int(p) for p in f.read().split()]
    return found


def alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False


def port_free(port: int) -> bool:
    with socket.socket() as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


def metric(url: str, name: str, **labels: str) -> float:
    """One sample from the metrics port, parsed by prometheus_client's own parser."""
    text = httpx.get(url + "/metrics", timeout=10).text
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name == name and all(sample.labels.get(k) == v for k, v in labels.items()):
                return sample.value
    raise KeyError(name)


def metric_sum(url: str, name: str) -> float:
    text = httpx.get(url + "/metrics", timeout=10).text
    return sum(s.value for f in text_string_to_metric_families(text) for s in f.samples
               if s.name == name)


class Served:
    """Ports and environment for one server; `start()` runs `tokenmill serve`."""

    # the command before the flags: `tokenmill serve`, or an alias of it
    entry = ("-m", "tokenmill.entrypoints.cli", "serve")

    def __init__(self, model: str, tmp_path, *flags: str) -> None:
        self.ports = {name: free_port() for name in ("port", "health", "metrics", "grpc")}
        self.env = {**os.environ,
                    "SERVICE_HTTP_PORT": str(self.ports["port"]),
                    "HEALTH_HTTP_PORT": str(self.ports["health"]),
                    "METRICS_HTTP_PORT": str(self.ports["metrics"]),
                    "SERVICE_GRPC_PORT": str(self.ports["grpc"])}
        self.args = [model, "--host", "127.0.0.1", "--kv-cache-memory", "0.02",
                     "--served-model-name", "tiny", *flags]
        self.cwd = tmp_path
        self.api = f"http://127.0.0.1:{self.ports['port']}"
        self.health = f"http://127.0.0.1:{self.ports['health']}"
        self.metrics = f"http://127.0.0.1:{self.ports['metrics']}"
        self.process = None

    def start(self):
        # Output goes to a file, not a pipe: a server logs a line per request, and a pipe
        # nobody reads fills up (64 KiB) and blocks it. `process.stdout` reads the file (the
        # tests read it once the server has exited).
        log_path = os.path.join(str(self.cwd), f"served-{self.ports['port']}.log")
        with open(log_path, "wb") as log:
            self.process = subprocess.Popen(
                [sys.executable, *self.entry, *self.args],
                env=self.env, cwd=self.cwd, stdout=log, stderr=subprocess.STDOUT,
                start_new_session=True)  # its own process group, like a terminal job
        self.process.stdout = open(log_path, "rb")  # noqa: SIM115 (closed with the process)
        return self

    def ready(self) -> bool:
        try:
            return httpx.get(self.health + "/v2/health/ready", timeout=2).status_code == 200
        except httpx.TransportError:
            return False

    # Start-up bounds only guard against a hang: a busy shared machine may take minutes to
    # import torch and load the model in a fresh process.
    def wait_ready(self, timeout=300.0):
        assert wait_until(lambda: self.ready() or self.process.poll() is not None, timeout)
        assert self.process.poll() is None, self.process.stdout.read().decode()[-3000:]

    def ports_free(self) -> bool:
        return all(port_free(p) for p in self.ports.values())

    @contextlib.contextmanager
    def running(self, timeout=300.0):
        """Started and ready inside the block; stopped after it, whatever happened."""
        self.start()
        try:
            self.wait_ready(timeout)
            yield self
        finally:
            self.stop()

    def stop(self):
        """Graceful first; then nothing of the process group may survive the test."""
        if self.process is None:
            return
        if self.process.poll() is None:
            self.process.terminate()
            with contextlib.suppress(subprocess.TimeoutExpired):
                self.process.wait(30)
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.process.pid, signal.SIGKILL)
        self.process.wait(30)


def with_think_tokens(path: str, out) -> str:
    """A copy of the tiny model `path` whose vocabulary has <think> and </think> (added tokens,
    as DeepSeek-R1's and Qwen3's), which a reasoning parser needs."""
    import shutil

    from tokenmill.loading.checkpoint import load_tokenizer

    shutil.copytree(path, out)
    tok = load_tokenizer(str(out))
    tok.add_tokens(["<think>", "</think>"])  # (ids within the tiny model's 512 rows)
    assert max(tok.convert_tokens_to_ids(["<think>", "</think>"])) < 512
    tok.save_pretrained(str(out))
    return str(out)
