"""NVIDIA GPUs: the checkpoint's 16-bit dtype (bf16 when it names none), the Triton backend,
the KV budget from `gpu_memory_utilization` once the weights are resident and the largest
step's activations measured, decode steps as
CUDA graphs (worker/cuda_graphs.py)."""

from __future__ import annotations

from typing import Any

import torch

from tokenmill.attention.backend import AttentionBackend
from tokenmill.platforms.interface import Platform, register_platform, triton_backend


@register_platform
class CudaPlatform(Platform):
    device_type = "cuda"
    supports_graphs = True

    def default_dtype(self, hf_config: Any) -> torch.dtype:
        dtype = getattr(hf_config, "dtype", None) or getattr(hf_config, "torch_dtype", None)
        if isinstance(dtype, str):
            dtype = getattr(torch, dtype, None)
        return dtype if dtype in (torch.float16, torch.bfloat16) else torch.bfloat16

    def attention_backend(self, choice: str) -> AttentionBackend:
        if choice == "torch":
            from tokenmill.attention.torch_sdpa import TorchSDPABackend

            return TorchSDPABackend()
        try:
            return triton_backend(fresh_sdpa=True)
        except ValueError:
            if choice == "triton":
                raise
            from tokenmill.attention.torch_sdpa import TorchSDPABackend

            return TorchSDPABackend()  # auto without triton installed

    def check_kv_cache(self, dtype: torch.dtype, backend: AttentionBackend) -> None:
        """Triton has float8 e4m3 from compute capability 8.9 (Ada, Hopper) on: an A100's
        kernels could neither write nor read a float8 cache (torch's ops convert anywhere)."""
        if dtype != torch.float8_e4m3fn or not backend.triton_kernels:
            return
        major, minor = torch.cuda.get_device_capability(self.device)
        if (major, minor) < (8, 9):
            raise ValueError(f"--kv-cache-dtype fp8 needs float8 in the GPU's Triton kernels "
                             f"(compute capability 8.9 or later: Ada, Hopper); this GPU is "
                             f"{major}.{minor}. Drop the flag, or run the torch attention "
                             "backend (--attention-backend torch).")

    def reserved_bytes(self) -> int:
        return torch.cuda.memory_reserved(self.device)

    def empty_cache(self) -> None:
        torch.cuda.empty_cache()

    def kv_budget_bytes(self, gib, utilization, profile=None, *, ranks_here=1,
                        wanted=None) -> int:
        """`utilization` x the card, less what is in use (weights, CUDA context, torch's
        cache) and the peak the largest step allocates above that (`profile`). The CUDA
        graphs, captured after the cache is bound, come on top (ModelRunner.graph_bytes)."""
        if gib is not None:
            return int(gib * 2**30)
        activations = 0
        if profile is not None:
            torch.cuda.synchronize(self.device)
            torch.cuda.reset_peak_memory_stats(self.device)
            before = torch.cuda.memory_allocated(self.device)
            profile()
            torch.cuda.synchronize(self.device)
            activations = torch.cuda.max_memory_allocated(self.device) - before
            torch.cuda.empty_cache()
        free, total = torch.cuda.mem_get_info(self.device)
        return int(total * utilization) - (total - free) - activations
