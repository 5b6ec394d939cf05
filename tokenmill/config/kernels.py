"""Kernel switches: which compiled CPU kernels and which GPU kernel choices run, resolved
from the TOKENMILL_* variables once at start-up (`KernelConfig`, carried by `EngineConfig`)
and put in force while an engine builds its model (`using`; kernels ask `current()`)."""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator
from dataclasses import dataclass

from tokenmill.config.env import Env, cache_dir


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
        cache = cache_dir(environ)
        environ = Env(environ).environ
        return cls(enabled=environ.get("TOKENMILL_CPU_KERNELS", "1") != "0",
                   compiler=environ.get("CC", "cc"),
                   cache_dir=os.path.join(cache, "kernels"),
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
        env = Env(environ)
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


@dataclass(frozen=True)
class KernelConfig:
    """Every kernel switch, resolved once (`EngineConfig.kernels`; worker processes get the
    API process's copy with the rest of the configuration)."""

    cpu: CpuKernelSettings
    gpu: GpuKernelSettings

    @classmethod
    def from_env(cls, environ=None) -> KernelConfig:
        return cls(cpu=CpuKernelSettings.from_env(environ),
                   gpu=GpuKernelSettings.from_env(environ))


_in_force: KernelConfig | None = None


@contextlib.contextmanager
def using(kernels: KernelConfig) -> Iterator[None]:
    """`kernels` in force while an engine's model is built, loaded and its step paths chosen
    (worker/model_runner.py): the loaders and kernels below read them through `current()`."""
    global _in_force
    before, _in_force = _in_force, kernels
    try:
        yield
    finally:
        _in_force = before


def current() -> KernelConfig:
    """The switches in force; outside an engine's start-up (the convert and quantize tools, a
    loader called on its own) the environment's, read now."""
    return _in_force if _in_force is not None else KernelConfig.from_env()
