"""Models from ModelScope (`--source modelscope`, or names resolved there with
TOKENMILL_USE_MODELSCOPE=1 / vLLM's VLLM_USE_MODELSCOPE=1), through the optional `modelscope`
package (`pip install 'tokenmill[modelscope]'`; MODELSCOPE_ENDPOINT, MODELSCOPE_CACHE and
MODELSCOPE_API_TOKEN are read by it): its listing and download, which fetch.fetch runs as it
runs the Hugging Face Hub's, so the same files are chosen (download.py) and the same checks
made (sizes and sha256 against ModelScope's listing, the snapshot marked verified, failures in
one line)."""

from __future__ import annotations

import errno
import logging

from tokenmill.hub.download import HubError, RemoteFile, model_location, verified_files

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


def explain(exc: BaseException, repo: str, revision: str | None) -> HubError:
    """A failure of modelscope or the disk as one line (`revision`: the one asked for)."""
    revision = None if revision == DEFAULT_REVISION else revision
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


def remote_files(repo: str, revision: str | None, endpoint: str | None, token
                 ) -> tuple[str, list[RemoteFile]]:
    """The revision to download (ModelScope's snapshots are keyed by it) and the
    repository's files with their sizes and sha256."""
    hub_api, _ = _client()
    revision = revision or DEFAULT_REVISION
    listing = hub_api(endpoint=endpoint, token=token).get_model_files(
        repo, revision=revision, recursive=True)
    return revision, [RemoteFile(f.get("Path") or f.get("Name"), _size(f),
                                 f.get("Sha256") or None, None)
                      for f in listing if (f.get("Type") or "blob") != "tree"]


def download(repo: str, revision: str, chosen: list[str], local_dir: str | None,
             cache_dir: str | None, endpoint: str | None, token) -> str:
    """modelscope's snapshot download of the chosen files (resumed, hashed as they come);
    returns the snapshot folder."""
    _, snapshot_download = _client()
    return snapshot_download(repo, revision=revision, cache_dir=cache_dir, local_dir=local_dir,
                             allow_patterns=chosen, token=token, endpoint=endpoint)


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
