"""Model files are untrusted input: their headers are checked against the file's own size,
and a config's sizes against sane bounds, before anything is allocated for them.

A GGUF's counts, string and array lengths, tensor dimensions and data offsets; a safetensors
header's length, each tensor's dtype, shape and byte range; a config's layer, head, width,
vocabulary and context sizes; the nesting of every JSON file read (config.json,
tokenizer.json, ...). A file past a bound is a `ModelFileError` (a `ValueError`), one line
naming the file, the field and the bound: the commands print it and exit 2, having read no
more than the header and allocated nothing the header asked for. llama.cpp's GGUF reader and
safetensors' own checks cover the same ground (bounded by the file's size); this module is
the one place tokenmill does, in front of gguf-py's reader (which trusts the header) and of
transformers' JSON loading (which recurses)."""

from __future__ import annotations

import json
import math
import os
import struct
from functools import lru_cache
from typing import Any

from tokenmill.json_depth import nests_deeper


class ModelFileError(ValueError):
    """A model file that is malformed or past a bound (the message names file and field)."""


# JSON files of a model folder: how large (tokenizer.json of a 256k-token vocabulary is
# ~35 MB) and how deeply nested (a tokenizer's is ~6 deep) they may be.
MAX_JSON_FILE_BYTES = 256 * 1024 * 1024
MAX_MODEL_JSON_DEPTH = 64


def check_json_file(path: str) -> None:
    """A model folder's JSON file, before a parser that recurses reads it: its size, and its
    nesting (a tokenizer.json nested 200,000 deep was a RecursionError). Once per version of
    the file (the config and the tokenizer loaders both ask)."""
    try:
        stat = os.stat(path)
    except OSError:
        return  # (absent: the loader says so in its words)
    _checked_json(path, stat.st_size, stat.st_mtime)


@lru_cache(maxsize=64)
def _checked_json(path: str, size: int, mtime: float) -> None:
    name = os.path.basename(path)
    if size > MAX_JSON_FILE_BYTES:
        raise ModelFileError(f"{name}: {size} bytes, more than the {MAX_JSON_FILE_BYTES >> 20} "
                             "MiB a model's JSON file may have.")
    with open(path, "rb") as f:
        raw = f.read()
    if nests_deeper(raw, MAX_MODEL_JSON_DEPTH):
        raise ModelFileError(f"{name}: arrays and objects nested more than "
                             f"{MAX_MODEL_JSON_DEPTH} deep.")


def check_json_files(folder: str) -> None:
    """Every JSON file a model folder is read through (its config, tokenizer, generation
    config, chat template and index files)."""
    if not os.path.isdir(folder):
        return
    for entry in sorted(os.listdir(folder)):
        if entry.endswith(".json"):
            check_json_file(os.path.join(folder, entry))


# --- config.json ---------------------------------------------------------------------------
# field: (least, most); 0 where configs use it for "none" (no window, no experts). Generous:
# the largest models of 2026 are far inside (hidden 16,384, 160 layers, 256k vocabulary, 10M
# context, 384 experts); a value past them is a broken or hostile file, which would otherwise
# allocate gigabytes before failing.
CONFIG_BOUNDS = {
    "hidden_size": (1, 1 << 17),
    "intermediate_size": (1, 1 << 20),
    "moe_intermediate_size": (0, 1 << 20),
    "num_hidden_layers": (1, 1024),
    "num_attention_heads": (1, 1024),
    "num_key_value_heads": (1, 1024),
    "head_dim": (1, 4096),
    "vocab_size": (1, 1 << 23),
    "max_position_embeddings": (1, 1 << 27),
    "num_local_experts": (0, 1 << 16),
    "num_experts": (0, 1 << 16),
    "n_routed_experts": (0, 1 << 16),
    "num_experts_per_tok": (0, 1024),
    "sliding_window": (0, 1 << 27),
    "kv_lora_rank": (0, 1 << 14),
    "q_lora_rank": (0, 1 << 16),
    # state layers (Mamba-2, Qwen3-Next's gated DeltaNet): their state is heads x sizes
    "num_heads": (1, 1 << 14),
    "state_size": (1, 1 << 12),
    "n_groups": (1, 1 << 14),
    "conv_kernel": (1, 64),
    "linear_conv_kernel_dim": (1, 64),
    "linear_num_key_heads": (1, 1 << 14),
    "linear_num_value_heads": (1, 1 << 14),
    "linear_key_head_dim": (1, 4096),
    "linear_value_head_dim": (1, 4096),
    "mamba_n_heads": (1, 1 << 14),
    "mamba_n_groups": (1, 1 << 14),
    "mamba_d_state": (1, 1 << 12),
    "mamba_d_conv": (1, 64),
}


# what every decoder the engine serves has
REQUIRED_CONFIG = ("hidden_size", "num_hidden_layers", "num_attention_heads", "vocab_size")


def check_config(config: Any, source: str, required: bool = True) -> None:
    """A model config's sizes (a transformers config, or the dict of config.json): each an
    integer within CONFIG_BOUNDS (REQUIRED_CONFIG present unless not `required`, the others
    where given), and the heads dividing as attention needs."""
    get = config.get if isinstance(config, dict) else lambda k, d=None: getattr(config, k, d)
    name = os.path.basename(source.rstrip("/")) or source
    for field, (least, most) in CONFIG_BOUNDS.items():
        value = get(field, None)
        if (value is None and required and field in REQUIRED_CONFIG
                and (field, get("model_type", None)) != ("num_attention_heads", "mamba2")):
            raise ModelFileError(f"{name}: config field {field} is missing.")
        if value is None:
            continue
        if isinstance(value, bool) or not isinstance(value, int) or not least <= value <= most:
            raise ModelFileError(f"{name}: config field {field} = {_short(value)} must be an "
                                 f"integer from {least} to {most}.")
    heads, kv_heads = get("num_attention_heads", None), get("num_key_value_heads", None)
    if heads and kv_heads and heads % kv_heads:
        raise ModelFileError(f"{name}: config field num_attention_heads = {heads} is not a "
                             f"multiple of num_key_value_heads = {kv_heads}.")
    hidden = get("hidden_size", None)
    if heads and hidden and get("head_dim", None) is None and hidden % heads:
        raise ModelFileError(f"{name}: config field hidden_size = {hidden} is not a multiple "
                             f"of num_attention_heads = {heads} (and no head_dim is given).")


def check_config_file(folder: str) -> None:
    """config.json as it is on disk, before transformers builds (and validates, dividing by
    its head count) a config of it: the fields present, and those of its `text_config`."""
    path = os.path.join(folder, "config.json")
    try:
        with open(path, "rb") as f:
            raw = json.load(f)
    except (OSError, ValueError):
        return  # (absent or not JSON: the loader's own error)
    for part in (raw, raw.get("text_config") if isinstance(raw, dict) else None):
        if isinstance(part, dict):
            check_config(part, path, required=False)


def check_model_folder(folder: str) -> None:
    """What transformers reads of a model folder (its JSON files, the config's sizes), before
    it reads them: every loader of a folder (config, tokenizer) calls this first."""
    check_json_files(folder)
    check_config_file(folder)


def _short(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 40 else text[:40] + "..."


# --- safetensors -----------------------------------------------------------------------------
MAX_SAFETENSORS_HEADER = 100 * 1024 * 1024  # the safetensors library's own bound
_ST_BYTES = {"BOOL": 1, "U8": 1, "I8": 1, "F8_E4M3": 1, "F8_E5M2": 1, "F8_E8M0": 1,
             "I16": 2, "U16": 2, "F16": 2, "BF16": 2, "I32": 4, "U32": 4, "F32": 4,
             "I64": 8, "U64": 8, "F64": 8}


def check_safetensors(path: str) -> None:
    """A safetensors file's header against the file: its length, then each tensor's dtype,
    shape and byte range (the shape's bytes exactly its range, the range inside the file)."""
    name = os.path.basename(path)
    size = os.path.getsize(path)
    with open(path, "rb") as f:
        head = f.read(8)
        if len(head) < 8:
            raise ModelFileError(f"{name}: {size} bytes, too short for a safetensors header.")
        (length,) = struct.unpack("<Q", head)
        if length > min(MAX_SAFETENSORS_HEADER, size - 8):
            raise ModelFileError(f"{name}: header length {length} is past the file's "
                                 f"{size} bytes (or the {MAX_SAFETENSORS_HEADER >> 20} MiB "
                                 "limit).")
        raw = f.read(length)
    if nests_deeper(raw, MAX_MODEL_JSON_DEPTH):
        raise ModelFileError(f"{name}: header nested more than {MAX_MODEL_JSON_DEPTH} deep.")
    try:
        header = json.loads(raw)
    except (ValueError, RecursionError):
        raise ModelFileError(f"{name}: the header is not valid JSON.") from None
    if not isinstance(header, dict):
        raise ModelFileError(f"{name}: the header is not a JSON object.")
    data_bytes = size - 8 - length
    for tensor, info in header.items():
        if tensor == "__metadata__":
            continue
        where = f"{name}: tensor {_short(tensor)}"
        if not isinstance(info, dict) or info.get("dtype") not in _ST_BYTES:
            raise ModelFileError(f"{where} has no known dtype.")
        shape, offsets = info.get("shape"), info.get("data_offsets")
        if not (isinstance(shape, list) and len(shape) <= 16 and all(
                isinstance(d, int) and not isinstance(d, bool) and 0 <= d < 1 << 62
                for d in shape)):
            raise ModelFileError(f"{where}: shape must be at most 16 sizes, each from 0 to "
                                 "2^62.")
        if not (isinstance(offsets, list) and len(offsets) == 2 and all(
                isinstance(o, int) and not isinstance(o, bool) for o in offsets)
                and 0 <= offsets[0] <= offsets[1] <= data_bytes):
            raise ModelFileError(f"{where}: data_offsets {_short(offsets)} are not a range "
                                 f"within the file's {data_bytes} data bytes.")
        need = math.prod(shape) * _ST_BYTES[info["dtype"]]
        if need != offsets[1] - offsets[0]:
            raise ModelFileError(f"{where}: shape {shape} of {info['dtype']} needs {need} "
                                 f"bytes, its range holds {offsets[1] - offsets[0]}.")


# --- GGUF ------------------------------------------------------------------------------------
_GGUF_SCALARS = {0: 1, 1: 1, 2: 2, 3: 2, 4: 4, 5: 4, 6: 4, 7: 1, 10: 8, 11: 8, 12: 8}
_GGUF_STRING, _GGUF_ARRAY = 8, 9
MAX_GGUF_KEY = 65535  # the format's bound on a key's length
MAX_GGUF_DIMS = 4  # GGML_MAX_DIMS


@lru_cache(maxsize=8)
def _checked_gguf(path: str, size: int, mtime: float) -> None:
    _GgufHeader(path, size).check()


def check_gguf(path: str) -> None:
    """A GGUF file's header against the file (once per file version): counts, every key,
    string and array length, and every tensor's dimensions, type and data range."""
    stat = os.stat(path)
    _checked_gguf(path, stat.st_size, stat.st_mtime)


class _GgufHeader:
    """Walks a GGUF header as llama.cpp's reader does, each length checked against the bytes
    left before it is used."""

    def __init__(self, path: str, size: int) -> None:
        self.name, self.size, self.path = os.path.basename(path), size, path
        self.data: Any = b""
        self.pos = 0

    def fail(self, what: str) -> None:
        raise ModelFileError(f"{self.name}: {what} (the file has {self.size} bytes).")

    def skip(self, n: int, what: str) -> int:
        """Moves past `n` bytes (checked first); returns where they start."""
        if n < 0 or n > self.size - self.pos:
            self.fail(f"{what} runs past the end of the file at byte {self.pos}")
        start, self.pos = self.pos, self.pos + n
        return start

    def take(self, n: int, what: str) -> bytes:
        start = self.skip(n, what)
        return self.data[start:self.pos]

    def u32(self, what: str) -> int:
        return struct.unpack_from("<I", self.data, self.skip(4, what))[0]

    def u64(self, what: str) -> int:
        return struct.unpack_from("<Q", self.data, self.skip(8, what))[0]

    def string(self, what: str, most: int | None = None) -> bytes:
        length = self.u64(f"{what}'s length")
        if most is not None and length > most:
            self.fail(f"{what} is {length} bytes long, more than {most}")
        return self.take(length, f"{what} ({length} bytes)")

    def skip_value(self, kind: int, what: str, depth: int = 0) -> None:
        if kind in _GGUF_SCALARS:
            self.skip(_GGUF_SCALARS[kind], what)
        elif kind == _GGUF_STRING:
            self.skip(self.u64(f"{what}'s length"), what)
        elif kind == _GGUF_ARRAY and depth == 0:  # (arrays of arrays: one level, as gguf-py)
            item, count = self.u32(f"{what}'s item type"), self.u64(f"{what}'s length")
            if item in _GGUF_SCALARS:
                self.skip(count * _GGUF_SCALARS[item], f"{what} ({count} items)")
            elif item in (_GGUF_STRING, _GGUF_ARRAY):
                least = 8 if item == _GGUF_STRING else 12
                if count > (self.size - self.pos) // least:
                    self.fail(f"{what} claims {count} items, more than the file can hold")
                for i in range(count):
                    self.skip_value(item, f"{what}[{i}]", depth + 1)
            else:
                self.fail(f"{what} has unknown item type {item}")
        else:
            self.fail(f"{what} has unknown type {kind}")

    def check(self) -> None:
        import mmap

        with open(self.path, "rb") as f:
            if self.size:
                with mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as self.data:
                    self._walk()
            else:
                self._walk()

    def _walk(self) -> None:
        from gguf.constants import GGML_QUANT_SIZES, GGMLQuantizationType

        if self.take(4, "the magic") != b"GGUF":
            self.fail("not a GGUF file (no GGUF magic)")
        version = self.u32("the version")
        if version not in (2, 3):
            self.fail(f"GGUF version {version} is not 2 or 3")
        tensors, kvs = self.u64("the tensor count"), self.u64("the key-value count")
        if tensors > self.size // 33:  # (a tensor's info takes at least 33 bytes)
            self.fail(f"tensor count {tensors} is more than the file can hold")
        if kvs > self.size // 13:  # (a key-value at least 13)
            self.fail(f"key-value count {kvs} is more than the file can hold")
        alignment = 32
        for i in range(kvs):
            key = self.string(f"key {i}", MAX_GGUF_KEY)
            kind = self.u32(f"key {key[:60]!r}'s type")
            start = self.pos
            self.skip_value(kind, f"value of {key[:60].decode('utf-8', 'replace')}")
            if key == b"general.alignment":
                if kind != 4:
                    self.fail("general.alignment is not a uint32")
                alignment = struct.unpack_from("<I", self.data, start)[0]
                if alignment == 0 or alignment & (alignment - 1) or alignment > 1 << 20:
                    self.fail(f"general.alignment {alignment} is not a power of two")
        infos = []
        for i in range(tensors):
            name = self.string(f"tensor {i}'s name", MAX_GGUF_KEY).decode("utf-8", "replace")
            dims = self.u32(f"tensor {name[:60]}'s dimension count")
            if not 1 <= dims <= MAX_GGUF_DIMS:
                self.fail(f"tensor {name[:60]} has {dims} dimensions, not 1 to "
                          f"{MAX_GGUF_DIMS}")
            shape = [self.u64(f"tensor {name[:60]}'s dimensions") for _ in range(dims)]
            kind, offset = self.u32(f"tensor {name[:60]}'s type"), \
                self.u64(f"tensor {name[:60]}'s offset")
            infos.append((name, shape, kind, offset))
        data_start = -(-self.pos // alignment) * alignment
        for name, shape, kind, offset in infos:
            where = f"tensor {name[:60]}"
            if any(d >= 1 << 62 for d in shape) or math.prod(shape) >= 1 << 62:
                self.fail(f"{where}'s dimensions {shape} multiply past 2^62")
            try:
                block, type_size = GGML_QUANT_SIZES[GGMLQuantizationType(kind)]
            except (ValueError, KeyError):
                self.fail(f"{where} has unknown type {kind}")
            count = math.prod(shape)
            if shape[0] % block:
                self.fail(f"{where}'s first dimension {shape[0]} is not a multiple of its "
                          f"type's block of {block}")
            end = data_start + offset + count // block * type_size
            if offset % alignment or end > self.size:
                self.fail(f"{where}'s data (offset {offset}, {count // block * type_size} "
                          "bytes) is not aligned within the file")
