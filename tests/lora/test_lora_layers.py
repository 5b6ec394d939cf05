"""LoRALayer against the obvious per-row formula: rows grouped by slot (runs and gathered
indices), the base rows untouched, and a step seen in consecutive chunks (a CPU prompt's
MLP) equal to the step seen whole."""

import numpy as np
import torch

from tokenmill.layers.linear import Linear, MergedLinear
from tokenmill.lora.adapter import LoRAWeights
from tokenmill.lora.layers import LoRABatch, LoRALayer


def _reference(x, slots, pairs_by_slot, offsets, out_features):
    out = torch.zeros(x.shape[0], out_features)
    for row, slot in enumerate(slots):
        if slot < 0:
            continue
        for shard, (a, b) in pairs_by_slot[slot].items():
            i = shard or 0
            piece = b @ (a @ x[row])
            out[row, offsets[i]:offsets[i] + len(piece)] += piece
    return out


def test_layer_matches_rows_one_by_one():
    torch.manual_seed(0)
    layer = MergedLinear(16, [8, 4, 4])
    batch = LoRABatch()
    lora = LoRALayer(layer, batch, max_loras=3, max_rank=8, dtype=torch.float32,
                     device=torch.device("cpu"))
    pairs = {0: {0: (torch.randn(4, 16), torch.randn(8, 4)), 2: (torch.randn(2, 16),
                                                                  torch.randn(4, 2))},
             2: {1: (torch.randn(8, 16), torch.randn(4, 8))}}
    for slot, p in pairs.items():
        lora.set_slot(slot, LoRAWeights(p))
    slots = np.array([0, 0, -1, 2, 0, 2, 2, -1, 0, 0], dtype=np.int64)
    batch.set(slots, torch.device("cpu"))
    x = torch.randn(len(slots), 16)
    expected = _reference(x, slots, pairs, [0, 8, 12], 16)
    torch.testing.assert_close(lora.add(x, torch.zeros(len(slots), 16)), expected)
    chunked = torch.cat([lora.add(x[s:s + 4], torch.zeros(len(x[s:s + 4]), 16))
                         for s in range(0, len(slots), 4)])
    torch.testing.assert_close(chunked, expected)
    torch.testing.assert_close(lora.add(x, torch.zeros(len(slots), 16)), expected)  # (reset)
    lora.set_slot(0, None)  # (a slot emptied: its rows as the base model's)
    expected = _reference(x, np.where(slots == 0, -1, slots), pairs, [0, 8, 12], 16)
    torch.testing.assert_close(lora.add(x, torch.zeros(len(slots), 16)), expected)


def test_layer_without_groups_is_the_base():
    layer = Linear(8, 8)
    batch = LoRABatch()
    lora = LoRALayer(layer, batch, 1, 4, torch.float32, torch.device("cpu"))
    lora.set_slot(0, LoRAWeights({None: (torch.randn(4, 8), torch.randn(8, 4))}))
    batch.set(np.full(3, -1, dtype=np.int64), torch.device("cpu"))
    base = torch.randn(3, 8)
    assert torch.equal(lora.add(torch.randn(3, 8), base.clone()), base)


def test_compiled_products_equal_the_reference():
    """csrc/lora.c (runs of one slot in blocks, the expand without the block-diagonal zeros)
    against `add_reference`'s matmuls: slots in runs and scattered, ranks differing by slot,
    an empty slot, more rows than one block list holds."""
    from tokenmill import csrc

    if not csrc.available():
        return
    torch.manual_seed(1)
    layer = MergedLinear(40, [24, 8, 8])
    batch = LoRABatch()
    lora = LoRALayer(layer, batch, max_loras=4, max_rank=8, dtype=torch.float32,
                     device=torch.device("cpu"))
    assert lora.fast
    for slot, r in ((0, 8), (1, 3), (3, 5)):
        lora.set_slot(slot, LoRAWeights({i: (torch.randn(r, 40), torch.randn(n, r))
                                         for i, n in enumerate([24, 8, 8])}))
    rng = np.random.default_rng(0)
    for rows in (1, 7, 64, 150):
        slots = np.sort(rng.integers(-1, 4, rows)) if rows % 2 else rng.integers(-1, 4, rows)
        batch.set(slots.astype(np.int64), torch.device("cpu"))
        x, base = torch.randn(rows, 40), torch.randn(rows, 40)
        expected = lora.add_reference(x, base.clone(), batch.groups)
        torch.testing.assert_close(lora.add(x, base.clone()), expected, rtol=1e-5, atol=1e-5)
