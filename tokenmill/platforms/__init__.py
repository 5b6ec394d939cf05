"""What depends on the device, behind one small interface: the default dtype, the attention
backend, the KV-cache budget and whether decode steps are captured as CUDA graphs. The model
runner asks the `Platform` of its device; models never branch on the device.

Built in: cpu.py and cuda.py. An out-of-tree device (as vLLM-Ascend plugs an NPU into vLLM)
registers its own `Platform` subclass for its torch device type, either by calling
`register_platform` or through a `tokenmill.platforms` entry point naming the class."""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable
from importlib.metadata import entry_points
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

    @abstractmethod
    def attention_backend(self, choice: str) -> AttentionBackend:
        """The backend for `choice` ("auto", "torch", "triton"), or a ValueError saying why
        this device has none of that name."""

    @abstractmethod
    def kv_budget_bytes(self, gib: float | None, utilization: float,
                        profile: Callable[[], None] | None = None) -> int:
        """Bytes for K/V blocks: `gib` when set, else this device's default; `profile` runs
        the largest step once (its activations must fit beside the cache)."""

    def reserved_bytes(self) -> int:
        """Device memory this process holds in torch's caching allocator (0 where it has
        none: the CPU): measured around the CUDA-graph captures, which sit outside the KV
        budget."""
        return 0

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


def get_platform(device: torch.device) -> Platform:
    if device.type not in _PLATFORMS:
        from tokenmill.platforms import cpu, cuda  # noqa: F401 - they register themselves

        for point in entry_points(group="tokenmill.platforms"):
            if point.name == device.type:
                register_platform(point.load())
    if device.type not in _PLATFORMS:
        raise ValueError(f"No tokenmill platform for device type {device.type!r}; built in: "
                         f"{', '.join(sorted(_PLATFORMS))}.")
    return _PLATFORMS[device.type](device)


def triton_backend(fresh_sdpa: bool = False) -> AttentionBackend:
    try:
        from tokenmill.attention.triton.backend import TritonBackend
    except ImportError:
        raise ValueError("attention_backend 'triton' needs the triton package "
                         "(pip install triton)") from None
    return TritonBackend(fresh_sdpa)


def resolve_device(name: str, rank: int = 0, ranks_per_node: int = 1) -> torch.device:
    """The device of parallel rank `rank`: on GPUs, one GPU per rank of a node (cuda:N
    pins every rank to N)."""
    if name == "auto":
        name = "cuda" if torch.cuda.is_available() else "cpu"
    device = torch.device(name)
    if device.type != "cuda" or device.index is not None:
        return device
    visible = torch.cuda.device_count()
    if ranks_per_node > visible:
        raise ValueError(f"{ranks_per_node} parallel ranks per node need as many GPUs; "
                         f"{visible} visible (CUDA_VISIBLE_DEVICES).")
    return torch.device("cuda", rank % ranks_per_node)
