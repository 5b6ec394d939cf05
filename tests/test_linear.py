"""Linear kernels chosen after loading: the packed CPU kernel against the dense one."""

import torch
from torch import nn

from tokenmill.layers.linear import (
    CpuPackedKernel,
    DenseKernel,
    Linear,
    MergedLinear,
    choose_linear_kernels,
)


def test_packed_cpu_kernel_matches_dense_for_any_row_count():
    torch.manual_seed(0)
    layer = MergedLinear(48, [40, 24], bias=True)
    layer.weight.data.normal_(std=0.2)
    layer.bias.data.normal_()
    dense = Linear(48, 64, bias=True)
    dense.weight.data.copy_(layer.weight.data)
    dense.bias.data.copy_(layer.bias.data)
    assert CpuPackedKernel.supports(layer)
    layer.use_kernel(CpuPackedKernel(layer))
    assert layer.weight is None  # the packed copy replaced it
    for rows in (0, 1, 7, 32, 100):
        x = torch.randn(rows, 48)
        torch.testing.assert_close(layer(x), dense(x), atol=1e-5, rtol=1e-5)
    wide = torch.randn(5, 80)[:, 16:64]  # a non-contiguous view of activations
    torch.testing.assert_close(layer(wide), dense(wide), atol=1e-5, rtol=1e-5)


def test_choose_kernels_keeps_a_tied_embedding_and_skips_other_dtypes():
    model = nn.Module()
    model.embed = nn.Embedding(30, 16)
    model.head = Linear(16, 30)
    model.head.weight = model.embed.weight  # tied, as in LlamaForCausalLM
    model.half_proj = Linear(16, 8).to(torch.bfloat16)
    counts = choose_linear_kernels(model)
    assert counts == {"cpu-packed": 1, "dense": 1}
    assert isinstance(model.half_proj.kernel, DenseKernel)
    assert model.embed.weight is not None and model.embed.weight.shape == (30, 16)
    hidden = torch.randn(3, 16)
    torch.testing.assert_close(model.head(hidden), hidden @ model.embed.weight.T,
                               atol=1e-5, rtol=1e-5)
