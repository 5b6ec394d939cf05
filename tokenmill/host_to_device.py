"""Copies between host and device that do not synchronize them. Host lists to the device:
`torch.tensor(values, device=cuda)` copies with a stream synchronization, so every step input
built that way made the host wait for the forward still queued on the GPU; `on_device`'s
copies are ordered on the stream like any kernel, and the host goes on. Device results to
the host: `HostCopy` waits only when the values are read."""

from __future__ import annotations

import numpy as np
import torch

_NUMPY = {torch.int64: np.int64, torch.int32: np.int32, torch.float32: np.float32,
          torch.float64: np.float64, torch.bool: np.bool_}


def on_device(values, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A host list (or numpy array) as a tensor on `device`, copied without waiting for the
    device. (Through numpy: `torch.tensor` of a Python list takes 4x as long, 0.15 ms for
    2048 ints.)"""
    kind = _NUMPY.get(dtype)
    if kind is None:  # (16-bit floats: numpy has no bfloat16)
        return torch.tensor(values, dtype=dtype).to(device, non_blocking=True)
    return torch.from_numpy(np.asarray(values, dtype=kind)).to(device, non_blocking=True)


class HostCopy:
    """A device tensor's values on their way to the host: the copy is queued behind the work
    that computes them and the host goes on; `tolist()` waits for that copy alone (on the
    CPU there is nothing to wait for)."""

    def __init__(self, tensor: torch.Tensor) -> None:
        self._event = None
        if tensor.device.type == "cpu":
            self._host = tensor
            return
        self._host = torch.empty(tensor.shape, dtype=tensor.dtype, pin_memory=True)
        self._host.copy_(tensor, non_blocking=True)
        self._event = torch.Event(tensor.device)
        self._event.record()

    def tolist(self) -> list:
        if self._event is not None:
            self._event.synchronize()
        return self._host.tolist()
