"""Images of a request, from bytes to what the engine takes: decoded with pillow under
bounds (size of the file, pixels before decoding, formats: a decompression bomb, a truncated
or non-image file is refused naming why), then made into the model's pixels by its own
image processor (transformers', from the model folder) and placed in the prompt: each image
token the prompt holds becomes as many placeholder tokens as the image gives rows
(`MultiModalInput`: pixels, offset, length, content hash)."""

from __future__ import annotations

import base64
import binascii
import io
import math
import time
import urllib.error
import urllib.parse
import urllib.request
from typing import Any

import numpy as np

from tokenmill.config.multimodal import MultiModalConfig
from tokenmill.entrypoints.api.offload import run_heavy
from tokenmill.mm_inputs import MultiModalInput
from tokenmill.sampling_params import InvalidParameter

MAX_IMAGE_BYTES = 20 << 20  # one image's file
MAX_IMAGE_PIXELS = 40_000_000  # width x height, checked before the pixels are decoded
FORMATS = ("PNG", "JPEG", "WEBP", "GIF", "BMP")
FETCH_TIMEOUT_S = 10.0  # a remote image's fetch, each read and in all


def image_bytes(url: str, param: str = "image_url", allowed: tuple[str, ...] = ()) -> bytes:
    """A data URL's bytes (`data:image/png;base64,...`), or a remote image's from a host of
    `allowed` (--allowed-media-domains; none: remote URLs are refused)."""
    if url.startswith(("http://", "https://")):
        if not allowed:
            raise InvalidParameter(param, "Remote image URLs are not fetched by this server "
                                   "(--allowed-media-domains); send the image as a data URL "
                                   "(data:image/png;base64,...).")
        return fetch_image(url, allowed, param)
    head, sep, payload = url.partition(",")
    if not (url.startswith("data:") and sep and head.endswith(";base64")):
        raise InvalidParameter(param, "An image must be a base64 data URL "
                               "(data:image/png;base64,...).")
    if len(payload) > MAX_IMAGE_BYTES * 4 // 3 + 4:
        raise InvalidParameter(param, f"An image may be at most {MAX_IMAGE_BYTES >> 20} MiB.")
    try:
        return base64.b64decode(payload, validate=True)
    except (binascii.Error, ValueError):
        raise InvalidParameter(param, "An image's data URL is not valid base64.") from None


class _Redirects(urllib.request.HTTPRedirectHandler):
    """Follows at most three redirects, each to an allowed host."""

    max_redirections = 3

    def __init__(self, allowed: tuple[str, ...], param: str) -> None:
        super().__init__()
        self.allowed, self.param = allowed, param

    def redirect_request(self, req, fp, code, msg, headers, newurl):
        _check_host(newurl, self.allowed, self.param)
        return super().redirect_request(req, fp, code, msg, headers, newurl)


def _check_host(url: str, allowed: tuple[str, ...], param: str) -> None:
    parts = urllib.parse.urlsplit(url)
    if parts.scheme not in ("http", "https") or parts.hostname not in allowed:
        raise InvalidParameter(param, f"Images are fetched only from "
                               f"{', '.join(allowed)} (--allowed-media-domains).")


def fetch_image(url: str, allowed: tuple[str, ...], param: str = "image_url") -> bytes:
    """A remote image's bytes: its host (and each redirect's) in `allowed`, at most
    MAX_IMAGE_BYTES, FETCH_TIMEOUT_S a read and in all (runs off the event loop)."""
    _check_host(url, allowed, param)
    opener = urllib.request.build_opener(_Redirects(allowed, param))
    deadline = time.monotonic() + FETCH_TIMEOUT_S
    try:
        with opener.open(urllib.request.Request(url, headers={"User-Agent": "tokenmill"}),
                         timeout=FETCH_TIMEOUT_S) as response:
            chunks, size = [], 0
            while chunk := response.read(1 << 16):
                size += len(chunk)
                if size > MAX_IMAGE_BYTES:
                    raise InvalidParameter(param, f"An image may be at most "
                                           f"{MAX_IMAGE_BYTES >> 20} MiB.")
                if time.monotonic() > deadline:
                    raise InvalidParameter(param, f"The image took over {FETCH_TIMEOUT_S:.0f} "
                                           "s to fetch.")
                chunks.append(chunk)
            return b"".join(chunks)
    except InvalidParameter:
        raise
    except urllib.error.HTTPError as exc:
        raise InvalidParameter(param, f"Fetching the image answered HTTP {exc.code}.") from None
    except (urllib.error.URLError, OSError, ValueError) as exc:
        reason = getattr(exc, "reason", exc)
        if isinstance(reason, InvalidParameter):  # (a redirect refused)
            raise reason from None
        what = "timed out" if isinstance(reason, TimeoutError) else "failed"
        raise InvalidParameter(param, f"Fetching the image {what}.") from None


def decode_image(data: bytes, param: str = "image_url") -> Any:
    """A PIL image, RGB, fully decoded (its dimensions checked before its pixels are)."""
    from PIL import Image, UnidentifiedImageError

    if len(data) > MAX_IMAGE_BYTES:
        raise InvalidParameter(param, f"An image may be at most {MAX_IMAGE_BYTES >> 20} MiB.")
    try:
        image = Image.open(io.BytesIO(data), formats=FORMATS)
    except UnidentifiedImageError:
        raise InvalidParameter(param, "The image is not a PNG, JPEG, WebP, GIF or BMP "
                               "file.") from None
    except Image.DecompressionBombError:
        raise InvalidParameter(param, "The image has too many pixels.") from None
    width, height = image.size
    if width < 1 or height < 1 or width * height > MAX_IMAGE_PIXELS:
        raise InvalidParameter(param, f"The image is {width} x {height} pixels; at most "
                               f"{MAX_IMAGE_PIXELS:,} pixels are taken.")
    try:
        image.load()
        return image.convert("RGB")
    except (OSError, SyntaxError, ValueError, Image.DecompressionBombError):
        raise InvalidParameter(param, "The image file is truncated or corrupt.") from None


def as_image(value: Any, param: str = "image") -> Any:
    """An offline caller's image: a PIL image, its file's bytes, or a data URL."""
    if isinstance(value, (bytes, bytearray)):
        return decode_image(bytes(value), param)
    if isinstance(value, str):
        return decode_image(image_bytes(value, param), param)
    if hasattr(value, "convert") and hasattr(value, "size"):
        return value.convert("RGB")
    raise InvalidParameter(param, "An image must be a PIL image, its file's bytes or a data "
                           "URL.")


class ImageInputs:
    """An image-text model's images for one API process (or the offline `LLM`)."""

    def __init__(self, model_path: str, config: MultiModalConfig,
                 allowed_domains: tuple[str, ...] = (), tokenizer: Any = None) -> None:
        """`allowed_domains`: hosts remote image URLs may name (--allowed-media-domains);
        `tokenizer`: the model's, for a model whose images come wrapped in text (Gemma 3)."""
        from transformers import AutoImageProcessor

        self.config, self.allowed = config, tuple(allowed_domains)
        if config.mmproj:  # (a GGUF's llama.cpp projector file: its size, mean and std)
            from tokenmill.loading.mmproj import image_processor
            self.processor = image_processor(config.mmproj)
        else:
            self.processor = AutoImageProcessor.from_pretrained(model_path)
        self.wrap: list[int] = []
        self.runs: dict[int, int] = {}  # a newline run's length -> its one token (and back)
        if config.wrap:
            self.wrap = tokenizer.encode(config.wrap, add_special_tokens=False)
            for n in range(1, 9):
                ids = tokenizer.encode("\n" * n, add_special_tokens=False)
                if len(ids) == 1:
                    self.runs[n] = ids[0]
        self.run_of = {token: n for n, token in self.runs.items()}

    def pixels(self, image: Any, param: str = "messages"
               ) -> tuple[np.ndarray, list[int], int, list[int]]:
        """A decoded image as the model's processor makes it: float32 [3, side, side] (a
        tiling model's: [tiles, 3, side, side]; a dynamic-resolution one's: [patches, patch
        values]), its (height, width) or patch grid where that counts, its rows, and its
        rows' grid (M-RoPE)."""
        config = self.config
        if config.dynamic:  # (its rows counted before the processor spends memory on it)
            patches = self.processor.get_number_of_image_patches(image.height, image.width,
                                                                 {})
            if patches // config.merge_size ** 2 > config.max_rows:
                raise InvalidParameter(param, f"An image of {image.width} x {image.height} "
                                       f"pixels makes {patches // config.merge_size ** 2} "
                                       f"tokens, more than max_model_len ({config.max_rows}).")
        out = self.processor(images=[image], return_tensors="np")
        pixels, side, grid = out["pixel_values"], config.image_size, []
        if config.dynamic:
            size = [int(n) for n in out["image_grid_thw"][0]]
            m = config.merge_size
            grid = [size[0], size[1] // m, size[2] // m]
            shape, rows = (math.prod(size), config.patch_dim), math.prod(grid)
        else:
            pixels, shape, size, rows = pixels[0], (3, side, side), [], config.tokens_per_image
            if config.tiled:
                size = [int(n) for n in out["image_sizes"][0]]
                shape, rows = (config.tiles(*size), *shape), config.rows(*size)
        if pixels.shape != shape:
            raise ValueError(f"The image processor gave pixels of shape {pixels.shape}, not "
                             f"{shape}.")
        return np.ascontiguousarray(pixels, dtype=np.float32), size, rows, grid

    def several(self, images: list[Any]) -> list[tuple[np.ndarray, list[int], int, list]]:
        """LLaVA-OneVision's images of one request holding several: each padded to a square
        as one whole-image tile (its processor's rule for them), as `pixels` gives them."""
        side = self.config.image_size
        out = self.processor(images=[list(images)], return_tensors="np")
        found = []
        for pixels, size in zip(out["pixel_values"], out["image_sizes"]):
            pixels = pixels[:1]
            if pixels.shape != (1, 3, side, side):
                raise ValueError(f"The image processor gave pixels of shape {pixels.shape}.")
            found.append((np.ascontiguousarray(pixels, dtype=np.float32),
                          [int(n) for n in size], self.config.untiled_rows, []))
        return found

    async def prepare(self, ids: list[int], urls: list[str], param: str = "messages"
                      ) -> tuple[list[int], list[MultiModalInput]]:
        """A rendered prompt's images from their data URLs (decoded and processed off the
        event loop): what `place` gives."""
        if len(urls) > self.config.max_images:  # (counted before anything is decoded)
            raise InvalidParameter(param, f"A request may hold at most "
                                   f"{self.config.max_images} images (--limit-mm-per-prompt), "
                                   f"got {len(urls)}.")

        def work():
            return self.place(ids, [decode_image(image_bytes(u, param, self.allowed), param)
                                    for u in urls], param)
        return await run_heavy(work)

    def place(self, ids: list[int], images: list[Any], param: str = "messages"
              ) -> tuple[list[int], list[MultiModalInput]]:
        """The prompt with each image token grown to the image's placeholder tokens, and the
        images as the engine takes them (in prompt order)."""
        config = self.config
        if len(images) > config.max_images:
            raise InvalidParameter(param, f"A request may hold at most {config.max_images} "
                                   f"images (--limit-mm-per-prompt), got {len(images)}.")
        slots = [i for i, t in enumerate(ids) if t == config.prompt_token_id]
        if len(slots) != len(images):
            raise InvalidParameter(param, f"The prompt places {len(slots)} images but the "
                                   f"request holds {len(images)}.")
        out, inputs, start = [], [], 0
        several = (self.several(images) if config.max_tiles > 0 and len(images) > 1
                   else None)
        for k, (slot, image) in enumerate(zip(slots, images)):
            out = self._join(out, ids[start:slot])
            pixels, size, n, grid = several[k] if several else self.pixels(image, param)
            if config.start_id >= 0:  # (Gemma 3: "\n\n<start_of_image>", rows, ...)
                out = self._join(out, self.wrap) + [config.start_id]
            inputs.append(MultiModalInput.of(pixels.tobytes(), list(pixels.shape), len(out), n,
                                             size, grid))
            out += [config.image_token_id] * n
            if config.end_id >= 0:
                out += [config.end_id, *self.wrap]
            start = slot + 1
        return self._join(out, ids[start:]), inputs

    def _join(self, left: list[int], right: list[int]) -> list[int]:
        """left + right, a newline run at the seam one token where the tokenizer has one
        (the processor wraps images in text and tokenizes it whole: "\n" then "\n\n" is
        "\n\n\n" for it)."""
        if left and right and left[-1] in self.run_of and right[0] in self.run_of:
            merged = self.runs.get(self.run_of[left[-1]] + self.run_of[right[0]])
            if merged is not None:
                return left[:-1] + [merged] + right[1:]
        return left + right
