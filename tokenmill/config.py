"""Configuration: the engine's knobs (`EngineConfig`, in engine_config.py) and the server's,
built from defaults < the seed's environment variables < vLLM-style flags, validated once at
start-up. The only module that reads environment variables."""

from __future__ import annotations

from dataclasses import dataclass

from tokenmill.engine_config import EngineConfig
from tokenmill.parallel_config import node_settings
from tokenmill.spec_decode.config import from_seed

# ---------------------------------------------------------------------------------------------
# Server configuration: defaults < the seed's environment variables < vLLM-style flags.

# (field, new env name, old env name). The old name wins when both are set, as in the seed's
# start_server script (`HEALTH_HTTP_PORT=${HTTP_PORT:-${HEALTH_HTTP_PORT:-8110}}`).
_PORT_ENV = (("port", "SERVICE_HTTP_PORT", "PUSH_MODE_HTTP_PORT"),
             ("health_port", "HEALTH_HTTP_PORT", "HTTP_PORT"),
             ("grpc_port", "SERVICE_GRPC_PORT", "GRPC_PORT"),
             ("metrics_port", "METRICS_HTTP_PORT", "METRICS_PORT"),
             ("inter_proc_port", "INTER_PROC_PORT", "INFER_QUEUE_PORT"))


@dataclass
class ServerConfig:
    engine: EngineConfig
    host: str = "0.0.0.0"
    port: int = 9965  # native + OpenAI + Triton-generate HTTP API
    health_port: int = 8110  # /v2/health/live, /v2/health/ready
    grpc_port: int = 8811  # KServe v2 / Triton gRPC
    metrics_port: int = 8722  # Prometheus /metrics
    inter_proc_port: int = 8813  # the seed's queue port; checked for conflicts, see README
    served_model_name: list[str] | None = None  # default: the model's file/dir name
    api_key: str | None = None
    http_workers: int = 1  # PUSH_MODE_HTTP_WORKERS
    max_cached_task_num: int = 128  # requests allowed to wait in the engine queue
    max_dec_len: int = 1024  # cap on requested new tokens
    max_seq_len: int | None = None  # cap on prompt tokens; default: max_model_len - 1
    disable_streaming: bool = False
    use_warmup: bool = False
    log_dir: str = "log"
    shutdown_timeout: float = 300.0  # SIGTERM: seconds to let in-flight requests finish
    check_health_interval: float = 10.0  # engine silent this long => not ready, requests fail
    max_request_body_bytes: int = 2 * 1024 * 1024  # larger bodies get 413 before parsing
    trust_request_chat_template: bool = False  # accept `chat_template` in requests
    reasoning_parser: str | None = None  # deepseek_r1 | qwen3: chat output's <think> split
    # vLLM flags given that have no effect here: (flag, why), logged once at start-up
    ignored_flags: tuple[tuple[str, str], ...] = ()

    @property
    def model_names(self) -> list[str]:
        """Names accepted in `model` fields; the first is reported (vLLM: the model argument
        itself when no --served-model-name is given)."""
        return self.served_model_name or [self.engine.model or "default"]

    def validate(self) -> None:
        ports = {}
        for name in ("port", "health_port", "grpc_port", "metrics_port", "inter_proc_port"):
            value = getattr(self, name)
            if not isinstance(value, int) or not 0 < value < 65536:
                raise ValueError(f"{name} must be a TCP port in 1-65535, got {value!r}.")
            if value in ports:
                raise ValueError(f"{name} and {ports[value]} are both set to port {value}; "
                                 "every port must be different.")
            ports[value] = name
        if not 1 <= self.http_workers <= 8:
            raise ValueError(f"PUSH_MODE_HTTP_WORKERS ({self.http_workers}) must be between "
                             "1 and 8.")
        if self.engine.max_num_seqs > 256:
            raise ValueError("The parameter `max_batch_size` is not allowed to exceed 256, but "
                             f"now it's {self.engine.max_num_seqs}.")
        for name in ("max_cached_task_num", "max_dec_len"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be a positive integer, got "
                                 f"{getattr(self, name)}.")
        if self.max_seq_len is not None and self.max_seq_len < 1:
            raise ValueError(f"max_seq_len must be a positive integer, got {self.max_seq_len}.")
        if not self.shutdown_timeout >= 0:
            raise ValueError(f"shutdown_timeout must be >= 0, got {self.shutdown_timeout}.")
        if self.max_request_body_bytes < 1024:
            raise ValueError("max_request_body_bytes must be at least 1024, got "
                             f"{self.max_request_body_bytes}.")
        if not self.check_health_interval > 0:
            raise ValueError("CHECK_HEALTH_INTERVAL must be > 0, got "
                             f"{self.check_health_interval}.")
        if self.served_model_name is not None and not all(self.served_model_name):
            raise ValueError("served_model_name must not be empty.")


def _parse_len(text: str) -> int:
    """vLLM accepts 4096, 4k, 4K (x1000) and 4KiB-style 1ki (x1024) for --max-model-len."""
    t = text.strip().lower()
    for suffix, mult in (("ki", 1024), ("k", 1000), ("mi", 1 << 20), ("m", 1_000_000)):
        if t.endswith(suffix):
            return int(float(t[: -len(suffix)]) * mult)
    return int(t)


def make_serve_parser(prog: str = "tokenmill serve", description: str | None = None):
    import argparse

    p = argparse.ArgumentParser(
        prog=prog,
        description=description or "Serve a model over the native, OpenAI and Triton-generate "
                    "HTTP APIs and KServe gRPC. Flags override the seed's environment "
                    "variables, which override defaults.")
    a = p.add_argument
    a("model", nargs="?", default=None,
      help="HF directory or .gguf file (env MODEL_DIR; default: bundled SmolLM2-135M)")
    a("--model", dest="model_flag", default=None, help="same as the positional MODEL")
    a("--tokenizer", default=None)
    a("--host", default=None, help="bind address of the HTTP ports (default 0.0.0.0)")
    a("--port", type=int, default=None, help="API port (env SERVICE_HTTP_PORT; default 9965)")
    a("--health-port", type=int, default=None, help="env HEALTH_HTTP_PORT; default 8110")
    a("--metrics-port", type=int, default=None, help="env METRICS_HTTP_PORT; default 8722")
    a("--grpc-port", type=int, default=None, help="env SERVICE_GRPC_PORT; default 8811")
    a("--served-model-name", nargs="+", default=None,
      help="names accepted in `model`; the first is reported")
    a("--api-key", default=None, help="require `Authorization: Bearer KEY` (env VLLM_API_KEY)")
    a("--dtype", default=None, help="auto, float32, bfloat16, float16 (env DTYPE)")
    a("--device", default=None, help="auto, cpu, cuda[:N]")
    a("--quantization", "-q", default=None,
      help="int8, int4, a8w8 or fp8 (also weight_only_int8, weight_only_int4); default: as the "
           "checkpoint is")
    a("--kv-cache-dtype", default=None, choices=["auto", "int8"],
      help="int8: int8 K/V cache (env USE_CACHE_KV_INT8=1)")
    a("--max-model-len", type=_parse_len, default=None, help="context length (e.g. 4096, 4k)")
    a("--speculative-config", default=None, help="JSON (env SPECULATE_METHOD, SPECULATE_*)")
    a("--max-num-seqs", type=int, default=None, help="concurrent sequences (env BATCH_SIZE)")
    a("--max-num-batched-tokens", type=int, default=None, help="tokens per engine step")
    a("--block-size", type=int, default=None, help="KV block tokens (env BLOCK_SIZE)")
    a("--gpu-memory-utilization", type=float, default=None)
    a("--kv-cache-memory", type=float, default=None, metavar="GIB", help="KV blocks' memory "
      "(default 4 on the CPU; on a GPU it overrides --gpu-memory-utilization)")
    a("--num-kv-blocks", type=int, default=None, help="exact KV block count (env BLOCK_BS)")
    a("--enable-prefix-caching", action=argparse.BooleanOptionalAction, default=None)
    a("--tensor-parallel-size", "-tp", type=int, default=None,
      help="ranks that split every layer (env MP_NUM; default 1)")
    a("--distributed-executor-backend", default=None, choices=["mp", "ray"],
      help="mp: the ranks as processes on this node (and --nnodes); ray: as actors on the "
           "Ray cluster (RAY_ADDRESS, or the local one)")
    a("--distributed-timeout", type=float, default=None, metavar="S",
      help="seconds start-up waits for every rank to join (default 120)")
    a("--enable-expert-parallel", action="store_true", default=None,
      help="each tensor-parallel rank holds whole experts (1/tp of them) instead of a "
           "slice of every one")
    a("--data-parallel-size", "-dp", type=int, default=None,
      help="engine replicas behind the API (each with its own tensor/pipeline ranks)")
    a("--nnodes", type=int, default=None, help="nodes sharing the ranks (env MP_NNODE)")
    a("--node-rank", type=int, default=None,
      help="this node's index (default: from POD_IPS, OMPI_COMM_WORLD_RANK or PMI_RANK)")
    a("--master-addr", default=None,
      help="node 0's address: its rendezvous (env MASTER_ADDR, else POD_0_IP)")
    a("--master-port", type=int, default=None,
      help="node 0's rendezvous port (env MASTER_PORT; default 29500)")
    a("--pipeline-parallel-size", "-pp", type=int, default=None,
      help="stages the layers are split into (MP_NUM then counts tp x pp ranks)")
    # vLLM flags its deployment guides pass that mean nothing here: accepted, logged once.
    a("--num-scheduler-steps", type=int, default=None, help="accepted, no effect (vLLM)")
    a("--trust-remote-code", action="store_true", default=None, help="accepted; no code is run")
    a("--enforce-eager", action="store_true", default=None, help="no effect: no CUDA graphs yet")
    a("--disable-async-output-proc", action="store_true", default=None, help="no effect (vLLM)")
    a("--seed", type=int, default=None)
    a("--max-dec-len", type=int, default=None, help="cap on new tokens (env MAX_DEC_LEN)")
    a("--max-seq-len", type=int, default=None, help="cap on prompt tokens (env MAX_SEQ_LEN)")
    a("--max-cached-task-num", type=int, default=None,
      help="queued requests before 503 (env MAX_CACHED_TASK_NUM; default 128)")
    a("--http-workers", type=int, default=None, help="env PUSH_MODE_HTTP_WORKERS (1-8)")
    a("--disable-streaming", action="store_true", default=None, help="env DISABLE_STREAMING=1")
    a("--use-warmup", action="store_true", default=None, help="env USE_WARMUP=1")
    a("--log-dir", default=None, help="env FD_LOG_DIR; default log")
    a("--shutdown-timeout", type=float, default=None,
      help="seconds SIGTERM waits for in-flight requests (default 300); 0 ends them at once")
    a("--max-request-body-bytes", type=int, default=None,
      help="larger request bodies get 413 before parsing (default 2097152 = 2 MiB)")
    a("--trust-request-chat-template", action="store_true", default=None,
      help="accept a `chat_template` in chat requests (rendered sandboxed; default: 400)")
    a("--reasoning-parser", choices=["deepseek_r1", "qwen3"], help="chat: <think> -> reasoning")
    return p


class _Env:
    """Typed reads of environment variables with messages that name the variable."""

    def __init__(self, environ) -> None:
        self.environ = environ

    def raw(self, *names: str) -> tuple[str, str] | None:
        for name in names:  # first given name wins
            value = self.environ.get(name)
            if value not in (None, ""):
                return name, value
        return None

    def text(self, *names: str):
        found = self.raw(*names)
        return None if found is None else found[1]

    def integer(self, *names: str):
        found = self.raw(*names)
        if found is None:
            return None
        try:
            return int(found[1])
        except ValueError:
            raise ValueError(f"Environment variable {found[0]} must be an integer, got "
                             f"{found[1]!r}.") from None

    def number(self, *names: str):
        found = self.raw(*names)
        if found is None:
            return None
        try:
            return float(found[1])
        except ValueError:
            raise ValueError(f"Environment variable {found[0]} must be a number, got "
                             f"{found[1]!r}.") from None

    def flag(self, name: str):
        found = self.raw(name)
        if found is None:
            return None
        if found[1] not in ("0", "1"):
            raise ValueError(f"Environment variable {name} must be 0 or 1, got {found[1]!r}.")
        return found[1] == "1"


def build_server_config(argv: list[str], environ=None, **parser_text: str) -> ServerConfig:
    """Defaults, then the seed's environment variables, then flags; validated. `parser_text`:
    the `prog` and `description` of the --help text."""
    import math
    import os

    environ = os.environ if environ is None else environ
    args = make_serve_parser(**parser_text).parse_args(argv)
    env = _Env(environ)

    def pick(flag, env_value, default=None):
        return flag if flag is not None else env_value if env_value is not None else default

    kv_int8 = env.flag("USE_CACHE_KV_INT8")
    # MP_NUM counts every rank (tensor x pipeline parallel), as the seed's launcher does.
    pp = pick(args.pipeline_parallel_size, None, 1)
    if not isinstance(pp, int) or pp < 1:
        raise ValueError(f"--pipeline-parallel-size must be a positive integer, got {pp}.")
    ranks = env.integer("MP_NUM")
    if ranks is not None and args.tensor_parallel_size is None and ranks % pp:
        raise ValueError(f"MP_NUM ({ranks}) must be divisible by --pipeline-parallel-size "
                         f"({pp}).")
    tp = pick(args.tensor_parallel_size, None if ranks is None else ranks // pp, 1)
    if not isinstance(tp, int) or tp < 1:
        raise ValueError(f"tensor parallel size (MP_NUM / --tensor-parallel-size) must be a "
                         f"positive integer, got {tp}.")
    block_ratio = env.number("BLOCK_RATIO")
    if block_ratio is not None and not 0 < block_ratio <= 1:
        raise ValueError(f"BLOCK_RATIO must be in (0, 1], got {block_ratio}.")
    block_bs = env.number("BLOCK_BS")
    if block_bs is not None and not block_bs > 0:
        raise ValueError(f"BLOCK_BS must be > 0, got {block_bs}.")

    block_size = pick(args.block_size, env.integer("BLOCK_SIZE"), 16)
    max_dec_len = pick(args.max_dec_len, env.integer("MAX_DEC_LEN"), 1024)
    max_seq_len = pick(args.max_seq_len, env.integer("MAX_SEQ_LEN"))
    num_kv_blocks = args.num_kv_blocks
    if num_kv_blocks is None and block_bs is not None:
        # The seed sizes the cache as BLOCK_BS requests of the longest allowed length.
        longest = max(max_dec_len, max_seq_len or 0)
        num_kv_blocks = max(1, int(block_bs * math.ceil(longest / block_size)))
    engine_kwargs = {
        "model": pick(args.model_flag or args.model, env.text("MODEL_DIR")),
        "tokenizer": args.tokenizer,
        "dtype": pick(args.dtype, env.text("DTYPE"), "auto"),
        "device": pick(args.device, None, "auto"),
        "max_model_len": args.max_model_len,
        "max_num_seqs": pick(args.max_num_seqs, env.integer("BATCH_SIZE"), 256),
        "max_num_batched_tokens": args.max_num_batched_tokens,
        "block_size": block_size,
        "enable_prefix_caching": pick(args.enable_prefix_caching, None, True),
        "kv_cache_memory_gib": args.kv_cache_memory,
        "gpu_memory_utilization": pick(args.gpu_memory_utilization, None, 0.9),
        "num_kv_blocks": num_kv_blocks,
        "seed": pick(args.seed, None, 0),
        "quantization": args.quantization,
        "kv_cache_dtype": pick(args.kv_cache_dtype, "int8" if kv_int8 else None, "auto"),
        "speculative_config": pick(args.speculative_config, from_seed(
            env.text("SPECULATE_METHOD"), env.integer("SPECULATE_MAX_DRAFT_TOKEN_NUM"),
            env.integer("SPECULATE_MAX_NGRAM_SIZE"), env.text("SPECULATE_MODEL_PATH"),
            env.text("SPECULATE_MODEL_QUANT_TYPE"))),
        "tensor_parallel_size": tp,
        "pipeline_parallel_size": pp,
        "data_parallel_size": pick(args.data_parallel_size, None, 1),
        "enable_expert_parallel": bool(args.enable_expert_parallel),
        "ray_address": env.text("RAY_ADDRESS"),
        **node_settings(args, env, tp * pp),
        "distributed_executor_backend": pick(args.distributed_executor_backend, None, "mp"),
        "distributed_timeout": pick(args.distributed_timeout, None, 120.0),
    }
    engine = EngineConfig(**engine_kwargs)
    ports = {name: port for name, new, old in _PORT_ENV
             if (port := pick(getattr(args, name, None), env.integer(old, new))) is not None}
    config = ServerConfig(
        engine=engine,
        host=pick(args.host, None, "0.0.0.0"),
        served_model_name=args.served_model_name,
        api_key=pick(args.api_key, env.text("VLLM_API_KEY")),
        http_workers=pick(args.http_workers, env.integer("PUSH_MODE_HTTP_WORKERS"), 1),
        max_cached_task_num=pick(args.max_cached_task_num, env.integer("MAX_CACHED_TASK_NUM"), 128),
        max_dec_len=max_dec_len,
        max_seq_len=max_seq_len,
        disable_streaming=pick(args.disable_streaming, env.flag("DISABLE_STREAMING"), False),
        use_warmup=pick(args.use_warmup, env.flag("USE_WARMUP"), False),
        log_dir=pick(args.log_dir, env.text("FD_LOG_DIR"), "log"),
        shutdown_timeout=pick(args.shutdown_timeout, None, 300.0),
        check_health_interval=pick(None, env.number("CHECK_HEALTH_INTERVAL"), 10.0),
        max_request_body_bytes=pick(args.max_request_body_bytes, None, 2 * 1024 * 1024),
        trust_request_chat_template=pick(args.trust_request_chat_template, None, False),
        reasoning_parser=args.reasoning_parser,
        ignored_flags=tuple(flag for name, flag in _IGNORED.items()
                            if getattr(args, name) is not None),
        **ports)
    config.validate()
    return config


_IGNORED = {
    "num_scheduler_steps": ("--num-scheduler-steps", "every step is scheduled anew"),
    "trust_remote_code": ("--trust-remote-code", "tokenmill never runs a checkpoint's own "
                          "code; it serves the architectures it implements"),
    "enforce_eager": ("--enforce-eager", "no CUDA graphs are captured yet"),
    "disable_async_output_proc": ("--disable-async-output-proc",
                                  "outputs are processed in the API process already"),
}


def check_ports_free(config: ServerConfig) -> None:
    """Fail fast, naming the port, when something already listens on one of ours (a node
    other than 0 runs ranks only: it listens on none of them)."""
    import socket

    if config.engine.node_rank > 0:
        return

    checks = [(config.host if name != "inter_proc_port" else "127.0.0.1", getattr(config, name))
              for name, _, _ in _PORT_ENV]
    engine = config.engine
    if engine.world_size > 1 and engine.node_rank == 0 and (
            engine.nnodes > 1 or engine.distributed_executor_backend == "ray"):
        # node 0 serves the ranks' rendezvous
        ray = engine.distributed_executor_backend == "ray"  # (on the node's Ray address)
        checks.append(("0.0.0.0" if ray else engine.master_addr, engine.master_port))
    for host, port in checks:
        with socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET,
                           socket.SOCK_STREAM) as s:
            s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            try:
                s.bind((host, port))
            except OSError:
                raise OSError(f"PORT: {port} occupied! Please change the port!") from None


@dataclass(frozen=True)
class CpuKernelSettings:
    """The compiled CPU kernels: TOKENMILL_CPU_KERNELS=0 turns them off (tests, debugging);
    TOKENMILL_CPU_INT_DOT=0 keeps int8/int4 weight layers' activations in float32 (exact
    weight-only arithmetic, ~2x slower decode) instead of int16 per 32 inputs;
    TOKENMILL_CPU_DECODE_STEP=0 runs decode steps layer by layer from Python instead of in one
    compiled call (same kernels, same results; for comparisons); TOKENMILL_GGUF_COMPACT=0
    widens GGUF Q6_K blocks to int8 groups of 16 (1.5x the file's bytes) and Q5_0 / Q5_1 to
    int8 groups of 32 (1.6x) instead of keeping them as stored; CC picks the compiler;
    XDG_CACHE_HOME moves the build cache."""

    enabled: bool
    compiler: str
    cache_dir: str
    int_dot: bool = True
    decode_step: bool = True
    gguf_compact: bool = True

    @classmethod
    def from_env(cls, environ=None) -> CpuKernelSettings:
        import os

        environ = os.environ if environ is None else environ
        cache = environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
        return cls(enabled=environ.get("TOKENMILL_CPU_KERNELS", "1") != "0",
                   compiler=environ.get("CC", "cc"),
                   cache_dir=os.path.join(cache, "tokenmill", "kernels"),
                   int_dot=environ.get("TOKENMILL_CPU_INT_DOT", "1") != "0",
                   decode_step=environ.get("TOKENMILL_CPU_DECODE_STEP", "1") != "0",
                   gguf_compact=environ.get("TOKENMILL_GGUF_COMPACT", "1") != "0")


def share_metrics_dir(path: str) -> None:
    """Point PROMETHEUS_MULTIPROC_DIR at `path` for this process and the HTTP workers it
    spawns afterwards (they inherit the environment; prometheus_client reads the variable when
    it is imported there and writes its metric files under it)."""
    import os

    os.environ["PROMETHEUS_MULTIPROC_DIR"] = path
