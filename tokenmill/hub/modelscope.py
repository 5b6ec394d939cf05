"""Models from ModelScope (`--source modelscope`, or names resolved there with
TOKENMILL_USE_MODELSCOPE=1 / vLLM's VLLM_USE_MODELSCOPE=1), through the optional `modelscope`
package (`pip install 'tokenmill[modelscope]'`; MODELSCOPE_ENDPOINT, MODELSCOPE_CACHE and
MODELSCOPE_API_TOKEN are read by it). The same files are chosen as from the Hugging Face Hub
(download.py), the same checks made: each file's size and sha256 against ModelScope's listing,
the snapshot marked verified, failures in one line."""

from __future__ import annotations

import errno
import logging

from tokenmill.hub.download import (
    HubError,
    RemoteFile,
    model_location,
    select_files,
    verified_files,
    verify,
)

logger = logging.getLogger(__name__)

DEFAULT_REVISION = "master"  # (ModelScope's default branch)


def _client():
    try:
        import modelscope  # noqa: F401
    except ImportError:
        raise HubError("--source modelscope needs the modelscope package: pip install "
                       "'tokenmill[modelscope]'.") from None
    from modelscope.hub.api import HubApi
    from modelscope.hub.snapshot_download import snapshot_download
    return HubApi, snapshot_download


def _explain(exc: BaseException, repo: str, revision: str | None) -> HubError:
    names = {c.__name__ for c in type(exc).__mro__}
    if "NotExistError" in names or "NoValidRevisionError" in names:
        what = f"no revision {revision!r}" if revision else "no such model (or it is private)"
        return HubError(f"ModelScope has {what} for {repo!r} (MODELSCOPE_API_TOKEN for a "
                        "private one).")
    if names & {"AuthenticationError", "PermissionDeniedError"}:
        return HubError(f"{repo} on ModelScope needs access: set MODELSCOPE_API_TOKEN to a "
                        "token that has it.")
    if names & {"FileDownloadError", "FileIntegrityError"}:
        return HubError(f"A file of {repo} kept failing to download or its sha256 check "
                        f"({type(exc).__name__}); nothing half-written was kept: run again.")
    if isinstance(exc, OSError) and exc.errno == errno.ENOSPC:
        return HubError(f"The disk is full while downloading {repo}; free space and run "
                        "again to resume.")
    if names & {"ConnectionError", "NetworkError", "RequestTimeoutError", "Timeout",
                "ChunkedEncodingError", "ProtocolError"}:
        return HubError(f"Cannot reach ModelScope, or the connection dropped "
                        f"({type(exc).__name__}); run again to resume.")
    status = getattr(getattr(exc, "response", None), "status_code", None)
    if status is not None:
        return HubError(f"ModelScope answered HTTP {status} for {repo}.")
    return HubError(f"Downloading {repo} from ModelScope failed: {type(exc).__name__}.")


def fetch(repo: str, revision: str | None = None, local_dir: str | None = None,
          gguf_file: str | None = None, gguf_quant: str | None = None,
          include: list[str] | None = None, exclude: list[str] | None = None,
          endpoint: str | None = None, cache_dir: str | None = None, token=None,
          recheck: bool = False, node: tuple[int, int] | None = None) -> str:
    """As fetch.fetch, from ModelScope."""
    hub_api, snapshot_download = _client()
    revision = revision or DEFAULT_REVISION
    try:
        listing = hub_api(endpoint=endpoint, token=token).get_model_files(
            repo, revision=revision, recursive=True)
        files = [RemoteFile(f.get("Path") or f.get("Name"), _size(f), f.get("Sha256") or None,
                            None) for f in listing if (f.get("Type") or "blob") != "tree"]
        chosen = select_files([f.name for f in files], gguf_file, gguf_quant, include, exclude,
                              node)
        root = snapshot_download(repo, revision=revision, cache_dir=cache_dir,
                                 local_dir=local_dir, allow_patterns=chosen, token=token,
                                 endpoint=endpoint)
    except HubError:
        raise
    except Exception as exc:  # every failure of the hub or the disk, named in one line
        raise _explain(exc, repo, revision if revision != DEFAULT_REVISION else None) \
            from None
    verify(root, [f for f in files if f.name in chosen], recheck)
    return model_location(root, chosen)


def _size(entry: dict) -> int | None:
    size = entry.get("Size")
    return int(size) if size is not None else None


def cached(repo: str, revision: str | None = None, cache_dir: str | None = None,
           node: tuple[int, int] | None = None) -> str | None:
    """What to load of a verified snapshot of `repo` in ModelScope's cache, or None (found
    through modelscope's own offline lookup: its cache layout is its own)."""
    try:
        _, snapshot_download = _client()
        root = snapshot_download(repo, revision=revision or DEFAULT_REVISION,
                                 cache_dir=cache_dir, local_files_only=True)
    except Exception:  # (not there, or no modelscope)
        return None
    files = verified_files(root, node)
    return None if files is None else model_location(root, files)
