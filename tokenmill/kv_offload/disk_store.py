"""`DiskKVStore`: the disk tier of the KV cache. Each full block's KV (every layer's K and V
rows, as the engine holds them) is one file, named by the block's chained token hash, under
a folder named by the digest of everything else the KV depends on (the model's files and
config, dtypes, layout: `key`). Files are written to a temporary name and renamed, so the
data-parallel replicas of one machine and a restarted engine share the folder safely. A
file is served only if its header names this key and this block, its length is the block's
and its BLAKE2 digest matches: anything else (a torn or corrupt file, another model's) is
deleted and recomputed, never served. The folder is bounded (`max_bytes`, all keys
together): past it the least recently used files (by mtime, bumped on each read) go.

File: MAGIC, the header's length (u32 little-endian), the header (JSON: key, block,
bytes, digest), the payload."""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import os
import struct
import threading

logger = logging.getLogger(__name__)

MAGIC = b"TMKV\x01\n"
MAX_HEADER = 1024
TRIM_TO = 0.9  # a trim leaves the folder at this share of its bound


class DiskKVStore:
    def __init__(self, root: str, max_bytes: int, key: dict, block_bytes: int) -> None:
        """`key`: what a block's KV depends on besides its tokens (JSON-able);
        `block_bytes`: one block's payload. ValueError (one line) when `root` cannot be
        written."""
        self.root, self.max_bytes, self.block_bytes = root, max_bytes, block_bytes
        self.key = hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()
        self.dir = os.path.join(root, self.key[:32])
        try:
            os.makedirs(root, mode=0o700, exist_ok=True)  # (made here: the server's user's)
            os.makedirs(self.dir, mode=0o700, exist_ok=True)
            probe = os.path.join(self.dir, f".probe-{os.getpid()}")
            with open(probe, "wb") as f:
                f.write(b"x")
            os.remove(probe)
        except OSError as exc:
            raise ValueError(f"--kv-cache-disk-dir {root!r} cannot be written: "
                             f"{exc.strerror or exc}.") from None
        self._lock = threading.Lock()
        self._bytes: int | None = None  # the folder's size: scanned, plus what was written
        self.num_saved = self.num_loaded = self.num_rejected = self.num_failed = 0
        self._warned = False

    def path(self, block_hash: bytes) -> str:
        name = block_hash.hex()
        return os.path.join(self.dir, name[:2], name + ".kv")

    def contains(self, block_hash: bytes) -> bool:
        return os.path.exists(self.path(block_hash))

    def save(self, block_hash: bytes, payload: bytes) -> bool:
        """Writes one block (no-op when it is there); False when the disk refused it (full,
        gone: logged once, the engine serves on)."""
        path = self.path(block_hash)
        if os.path.exists(path):
            return True
        header = json.dumps({"key": self.key, "block": block_hash.hex(), "bytes": len(payload),
                             "digest": _digest(payload)}).encode()
        tmp = f"{path}.{os.getpid()}.{threading.get_ident()}.tmp"
        try:
            os.makedirs(os.path.dirname(path), mode=0o700, exist_ok=True)
            with open(tmp, "wb") as f:
                f.write(MAGIC + struct.pack("<I", len(header)) + header)
                f.write(payload)
            os.replace(tmp, path)
        except OSError as exc:
            self.num_failed += 1
            _remove(tmp)
            if not self._warned:
                self._warned = True
                logger.warning("KV disk tier: a block could not be written (%s); blocks the "
                               "disk refuses are not kept there.", exc.strerror or exc)
            return False
        self.num_saved += 1
        self._account(len(MAGIC) + 4 + len(header) + len(payload))
        return True

    def load(self, block_hash: bytes) -> bytes | None:
        """One block's payload, checked; None when it is not there or fails a check (then
        the file is deleted)."""
        path = self.path(block_hash)
        try:
            with open(path, "rb") as f:
                size = os.fstat(f.fileno()).st_size
                if size > len(MAGIC) + 4 + MAX_HEADER + self.block_bytes:
                    return self._reject(path, "too large")
                data = f.read()
        except FileNotFoundError:
            return None
        except OSError as exc:
            return self._reject(path, exc.strerror or str(exc))
        payload = self._check(data, block_hash)
        if payload is None:
            return self._reject(path, "failed its checks")
        with contextlib.suppress(OSError):
            os.utime(path)  # (recently used: the last to go)
        self.num_loaded += 1
        return payload

    def _check(self, data: bytes, block_hash: bytes) -> bytes | None:
        start = len(MAGIC) + 4
        if len(data) < start or not data.startswith(MAGIC):
            return None
        (length,) = struct.unpack_from("<I", data, len(MAGIC))
        if length > MAX_HEADER or len(data) < start + length:
            return None
        try:
            header = json.loads(data[start:start + length])
        except ValueError:
            return None
        payload = data[start + length:]
        if (not isinstance(header, dict) or header.get("key") != self.key
                or header.get("block") != block_hash.hex()
                or header.get("bytes") != len(payload) or len(payload) != self.block_bytes
                or header.get("digest") != _digest(payload)):
            return None
        return payload

    def _reject(self, path: str, why: str) -> None:
        self.num_rejected += 1
        logger.warning("KV disk tier: %s %s; it is deleted and its block recomputed.",
                       os.path.basename(path), why)
        _remove(path)
        return None

    def _account(self, written: int) -> None:
        with self._lock:
            if self._bytes is None:
                self._bytes = self._scan_size()
            else:
                self._bytes += written
            if self._bytes > self.max_bytes:
                self._bytes = self._trim()

    def _files(self) -> list[tuple[float, int, str]]:
        """(mtime, size, path) of every block file under the root (every key's)."""
        out = []
        for folder, _, names in os.walk(self.root):
            for name in names:
                if name.endswith(".kv"):
                    path = os.path.join(folder, name)
                    try:
                        st = os.stat(path)
                    except OSError:
                        continue
                    out.append((st.st_mtime, st.st_size, path))
        return out

    def _scan_size(self) -> int:
        return sum(size for _, size, _ in self._files())

    def _trim(self) -> int:
        """Deletes the least recently used files until the folder is at TRIM_TO of its
        bound; returns its size then."""
        files = sorted(self._files())
        total = sum(size for _, size, _ in files)
        for _, size, path in files:
            if total <= self.max_bytes * TRIM_TO:
                break
            _remove(path)
            total -= size
        return total


def _digest(payload: bytes) -> str:
    return hashlib.blake2b(payload, digest_size=16).hexdigest()


def _remove(path: str) -> None:
    with contextlib.suppress(OSError):
        os.remove(path)
