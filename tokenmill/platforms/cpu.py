"""The CPU: float32 (bfloat16 asked for: bf16 weights, float32 activations), the torch
backend (compiled kernels + SDPA), a KV budget that is the machine's (split across the ranks
on it; by default what the batch can fill, at most 4 GiB and a quarter of the free memory),
glibc told to keep freed step buffers; Triton kernels only in Triton's interpreter (tests)."""

from __future__ import annotations

import logging
from typing import Any

import torch

from tokenmill.attention.backend import AttentionBackend
from tokenmill.platforms.interface import Platform, register_platform, triton_backend

logger = logging.getLogger(__name__)


@register_platform
class CpuPlatform(Platform):
    device_type = "cpu"

    def default_dtype(self, hf_config: Any) -> torch.dtype:
        return torch.float32  # CPU 16-bit matmuls are slower than fp32 without AMX

    def model_dtypes(self, dtype: torch.dtype) -> tuple[torch.dtype, bool]:
        """bfloat16 with the compiled kernels: linear weights in bf16 panels (AVX512-BF16 dot
        products where the CPU has them), everything else in float32 (the compiled decode
        step, attention and KV kernels are float32's): 1.9-2.2x fp32's matmuls on a Zen 4.
        Without them, torch's bf16 ops."""
        from tokenmill import csrc

        if dtype == torch.bfloat16 and csrc.available():
            logger.info("bfloat16 on this CPU: linear weights in bf16 (%s), activations and "
                        "KV cache in float32", "AVX512-BF16 dot products" if csrc.bf16_native()
                        else "no AVX512-BF16 here: widened to float32")
            return torch.float32, True
        return dtype, False

    def attention_backend(self, choice: str) -> AttentionBackend:
        if choice == "triton":
            from tokenmill.config.env import triton_interpreted

            if not triton_interpreted():
                raise ValueError("attention_backend 'triton' runs on the CPU only in Triton's "
                                 "interpreter (TRITON_INTERPRET=1); use 'torch' or 'auto'.")
            return triton_backend()
        from tokenmill.attention.torch_sdpa import TorchSDPABackend

        return TorchSDPABackend()

    def kv_budget_bytes(self, gib, utilization, profile=None, *, ranks_here: int = 1,
                        wanted: int | None = None) -> int:
        """This rank's share of the machine's budget: `gib` (checked against free memory
        before the ranks start: `check_kv_budget`), else `wanted` (max_num_seqs full
        contexts) within DEFAULT_KV_GIB and a quarter of the free memory."""
        if gib is not None:
            return int(gib * 2**30 / ranks_here)
        machine = min(DEFAULT_KV_GIB * 2**30, available_memory() // 4)
        share = machine // ranks_here
        return share if wanted is None else min(share, wanted)

    def check_kv_budget(self, gib: float | None) -> None:
        if gib is not None and gib * 2**30 > (free := available_memory()):
            raise ValueError(f"--kv-cache-memory {gib:g} GiB does not fit: this machine has "
                             f"{free / 2**30:.1f} GiB free; ask for less (or leave it out: "
                             "the default is sized from the model and the free memory).")

    def setup_process(self) -> None:
        keep_freed_cpu_memory()


DEFAULT_KV_GIB = 4  # vLLM-CPU's default KV space (VLLM_CPU_KVCACHE_SPACE)


def available_memory() -> int:
    """Bytes this machine can still hand out (MemAvailable: free plus reclaimable cache)."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    import os

    return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")  # (free pages only)


def keep_freed_cpu_memory() -> None:
    """Make glibc keep freed step buffers instead of returning them to the OS.

    A prompt step allocates activations of tens of MB; by default glibc serves those with fresh
    mmaps and unmaps them on free, so every such buffer page-faults again on the next use
    (the first 2048-token step of the default model took 4.7 s instead of 3.2 s). Buffers below
    32 MB (glibc's maximum) now come from the heap, and the heap is not trimmed."""
    import ctypes
    import ctypes.util

    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        m_trim_threshold, m_mmap_threshold = -1, -3
        libc.mallopt(m_mmap_threshold, 32 * 2**20)
        libc.mallopt(m_trim_threshold, 2**31 - 1)
    except (OSError, AttributeError):  # not glibc (macOS, musl): nothing to tune
        pass

