"""Linear layers whose parameters know how to load themselves from checkpoint shards, and the
kernels that multiply by them, chosen once after loading (never per call)."""

from __future__ import annotations

import contextlib

import torch
import torch.nn.functional as F
from torch import nn

from tokenmill import csrc
from tokenmill.distributed.parallel_state import divide, get_tp_group


class CheckpointSlice:
    """A safetensors tensor not read yet: a tensor-parallel rank reads only the rows or
    columns it keeps (`narrow`), so its peak memory is its shard's, not the checkpoint's."""

    def __init__(self, lazy) -> None:  # safetensors' PySafeSlice
        self._lazy = lazy
        self.shape = torch.Size(lazy.get_shape())

    def dim(self) -> int:
        return len(self.shape)

    def narrow(self, dim: int, start: int, length: int) -> torch.Tensor:
        return self._lazy[(slice(None),) * dim + (slice(start, start + length),)]

    def read(self) -> torch.Tensor:
        return self._lazy[:]


def whole(loaded: torch.Tensor | CheckpointSlice) -> torch.Tensor:
    return loaded.read() if isinstance(loaded, CheckpointSlice) else loaded


def default_weight_loader(param: nn.Parameter, loaded: torch.Tensor) -> None:
    loaded = whole(loaded)
    if param.shape != loaded.shape:
        raise ValueError(f"Checkpoint tensor has shape {tuple(loaded.shape)}, "
                         f"expected {tuple(param.shape)}.")
    param.data.copy_(loaded)


class DenseKernel:
    """`x @ W.T + b` with the layer's own weight: any device, any dtype."""

    name = "dense"

    def apply(self, layer: Linear, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, layer.weight, layer.bias)

    def apply_gated(self, layer: Linear, x: torch.Tensor) -> torch.Tensor | None:
        """silu(gate) * up of a merged gate|up layer in one pass; None: this kernel has no
        such pass (the MLP runs the product and the activation apart)."""
        return None

    def compiled_form(self) -> None:
        """The compiled decode step's description of this kernel (csrc.LinearForm); None:
        it has none, so the step runs layer by layer in Python."""
        return None


def _check_width(layer: nn.Module, x: torch.Tensor) -> None:
    """The compiled kernels trust the input's width: a wrong one would read past the rows."""
    if x.shape[-1] != layer.in_features:
        raise ValueError(f"{type(layer).__name__} takes {layer.in_features} inputs per row, "
                         f"got {x.shape[-1]}.")


class CpuPackedKernel:
    """fp32 on CPU: the weight reordered once into oneDNN's blocked layout.

    torch's plain fp32 GEMM (MKL) re-packs the weight on every call; with the few rows of a
    decode step that costs more than the multiply (measured on the default model, all layers:
    2x faster at 32 rows, 2.5x at 7, equal at 1 row; see bench/NOTES.md). The packed copy
    replaces the weight, so memory is unchanged except for an LM head tied to the embedding
    table, which keeps its rows for lookups. The compiled panel kernel (csrc/f32_panel.c) reads
    the same packed copy for any number of rows: oneDNN's single-row path streams it at ~14
    GB/s, the compiled one at ~20; on AVX2 its tiles are 1.1-1.4x faster than oneDNN from 2 to
    128 rows, 1.0-1.08x on prompts of 256-2048 rows; on AVX-512 (where oneDNN is faster) about
    par from 16 rows, 1.1-1.5x below (bench/NOTES.md). oneDNN keeps the layers whose packed
    layout the kernel cannot read."""

    name = "cpu-packed"
    # Row count oneDNN tunes the layout for; any count works. 32 was best from 1 to 512 rows.
    BATCH_HINT = 32
    # The compiled panel kernel is the fastest at every row count (LinearForm.max_rows).
    ANY_ROWS = 2**31 - 1

    def __init__(self, layer: Linear) -> None:
        weight = layer.weight.detach()
        self.packed = torch.ops.mkldnn._reorder_linear_weight(weight, self.BATCH_HINT)
        self.out_features, self.in_features = weight.shape
        self.panel_stride = self._check_panel_layout()

    def _check_panel_layout(self) -> int | None:
        """The packed copy's padded K if the compiled panel GEMV can read it, else None. The
        byte count must fit the panel layout, and one product must equal oneDNN's (a layout
        read wrongly would permute the weights)."""
        if not csrc.available():
            return None
        try:
            kp = csrc.f32_panel_stride(self.packed, self.out_features, self.in_features)
        except (AttributeError, RuntimeError):  # a torch without mkldnn's _nbytes / data_ptr
            return None
        if kp is None:
            return None
        x = torch.randn(2, self.in_features, generator=torch.Generator().manual_seed(0))
        ours = csrc.f32_panel_gemm(x, self.packed, kp, self.out_features, None)
        theirs = self._onednn(x, None)
        tolerance = 1e-4 * float(theirs.abs().max()) + 1e-30
        return kp if float((ours - theirs).abs().max()) <= tolerance else None

    @staticmethod
    def supports(layer: Linear) -> bool:
        return (layer.weight.device.type == "cpu" and layer.weight.dtype == torch.float32
                and torch.backends.mkldnn.is_available())

    def _onednn(self, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        return torch.ops.mkldnn._linear_pointwise(x, self.packed, bias, "none", [], "")

    def apply(self, layer: Linear, x: torch.Tensor) -> torch.Tensor:
        if self.panel_stride is not None and x.dim() == 2:
            return csrc.f32_panel_gemm(x.contiguous(), self.packed, self.panel_stride,
                                       self.out_features, layer.bias)
        return self._onednn(x, layer.bias)

    def apply_gated(self, layer: Linear, x: torch.Tensor) -> torch.Tensor | None:
        """silu(gate) * up of a merged gate|up layer in one pass of the panel kernel (its [M, 2I]
        product never written out: 1.07-1.11x from 16 rows up, bench/NOTES.md), bitwise what
        the product and `SiluAndMul` give; None where the kernel cannot (the caller runs them
        apart)."""
        inter = self.out_features // 2
        if self.panel_stride is None or x.dim() != 2 or inter % 64 or self.out_features % 2:
            return None
        return csrc.f32_panel_glu(x.contiguous(), self.packed, self.panel_stride, inter,
                                  layer.bias)

    def compiled_form(self) -> csrc.LinearForm | None:
        if self.panel_stride is None:
            return None
        return csrc.LinearForm(csrc.F32_PANEL, self.panel_stride, self.ANY_ROWS,
                               torch.ops.mkldnn.data_ptr(self.packed))

    def weight_bytes(self) -> int:
        return self.packed.numel() * self.packed.element_size()


# The device of the model being built while its linears' weights are deferred (a block-FP8
# checkpoint kept as float8: most linears never hold a float weight).
_DEFERRED: list[torch.device] = []


@contextlib.contextmanager
def deferred_weights(device: torch.device):
    """Linear layers built inside start with their weight on the meta device (no memory);
    `materialized` gives it memory on `device` where a loader first writes it. A weight no
    loader writes stays meta, and the loader's missing-weights check names it."""
    _DEFERRED.append(device)
    try:
        yield
    finally:
        _DEFERRED.pop()


def materialized(layer: Linear) -> nn.Parameter:
    """The layer's weight, given memory if it was deferred (same shape, dtype and loader)."""
    weight = layer.weight
    if weight.is_meta:
        real = nn.Parameter(torch.empty(weight.shape, dtype=weight.dtype,
                                        device=layer.weight_device), requires_grad=False)
        real.weight_loader = weight.weight_loader
        layer.weight = weight = real
    return weight


def writable(model: nn.Module, name: str, param: nn.Parameter) -> nn.Parameter:
    """`model`'s parameter `name` (`param`) ready for a loader's copy: a deferred linear
    weight gets its memory first (`materialized`)."""
    return materialized(model.get_submodule(name.rpartition(".")[0])) if param.is_meta \
        else param


class Linear(nn.Module):
    """A linear layer every tensor-parallel rank holds whole (replicated)."""

    # A layer whose float weight is read directly (MLA's kv_b_proj): it keeps its weight and
    # dense kernel. A layer kept in float (a mixture of experts' router): never quantized.
    keep_weight = False
    keep_float = False
    # LoRA adapters' slots for this layer (lora/layers.py's LoRALayer), once one targets it
    lora = None

    def __init__(self, in_features: int, out_features: int, bias: bool = False) -> None:
        super().__init__()
        self.in_features, self.out_features = in_features, out_features
        # (deferred: on the meta device until a loader writes it, see `deferred_weights`)
        self.weight_device = _DEFERRED[-1] if _DEFERRED else None
        self.weight = nn.Parameter(torch.empty(out_features, in_features,
                                               device="meta" if _DEFERRED else None),
                                   requires_grad=False)
        self.weight.weight_loader = default_weight_loader
        if bias:
            self.bias = nn.Parameter(torch.empty(out_features), requires_grad=False)
            self.bias.weight_loader = default_weight_loader
        else:
            self.register_parameter("bias", None)
        # DenseKernel, CpuPackedKernel or a quantized kernel (tokenmill/quantization)
        self.kernel = DenseKernel()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        _check_width(self, x)
        out = self.kernel.apply(self, x)
        return out if self.lora is None else self.lora.add(x, out)

    def apply_gated(self, x: torch.Tensor) -> torch.Tensor | None:
        """silu(gate) * up of a merged gate|up layer in one pass where its kernel has one
        (and no adapter adds to the product); None: the caller runs them apart."""
        return None if self.lora is not None else self.kernel.apply_gated(self, x)

    @property
    def device(self) -> torch.device:
        """Where the layer's weight (or the kernel replacing it) lives."""
        return self.weight_device if self.weight.is_meta else self.weight.device

    def use_kernel(self, kernel) -> None:
        """Switch to a kernel that holds its own copy of the weight; ours is dropped (a weight
        shared with another module, such as a tied embedding, lives on there)."""
        self.kernel = kernel
        self.weight = None

    def checkpoint_slice(self, shard: int | None = None) -> tuple[int, int, int] | None:
        """The part of checkpoint weight `shard` this rank keeps: (dim, start, size), or None
        for all of it (read by loaders of tensors kept quantized, such as GGUF blocks)."""
        return None


def _narrowed(dim: int, start: int, size: int):
    """A weight loader that keeps `size` entries of the checkpoint tensor from `start` along
    `dim` (this rank's shard) and zero-fills what lies past the tensor's end (padding)."""
    def load(param: nn.Parameter, loaded: torch.Tensor) -> None:
        if loaded.dim() <= dim:
            default_weight_loader(param, loaded)  # let the shape check name the mismatch
            return
        kept = max(0, min(size, loaded.shape[dim] - start))
        if kept < size:
            param.data.zero_()
        default_weight_loader(param.data.narrow(dim, 0, kept), loaded.narrow(dim, start, kept))
    return load


class ColumnParallelLinear(Linear):
    """Output channels split across the tensor-parallel ranks: rank r computes channels
    [r * out / tp, (r + 1) * out / tp); no communication. `padded_out` (>= out, a multiple of
    tp) lets an LM head split a vocabulary tp does not divide: the padding rows are zeros."""

    def __init__(self, in_features: int, out_features: int, bias: bool = False,
                 padded_out: int | None = None) -> None:
        self.tp = get_tp_group()
        local = divide(padded_out or out_features, self.tp.size, "output size")
        super().__init__(in_features, local, bias)
        self.full_out = out_features
        loader = _narrowed(0, self.tp.rank * local, local)
        self.weight.weight_loader = loader
        if bias:
            self.bias.weight_loader = loader

    def checkpoint_slice(self, shard: int | None = None) -> tuple[int, int, int] | None:
        # (rows past the checkpoint's are padding: a loader of quantized blocks cannot pad)
        return None if self.tp.size == 1 else (0, self.tp.rank * self.out_features,
                                               self.out_features)


class RowParallelLinear(Linear):
    """Input channels split across the ranks (the input is the column-parallel layer's
    output, already split): each rank's partial products summed by one all-reduce. The bias
    is added once, by rank 0 (the others hold zeros). `reduce=False`: the partial products
    are returned, for a caller that sums several layers' before one all-reduce (the experts
    of a mixture-of-experts layer)."""

    def __init__(self, in_features: int, out_features: int, bias: bool = False,
                 reduce: bool = True) -> None:
        self.tp = get_tp_group()
        self.reduce = reduce
        local = divide(in_features, self.tp.size, "input size")
        super().__init__(local, out_features, bias)
        narrowed = _narrowed(1, self.tp.rank * local, local)
        # The whole rows' absolute maxima, kept only when the loader will quantize this split
        # layer per output channel: every rank's slice then gets the scales of the unsplit
        # layer (tensor-parallel results = one rank's). Reading them reads the whole tensor.
        self.wants_row_absmax = False
        self.row_absmax: torch.Tensor | None = None

        def load(param: nn.Parameter, loaded: torch.Tensor) -> None:
            narrowed(param, loaded)
            if self.wants_row_absmax and self.tp.size > 1:
                self.row_absmax = whole(loaded).abs().amax(1).float()
        self.weight.weight_loader = load
        if bias and not self.tp.is_first:
            self.bias.weight_loader = lambda param, loaded: param.data.zero_()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        _check_width(self, x)
        out = self.kernel.apply(self, x)
        if self.lora is not None:  # (this rank's columns' share, summed with the rest)
            out = self.lora.add(x, out)
        return self.tp.all_reduce(out) if self.reduce else out

    def checkpoint_slice(self, shard: int | None = None) -> tuple[int, int, int] | None:
        return None if self.tp.size == 1 else (1, self.tp.rank * self.in_features,
                                               self.in_features)


class MergedLinear(Linear):
    """Several projections of the same input stored as one matrix (q|k|v, gate|up), so one GEMM
    does the work of several; column-parallel, each projection split on its own. Checkpoint
    shards load into their row slice by shard index.

    `shards`: per projection, (first row, rows) of the full projection this rank keeps;
    default: an equal split of each."""

    def __init__(self, in_features: int, output_sizes: list[int], bias: bool = False,
                 shards: list[tuple[int, int]] | None = None) -> None:
        self.tp = get_tp_group()
        if shards is None:
            shards = []
            for size in output_sizes:
                local = divide(size, self.tp.size, "projection size")
                shards.append((self.tp.rank * local, local))
        super().__init__(in_features, sum(rows for _, rows in shards), bias)
        self.full_sizes = output_sizes
        self.shards = shards
        self.output_sizes = [rows for _, rows in shards]  # this rank's, in order
        self.weight.weight_loader = self._load_shard
        if bias:
            self.bias.weight_loader = self._load_shard

    def _load_shard(self, param: nn.Parameter, loaded: torch.Tensor,
                    shard: int | None = None) -> None:
        if shard is None:  # the merged tensor itself (a checkpoint `tokenmill quantize` wrote)
            loaded = whole(loaded)
            if loaded.shape[0] != sum(self.full_sizes):
                default_weight_loader(param, loaded)  # the shape check names the mismatch
            for i, part in enumerate(loaded.split(self.full_sizes)):
                self._load_shard(param, part, i)
            return
        start, rows = self.shards[shard]
        offset = sum(self.output_sizes[:shard])
        default_weight_loader(param.data.narrow(0, offset, rows), loaded.narrow(0, start, rows))

    def checkpoint_slice(self, shard: int | None = None) -> tuple[int, int, int] | None:
        if shard is None or self.tp.size == 1:
            return None
        return (0, *self.shards[shard])


class QKVLinear(MergedLinear):
    """q|k|v of an attention layer, split by heads: each rank keeps heads / tp query heads and
    kv_heads / tp key/value heads, or, with fewer key/value heads than ranks, one key/value
    head shared by tp / kv_heads ranks (replicated)."""

    def __init__(self, hidden: int, head_dim: int, num_heads: int, num_kv_heads: int,
                 bias: bool = False) -> None:
        tp = get_tp_group()
        self.num_heads = divide(num_heads, tp.size, "attention heads")
        if num_kv_heads >= tp.size:
            self.num_kv_heads = divide(num_kv_heads, tp.size, "key/value heads")
            kv_first = tp.rank * self.num_kv_heads
        else:
            if tp.size % num_kv_heads:
                raise ValueError(f"tensor parallel size {tp.size} (--tensor-parallel-size / "
                                 f"MP_NUM) must divide the model's {num_kv_heads} key/value "
                                 "heads or be a multiple of them.")
            replicas = tp.size // num_kv_heads
            self.num_kv_heads, kv_first = 1, tp.rank // replicas
        kv = (kv_first * head_dim, self.num_kv_heads * head_dim)
        super().__init__(hidden, [num_heads * head_dim, num_kv_heads * head_dim,
                                  num_kv_heads * head_dim], bias,
                         shards=[(tp.rank * self.num_heads * head_dim,
                                  self.num_heads * head_dim), kv, kv])
