"""The GPU path's adapter products (lora/triton_ops.py: rows aligned by slot, one shrink and
one expand kernel per layer) against `LoRALayer.add_reference`, and a whole engine on them:
in Triton's interpreter on a machine without a GPU (conftest sets TRITON_INTERPRET=1)."""

import numpy as np
import pytest
import torch
from helpers import hf_greedy

from tokenmill import LLM, SamplingParams
from tokenmill.layers.linear import MergedLinear
from tokenmill.lora import triton_ops
from tokenmill.lora.adapter import LoRAWeights
from tokenmill.lora.layers import LoRABatch, LoRALayer
from tokenmill.lora.request import LoRARequest

pytestmark = pytest.mark.skipif(triton_ops.kernels() is None, reason="triton not installed")
DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
TOLERANCE = {torch.float32: dict(rtol=1e-5, atol=1e-5),
             torch.float16: dict(rtol=2e-3, atol=2e-3),
             torch.bfloat16: dict(rtol=1.6e-2, atol=1.6e-2)}
DTYPES = [torch.float32, torch.float16, pytest.param(torch.bfloat16, marks=pytest.mark.skipif(
    not torch.cuda.is_available(), reason="Triton's interpreter converts to bfloat16 wrongly"))]


@pytest.mark.parametrize("dtype", DTYPES)
def test_kernels_equal_the_reference(dtype):
    """Slots in runs and scattered, ranks differing by slot (up to 2 blocks of columns), an
    empty slot, base rows, more rows than one block, a layer of 3 projections with a
    projection's output not a multiple of the column block."""
    torch.manual_seed(2)
    sizes = [72, 8, 40]
    layer = MergedLinear(48, sizes)
    batch = LoRABatch()
    lora = LoRALayer(layer, batch, max_loras=4, max_rank=16, dtype=dtype, device=DEVICE)
    for slot, r in ((0, 16), (1, 3), (3, 9)):
        lora.set_slot(slot, LoRAWeights({i: (torch.randn(r, 48) / 4, torch.randn(n, r) / 4)
                                         for i, n in enumerate(sizes)}))
    rng = np.random.default_rng(0)
    for rows in (1, 7, 40):
        slots = np.sort(rng.integers(-1, 4, rows)) if rows % 2 else rng.integers(-1, 4, rows)
        batch.set(slots.astype(np.int64), DEVICE)
        x = torch.randn(rows, 48, device=DEVICE).to(dtype)
        base = torch.randn(rows, 120, device=DEVICE).to(dtype)
        expected = lora.add_reference(x, base.clone(), batch.groups)
        aligned_rows, block_slot = batch.aligned(0, rows, 4)
        got = triton_ops.add(x, base.clone(), lora.at, lora.bt, lora.widths_t,
                             max(lora.widths), aligned_rows, block_slot)
        torch.testing.assert_close(got, expected, **TOLERANCE[dtype])
        untouched = slots < 0
        assert torch.equal(got[untouched], base[untouched])  # (the base model's rows)


def test_align_rows():
    """Every row of a slot once, in a block of that slot; the base rows only in blocks the
    kernels skip (slot -1)."""
    slots = torch.tensor([2, -1, 0, 2, 2, -1, 0])
    rows, block_slot = triton_ops.align_rows(slots, 3)
    seen = {}
    for b, slot in enumerate(block_slot.tolist()):
        for row in rows[b * triton_ops.BLOCK_M:(b + 1) * triton_ops.BLOCK_M].tolist():
            if row < len(slots):
                assert slots[row] == slot
                seen[row] = seen.get(row, 0) + 1
    assert seen == {i: 1 for i in range(len(slots))}


def test_engine_on_the_kernels(tiny_models, adapters, monkeypatch):
    """Two adapters and the base model mixed in one batch with every adapted layer's
    products in the kernels (as on a GPU: the compiled decode step off, every layer's slots
    on the kernels): greedy tokens as peft's."""
    monkeypatch.setenv("TOKENMILL_CPU_DECODE_STEP", "0")
    made = LoRALayer.__init__

    def on_the_kernels(self, *args):
        made(self, *args)
        self.fast, self.triton = False, True

    monkeypatch.setattr(LoRALayer, "__init__", on_the_kernels)
    calls = []
    add = triton_ops.add
    monkeypatch.setattr(triton_ops, "add", lambda *args: calls.append(1) or add(*args))
    path, hf_model = tiny_models("llama")
    targets = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
    a_path, a_ref = adapters("llama", "triton-a", seed=5, target_modules=targets)
    b_path, b_ref = adapters("llama", "triton-b", seed=6, r=16, target_modules=["v_proj"])
    a, b = LoRARequest("a", 1, a_path), LoRARequest("b", 2, b_path)
    prompts = [[5, 9, 23, 41, 7, 3], [100, 3, 77, 2, 9]]
    plan = [(p, lora, ref) for p in prompts for lora, ref in ((a, a_ref), (None, hf_model),
                                                               (b, b_ref))]
    greedy = SamplingParams(max_tokens=5, temperature=0, ignore_eos=True)
    with LLM(path, enable_lora=True, max_loras=2, max_model_len=128) as llm:
        outs = llm.generate([{"prompt_token_ids": p} for p, _, _ in plan], greedy,
                            use_tqdm=False, lora_request=[lora for _, lora, _ in plan])
    assert [o.outputs[0].token_ids for o in outs] == [hf_greedy(ref, p, 5)
                                                      for p, _, ref in plan]
    assert calls
