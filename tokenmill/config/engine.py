"""The engine's typed configuration: every knob in one dataclass, validated once at start-up
(built by `LLM(...)` from keyword arguments, or by server.py from flags and environment)."""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any

from tokenmill.config.kernels import KernelConfig
from tokenmill.config.kv_transfer import KVTransferConfig
from tokenmill.config.multimodal import parse_limits
from tokenmill.config.pooling import RUNNERS, parse_override
from tokenmill.config.tenants import check_max_queue_time, parse_weights

_DTYPES = ("auto", "float32", "bfloat16", "float16")
_DTYPE_ALIASES = {"fp32": "float32", "float": "float32", "bf16": "bfloat16", "fp16": "float16",
                  "half": "float16"}


@dataclass
class EngineConfig:
    model: str | None = None  # HF directory, .gguf file, or None for the bundled default model
    tokenizer: str | None = None  # defaults to the model's own
    revision: str | None = None  # a hub name's branch, tag or commit (default main)
    download_dir: str | None = None  # where hub names are downloaded (default: the hub cache)
    # default sampling parameters: auto (the model's generation_config.json), vllm (none) or a
    # folder holding one; override: JSON fields over them (generation.py)
    generation_config: str = "auto"
    override_generation_config: dict | str | None = None
    # auto: float32 on CPU, the checkpoint's 16-bit type on GPU; bfloat16 on a CPU: linear
    # weights in bf16, activations and KV cache in float32 (platforms/cpu.py)
    dtype: str = "auto"
    device: str = "auto"  # auto: cuda when available, else cpu
    max_model_len: int | None = None  # default: the model's max_position_embeddings
    max_num_seqs: int = 256
    max_num_batched_tokens: int | None = None  # default: max(2048, max_model_len) if unchunked
    enable_chunked_prefill: bool = True
    block_size: int = 16
    enable_prefix_caching: bool = True
    # bytes set aside for K/V blocks; unset: 4 GiB on the CPU, gpu_memory_utilization on a GPU
    kv_cache_memory_gib: float | None = None
    gpu_memory_utilization: float = 0.9  # GPU: fraction of device memory for weights + KV
    num_kv_blocks: int | None = None  # explicit block count; overrides both budgets
    seed: int = 0
    trust_remote_code: bool = False  # accepted (vLLM's name); checkpoint code never runs
    # Weights: int8 | int4 | a8w8 | fp8 (aliases: weight_only_int8, wint4, ...), quantized at
    # load time; None: as the checkpoint is (a `tokenmill quantize` output loads quantized).
    quantization: str | None = None
    # auto: the model dtype; int8: int8 K/V with a scale per row and head; fp8 (fp8_e4m3):
    # float8 e4m3 K/V, unscaled (vLLM's default scale of 1.0)
    kv_cache_dtype: str = "auto"
    # auto: triton on GPUs, torch (compiled kernels + SDPA) on the CPU; triton on the CPU runs
    # in Triton's interpreter (TRITON_INTERPRET=1: tests)
    attention_backend: str = "auto"
    enforce_eager: bool = False  # True: no CUDA graphs (GPU decode steps run op by op)
    # schedule and launch the next step while the current one runs, its decodes reading
    # their tokens on the device (no pipeline parallel, no speculative decoding)
    async_scheduling: bool = False
    # vLLM's --speculative-config (a dict, its JSON text, or a SpeculativeConfig); None: off
    speculative_config: Any = None
    # LoRA adapters (vLLM's flags): a request may name one; at most max_loras different ones
    # run at once, of rank <= max_lora_rank; max_cpu_loras stay read in host memory (None:
    # max_loras)
    # fcfs: requests run in arrival order; priority: by each request's `priority` (lower
    # first, then arrival), which also picks whom to preempt (vLLM's --scheduling-policy);
    # fair: tenants share the steps' tokens by `tenant_weights` (config/tenants.py; 1 for a
    # tenant it does not name), each tenant's requests by priority, then arrival
    scheduling_policy: str = "fcfs"
    # the KV cache's disk tier (engine/kv_offload_tier.py): full blocks written through to this
    # folder (shared by the replicas of one machine, kept across restarts) and read back on
    # a prefix hit; bounded to kv_cache_disk_gib, least recently used files going first
    kv_cache_disk_dir: str | None = None
    kv_cache_disk_gib: float = 10.0
    # the KV cache's host-memory tier (vLLM's flags; the same engine/kv_offload_tier.py, in
    # front of the disk tier if both are set): this many GiB of full blocks in host memory,
    # for an engine whose cache is on a GPU
    kv_offloading_size: float | None = None
    kv_offloading_backend: str = "native"
    # prefill/decode disaggregation (engine/kv_transfer.py): a KVTransferConfig, or its JSON
    kv_transfer_config: Any = None
    tenant_weights: Any = None
    # seconds a request may wait before its first step (None: no limit); one past it is
    # refused (429), and the API refuses at once one it expects to wait longer
    max_queue_time: float | None = None
    # generate (text), pooling (embeddings and scores: /v1/embeddings, /v1/score, ...) or
    # auto (pooling for a sentence-transformers folder, a bare decoder or a classifier);
    # pooler_config: {"pooling_type": "LAST|MEAN|CLS|MAX", "normalize": bool} over the
    # model's own (config/pooling.py; a dict or its JSON text)
    runner: str = "auto"
    pooler_config: dict | str | None = None
    # an image-text model's images per request: {"image": N} (vLLM's flag; a dict or its
    # JSON text; default 8)
    limit_mm_per_prompt: dict | str | None = None
    # a GGUF language model's llama.cpp vision projector file (llama.cpp's --mmproj)
    mmproj: str | None = None
    # image rows the vision encoder makes in one step (default: the token budget)
    max_num_encoder_input_tokens: int | None = None
    # sleep mode (vLLM's flag): /sleep frees the KV cache (level 1) and the weights (level
    # 2) of an idle engine, /wake_up brings them back (engine/sleep_mode.py)
    enable_sleep_mode: bool = False
    enable_lora: bool = False
    max_loras: int = 1
    max_lora_rank: int = 16
    max_cpu_loras: int | None = None
    # adapters served from start-up: (name, folder, base model name or None), ids 1.. in order
    # (--lora-modules NAME=PATH or its JSON form)
    lora_modules: list[tuple[str, str, str | None]] | None = None
    # Tensor parallel: ranks splitting every layer (MP_NUM); `mp` starts ranks 1.. as
    # processes on this node; start-up waits this long for every rank to join.
    tensor_parallel_size: int = 1
    pipeline_parallel_size: int = 1  # stages the layers are split into (ranks: tp x pp)
    distributed_executor_backend: str = "mp"
    ray_address: str | None = None  # HOST:PORT of the Ray cluster (None: the local one)
    distributed_timeout: float = 120.0
    # Several nodes (torchrun-style flags, or the seed's MP_NNODE / POD_IPS): node n holds
    # ranks n * tp / nnodes ..; node 0 (rank 0, the API) serves the rendezvous at
    # master_addr:master_port; node_addr is where this node's ranks listen (None: 127.0.0.1
    # on one node, else the local address that reaches master_addr).
    # Data parallel (server only): this many engine cores, each with its own ranks, behind
    # the API processes; the machine's cores are shared out among all their ranks.
    data_parallel_size: int = 1
    # mixture-of-experts layers: whole experts per tensor-parallel rank (vLLM's flag)
    enable_expert_parallel: bool = False
    nnodes: int = 1
    node_rank: int = 0
    master_addr: str = "127.0.0.1"
    master_port: int = 29500
    node_addr: str | None = None
    # How its processes log (logs.py): text | json; debug | info | warning | error
    log_format: str = "text"
    log_level: str = "info"
    # the kernel switches (config/kernels.py); None: the TOKENMILL_* variables, read here once
    kernels: KernelConfig | None = None

    def token_budget(self, max_model_len: int) -> int:
        """Tokens one step may hold (the scheduler's budget)."""
        if self.max_num_batched_tokens is not None:
            return self.max_num_batched_tokens
        return 2048 if self.enable_chunked_prefill else max(2048, max_model_len)

    @property
    def world_size(self) -> int:
        return self.tensor_parallel_size * self.pipeline_parallel_size

    @property
    def ranks_per_node(self) -> int:
        return self.world_size // self.nnodes

    @property
    def ranks_on_machine(self) -> int:
        """Every rank of every data-parallel replica on this machine: they share its cores
        and, on a CPU, its KV budget."""
        return self.ranks_per_node * self.data_parallel_size

    def __post_init__(self) -> None:
        from tokenmill.config.model_names import split_precision

        self.model, named = split_precision(self.model)  # the seed's ORG/NAME/<precision>
        if self.quantization is None:
            self.quantization = named.get("quantization")
        if self.dtype == "auto":
            self.dtype = named.get("dtype", "auto")
        self.dtype = _DTYPE_ALIASES.get(self.dtype, self.dtype)
        from tokenmill.config.quantization import parse_method
        from tokenmill.config.speculative import SpeculativeConfig
        self.quantization = parse_method(self.quantization)
        self.speculative_config = SpeculativeConfig.parse(self.speculative_config)
        self.lora_modules = parse_lora_modules(self.lora_modules)
        from tokenmill.config.generation import checked
        if self.kernels is None:
            self.kernels = KernelConfig.from_env()
        self.override_generation_config = checked(self.generation_config,
                                                  self.override_generation_config)
        self.validate()

    def validate(self) -> None:
        def positive_int(name: str, allow_none: bool = False) -> None:
            value = getattr(self, name)
            if value is None and allow_none:
                return
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"{name} must be a positive integer, got {value!r}.")

        if self.dtype not in _DTYPES:
            raise ValueError(f"dtype must be one of {', '.join(_DTYPES)}, got {self.dtype!r}.")
        if self.device not in ("auto", "cpu", "cuda") and not self.device.startswith("cuda:"):
            raise ValueError(f"device must be 'auto', 'cpu' or 'cuda[:N]', got {self.device!r}.")
        positive_int("max_num_seqs")
        positive_int("block_size")
        positive_int("max_model_len", allow_none=True)
        positive_int("max_num_batched_tokens", allow_none=True)
        positive_int("num_kv_blocks", allow_none=True)
        if self.block_size > 256:
            raise ValueError(f"block_size must be <= 256, got {self.block_size}.")
        if self.kv_cache_memory_gib is not None and not self.kv_cache_memory_gib > 0:
            raise ValueError(
                f"kv_cache_memory_gib must be > 0, got {self.kv_cache_memory_gib!r}.")
        if not 0.0 < self.gpu_memory_utilization <= 1.0:
            raise ValueError("gpu_memory_utilization must be in (0, 1], got "
                             f"{self.gpu_memory_utilization!r}.")
        if not isinstance(self.seed, int):
            raise ValueError(f"seed must be an integer, got {self.seed!r}.")
        from tokenmill.config.quantization import ALIASES, METHODS
        if self.quantization is not None and self.quantization not in METHODS:
            raise ValueError(f"quantization must be one of {', '.join(METHODS)} (or "
                             f"{', '.join(sorted(ALIASES))}), got {self.quantization!r}.")
        positive_int("tensor_parallel_size")
        positive_int("pipeline_parallel_size")
        positive_int("data_parallel_size")
        if self.data_parallel_size > 1 and self.nnodes > 1:
            raise ValueError("--data-parallel-size with several nodes is not built yet: run "
                             "one multi-node server per replica.")
        if self.distributed_executor_backend not in ("mp", "ray"):
            raise ValueError("distributed_executor_backend must be 'mp' or 'ray', got "
                             f"{self.distributed_executor_backend!r}.")
        if self.distributed_executor_backend == "ray" and self.nnodes > 1:
            raise ValueError("--distributed-executor-backend ray places the ranks on the Ray "
                             "cluster's nodes itself: drop --nnodes / MP_NNODE.")
        if not self.distributed_timeout > 0:
            raise ValueError(f"distributed_timeout must be > 0, got {self.distributed_timeout}.")
        positive_int("nnodes")
        if self.world_size % self.nnodes:
            raise ValueError(f"MP_NUM / tensor x pipeline parallel size ({self.world_size}) "
                             f"must be divisible by MP_NNODE / --nnodes ({self.nnodes}).")
        if not 0 <= self.node_rank < self.nnodes:
            raise ValueError(f"node rank (--node-rank) must be in [0, {self.nnodes}), got "
                             f"{self.node_rank}.")
        if not 0 < self.master_port < 65536:
            raise ValueError(f"--master-port must be a TCP port, got {self.master_port}.")
        if self.attention_backend not in ("auto", "torch", "triton"):
            raise ValueError("attention_backend must be 'auto', 'torch' or 'triton', got "
                             f"{self.attention_backend!r}.")
        if self.runner not in RUNNERS:
            raise ValueError(f"runner must be one of {', '.join(RUNNERS)}, got "
                             f"{self.runner!r}.")
        self.pooler_config = parse_override(self.pooler_config)
        self.limit_mm_per_prompt = parse_limits(self.limit_mm_per_prompt)
        if self.mmproj is not None and not os.path.isfile(self.mmproj):
            raise ValueError(f"--mmproj: no such file {self.mmproj!r}.")
        if self.scheduling_policy not in ("fcfs", "priority", "fair"):
            raise ValueError("scheduling_policy must be 'fcfs', 'priority' or 'fair', got "
                             f"{self.scheduling_policy!r}.")
        self.tenant_weights = parse_weights(self.tenant_weights)
        if self.tenant_weights and self.scheduling_policy != "fair":
            raise ValueError("--tenant-weights needs --scheduling-policy fair.")
        self.max_queue_time = check_max_queue_time(self.max_queue_time, "max_queue_time")
        self._check_offload()
        self._check_kv_transfer()
        positive_int("max_loras")
        positive_int("max_lora_rank")
        positive_int("max_cpu_loras", allow_none=True)
        if self.max_lora_rank > 512:
            raise ValueError(f"max_lora_rank must be <= 512, got {self.max_lora_rank}.")
        if self.lora_modules and not self.enable_lora:
            raise ValueError("--lora-modules needs --enable-lora.")
        if self.max_cpu_loras is not None and self.max_cpu_loras < self.max_loras:
            raise ValueError(f"max_cpu_loras ({self.max_cpu_loras}) must be >= max_loras "
                             f"({self.max_loras}).")
        if self.async_scheduling and (self.pipeline_parallel_size > 1
                                      or self.speculative_config):
            raise ValueError("async_scheduling (--async-scheduling) runs without pipeline "
                             "parallel and speculative decoding: drop it, or "
                             "--pipeline-parallel-size and --speculative-config.")
        if self.enable_sleep_mode and self.world_size > 1:
            raise ValueError("--enable-sleep-mode is not built for tensor or pipeline "
                             "parallel engines: drop it, or run one rank.")
        if self.kv_cache_dtype == "fp8_e4m3":  # (vLLM's other name of it)
            self.kv_cache_dtype = "fp8"
        if self.kv_cache_dtype not in ("auto", "float32", "bfloat16", "int8", "fp8"):
            raise ValueError("kv_cache_dtype must be 'auto', 'float32', 'bfloat16', 'int8' or "
                             f"'fp8', got {self.kv_cache_dtype!r}.")

    def _check_offload(self) -> None:
        """The KV offloading tiers: --kv-offloading-size (host memory), --kv-cache-disk-dir."""
        if self.kv_offloading_backend != "native":
            raise ValueError(f"kv_offloading_backend must be 'native' (LMCache's is not built "
                             f"here), got {self.kv_offloading_backend!r}.")
        for name in ("kv_offloading_size", "kv_cache_disk_gib"):
            value = getattr(self, name)
            if (value is not None or name == "kv_cache_disk_gib") and (
                    isinstance(value, bool) or not isinstance(value, (int, float))
                    or not 0 < value < 2**20):
                raise ValueError(f"{name} must be a number of GiB > 0, got {value!r}.")
        flag = ("--kv-cache-disk-dir" if self.kv_cache_disk_dir
                else "--kv-offloading-size" if self.kv_offloading_size else None)
        if flag is None:
            return
        unsupported = [flag for flag, on in (
            ("tensor or pipeline parallel", self.world_size > 1),
            ("--async-scheduling", self.async_scheduling),
            ("--speculative-config", self.speculative_config is not None),
            ("--enable-sleep-mode", self.enable_sleep_mode),
            ("--no-enable-prefix-caching", not self.enable_prefix_caching)) if on]
        if unsupported:
            raise ValueError(f"{flag} is not built with {unsupported[0]}: drop one of them.")

    def _check_kv_transfer(self) -> None:
        self.kv_transfer_config = KVTransferConfig.parse(self.kv_transfer_config)
        if self.kv_transfer_config is None:
            return
        unsupported = [flag for flag, on in (
            ("tensor or pipeline parallel", self.world_size > 1),
            ("--enable-sleep-mode", self.enable_sleep_mode),
            ("--no-enable-prefix-caching", not self.enable_prefix_caching)) if on]
        if unsupported:
            raise ValueError(f"--kv-transfer-config is not built with {unsupported[0]}: drop "
                             "one of them.")
        _ = self.kv_transfer_config.secret  # (an unreadable secret file stops the start here)


def parse_lora_modules(values: Any) -> list[tuple[str, str, str | None]] | None:
    """vLLM's --lora-modules: NAME=PATH or JSON {"name", "path", "base_model_name"} each (or
    such tuples already) -> (name, path, base model name); names unique."""
    import json

    if not values:
        return None
    modules = []
    for value in values:
        if isinstance(value, (tuple, list)):
            name, path, base = (list(value) + [None])[:3]
        elif isinstance(value, str) and value.lstrip().startswith("{"):
            try:
                obj = json.loads(value)
            except ValueError:
                raise ValueError(f"--lora-modules: {value[:80]!r} is not valid JSON.") from None
            if not isinstance(obj, dict) or not {"name", "path"} <= obj.keys() or not set(
                    obj) <= {"name", "path", "base_model_name"}:
                raise ValueError("--lora-modules JSON takes \"name\", \"path\" and optionally "
                                 f"\"base_model_name\", got {value[:80]!r}.")
            name, path, base = obj["name"], obj["path"], obj.get("base_model_name")
        elif isinstance(value, str) and "=" in value:
            name, path = value.split("=", 1)
            base = None
        else:
            raise ValueError(f"--lora-modules takes NAME=PATH or JSON, got {str(value)[:80]!r}.")
        if not (isinstance(name, str) and name and isinstance(path, str) and path):
            raise ValueError(f"--lora-modules: an adapter needs a name and a path, got "
                             f"{str(value)[:80]!r}.")
        if base is not None and not isinstance(base, str):
            raise ValueError("--lora-modules: base_model_name must be a string.")
        modules.append((name, path, base))
    names = [name for name, _, _ in modules]
    if len(set(names)) != len(names):
        raise ValueError(f"--lora-modules names an adapter twice: {names}.")
    return modules
