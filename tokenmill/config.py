"""Configuration: the engine's knobs (`EngineConfig`, in engine_config.py) and the server's,
built from defaults < the seed's environment variables < vLLM-style flags, validated once at
start-up. The only module that reads environment variables."""

from __future__ import annotations

from dataclasses import dataclass, field

from tokenmill.api_options import ApiOptions
from tokenmill.engine_config import EngineConfig
from tokenmill.parallel_config import node_settings
from tokenmill.serve_args import (
    IGNORED_FLAGS,
    check_vllm_flags,
    cors_arguments,
    make_serve_parser,
)
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
    chat_template: str | None = None  # a file or the template's text, over the tokenizer's
    api: ApiOptions = field(default_factory=ApiOptions)
    use_warmup: bool = False
    log_dir: str = "log"
    shutdown_timeout: float = 300.0  # SIGTERM: seconds to let in-flight requests finish
    check_health_interval: float = 10.0  # engine silent this long => not ready, requests fail
    max_request_body_bytes: int = 2 * 1024 * 1024  # larger bodies get 413 before parsing
    trust_request_chat_template: bool = False  # accept `chat_template` in requests
    reasoning_parser: str | None = None  # deepseek_r1 | qwen3: chat output's <think> split
    tool_call_parser: str | None = None  # hermes | llama3_json | ...: tool_choice auto
    log_requests: bool = False  # access lines carry prompt and output text
    otlp_traces_endpoint: str | None = None  # OTLP/HTTP collector: one span per request
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
        self.api.validate()
        if self.max_request_body_bytes < 1024:
            raise ValueError("max_request_body_bytes must be at least 1024, got "
                             f"{self.max_request_body_bytes}.")
        if not self.check_health_interval > 0:
            raise ValueError("CHECK_HEALTH_INTERVAL must be > 0, got "
                             f"{self.check_health_interval}.")
        if self.served_model_name is not None and not all(self.served_model_name):
            raise ValueError("served_model_name must not be empty.")


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
    check_vllm_flags(args)
    env = _Env(environ)

    def pick(flag, env_value, default=None):
        return flag if flag is not None else env_value if env_value is not None else default

    if args.enable_auto_tool_choice and not args.tool_call_parser:
        raise ValueError("--enable-auto-tool-choice needs --tool-call-parser (hermes, "
                         "llama3_json, mistral, deepseek_v3 or pythonic).")
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
        "enable_chunked_prefill": pick(args.enable_chunked_prefill, None, True),
        "kv_cache_memory_gib": args.kv_cache_memory,
        "gpu_memory_utilization": pick(args.gpu_memory_utilization, None, 0.9),
        "num_kv_blocks": num_kv_blocks,
        "seed": pick(args.seed, None, 0),
        "quantization": args.quantization,
        "kv_cache_dtype": pick(args.kv_cache_dtype, "int8" if kv_int8 else None, "auto"),
        "attention_backend": pick(args.attention_backend, None, "auto"),
        "enforce_eager": bool(args.enforce_eager),
        "async_scheduling": bool(args.async_scheduling),
        "generation_config": pick(args.generation_config, None, "auto"),
        "revision": args.revision, "download_dir": args.download_dir,
        "override_generation_config": args.override_generation_config,
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
        "log_format": args.log_format or "text", "log_level": args.log_level or "info",
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
        chat_template=args.chat_template,
        api=ApiOptions(
            stream_interval=pick(args.stream_interval, None, 1),
            max_logprobs=pick(args.max_logprobs, None, 20),
            response_role=args.response_role or "assistant",
            prompt_tokens_details=bool(args.enable_prompt_tokens_details),
            tokens_as_ids=bool(args.return_tokens_as_token_ids),
            request_id_headers=bool(args.enable_request_id_headers),
            load_tracking=bool(args.enable_server_load_tracking),
            disable_docs=bool(args.disable_fastapi_docs), root_path=args.root_path or "",
            cors=cors_arguments(args)),
        use_warmup=pick(args.use_warmup, env.flag("USE_WARMUP"), False),
        log_dir=pick(args.log_dir, env.text("FD_LOG_DIR"), "log"),
        shutdown_timeout=pick(args.shutdown_timeout, None, 300.0),
        check_health_interval=pick(None, env.number("CHECK_HEALTH_INTERVAL"), 10.0),
        max_request_body_bytes=pick(args.max_request_body_bytes, None, 2 * 1024 * 1024),
        trust_request_chat_template=pick(args.trust_request_chat_template, None, False),
        reasoning_parser=args.reasoning_parser,
        tool_call_parser=args.tool_call_parser,
        log_requests=bool(args.log_requests),
        otlp_traces_endpoint=args.otlp_traces_endpoint,
        ignored_flags=tuple(flag for name, flag in IGNORED_FLAGS.items()
                            if getattr(args, name) is not None),
        **ports)
    config.validate()
    return config


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
    TOKENMILL_CPU_DECODE_STEP=0 runs decode steps layer by layer from Python, not in one
    compiled call (same results); TOKENMILL_GGUF_COMPACT=0 widens GGUF Q6_K blocks to int8
    groups of 16 (1.5x the bytes) and Q5_0 / Q5_1 to groups of 32 (1.6x) instead of keeping
    them; CC picks the compiler; XDG_CACHE_HOME moves the build cache."""

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


@dataclass(frozen=True)
class GpuKernelSettings:
    """GPU kernel choices still being measured: TOKENMILL_GPU_SKINNY_LINEAR=1: 16-bit linears
    run steps of up to 16 rows on the Triton skinny matmul where timed faster than cuBLAS
    (layers/skinny.py). TOKENMILL_FP8_BLOCKS=auto|keep|dequantize: a block-FP8 checkpoint's
    float8 weights kept (auto: on GPUs) or loaded as float weights (quantization/fp8_blocks.py),
    also in a pre-sharded folder's files (auto or keep: float8; convert/sharded.py).
    TOKENMILL_GPU_PIECEWISE_GRAPHS=0: no piecewise CUDA graphs (worker/piecewise_graphs.py).
    TOKENMILL_CPU_GRAPH_BUCKETS=1: the graphs' buckets run eagerly on the CPU (the tests,
    tensor-parallel ranks included)."""

    skinny_linear: bool = False
    fp8_blocks: str = "auto"
    piecewise_graphs: bool = True
    cpu_graph_buckets: bool = False

    @classmethod
    def from_env(cls, environ=None) -> GpuKernelSettings:
        import os

        env = _Env(os.environ if environ is None else environ)
        fp8_blocks = (env.text("TOKENMILL_FP8_BLOCKS") or "auto").lower()
        if fp8_blocks not in ("auto", "keep", "dequantize"):
            raise ValueError("Environment variable TOKENMILL_FP8_BLOCKS must be auto, keep "
                             f"or dequantize, got {fp8_blocks!r}.")
        return cls(skinny_linear=bool(env.flag("TOKENMILL_GPU_SKINNY_LINEAR")),
                   fp8_blocks=fp8_blocks,
                   piecewise_graphs=env.flag("TOKENMILL_GPU_PIECEWISE_GRAPHS") is not False,
                   cpu_graph_buckets=bool(env.flag("TOKENMILL_CPU_GRAPH_BUCKETS")))

    def keep_fp8_blocks(self, device) -> bool:
        return self.fp8_blocks == "keep" or (self.fp8_blocks == "auto"
                                             and device.type == "cuda")

    def fp8_blocks_in_files(self) -> bool:
        """Whether `tokenmill convert --tp-size` writes float8 weights (files serve any device)."""
        return self.fp8_blocks != "dequantize"


def share_metrics_dir(path: str) -> None:
    """PROMETHEUS_MULTIPROC_DIR = `path`, for this process and the HTTP workers it spawns
    afterwards (inherited; prometheus_client writes its metric files there)."""
    import os

    os.environ["PROMETHEUS_MULTIPROC_DIR"] = path


def md5_check(environ=None) -> bool:
    """The seed downloader's MD5_CHECK=1: files present are hashed again (sha256, not md5)."""
    import os

    return bool(_Env(os.environ if environ is None else environ).flag("MD5_CHECK"))


def triton_interpreted(environ=None) -> bool:
    """TRITON_INTERPRET=1: Triton kernels run in its interpreter (on the CPU)."""
    import os

    found = _Env(os.environ if environ is None else environ).raw("TRITON_INTERPRET")
    return found is not None and found[1].strip().lower() in ("1", "true", "on", "yes")


def hub_source(environ=None) -> str:
    """Where hub names are looked up: "modelscope" with TOKENMILL_USE_MODELSCOPE=1 (or vLLM's
    VLLM_USE_MODELSCOPE=1), else "hf" (the Hugging Face Hub, or HF_ENDPOINT's mirror)."""
    import os

    env = _Env(os.environ if environ is None else environ)
    vllm = env.raw("VLLM_USE_MODELSCOPE")  # (vLLM takes "true" / "True")
    return "modelscope" if env.flag("TOKENMILL_USE_MODELSCOPE") or \
        (vllm is not None and vllm[1].strip().lower() in ("1", "true")) else "hf"
