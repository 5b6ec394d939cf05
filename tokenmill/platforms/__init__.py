"""What depends on the device, behind one small interface: the default dtype, the attention
backend, the KV-cache budget and whether decode steps are captured as CUDA graphs. The model
runner asks the `Platform` of its device; models never branch on the device.

Built in: cpu.py and cuda.py. An out-of-tree device (as vLLM-Ascend plugs an NPU into vLLM)
registers its own `Platform` subclass for its torch device type, either by calling
`register_platform` or through a `tokenmill.platforms` entry point naming the class."""

from __future__ import annotations

from importlib.metadata import entry_points

import torch

from tokenmill.platforms.interface import _PLATFORMS, Platform, register_platform

__all__ = ["Platform", "check_kv_budget", "get_platform", "register_platform",
           "resolve_device"]


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


def check_kv_budget(config) -> None:
    """Before any rank starts: the asked-for KV budget (an EngineConfig's) fits this
    machine's device (one-line ValueError otherwise)."""
    device = resolve_device(config.device, 0, config.ranks_per_node)
    get_platform(device).check_kv_budget(config.kv_cache_memory_gib)
