"""An image of a request as it travels to the engine (vLLM's multimodal feature): its
pixels as the model's processor made them, where its placeholder tokens sit in the prompt,
and a hash of its pixels (prefix caching keys on it). msgspec: no pickles."""

from __future__ import annotations

import hashlib

import msgspec


class MultiModalInput(msgspec.Struct, array_like=True, frozen=True):
    pixels: bytes  # float32, C order, `shape`
    shape: list[int]  # [channels, height, width]
    offset: int  # its first placeholder token's position in the prompt
    length: int  # placeholder tokens (the rows the vision encoder gives)
    hash: str  # sha256 of the shape, size and pixels, hex
    # the image's own (height, width), where the rows depend on it (LLaVA-NeXT's tiles:
    # `shape` is then [tiles, channels, height, width])
    size: list[int] = []

    @classmethod
    def of(cls, pixels: bytes, shape: list[int], offset: int, length: int,
           size: list[int] | None = None) -> MultiModalInput:
        digest = hashlib.sha256(repr((list(shape), size)).encode() + pixels).hexdigest()
        return cls(pixels, list(shape), offset, length, digest, list(size or []))

    @property
    def end(self) -> int:
        return self.offset + self.length


def cache_key(inputs: list[MultiModalInput]) -> bytes:
    """What a request's prefix-cache hashes start from for its images: the same tokens with
    other images (or none) never share KV."""
    return b"images\0" + b"\0".join(f"{m.offset}:{m.hash}".encode() for m in inputs)
