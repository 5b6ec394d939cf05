"""Building and loading the compiled CPU kernels: the `.c` files beside this module compiled
once per machine (`-march=native`, keyed by the sources, the compiler and the CPU's flags) into
a cached library, loaded with ctypes and its functions' argument types declared."""

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

from tokenmill.config import kernels as kernel_switches

logger = logging.getLogger("tokenmill.csrc")

_HERE = os.path.dirname(__file__)
_SOURCES = [os.path.join(_HERE, name)
            for name in ("gemm.c", "panel_gemm.c", "f32_panel.c", "bf16_panel.c",
                         "dequant_panels.c", "vnni_panels.c", "fp4_experts.c", "kquant_panels.c",
                         "paged_attention.c", "prompt_attention.c", "layer_ops.c",
                         "decode_step.c", "shm_allreduce.c", "lora.c")]
_HEADERS = [os.path.join(_HERE, name)
            for name in ("simd.h", "kernels.h", "panel.h", "kv_rows.h", "vnni_tile.h")]
# -ffp-contract=off: a separate multiply and add stay two roundings, as in the torch formulas
# the kernels replace (explicit FMA intrinsics are unaffected).
_FLAGS = ["-O3", "-march=native", "-mavx2", "-mfma", "-mf16c", "-ffp-contract=off", "-fopenmp",
          "-shared", "-fPIC"]


@lru_cache(maxsize=1)
def _cpu_flags() -> frozenset[str]:
    if sys.platform != "linux":
        return frozenset()
    try:
        with open("/proc/cpuinfo") as f:
            return frozenset(next((line for line in f if line.startswith("flags")), "").split())
    except OSError:
        return frozenset()


def cpu_has_avx2() -> bool:
    return {"avx2", "fma", "f16c"} <= _cpu_flags()


def _build(compiler: str, cache_dir: str) -> str:
    source = b""
    for path in _SOURCES + _HEADERS:
        with open(path, "rb") as f:
            source += f.read()
    version = subprocess.run([compiler, "--version"], capture_output=True, text=True).stdout
    # -march=native builds for this CPU (AVX-512 where it has it): a cache shared by machines
    # of another kind must not hand them this build, so the CPU's flags are part of the key.
    cpu = " ".join(sorted(_cpu_flags()))
    key = hashlib.sha256(source + version.encode() + " ".join(_FLAGS).encode()
                         + cpu.encode()).hexdigest()[:16]
    target = os.path.join(cache_dir, f"cpu_kernels-{key}.so")
    if os.path.isfile(target):
        return target
    os.makedirs(os.path.dirname(target), exist_ok=True)
    logger.info("building the CPU kernels for this machine (once: cached in %s)", cache_dir)
    # Build beside the target and rename: concurrent processes never load a half-written file.
    fd, tmp = tempfile.mkstemp(suffix=".so", dir=os.path.dirname(target))
    os.close(fd)
    try:
        subprocess.run([compiler, *_FLAGS, *_SOURCES, "-o", tmp], check=True,
                       capture_output=True, text=True, timeout=120)
        os.replace(tmp, target)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    return target


@lru_cache(maxsize=1)
def loaded() -> ctypes.CDLL | None:
    """The library, built on first use; None where it cannot be (switched off, no AVX2, no
    compiler, a failed build: logged)."""
    settings = kernel_switches.current().cpu
    if not settings.enabled or not cpu_has_avx2():
        return None
    compiler = shutil.which(settings.compiler) or shutil.which("gcc")
    if compiler is None:
        logger.warning("No C compiler found: CPU kernels fall back to slower torch ops.")
        return None
    try:
        path = _build(compiler, settings.cache_dir)
    except (OSError, subprocess.SubprocessError) as exc:
        detail = getattr(exc, "stderr", "") or exc
        logger.warning("Building the CPU kernels failed (%s): using torch ops instead.",
                       str(detail).strip()[:500])
        return None
    # torch is imported first, so the library's libgomp.so.1 resolves to the runtime torch
    # already loaded: one OpenMP thread pool, sized by torch.set_num_threads.
    lib = ctypes.CDLL(path)
    i64, ptr = ctypes.c_int64, ctypes.c_void_p
    lib.tm_int8_gemm.argtypes = [ptr] * 5 + [i64] * 4
    lib.tm_int4_gemm.argtypes = [ptr] * 6 + [i64] * 4
    lib.tm_paged_decode_attention.argtypes = ([ptr, i64] + [ptr] * 3 + [i64] + [ptr] * 2
                                              + [i64] * 5 + [ctypes.c_float, i64, i64, ptr])
    f32 = ctypes.c_float
    lib.tm_prompt_attention.argtypes = ([ptr, i64] + [ptr] * 3 + [i64, ptr, i64, ptr] + [i64] * 4
                                        + [f32, i64])
    lib.tm_prompt_attention.restype = i64
    lib.tm_quantize_rows_q16.argtypes = [ptr] * 4 + [i64] * 2
    lib.tm_int8_gemm_q16.argtypes = [ptr] * 6 + [i64] * 4
    lib.tm_int4_gemm_q16.argtypes = [ptr] * 8 + [i64] * 3
    lib.tm_f32_panel_gemm.argtypes = [ptr] * 4 + [i64] * 4
    lib.tm_f32_panel_glu.argtypes = [ptr] * 4 + [i64] * 4
    lib.tm_f32_panel_glu.restype = i64
    lib.tm_bf16_to_panels.argtypes = [ptr] + [i64] * 3 + [ptr]
    lib.tm_bf16_panel_gemm.argtypes = [ptr] * 4 + [i64] * 4
    lib.tm_bf16_panel_gemm.restype = i64
    lib.tm_bf16_panel_glu.argtypes = [ptr] * 4 + [i64] * 4
    lib.tm_bf16_panel_glu.restype = i64
    lib.tm_bf16_native.restype = i64
    lib.tm_int8_to_panels.argtypes = [ptr] * 2 + [i64] * 3 + [ptr]
    lib.tm_int4_to_panels.argtypes = [ptr] * 3 + [i64] * 3 + [ptr]
    lib.tm_int8_to_vnni.argtypes = [ptr] * 2 + [i64] * 3 + [ptr] * 2
    lib.tm_int4_to_vnni.argtypes = [ptr] * 3 + [i64] * 3 + [ptr] * 3
    lib.tm_vnni_native.restype = i64
    lib.tm_int8_vnni_gemm.argtypes = [ptr] * 6 + [i64] * 4
    lib.tm_int4_vnni_gemm.argtypes = [ptr] * 8 + [i64] * 4
    lib.tm_fp4_vnni_gemm.argtypes = [ptr] * 6 + [i64] * 3
    lib.tm_fp4_experts.argtypes = [ptr] + [i64] * 4 + [ptr] * 2 + [i64, ptr, f32, f32, ptr]
    lib.tm_kquant_panel_bytes.argtypes = [i64] * 2
    lib.tm_kquant_panel_bytes.restype = i64
    lib.tm_quantize_rows_q8x2.argtypes = [ptr] * 5 + [i64] * 2
    lib.tm_kquant_gemm.argtypes = [i64] + [ptr] * 7 + [i64] * 3
    lib.tm_add_rms_norm.argtypes = [ptr] * 4 + [i64] * 2 + [f32]
    lib.tm_rotary.argtypes = [ptr] + [i64] * 4 + [ptr] * 3
    lib.tm_silu_and_mul.argtypes = [ptr] * 2 + [i64] * 2
    lib.tm_argmax_rows.argtypes = [ptr] + [i64] * 3 + [ptr]
    lib.tm_write_kv.argtypes = [ptr] * 2 + [i64] * 2 + [ptr] * 3 + [i64] * 4
    lib.tm_lora_add.argtypes = [ptr] * 2 + [i64] * 3 + [ptr] * 2 + [i64] * 3 + [ptr] * 4
    lib.tm_decode_layers.argtypes = [ptr] * 3 + [i64] + [ptr] * 3 + [i64, ptr]
    lib.tm_decode_layers.restype = i64
    lib.tm_shm_allreduce.argtypes = [ptr] + [i64] * 3 + [ptr, ptr, i64]
    lib.tm_shm_allreduce.restype = i64
    return lib


def address(t: torch.Tensor | None) -> int | None:
    """A tensor's data address for the kernels (None stays a NULL pointer)."""
    return None if t is None else t.data_ptr()
