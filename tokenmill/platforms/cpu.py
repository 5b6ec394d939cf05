"""The CPU: float32, the torch backend (compiled kernels + SDPA), a 4 GiB KV budget by
default; Triton kernels only in Triton's interpreter (tests)."""

from __future__ import annotations

from typing import Any

import torch

from tokenmill.attention.backend import AttentionBackend
from tokenmill.platforms import Platform, register_platform, triton_backend


@register_platform
class CpuPlatform(Platform):
    device_type = "cpu"

    def default_dtype(self, hf_config: Any) -> torch.dtype:
        return torch.float32  # CPU 16-bit matmuls are slower than fp32 without AMX

    def attention_backend(self, choice: str) -> AttentionBackend:
        if choice == "triton":
            from tokenmill.config import triton_interpreted

            if not triton_interpreted():
                raise ValueError("attention_backend 'triton' runs on the CPU only in Triton's "
                                 "interpreter (TRITON_INTERPRET=1); use 'torch' or 'auto'.")
            return triton_backend()
        from tokenmill.attention.torch_sdpa import TorchSDPABackend

        return TorchSDPABackend()

    def kv_budget_bytes(self, gib: float | None, utilization: float) -> int:
        return int((4.0 if gib is None else gib) * 2**30)
