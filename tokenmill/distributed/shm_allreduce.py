"""The all-reduce of tensor-parallel ranks on one node through shared memory
(csrc/shm_allreduce.c), as vLLM-CPU does: gloo's TCP all-reduce took ~1.5 ms per call on this
machine even for one row, 48 calls per step of a 24-layer model (bench/results/
tensor_parallel-*). gloo stays beside it as the reference and the fallback (no compiled
kernels, other dtypes).

Rank 0 creates the segment as a file in /dev/shm; every rank maps it; once all have mapped it
rank 0 unlinks the name, so nothing is left behind whichever way the ranks end."""

from __future__ import annotations

import ctypes
import os
import tempfile

import torch

from tokenmill import csrc

LINE = 64
SLOT_FLOATS = 1 << 20  # 4 MiB per rank and parity; larger buffers go through in chunks


def segment_bytes(size: int) -> int:
    return (size + 1) * LINE + 2 * size * SLOT_FLOATS * 4


def create_segment(size: int) -> str | None:
    """Rank 0: a zeroed segment for `size` ranks; its path (None: no /dev/shm here)."""
    if not csrc.available() or not os.path.isdir("/dev/shm"):
        return None
    fd, path = tempfile.mkstemp(prefix="tokenmill-tp-", dir="/dev/shm")
    try:
        os.ftruncate(fd, segment_bytes(size))
    finally:
        os.close(fd)
    return path


class ShmAllReduce:
    def __init__(self, path: str, rank: int, size: int) -> None:
        self.rank, self.size = rank, size
        self.buffer = torch.from_file(path, shared=True, size=segment_bytes(size),
                                      dtype=torch.uint8)
        self.base = self.buffer.data_ptr()
        self.seq = ctypes.c_int64(0)
        self._call = csrc.library().tm_shm_allreduce

    def supports(self, x: torch.Tensor) -> bool:
        return x.dtype == torch.float32 and x.device.type == "cpu" and x.is_contiguous()

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        """Sum over the ranks, in place (every rank gets the same bits)."""
        if self._call(self.base, self.rank, self.size, SLOT_FLOATS, ctypes.byref(self.seq),
                      x.data_ptr(), x.numel()):
            raise RuntimeError("A tensor-parallel rank died during an all-reduce.")
        return x

    def abort(self) -> None:
        """Make every rank's waiting all-reduce return with an error (a rank is gone)."""
        self.buffer[self.size * LINE: self.size * LINE + 8].fill_(1)
