"""The engine's typed configuration: every knob in one dataclass, validated once at start-up."""

from __future__ import annotations

from dataclasses import dataclass

_DTYPES = ("auto", "float32", "bfloat16", "float16")
_DTYPE_ALIASES = {"fp32": "float32", "float": "float32", "bf16": "bfloat16", "fp16": "float16",
                  "half": "float16"}


@dataclass
class EngineConfig:
    model: str | None = None  # HF directory, .gguf file, or None for the bundled default model
    tokenizer: str | None = None  # defaults to the model's own
    dtype: str = "auto"  # auto: float32 on CPU, the checkpoint's 16-bit type on GPU
    device: str = "auto"  # auto: cuda when available, else cpu
    max_model_len: int | None = None  # default: the model's max_position_embeddings
    max_num_seqs: int = 256
    max_num_batched_tokens: int | None = None  # default: max(2048, max_model_len) if unchunked
    enable_chunked_prefill: bool = True
    block_size: int = 16
    enable_prefix_caching: bool = True
    kv_cache_memory_gib: float = 4.0  # CPU: bytes set aside for K/V blocks
    gpu_memory_utilization: float = 0.9  # GPU: fraction of device memory for weights + KV
    num_kv_blocks: int | None = None  # explicit block count; overrides both budgets
    seed: int = 0
    trust_remote_code: bool = False

    def __post_init__(self) -> None:
        self.dtype = _DTYPE_ALIASES.get(self.dtype, self.dtype)
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
        if not self.kv_cache_memory_gib > 0:
            raise ValueError(
                f"kv_cache_memory_gib must be > 0, got {self.kv_cache_memory_gib!r}.")
        if not 0.0 < self.gpu_memory_utilization <= 1.0:
            raise ValueError("gpu_memory_utilization must be in (0, 1], got "
                             f"{self.gpu_memory_utilization!r}.")
        if not isinstance(self.seed, int):
            raise ValueError(f"seed must be an integer, got {self.seed!r}.")
