"""The compiled CPU kernels of `cpu_gemm.c`: built once per machine with the system C compiler
and cached, then called through ctypes on tensors' memory.

Why compile at run time: torch's own int8/int4 weight matmuls (`_weight_int8pack_mm`,
`_weight_int4pack_mm_for_cpu`) are 2.6x / 5x slower than fp32 on AVX2 CPUs (bench/NOTES.md),
and a plain C file needs no torch headers (builds in about a second). Without a compiler, or
without AVX2/FMA/F16C, `available()` is False and the quantized layers use their torch fallback."""

from __future__ import annotations

import ctypes
import hashlib
import logging
import os
import shutil
import subprocess
import sys
import tempfile
from functools import lru_cache

import torch

from tokenmill.config import CpuKernelSettings

logger = logging.getLogger(__name__)

_SOURCE = os.path.join(os.path.dirname(__file__), "cpu_gemm.c")
_FLAGS = ["-O3", "-march=native", "-mavx2", "-mfma", "-mf16c", "-fopenmp", "-shared", "-fPIC"]


def _cpu_has_avx2() -> bool:
    if sys.platform != "linux":
        return False
    try:
        with open("/proc/cpuinfo") as f:
            flags = next((line for line in f if line.startswith("flags")), "").split()
    except OSError:
        return False
    return {"avx2", "fma", "f16c"} <= set(flags)


def _build(compiler: str, cache_dir: str) -> str:
    with open(_SOURCE, "rb") as f:
        source = f.read()
    version = subprocess.run([compiler, "--version"], capture_output=True, text=True).stdout
    key = hashlib.sha256(source + version.encode() + " ".join(_FLAGS).encode()).hexdigest()[:16]
    target = os.path.join(cache_dir, f"cpu_gemm-{key}.so")
    if os.path.isfile(target):
        return target
    os.makedirs(os.path.dirname(target), exist_ok=True)
    # Build beside the target and rename: concurrent processes never load a half-written file.
    fd, tmp = tempfile.mkstemp(suffix=".so", dir=os.path.dirname(target))
    os.close(fd)
    try:
        subprocess.run([compiler, *_FLAGS, _SOURCE, "-o", tmp], check=True,
                       capture_output=True, text=True, timeout=120)
        os.replace(tmp, target)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    return target


@lru_cache(maxsize=1)
def _library() -> ctypes.CDLL | None:
    settings = CpuKernelSettings.from_env()
    if not settings.enabled or not _cpu_has_avx2():
        return None
    compiler = shutil.which(settings.compiler) or shutil.which("gcc")
    if compiler is None:
        logger.warning("No C compiler found: quantized layers use the slower torch fallback.")
        return None
    try:
        path = _build(compiler, settings.cache_dir)
    except (OSError, subprocess.SubprocessError) as exc:
        detail = getattr(exc, "stderr", "") or exc
        logger.warning("Building the CPU quantized kernels failed (%s): using the torch "
                       "fallback.", str(detail).strip()[:500])
        return None
    # torch is imported first, so the library's libgomp.so.1 resolves to the runtime torch
    # already loaded: one OpenMP thread pool, sized by torch.set_num_threads.
    lib = ctypes.CDLL(path)
    i64, ptr = ctypes.c_int64, ctypes.c_void_p
    lib.tm_int8_gemm.argtypes = [ptr] * 5 + [i64] * 4
    lib.tm_int4_gemm.argtypes = [ptr] * 6 + [i64] * 4
    return lib


def available() -> bool:
    return _library() is not None


def _ptr(t: torch.Tensor | None) -> int | None:
    return None if t is None else t.data_ptr()


def int8_gemm(x: torch.Tensor, qweight: torch.Tensor, scale: torch.Tensor,
              bias: torch.Tensor | None, group: int) -> torch.Tensor:
    """x [M, K] float32 contiguous; qweight int8 [N, K]; scale float32 [N, K // group]."""
    m, k = x.shape
    n = qweight.shape[0]
    y = torch.empty(m, n, dtype=torch.float32)
    _library().tm_int8_gemm(_ptr(x), _ptr(qweight), _ptr(scale), _ptr(bias), _ptr(y),
                            m, n, k, group)
    return y


def int4_gemm(x: torch.Tensor, qweight: torch.Tensor, scale: torch.Tensor, mins: torch.Tensor,
              bias: torch.Tensor | None, group: int) -> torch.Tensor:
    """x [M, K] float32 contiguous; qweight uint8 [N, K // 2] (Q4 layout); scale, mins float16
    [N, K // group]."""
    m, k = x.shape
    n = qweight.shape[0]
    y = torch.empty(m, n, dtype=torch.float32)
    _library().tm_int4_gemm(_ptr(x), _ptr(qweight), _ptr(scale), _ptr(mins), _ptr(bias),
                            _ptr(y), m, n, k, group)
    return y
