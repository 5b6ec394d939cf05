"""The compiled CPU layer kernels (tokenmill/csrc/layer_ops.c) against the torch formulas they
replace, on odd sizes and strided views."""

import pytest
import torch
import torch.nn.functional as F

from tokenmill import csrc
from tokenmill.attention.backend import AttentionBackend
from tokenmill.layers.norm import RMSNorm
from tokenmill.layers.rotary import RotaryEmbedding
from tokenmill.quantization.kv_cache import quantize_kv

pytestmark = pytest.mark.skipif(not csrc.available(), reason="no compiled CPU kernels")


@pytest.mark.parametrize("t,d", [(1, 576), (5, 68), (33, 896), (3, 13)])
def test_add_rms_norm_matches_hf_formula(t, d):
    torch.manual_seed(t)
    norm = RMSNorm(d, eps=1e-5)
    norm.weight.data.normal_(1, 0.2)
    x, residual = torch.randn(t, d) * 3, torch.randn(t, d)
    total = x + residual
    expect = norm.weight * (total * torch.rsqrt(total.pow(2).mean(-1, keepdim=True) + 1e-5))
    out = csrc.add_rms_norm(x.clone(), residual, norm.weight, 1e-5)
    torch.testing.assert_close(out, expect, atol=2e-6, rtol=2e-6)
    torch.testing.assert_close(residual, total, atol=0, rtol=0)  # the sum, in place
    alone = csrc.add_rms_norm(x, None, norm.weight, 1e-5)
    expect = norm.weight * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-5))
    torch.testing.assert_close(alone, expect, atol=2e-6, rtol=2e-6)


@pytest.mark.parametrize("rope_type", ["default", "linear"])
def test_rotary_in_place_on_qkv_view_matches_torch(monkeypatch, rope_type):
    torch.manual_seed(0)
    params = {"rope_type": rope_type, "rope_theta": 10000.0, "factor": 2.0}
    rotary = RotaryEmbedding(64, 300, params, 300)
    t, hq, hkv = 7, 9, 3
    qkv = torch.randn(t, (hq + 2 * hkv) * 64)
    positions = torch.tensor([0, 1, 5, 130, 299, 2, 64])
    view = qkv[:, : (hq + hkv) * 64].view(t, hq + hkv, 64)  # token stride = qkv width
    expect_table = rotary.for_step(positions, torch.float32)
    assert expect_table.compiled
    monkeypatch.setattr(csrc, "available", lambda: False)
    torch_table = rotary.for_step(positions, torch.float32)
    assert not torch_table.compiled
    expect = torch_table(view.clone())
    v_before = qkv[:, (hq + hkv) * 64:].clone()
    monkeypatch.undo()
    out = expect_table(view)
    assert out.data_ptr() == view.data_ptr()  # rotated in place
    torch.testing.assert_close(out, expect, atol=1e-6, rtol=1e-6)
    assert torch.equal(qkv[:, (hq + hkv) * 64:], v_before)  # V untouched


@pytest.mark.parametrize("t,i", [(1, 1536), (4, 4864), (3, 21)])
def test_silu_and_mul_matches_torch(t, i):
    torch.manual_seed(i)
    x = torch.randn(t, 2 * i) * 4
    x[0, :4] = torch.tensor([-100.0, 100.0, 0.0, -20.0])  # saturated and zero gates
    expect = F.silu(x[:, :i]) * x[:, i:]
    torch.testing.assert_close(csrc.silu_and_mul(x), expect, atol=1e-6, rtol=2e-6)


@pytest.mark.parametrize("kv_dtype", [torch.float32, torch.bfloat16, torch.int8])
def test_write_kv_matches_index_copy(kv_dtype, monkeypatch):
    torch.manual_seed(1)
    t, h, d, blocks, bs = 6, 3, 64, 10, 4
    qkv = torch.randn(t, (4 * h) * d) * 2
    qkv[0, 2 * h * d:2 * h * d + 3] = torch.tensor([1 + 2 ** -8, 1 + 3 * 2 ** -8,
                                                    -float("inf")])  # bf16's ties, inf
    k = qkv[:, 2 * h * d: 3 * h * d].view(t, h, d)
    v = qkv[:, 3 * h * d:].view(t, h, d)
    slots = torch.tensor([0, 7, 39, 12, 13, 25])
    width = d + 4 if kv_dtype == torch.int8 else d
    caches = [torch.zeros(blocks, bs, h, width, dtype=kv_dtype) for _ in range(4)]
    write_kv = csrc.write_kv
    write_kv(k, v, caches[0], caches[1], slots)
    for new, cache in ((k, caches[2]), (v, caches[3])):  # the torch path
        new = quantize_kv(new) if kv_dtype == torch.int8 else new.to(kv_dtype)
        cache.view(-1, h, width).index_copy_(0, slots, new)
    def same(a, b):  # bit for bit
        return torch.equal(a.view(torch.uint8), b.view(torch.uint8))

    assert same(caches[0], caches[2]) and same(caches[1], caches[3])
    # and the backend picks the kernel for such views
    fresh = [torch.zeros_like(caches[0]) for _ in range(2)]
    calls = []
    monkeypatch.setattr(csrc, "write_kv", lambda *a: calls.append(a) or write_kv(*a))
    AttentionBackend.write_kv(k, v, *fresh, slots)
    assert same(fresh[0], caches[2]) and same(fresh[1], caches[3])
    # one decode token: views of a [1, width] row get unequal token strides from `view`
    one = qkv[:1]
    k1, v1 = one[:, 2 * h * d: 3 * h * d].view(1, h, d), one[:, 3 * h * d:].view(1, h, d)
    AttentionBackend.write_kv(k1, v1, *fresh, torch.tensor([31]))
    assert len(calls) == 2
    expect = quantize_kv(k1[0]) if kv_dtype == torch.int8 else k1[0].to(kv_dtype)
    assert same(fresh[0].view(-1, h, width)[31], expect)
