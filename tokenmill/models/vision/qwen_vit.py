"""Qwen2-VL's and Qwen2.5-VL's vision transformer: an image at its own resolution as a
grid of patches (each 2 frames x 14 x 14 pixels: a still image is its frame twice), a
linear patch embedding (the checkpoint's 3-D convolution, whose stride is its kernel),
2-D rotary positions (half of each head's frequencies rotated by the patch's row, half by
its column), pre-norm blocks attending within an image (Qwen2.5-VL: most blocks within
windows of the image, `fullatt_block_indexes` over all of it), then the patch merger
(projector.py) making one row of each 2 x 2 patches for the language model.

The processor lays an image's patches out merge block by merge block (each block's 2 x 2
patches together), which the merger relies on; Qwen2.5-VL regroups the merge blocks window
by window for its blocks and restores their order after the merger."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from tokenmill.models.vision.clip import ACTIVATIONS
from tokenmill.models.vision.projector import PatchMerger, VisionRMSNorm
from tokenmill.models.vision.weights import load_named

ACTIVATIONS = {**ACTIVATIONS, "silu": F.silu}

Grid = tuple[int, int, int]  # an image's (frames, rows, columns) of patches


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


class QwenVisionAttention(nn.Module):
    def __init__(self, dim: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.qkv = nn.Linear(dim, 3 * dim)
        self.proj = nn.Linear(dim, dim)

    def forward(self, x: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor],
                bounds: list[int]) -> torch.Tensor:
        """x [patches, dim]; each patch attends to the patches of its segment (`bounds`:
        the segments' first patches and the end; the segments of one length, an image's
        full windows, in one batched call)."""
        n = len(x)
        q, k, v = self.qkv(x).view(n, 3, self.heads, -1).unbind(1)
        cos, sin = rope  # [patches, 1, head dim], float32 (rotated in float32)
        q, k = ((t.float() * cos + _rotate_half(t.float()) * sin).to(x.dtype) for t in (q, k))
        out = torch.empty_like(q)
        starts: dict[int, list[int]] = {}  # (segments of one length attend in one call)
        for a, b in zip(bounds, bounds[1:]):
            starts.setdefault(b - a, []).append(a)
        for length, firsts in starts.items():
            rows = (torch.tensor(firsts, device=x.device)[:, None]
                    + torch.arange(length, device=x.device)).flatten()
            batch = [t[rows].view(len(firsts), length, *t.shape[1:]).transpose(1, 2)
                     for t in (q, k, v)]
            out[rows] = F.scaled_dot_product_attention(*batch).transpose(1, 2).flatten(0, 1)
        return self.proj(out.reshape(n, -1))


class QwenVisionMLP(nn.Module):
    """Qwen2-VL: fc2(act(fc1 x)); Qwen2.5-VL (`gated`): down(act(gate x) * up x)."""

    def __init__(self, dim: int, hidden: int, act: str, gated: bool) -> None:
        super().__init__()
        if act not in ACTIVATIONS:
            raise ValueError(f"Vision activation {act!r} is not served.")
        self.act, self.gated = ACTIVATIONS[act], gated
        if gated:
            self.gate_proj, self.up_proj = nn.Linear(dim, hidden), nn.Linear(dim, hidden)
            self.down_proj = nn.Linear(hidden, dim)
        else:
            self.fc1, self.fc2 = nn.Linear(dim, hidden), nn.Linear(hidden, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.gated:
            return self.down_proj(self.act(self.gate_proj(x)) * self.up_proj(x))
        return self.fc2(self.act(self.fc1(x)))


class QwenVisionBlock(nn.Module):
    def __init__(self, dim: int, heads: int, mlp: QwenVisionMLP, rms: bool) -> None:
        super().__init__()
        self.norm1, self.norm2 = ((VisionRMSNorm(dim) if rms else nn.LayerNorm(dim, eps=1e-6))
                                  for _ in range(2))
        self.attn = QwenVisionAttention(dim, heads)
        self.mlp = mlp

    def forward(self, x, rope, bounds):
        x = x + self.attn(self.norm1(x), rope, bounds)
        return x + self.mlp(self.norm2(x))


class QwenVisionTower(nn.Module):
    """pixels [patches, patch values] of images with their `Grid`s -> rows [merge blocks,
    language model hidden], image after image. `config`: the checkpoint's `vision_config`;
    `windowed`: Qwen2.5-VL's (window attention, RMS norms, gated MLPs)."""

    def __init__(self, config: Any, windowed: bool) -> None:
        super().__init__()
        if windowed:
            dim, out, hidden = config.hidden_size, config.out_hidden_size, config.intermediate_size
            self.full_blocks = set(config.fullatt_block_indexes)
            self.window = config.window_size // config.spatial_merge_size // config.patch_size
        else:
            dim, out = config.embed_dim, config.hidden_size
            hidden, self.full_blocks, self.window = int(dim * config.mlp_ratio), None, 0
        heads = config.num_heads
        self.merge = config.spatial_merge_size
        self.patch_dim = (config.in_channels * config.temporal_patch_size
                          * config.patch_size ** 2)
        self.patch_embed = nn.Linear(self.patch_dim, dim, bias=False)
        head_dim = dim // heads
        theta = float((getattr(config, "rope_parameters", None) or {}).get("rope_theta", 1e4))
        half = head_dim // 2
        self.register_buffer("inv_freq", 1.0 / theta ** (torch.arange(0, half, 2).float() / half),
                             persistent=False)
        self.blocks = nn.ModuleList(
            QwenVisionBlock(dim, heads, QwenVisionMLP(dim, hidden, config.hidden_act, windowed),
                            windowed) for _ in range(config.depth))
        self.merger = PatchMerger(dim, out, self.merge, windowed)

    def forward(self, pixels: torch.Tensor, grids: list[Grid]) -> torch.Tensor:
        x = self.patch_embed(pixels.to(self.patch_embed.weight.dtype))
        rope = self._rope(grids)
        unit = self.merge ** 2  # patches of a merge block
        order = windows = None
        if self.window:  # (merge blocks regrouped window by window)
            order, windows = self._windows(grids)
            x = x.view(-1, unit, x.shape[-1])[order].flatten(0, 1)
            rope = tuple(t.view(-1, unit, *t.shape[1:])[order].flatten(0, 1) for t in rope)
        images = [0]
        for t, h, w in grids:
            for _ in range(t):  # (frame by frame)
                images.append(images[-1] + h * w)
        for i, block in enumerate(self.blocks):
            full = self.full_blocks is None or i in self.full_blocks
            x = block(x, rope, images if full else windows)
        rows = self.merger(x)
        return rows if order is None else rows[torch.argsort(order)]

    def _rope(self, grids: list[Grid]) -> tuple[torch.Tensor, torch.Tensor]:
        """Each patch's (cos, sin) [patches, 1, head dim]: half its frequencies at its row,
        half at its column, in the processor's merge-block order."""
        m, positions = self.merge, []
        for t, h, w in grids:
            rows = torch.arange(h).view(h // m, m, 1, 1).expand(h // m, m, w // m, m)
            cols = torch.arange(w).view(1, 1, w // m, m).expand(h // m, m, w // m, m)
            hw = torch.stack([r.transpose(1, 2).flatten() for r in (rows, cols)], dim=-1)
            positions.append(hw.repeat(t, 1))
        hw = torch.cat(positions).to(self.inv_freq.device)
        freqs = (hw[..., None].float() * self.inv_freq).flatten(1)  # [patches, half]
        emb = torch.cat((freqs, freqs), dim=-1)[:, None]
        return emb.cos(), emb.sin()

    def _windows(self, grids: list[Grid]) -> tuple[torch.Tensor, list[int]]:
        """Qwen2.5-VL: the merge blocks' order window by window (each image's grid of merge
        blocks cut into squares of `window` a side, the last ones short), and each
        window's first patch (and the end)."""
        order, bounds, first, size = [], [0], 0, self.window
        unit = self.merge ** 2
        for t, h, w in grids:
            gh, gw = h // self.merge, w // self.merge
            index = torch.arange(t * gh * gw).view(t, gh, gw) + first
            for f in range(t):
                for r in range(0, gh, size):
                    for c in range(0, gw, size):
                        window = index[f, r:r + size, c:c + size].flatten()
                        order.append(window)
                        bounds.append(bounds[-1] + len(window) * unit)
            first += t * gh * gw
        return torch.cat(order).to(self.inv_freq.device), bounds


class QwenVisionEncoder(nn.Module):
    """A Qwen2-VL / Qwen2.5-VL checkpoint's image side: pixels and grids -> each image's
    rows, all images through the tower in one pass."""

    def __init__(self, config: Any) -> None:
        super().__init__()
        windowed = config.architectures[0] == "Qwen2_5_VLForConditionalGeneration"
        self.tower = QwenVisionTower(config.vision_config, windowed)

    def encode(self, images: list[tuple[torch.Tensor, list[int]]]) -> list[torch.Tensor]:
        """Images (pixels [patches, patch values], their patch grid (t, h, w)) -> each one's
        rows [rows, hidden]."""
        grids = [tuple(size) for _, size in images]
        rows = self.tower(torch.cat([pixels for pixels, _ in images]), grids)
        unit = self.tower.merge ** 2
        return list(rows.split([t * h * w // unit for t, h, w in grids]))

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """The checkpoint's `visual.` tensors (old and new layouts)."""
        def ours(name: str) -> str | None:
            name = name.removeprefix("model.")
            if not name.startswith("visual."):
                return None
            return name.removeprefix("visual.").replace("patch_embed.proj.", "patch_embed.")

        def as_linear(name: str, tensor: torch.Tensor) -> torch.Tensor:
            return tensor.reshape(len(tensor), -1) if name == "patch_embed.weight" else tensor
        load_named(self.tower, weights, ours, as_linear)
