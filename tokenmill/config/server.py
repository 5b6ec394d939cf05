"""The server's configuration (`ServerConfig`: the engine's `EngineConfig`, ports, API
processes, `ApiOptions`), built from defaults < the seed's environment variables (read
through env.py) < vLLM-style flags (cli.py), validated once at start-up."""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, field

from tokenmill.config.api import ApiOptions
from tokenmill.config.cli import (
    IGNORED_FLAGS,
    check_vllm_flags,
    cors_arguments,
    make_serve_parser,
)
from tokenmill.config.engine import EngineConfig
from tokenmill.config.env import Env
from tokenmill.config.parallel import node_settings
from tokenmill.config.pooling import runner_of
from tokenmill.config.speculative import from_seed

# ---------------------------------------------------------------------------------------------
# Server configuration: defaults < the seed's environment variables < vLLM-style flags.

# (field, new env name, old env name). The old name wins when both are set, as in the seed's
# start_server script (`HEALTH_HTTP_PORT=${HTTP_PORT:-${HEALTH_HTTP_PORT:-8110}}`).
_PORT_ENV = (("port", "SERVICE_HTTP_PORT", "PUSH_MODE_HTTP_PORT"),
             ("health_port", "HEALTH_HTTP_PORT", "HTTP_PORT"),
             ("grpc_port", "SERVICE_GRPC_PORT", "GRPC_PORT"),
             ("metrics_port", "METRICS_HTTP_PORT", "METRICS_PORT"))
# The seed's queue-service port: tokenmill's engine link is a private unix socket, so nothing
# listens there; the variable is accepted and logged as having no effect.
_QUEUE_PORT_ENV = ("INTER_PROC_PORT", "INFER_QUEUE_PORT")


@dataclass
class ServerConfig:
    engine: EngineConfig
    host: str = "0.0.0.0"
    port: int = 9965  # native + OpenAI + Triton-generate HTTP API
    health_port: int = 8110  # /v2/health/live, /v2/health/ready
    grpc_port: int = 8811  # KServe v2 / Triton gRPC
    metrics_port: int = 8722  # Prometheus /metrics
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
    # one engine step running this long (at the least; more for steps measured slower) is a
    # stall: vLLM's VLLM_ENGINE_ITERATION_TIMEOUT_S
    engine_iteration_timeout: float = 60.0
    max_request_body_bytes: int = 2 * 1024 * 1024  # larger bodies get 413 before parsing
    # the Batch API's files (uploads, outputs) and batch records; None: the cache folder's
    # batches/ (config/env.py's cache_dir)
    batch_dir: str | None = None
    max_batch_file_bytes: int = 200 * 1024 * 1024  # an upload's limit (OpenAI's is 200 MB)
    # hosts an image-text model's requests may name in http(s) image URLs (vLLM's flag);
    # None: remote images are refused (data URLs only)
    allowed_media_domains: list[str] | None = None
    trust_request_chat_template: bool = False  # accept `chat_template` in requests
    reasoning_parser: str | None = None  # deepseek_r1 | qwen3 | glm45 | granite: the split
    tool_call_parser: str | None = None  # hermes | llama3_json | ...: tool_choice auto
    log_requests: bool = False  # access lines carry prompt and output text
    otlp_traces_endpoint: str | None = None  # OTLP/HTTP collector: one span per request
    # /v1/load_lora_adapter and /v1/unload_lora_adapter (VLLM_ALLOW_RUNTIME_LORA_UPDATING)
    allow_runtime_lora_updating: bool = False
    # vLLM flags given that have no effect here: (flag, why), logged once at start-up
    ignored_flags: tuple[tuple[str, str], ...] = ()

    @property
    def model_names(self) -> list[str]:
        """Names accepted in `model` fields; the first is reported (vLLM: the model argument
        itself when no --served-model-name is given)."""
        return self.served_model_name or [self.engine.model or "default"]

    def validate(self) -> None:
        ports = {}
        for name, _, _ in _PORT_ENV:
            value = getattr(self, name)
            lowest = 1 if name == "port" else 0  # 0: any free port (the API's must be known)
            if not isinstance(value, int) or not lowest <= value < 65536:
                raise ValueError(f"{name} must be a TCP port in {lowest}-65535, got {value!r}.")
            if value in ports and value:
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
        if self.max_batch_file_bytes < 1024:
            raise ValueError("max_batch_file_bytes must be at least 1024, got "
                             f"{self.max_batch_file_bytes}.")
        if self.max_request_body_bytes < 1024:
            raise ValueError("max_request_body_bytes must be at least 1024, got "
                             f"{self.max_request_body_bytes}.")
        if not self.engine_iteration_timeout > 0:
            raise ValueError("VLLM_ENGINE_ITERATION_TIMEOUT_S must be > 0, got "
                             f"{self.engine_iteration_timeout}.")
        if not self.check_health_interval > 0:
            raise ValueError("CHECK_HEALTH_INTERVAL must be > 0, got "
                             f"{self.check_health_interval}.")
        if self.served_model_name is not None and not all(self.served_model_name):
            raise ValueError("served_model_name must not be empty.")
        if self.allow_runtime_lora_updating and not self.engine.enable_lora:
            raise ValueError("VLLM_ALLOW_RUNTIME_LORA_UPDATING needs --enable-lora.")
        for name, _, _ in self.engine.lora_modules or ():
            if name in self.model_names:
                raise ValueError(f"--lora-modules: {name!r} is the served model's own name.")


def build_server_config(argv: list[str], environ=None, **parser_text: str) -> ServerConfig:
    """Defaults, then the seed's environment variables, then flags; validated. `parser_text`:
    the `prog` and `description` of the --help text."""
    import math

    args = make_serve_parser(**parser_text).parse_args(argv)
    check_vllm_flags(args)
    env = Env(environ)

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
        "runner": runner_of(args.runner, args.task),
        "pooler_config": args.pooler_config,
        "limit_mm_per_prompt": args.limit_mm_per_prompt, "mmproj": args.mmproj,
        "quantization": args.quantization,
        "kv_cache_dtype": pick(args.kv_cache_dtype, "int8" if kv_int8 else None, "auto"),
        "attention_backend": pick(args.attention_backend, None, "auto"),
        "enforce_eager": bool(args.enforce_eager),
        "async_scheduling": bool(args.async_scheduling),
        "enable_sleep_mode": bool(args.enable_sleep_mode),
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
        "scheduling_policy": args.scheduling_policy or "fcfs",
        "tenant_weights": args.tenant_weights, "max_queue_time": args.max_queue_time,
        "kv_cache_disk_dir": args.kv_cache_disk_dir,
        "kv_transfer_config": args.kv_transfer_config,
        "kv_offloading_size": args.kv_offloading_size,
        "kv_offloading_backend": args.kv_offloading_backend or "native",
        **({"kv_cache_disk_gib": args.kv_cache_disk_gib}
           if args.kv_cache_disk_gib is not None else {}),
        "enable_lora": bool(args.enable_lora),
        "lora_modules": args.lora_modules,
        **{name: getattr(args, name) for name in ("max_loras", "max_lora_rank", "max_cpu_loras")
           if getattr(args, name) is not None},
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
            cors=cors_arguments(args), tenant_header=args.tenant_header or "X-Tenant-Id"),
        use_warmup=pick(args.use_warmup, env.flag("USE_WARMUP"), False),
        log_dir=pick(args.log_dir, env.text("FD_LOG_DIR"), "log"),
        shutdown_timeout=pick(args.shutdown_timeout, None, 300.0),
        check_health_interval=pick(None, env.number("CHECK_HEALTH_INTERVAL"), 10.0),
        engine_iteration_timeout=pick(None, env.number("VLLM_ENGINE_ITERATION_TIMEOUT_S"),
                                      60.0),
        max_request_body_bytes=pick(args.max_request_body_bytes, None, 2 * 1024 * 1024),
        batch_dir=args.batch_dir,
        max_batch_file_bytes=pick(args.max_batch_file_bytes, None, 200 * 1024 * 1024),
        allowed_media_domains=args.allowed_media_domains,
        trust_request_chat_template=pick(args.trust_request_chat_template, None, False),
        reasoning_parser=args.reasoning_parser,
        tool_call_parser=args.tool_call_parser,
        log_requests=bool(args.log_requests),
        otlp_traces_endpoint=args.otlp_traces_endpoint,
        allow_runtime_lora_updating=pick(
            None, env.flag("VLLM_ALLOW_RUNTIME_LORA_UPDATING", words=True), False),
        ignored_flags=tuple(flag for name, flag in IGNORED_FLAGS.items()
                            if getattr(args, name) is not None) + tuple(
            (name, "nothing listens there: the engine link is a private unix socket")
            for name in _QUEUE_PORT_ENV if env.raw(name) is not None),
        **ports)
    config.validate()
    return config


def check_ports_free(config: ServerConfig) -> None:
    """Fail fast, naming the port, when something already listens on one of ours (a node
    other than 0 runs ranks only: it listens on none of them). Ports given as 0 are left to
    `choose_free_ports`."""
    if config.engine.node_rank > 0:
        return
    checks = [(config.host, getattr(config, name)) for name, _, _ in _PORT_ENV
              if getattr(config, name)]
    engine = config.engine
    if engine.world_size > 1 and engine.node_rank == 0 and (
            engine.nnodes > 1 or engine.distributed_executor_backend == "ray"):
        # node 0 serves the ranks' rendezvous
        ray = engine.distributed_executor_backend == "ray"  # (on the node's Ray address)
        checks.append(("0.0.0.0" if ray else engine.master_addr, engine.master_port))
    for host, port in checks:
        with _bound(host, port) as sock:
            if sock is None:
                raise OSError(f"PORT: {port} occupied! Please change the port!")


def choose_free_ports(config: ServerConfig) -> None:
    """Ports given as 0 become ports free right now, distinct from each other (all are held
    at once while chosen), so the start-up line can name them."""
    with contextlib.ExitStack() as held:
        for name, _, _ in _PORT_ENV:
            if getattr(config, name) == 0:
                sock = held.enter_context(_bound(config.host, 0))
                setattr(config, name, sock.getsockname()[1])


@contextlib.contextmanager
def _bound(host: str, port: int):
    """A TCP socket bound to host:port while the block runs, or None where the port is
    taken."""
    import socket

    with socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET,
                       socket.SOCK_STREAM) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind((host, port))
        except OSError:
            yield None
            return
        yield s
