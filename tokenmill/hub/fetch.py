"""Fetching a model by name: the hub calls (huggingface_hub; ModelScope through
modelscope.py) and their failures as one-line errors naming the cause.

`fetch` downloads (resuming what an interrupted run left) and verifies; `resolve` is what a
model argument goes through: a verified snapshot in the cache is used as it is (no network),
else the model is fetched."""

from __future__ import annotations

import errno
import logging
import os

from tokenmill.hub.download import (
    HubError,
    RemoteFile,
    model_location,
    select_files,
    verified_files,
    verify,
)

logger = logging.getLogger(__name__)


_TRANSPORT = {"TransportError", "TimeoutException", "NetworkError", "RemoteProtocolError",
              "ConnectionError", "Timeout"}


def _explain(exc: BaseException, repo: str, revision: str | None, endpoint: str | None
             ) -> HubError:
    from huggingface_hub import constants, errors

    where = endpoint or constants.ENDPOINT  # (HF_ENDPOINT, as huggingface_hub read it)
    if isinstance(exc, errors.GatedRepoError):
        return HubError(f"{repo} is a gated repository: accept its terms on the hub and set "
                        "HF_TOKEN to a token with access.")
    if isinstance(exc, errors.RevisionNotFoundError):
        return HubError(f"{repo} has no revision {revision!r}.")
    if isinstance(exc, errors.RepositoryNotFoundError):
        hint = ""
        parts = repo.split("/")
        if len(parts) == 2 and ("-2nodes" in parts[1] or parts[1].endswith("-MTP")):
            hint = (" (a seed name such as ORG/NAME-2nodes or -MTP names the deployment: "
                    "the hub repository is ORG/NAME; give that, with --nnodes or "
                    "--speculative-config)")
        return HubError(f"No model {repo!r} on {where} (or it is private: set HF_TOKEN)"
                        f"{hint}.")
    if isinstance(exc, errors.OfflineModeIsEnabled | errors.LocalEntryNotFoundError):
        return HubError(f"{repo} is not in the local cache and the hub cannot be asked "
                        "(HF_HUB_OFFLINE is set, or no network): download it first with "
                        f"`tokenmill download {repo}`.")
    if isinstance(exc, errors.HfHubHTTPError):
        status = getattr(exc.response, "status_code", "?")
        return HubError(f"The hub at {where} answered HTTP {status} for {repo}.")
    # (huggingface_hub's HTTP client varies by version: httpx, httpx2, requests)
    if any(c.__name__ in _TRANSPORT for c in type(exc).__mro__):
        return HubError(f"Cannot reach the hub at {where}, or the connection dropped "
                        f"({type(exc).__name__}); run again to resume.")
    if isinstance(exc, OSError) and exc.errno == errno.ENOSPC:
        return HubError(f"The disk is full while downloading {repo}; free space and run "
                        "again to resume.")
    return HubError(f"Downloading {repo} failed: {type(exc).__name__}.")


def remote_files(repo: str, revision: str | None, endpoint: str | None, token) -> tuple[
        str, list[RemoteFile]]:
    """The commit a revision points at and the repository's files with their sizes and
    hashes."""
    from huggingface_hub import HfApi

    info = HfApi(endpoint=endpoint, token=token).model_info(repo, revision=revision,
                                                            files_metadata=True)
    files = [RemoteFile(s.rfilename, s.size, s.lfs.sha256 if s.lfs else None, s.blob_id)
             for s in info.siblings or []]
    return info.sha, files


def fetch(repo: str, revision: str | None = None, local_dir: str | None = None,
          gguf_file: str | None = None, gguf_quant: str | None = None,
          include: list[str] | None = None, exclude: list[str] | None = None,
          endpoint: str | None = None, cache_dir: str | None = None, token=None,
          recheck: bool = False, node: tuple[int, int] | None = None,
          source: str = "hf") -> str:
    """Downloads what the engine needs of `repo` and verifies it; returns what to load (the
    folder, or the GGUF file). `node` (node_rank, nnodes): of a pre-sharded checkpoint only
    that node's ranks' files. `source`: "hf" or "modelscope" (modelscope.py)."""
    from tokenmill.hub import modelscope

    ms = source == "modelscope"
    try:
        listed = modelscope.remote_files if ms else remote_files
        pinned, files = listed(repo, revision, endpoint, token)
        chosen = select_files([f.name for f in files], gguf_file, gguf_quant, include, exclude,
                              node)
        fetch_files = modelscope.download if ms else _hf_download
        root = fetch_files(repo, pinned, chosen, local_dir, cache_dir, endpoint, token)
    except HubError:
        raise
    except Exception as exc:  # every failure of the hub or the disk, named in one line
        raise (modelscope.explain(exc, repo, revision) if ms
               else _explain(exc, repo, revision, endpoint)) from None
    if not ms and (revision or "main") != pinned and local_dir is None:
        _write_ref(cache_dir, repo, revision or "main", pinned)
    verify(root, [f for f in files if f.name in chosen], recheck)
    return model_location(root, chosen)


def _hf_download(repo: str, commit: str, chosen: list[str], local_dir: str | None,
                 cache_dir: str | None, endpoint: str | None, token) -> str:
    from huggingface_hub import snapshot_download

    return snapshot_download(repo, revision=commit, local_dir=local_dir, cache_dir=cache_dir,
                             allow_patterns=chosen, endpoint=endpoint, token=token)


def _write_ref(cache_dir, repo, revision, commit) -> None:
    """A branch or tag name resolves offline afterwards (huggingface_hub records the refs it
    resolved itself; a fetch by commit does not)."""
    refs = os.path.join(_repo_cache(repo, cache_dir), "refs")
    os.makedirs(refs, exist_ok=True)
    with open(os.path.join(refs, revision), "w") as f:
        f.write(commit)


def _repo_cache(repo: str, cache_dir: str | None) -> str:
    from huggingface_hub import constants

    return os.path.join(cache_dir or constants.HF_HUB_CACHE, f"models--{repo.replace('/', '--')}")


def cached(repo: str, revision: str | None = None, cache_dir: str | None = None,
           node: tuple[int, int] | None = None, source: str = "hf") -> str | None:
    """What to load of a verified snapshot of `repo` in the cache, or None. (Read from the
    cache's layout: huggingface_hub's own offline lookup wants every file of the repository,
    and only those the engine needs were fetched.)"""
    if source == "modelscope":
        from tokenmill.hub import modelscope
        return modelscope.cached(repo, revision, cache_dir, node)
    root = _repo_cache(repo, cache_dir)
    commit = revision or "main"
    try:
        with open(os.path.join(root, "refs", commit)) as f:
            commit = f.read().strip()
    except OSError:
        pass  # (a commit given as the revision)
    snapshot = os.path.join(root, "snapshots", commit)
    files = verified_files(snapshot, node) if os.path.isdir(snapshot) else None
    return None if files is None else model_location(snapshot, files)


def looks_like_repo(name: str) -> bool:
    parts = name.split("/")
    return len(parts) == 2 and all(parts) and not name.startswith((".", "/", "~")) \
        and not os.path.exists(name)


def resolve(name: str, revision: str | None = None, **kwargs) -> str:
    """A hub name -> the local path to load: the verified cached copy, else a download (from
    the source config.hub_source names, unless `source` is given)."""
    from tokenmill.config.env import hub_source

    kwargs.setdefault("source", hub_source())
    path = cached(name, revision, kwargs.get("cache_dir"), kwargs.get("node"),
                  kwargs["source"])
    if path is not None:
        return path
    logger.info("downloading %s from %s", name, kwargs["source"])
    try:
        return fetch(name, revision, **kwargs)
    except HubError as exc:
        raise HubError(f"{name!r} is not a local path, and as a hub name: {exc}") from None

