"""A fake model hub on 127.0.0.1: the Hugging Face Hub endpoints huggingface_hub calls to
download (`/api/models/{repo}[/revision/{rev}]`, `HEAD|GET /{repo}/resolve/{rev}/{file}` with
Range) and ModelScope's that modelscope calls (`/api/v1/models/{repo}/repo/files`,
`/api/v1/models/{repo}/repo?Revision=&FilePath=`), serving folders as repositories. Faults on
demand: cut a file's connection mid-way (a number of times), serve wrong bytes for a file,
mark a repository gated."""

from __future__ import annotations

import hashlib
import json
import os
import re
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from urllib.parse import parse_qs, unquote, urlparse

LFS = (".safetensors", ".gguf", ".bin")


def _blob_id(data: bytes) -> str:
    return hashlib.sha1(f"blob {len(data)}\0".encode() + data).hexdigest()


class FakeHub:
    def __init__(self) -> None:
        self.repos: dict[str, dict] = {}  # repo -> {"refs": {name: sha}, "commits": {sha: dir}}
        self.gated: set[str] = set()
        self.cuts: dict[str, int] = {}  # file name -> GETs to cut half-way (then served)
        self.drops: dict[str, int] = {}  # file name -> later GETs closed with no answer
        self.corrupt: set[str] = set()  # file names served with one byte changed
        self.requests: list[tuple[str, str, str | None]] = []  # (method, path, Range)
        self.server = ThreadingHTTPServer(("127.0.0.1", 0), self._handler())
        self.server.daemon_threads = True
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        self._thread = threading.Thread(target=self.server.serve_forever, daemon=True)

    def add(self, repo: str, folder: str, refs: tuple[str, ...] = ("main",)) -> str:
        """Adds `folder` as a commit of `repo` that each of `refs` points at; returns its sha."""
        sha = hashlib.sha1(f"{repo}:{folder}".encode()).hexdigest()
        entry = self.repos.setdefault(repo, {"refs": {}, "commits": {}})
        entry["commits"][sha] = folder
        for ref in refs:
            entry["refs"][ref] = sha
        return sha

    def __enter__(self) -> FakeHub:
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self.server.shutdown()
        self.server.server_close()

    def _commit(self, repo: str, rev: str) -> str | None:
        entry = self.repos[repo]
        sha = entry["refs"].get(rev, rev)
        return sha if sha in entry["commits"] else None

    def _files(self, folder: str) -> dict[str, str]:
        out = {}
        for root, _, names in os.walk(folder):
            for n in names:
                path = os.path.join(root, n)
                out[os.path.relpath(path, folder).replace(os.sep, "/")] = path
        return out

    def _info(self, repo: str, sha: str) -> dict:
        siblings = []
        for name, path in sorted(self._files(self.repos[repo]["commits"][sha]).items()):
            with open(path, "rb") as f:
                data = f.read()
            item = {"rfilename": name, "size": len(data), "blobId": _blob_id(data)}
            if name.endswith(LFS):
                item["lfs"] = {"sha256": hashlib.sha256(data).hexdigest(), "size": len(data),
                               "pointerSize": 134}
            siblings.append(item)
        return {"id": repo, "modelId": repo, "sha": sha, "private": False,
                "siblings": siblings, "tags": [], "downloads": 0, "likes": 0}

    def _handler(hub):  # noqa: N805 (the handler class closes over the hub)
        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *args) -> None:
                pass

            def _error(self, status: int, code: str) -> None:
                body = json.dumps({"error": code}).encode()
                self.send_response(status)
                self.send_header("X-Error-Code", code)
                self.send_header("X-Error-Message", code)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                if self.command != "HEAD":
                    self.wfile.write(body)

            def _json(self, obj) -> None:
                body = json.dumps(obj).encode()
                self.send_response(200)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def _route(self) -> None:
                path = unquote(urlparse(self.path).path)
                hub.requests.append((self.command, path, self.headers.get("Range")))
                if path.startswith("/api/v1/"):
                    return self._modelscope(path)
                api = re.fullmatch(r"/api/models/([^/]+/[^/]+)(?:/(revision|tree)/([^/]+))?",
                                   path)
                file = re.fullmatch(r"/([^/]+/[^/]+)/resolve/([^/]+)/(.+)", path)
                repo = (api or file).group(1) if (api or file) else None
                if repo is None or repo not in hub.repos:
                    return self._error(404, "RepoNotFound")
                if repo in hub.gated and not self.headers.get("Authorization"):
                    return self._error(401, "GatedRepo")
                rev = (api.group(3) if api else file.group(2)) or "main"
                sha = hub._commit(repo, rev)
                if sha is None:
                    return self._error(404, "RevisionNotFound")
                if api:
                    info = hub._info(repo, sha)
                    if api.group(2) != "tree":
                        return self._json(info)
                    return self._json([{"type": "file", "path": f["rfilename"],
                                        "size": f["size"], "oid": f["blobId"],
                                        **({"lfs": {"oid": f["lfs"]["sha256"], "size": f["size"],
                                                    "pointerSize": 134}} if "lfs" in f else {})}
                                       for f in info["siblings"]])
                name = file.group(3)
                local = hub._files(hub.repos[repo]["commits"][sha]).get(name)
                if local is None:
                    return self._error(404, "EntryNotFound")
                with open(local, "rb") as f:
                    self._send_file(repo, sha, name, f.read())

            def _modelscope(self, path: str) -> None:
                """ModelScope's endpoints (what modelscope's snapshot_download calls):
                `repo/files` (the listing with sizes and sha256) and `repo?FilePath=`."""
                found = re.fullmatch(r"/api/v1/models/([^/]+/[^/]+)(/repo(?:/files)?)?", path)
                repo = found.group(1) if found else None
                if repo is None or repo not in hub.repos:
                    body = json.dumps({"Code": 10010205001, "Success": False,
                                       "Message": "model not exist"}).encode()
                    self.send_response(404)
                    self.send_header("Content-Type", "application/json")
                    self.send_header("Content-Length", str(len(body)))
                    self.end_headers()
                    return self.wfile.write(body) if self.command != "HEAD" else None
                query = parse_qs(urlparse(self.path).query)
                sha = hub._commit(repo, query.get("Revision", ["master"])[0])
                if sha is None:
                    return self._error(404, "RevisionNotFound")
                files = hub._files(hub.repos[repo]["commits"][sha])
                if found.group(2) == "/repo/files":
                    listing = []
                    for name, local in sorted(files.items()):
                        with open(local, "rb") as f:
                            data = f.read()
                        listing.append({"Name": name.rsplit("/", 1)[-1], "Path": name,
                                        "Type": "blob", "Size": len(data), "Revision": sha,
                                        "Sha256": hashlib.sha256(data).hexdigest()})
                    return self._json({"Code": 200, "Success": True,
                                       "Data": {"Files": listing}})
                if found.group(2) != "/repo":
                    return self._json({"Code": 200, "Success": True,
                                       "Data": {"Path": repo.split("/")[0],
                                                "Name": repo.split("/")[1]}})
                name = query.get("FilePath", [""])[0]
                if name not in files:
                    return self._error(404, "EntryNotFound")
                with open(files[name], "rb") as f:
                    self._send_file(repo, sha, name, f.read())

            def _send_file(self, repo: str, sha: str, name: str, data: bytes) -> None:
                etag = hashlib.sha256(data).hexdigest() if name.endswith(LFS) \
                    else _blob_id(data)
                if name in hub.corrupt:
                    data = bytes([data[0] ^ 1]) + data[1:]
                if self.command == "GET" and hub.drops.get(name, 0) > 0 and not hub.cuts.get(name):
                    hub.drops[name] -= 1  # (no answer at all)
                    self.close_connection = True
                    self.connection.shutdown(2)
                    return
                start = 0
                ranged = re.fullmatch(r"bytes=(\d+)-", self.headers.get("Range") or "")
                if ranged and self.command == "GET":
                    start = int(ranged.group(1))
                self.send_response(206 if start else 200)
                self.send_header("X-Repo-Commit", sha)
                self.send_header("ETag", f'"{etag}"')
                self.send_header("Accept-Ranges", "bytes")
                self.send_header("Content-Length", str(len(data) - start))
                if start:
                    self.send_header("Content-Range", f"bytes {start}-{len(data) - 1}/{len(data)}")
                self.end_headers()
                if self.command == "HEAD":
                    return
                if hub.cuts.get(name, 0) > 0:
                    hub.cuts[name] -= 1
                    self.wfile.write(data[start:start + (len(data) - start) // 2])
                    self.wfile.flush()
                    self.close_connection = True
                    self.connection.shutdown(2)
                    return
                self.wfile.write(data[start:])

            do_GET = do_HEAD = _route

        return Handler
