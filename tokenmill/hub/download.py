"""Models from a hub (huggingface_hub; `HF_ENDPOINT`, `HF_TOKEN`, `HF_HUB_OFFLINE` and
`HF_HOME` are read by huggingface_hub itself): only the files the engine loads, resumed when
interrupted, verified against the sizes and hashes the hub publishes, and found in the cache
afterwards without the network.

What is fetched: the top-level JSON files (config, generation config, tokenizer config, the
safetensors index), the `*.safetensors` weights, the tokenizer files and the chat template;
for a GGUF repository one GGUF file (`gguf_file`, or the one whose name carries
`gguf_quant`, e.g. Q4_K_M), which holds its own tokenizer. huggingface_hub writes each file
under a temporary name and moves it into place when whole; tokenmill then checks every file
(size; sha256 for LFS files, the git blob id for the others) and only then records the
snapshot as verified (`.tokenmill-verified.json` in it). Resolving a name later loads a
verified snapshot without asking the hub."""

from __future__ import annotations

import fnmatch
import hashlib
import json
import logging
import os
from dataclasses import dataclass

logger = logging.getLogger(__name__)

MARKER = ".tokenmill-verified.json"
WEIGHTS = ("*.safetensors",)
SMALL = ("*.json", "tokenizer.model", "*.tiktoken", "merges.txt", "vocab.txt", "*.jinja")


class HubError(ValueError):
    """A one-line reason a model could not be fetched or found."""


@dataclass(frozen=True)
class RemoteFile:
    name: str
    size: int | None
    sha256: str | None  # LFS files
    blob_id: str | None  # git blob sha1 (the others)


def select_files(files: list[str], gguf_file: str | None = None, gguf_quant: str | None = None,
                 include: list[str] | None = None, exclude: list[str] | None = None,
                 node: tuple[int, int] | None = None) -> list[str]:
    """The files of a repository the engine needs (see the module docstring); `node`
    (node_rank, nnodes): of a pre-sharded checkpoint, only that node's ranks' files."""
    top = [f for f in files if "/" not in f]
    ggufs = [f for f in files if f.endswith(".gguf")]
    safetensors = [f for f in top if fnmatch.fnmatch(f, "*.safetensors")]
    if gguf_file is not None or gguf_quant is not None or (ggufs and not safetensors):
        chosen = _pick_gguf(ggufs, gguf_file, gguf_quant)
    else:
        if not safetensors and not include:
            hint = " (only PyTorch .bin weights: tokenmill loads safetensors or GGUF)" \
                if any(f.endswith(".bin") for f in top) else ""
            raise HubError(f"The repository has no *.safetensors or *.gguf weights{hint}.")
        chosen = [f for f in top if any(fnmatch.fnmatch(f, p) for p in WEIGHTS + SMALL)]
    if node is not None:
        chosen = [f for f in chosen if f not in others_rank_files(files, *node)]
    chosen += [f for f in files if include and any(fnmatch.fnmatch(f, p) for p in include)]
    chosen = [f for f in dict.fromkeys(chosen)
              if not (exclude and any(fnmatch.fnmatch(f, p) for p in exclude))]
    if not chosen:
        raise HubError("No file of the repository is left to fetch (check --include / "
                       "--exclude).")
    return chosen


def others_rank_files(files: list[str], node_rank: int, nnodes: int) -> set[str]:
    """The rank files of a pre-sharded checkpoint (loading/sharded.py) that other nodes load:
    node k runs world ranks [k x R / nnodes, (k + 1) x R / nnodes) of R. Empty for any other
    checkpoint."""
    from tokenmill.loading.sharded import SHARDING, rank_file

    if SHARDING not in files or nnodes <= 1:
        return set()
    ranks = 0
    while rank_file(ranks) in files:
        ranks += 1
    if ranks % nnodes or not 0 <= node_rank < nnodes:
        raise HubError(f"The checkpoint is sharded for {ranks} ranks, which {nnodes} nodes "
                       "cannot share equally; shard it for a multiple of the node count.")
    per = ranks // nnodes
    return {rank_file(r) for r in range(ranks) if r // per != node_rank}


def _pick_gguf(ggufs: list[str], name: str | None, quant: str | None) -> list[str]:
    if not ggufs:
        raise HubError("The repository has no .gguf file.")
    if name is not None:
        if name not in ggufs:
            raise HubError(f"No GGUF file {name!r} in the repository; it has: "
                           f"{', '.join(ggufs[:12])}.")
        return [name]
    if quant is not None:
        found = [f for f in ggufs if quant.lower() in os.path.basename(f).lower()]
    else:
        found = ggufs
    if len(found) != 1:
        what = f"matching {quant!r}" if quant else "in the repository"
        raise HubError(f"{len(found)} GGUF files {what}; choose one with --gguf-file or "
                       f"--gguf-quant: {', '.join(ggufs[:12])}.")
    return found


def _sha(path: str, algo: str, prefix: bytes = b"") -> str:
    h = hashlib.new(algo)
    h.update(prefix)
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def verify(root: str, remote: list[RemoteFile], recheck: bool = False) -> None:
    """Checks each file under `root` against the hub's size and hash; a bad one is removed
    (a rerun fetches it again) and named in the HubError. Files the snapshot's marker already
    records as verified with these hashes (and still of that size) are not hashed again
    unless `recheck`."""
    known = {} if recheck else _marker(root)
    for r in remote:
        path = os.path.join(root, r.name)
        size = os.path.getsize(path)
        entry = known.get(r.name)
        if entry == {"size": r.size, "sha256": r.sha256, "blob_id": r.blob_id} \
                and size == r.size:
            continue
        problem = None
        if r.size is not None and size != r.size:
            problem = f"{size} bytes where the hub lists {r.size}"
        elif r.sha256 is not None and _sha(path, "sha256") != r.sha256:
            problem = "its sha256 differs from the hub's"
        elif r.sha256 is None and r.blob_id is not None and \
                _sha(path, "sha1", f"blob {size}\0".encode()) != r.blob_id:
            problem = "its git blob id differs from the hub's"
        if problem is not None:
            target = os.path.realpath(path)
            os.remove(path)
            if target != os.path.abspath(path) and os.path.exists(target):
                os.remove(target)  # (the cache's blob behind the snapshot's link)
            raise HubError(f"{r.name} failed verification ({problem}); it was removed, run "
                           "the download again.")
    # (files verified before stay recorded: another node's share fetched into this folder)
    entries = {name: meta for name, meta in _marker(root).items()
               if os.path.isfile(os.path.join(root, name))}
    entries |= {r.name: {"size": r.size, "sha256": r.sha256, "blob_id": r.blob_id}
                for r in remote}
    with open(os.path.join(root, MARKER + ".tmp"), "w") as f:
        json.dump(entries, f)
    os.replace(os.path.join(root, MARKER + ".tmp"), os.path.join(root, MARKER))


def _marker(root: str) -> dict:
    try:
        with open(os.path.join(root, MARKER)) as f:
            found = json.load(f)
    except (OSError, ValueError):
        return {}
    return found if isinstance(found, dict) else {}


def verified_files(root: str, node: tuple[int, int] | None = None) -> list[str] | None:
    """The files a verified snapshot holds (None: not verified, a file went missing, or
    fewer of a pre-sharded checkpoint's rank files than `node` (node_rank, nnodes) needs:
    another node's share)."""
    files = _marker(root)
    if not files:
        return None
    needed = _needed_ranks(root, node)
    if needed is None or needed - set(files):
        return None
    for name, meta in files.items():
        path = os.path.join(root, name)
        if not os.path.isfile(path) or (meta.get("size") is not None
                                        and os.path.getsize(path) != meta["size"]):
            return None
    return list(files)


def _needed_ranks(root: str, node: tuple[int, int] | None) -> set[str] | None:
    """The rank files of a pre-sharded snapshot that `node` loads (every one without a node);
    None where its sharding file cannot be read."""
    from tokenmill.loading.sharded import SHARDING, is_sharded, layout

    try:
        if not is_sharded(root):
            return set()
        names = list(layout(root)["files"])
    except (OSError, ValueError, KeyError, TypeError):
        return None
    return set(names) - others_rank_files(names + [SHARDING], *node) \
        if node is not None else set(names)


def model_location(root: str, files: list[str]) -> str:
    """What the engine loads: the one GGUF file, else the folder."""
    ggufs = [f for f in files if f.endswith(".gguf")]
    return os.path.join(root, ggufs[0]) if len(ggufs) == 1 else root
