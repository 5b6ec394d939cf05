"""An image of a request as it travels to the engine (vLLM's multimodal feature): its
pixels as the model's processor made them, where its placeholder tokens sit in the prompt,
and a hash of its pixels (prefix caching keys on it). msgspec: no pickles."""

from __future__ import annotations

import hashlib

import msgspec
import numpy as np


class MultiModalInput(msgspec.Struct, array_like=True, frozen=True):
    pixels: bytes  # float32, C order, `shape`
    shape: list[int]  # [channels, height, width]
    offset: int  # its first placeholder token's position in the prompt
    length: int  # placeholder tokens (the rows the vision encoder gives)
    hash: str  # sha256 of the shape, size and pixels, hex
    # the image's own (height, width), where the rows depend on it (LLaVA-NeXT's tiles:
    # `shape` is then [tiles, channels, height, width]); Qwen2-VL: its patches' (t, h, w)
    # grid (`shape` [patches, patch values])
    size: list[int] = []
    # M-RoPE (Qwen2-VL): the (t, h, w) grid of its rows, over which its placeholders'
    # rotary positions are laid out; empty: they count on one by one like text
    grid: list[int] = []

    @classmethod
    def of(cls, pixels: bytes, shape: list[int], offset: int, length: int,
           size: list[int] | None = None, grid: list[int] | None = None) -> MultiModalInput:
        digest = hashlib.sha256(repr((list(shape), size)).encode() + pixels).hexdigest()
        return cls(pixels, list(shape), offset, length, digest, list(size or []),
                   list(grid or []))

    @property
    def end(self) -> int:
        return self.offset + self.length


def cache_key(inputs: list[MultiModalInput]) -> bytes:
    """What a request's prefix-cache hashes start from for its images: the same tokens with
    other images (or none) never share KV."""
    return b"images\0" + b"\0".join(f"{m.offset}:{m.hash}".encode() for m in inputs)


def uses_mrope(inputs: list[MultiModalInput]) -> bool:
    return any(m.grid for m in inputs)


def rope_positions(inputs: list[MultiModalInput], start: int, end: int) -> np.ndarray:
    """M-RoPE (Qwen2-VL's get_rope_index): the (temporal, height, width) rotary positions
    [3, end - start] of a sequence's tokens start .. end - 1 (its prompt's and any generated
    after it). Text counts on from the position before it in all three; an image's rows
    sit at its first position plus their (t, h, w) place in its grid, and the text after
    it goes on from one past the largest of them."""
    out = np.empty((3, end - start), dtype=np.int64)
    delta, cursor = 0, 0  # (a text token's position minus its index)
    for m in inputs:
        a, b = max(cursor, start), min(m.offset, end)
        if a < b:
            out[:, a - start:b - start] = np.arange(a + delta, b + delta)
        t, h, w = m.grid
        a, b = max(m.offset, start), min(m.end, end)
        if a < b:
            j = np.arange(a - m.offset, b - m.offset)
            base = m.offset + delta
            out[:, a - start:b - start] = (base + j // (h * w), base + j // w % h,
                                           base + j % w)
        delta += max(h, w) - m.length
        cursor = m.end
    a = max(cursor, start)
    if a < end:
        out[:, a - start:] = np.arange(a + delta, end + delta)
    return out
