"""The `Platform` interface a device implements (cpu.py, cuda.py, an out-of-tree plugin) and
the registry of those known by torch device type."""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable
from typing import Any

import torch

from tokenmill.attention.backend import AttentionBackend


class Platform(ABC):
    """The interface; cpu.py and cuda.py implement it."""

    device_type = ""
    supports_graphs = False  # decode steps captured as graphs and replayed

    def __init__(self, device: torch.device) -> None:
        self.device = device

    @abstractmethod
    def default_dtype(self, hf_config: Any) -> torch.dtype:
        """The dtype of "auto"."""

    def model_dtypes(self, dtype: torch.dtype) -> tuple[torch.dtype, bool]:
        """For a model asked for in `dtype`: the dtype it computes in, and whether its float
        linear layers keep bf16 weights beside that (default: all in `dtype`)."""
        return dtype, False

    @abstractmethod
    def attention_backend(self, choice: str) -> AttentionBackend:
        """The backend for `choice` ("auto", "torch", "triton"), or a ValueError saying why
        this device has none of that name."""

    @abstractmethod
    def kv_budget_bytes(self, gib: float | None, utilization: float,
                        profile: Callable[[], None] | None = None, *, ranks_here: int = 1,
                        wanted: int | None = None) -> int:
        """Bytes for this rank's K/V blocks: `gib` when set, else this device's default;
        `profile` runs the largest step once (its activations must fit beside the cache);
        `ranks_here`: ranks sharing this machine's memory (a device's own memory is not
        shared); `wanted`: what max_num_seqs full contexts take (a default need not exceed
        it)."""

    def check_kv_budget(self, gib: float | None) -> None:
        """A ValueError, before any rank allocates, where an asked-for budget of `gib` GiB
        cannot fit (default: a device's budget is checked as it is allocated)."""
        return None

    def reserved_bytes(self) -> int:
        """Device memory this process holds in torch's caching allocator (0 where it has
        none: the CPU): measured around the CUDA-graph captures, which sit outside the KV
        budget."""
        return 0

    def empty_cache(self) -> None:
        """Hand freed device memory back (sleep mode; default: nothing held back)."""
        return None

    def check_kv_cache(self, dtype: torch.dtype, backend: AttentionBackend) -> None:
        """A ValueError naming what to change where this device cannot keep K/V in `dtype`
        with `backend` (default: every pairing works)."""
        return None

    def setup_process(self) -> None:
        """Once per process that runs a model on this device, before loading it (default:
        nothing)."""
        return None


_PLATFORMS: dict[str, type[Platform]] = {}


def register_platform(cls: type[Platform]) -> type[Platform]:
    _PLATFORMS[cls.device_type] = cls
    return cls


def triton_backend(fresh_sdpa: bool = False) -> AttentionBackend:
    try:
        from tokenmill.attention.triton.backend import TritonBackend
    except ImportError:
        raise ValueError("attention_backend 'triton' needs the triton package "
                         "(pip install triton)") from None
    return TritonBackend(fresh_sdpa)
