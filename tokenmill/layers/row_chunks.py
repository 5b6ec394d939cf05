"""Row chunks for a CPU prompt step's MLP, so its large intermediate buffers stay on the heap
(a device concern kept out of the models: on other devices a step is never cut)."""

from __future__ import annotations

import torch

# The largest gate|up output a CPU prompt step allocates at once. glibc serves blocks above
# its mmap threshold (32 MB at most) with fresh mappings and unmaps them when freed, so each
# one page-faults in again on every layer: on the Qwen2.5-0.5B shape a 2,048-token step's
# 80 MB gate|up output (and 40 MB SiLU output) spent ~1 s of a 6-8 s step clearing pages.
# Cutting the MLP into row chunks keeps those buffers on the heap; the CPU kernels' sums for a
# row do not depend on the rows beside it, and chunks of 256+ rows keep the prompt GEMMs at
# their large-batch rate (bench/NOTES.md).
MLP_CHUNK_BYTES = 24 * 2**20


def mlp_chunk_rows(x: torch.Tensor, gate_up_width: int) -> int:
    """Rows per MLP chunk for x [T, H]: all of them off the CPU or where the buffers are small,
    else about equal chunks of at least 256 rows whose gate|up output fits MLP_CHUNK_BYTES
    where it can (every chunk keeps over 128 rows: the int8 / int4 kernels of CPUs without
    VNNI switch paths by row count there, and a prompt's rows should not)."""
    t = x.shape[0]
    total = t * gate_up_width * x.element_size()
    if x.dim() != 2 or x.device.type != "cpu" or total <= MLP_CHUNK_BYTES or t < 512:
        return t
    rows = max(256, -(-t // -(-total // MLP_CHUNK_BYTES)))
    return -(-t // -(-t // rows))  # equal chunks: none left with a few rows
