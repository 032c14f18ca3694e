"""A stand-in Hugging Face hub on loopback, answering from the local hub cache only.

Why: with HF_HUB_OFFLINE=1 vLLM replaces a repo id by its snapshot's local path
(`.../snapshots/<commit>`, vllm/engine/arg_utils.py), that path goes into the NIXL compatibility
hash, and two revisions refuse each other's handshake. A pod that fetches its model from the hub
(no HF_HUB_OFFLINE, the operator's default) keeps the repo id, whose hash is the same for every
revision. To reproduce that pod here without any network, the engines run online against this
server (HF_ENDPOINT), which knows one repository and answers from the files already in the cache:

- GET  /api/models/<repo>/revision/<rev>      repo info: the commit and the file list
- GET  /api/models/<repo>/tree/<rev>[/<path>]  the file list
- HEAD|GET /<repo>/resolve/<rev>/<file>        a file's metadata (commit, ETag = its blob's name,
  size) and, for GET, its bytes; 404 EntryNotFound for any file the snapshot lacks.

Every blob is already in the cache under its ETag, so huggingface_hub downloads nothing; `downloads`
counts the GETs of file contents all the same, and `requests` keeps every request line.
"""

from __future__ import annotations

import json
import re
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any
from urllib.parse import unquote, urlsplit


class LocalHub:
    def __init__(self, hub_cache: Path, repo_id: str) -> None:
        self.repo_id = repo_id
        self.repo_dir = hub_cache / ("models--" + repo_id.replace("/", "--"))
        self.requests: list[str] = []
        self.downloads = 0
        self._lock = threading.Lock()
        self._server: ThreadingHTTPServer | None = None

    @property
    def url(self) -> str:
        assert self._server is not None
        return f"http://127.0.0.1:{self._server.server_address[1]}"

    def commit(self, revision: str) -> str | None:
        if re.fullmatch(r"[0-9a-f]{40}", revision) and (self.repo_dir / "snapshots" / revision).is_dir():
            return revision
        ref = self.repo_dir / "refs" / revision
        return ref.read_text().strip() if ref.is_file() else None

    def files(self, commit: str) -> list[Path]:
        snapshot = self.repo_dir / "snapshots" / commit
        return sorted(path for path in snapshot.rglob("*") if path.is_file())

    def record(self, line: str, download: bool = False) -> None:
        with self._lock:
            self.requests.append(line)
            self.downloads += int(download)

    @contextmanager
    def serve(self) -> Iterator[LocalHub]:
        hub = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, format: str, *args: Any) -> None:
                pass

            def do_HEAD(self) -> None:
                hub.answer(self, with_body=False)

            def do_GET(self) -> None:
                hub.answer(self, with_body=True)

        self._server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self._server.daemon_threads = True
        thread = threading.Thread(target=self._server.serve_forever, daemon=True)
        thread.start()
        try:
            yield self
        finally:
            self._server.shutdown()
            self._server.server_close()
            thread.join(timeout=10)

    # ------------------------------------------------------------------ answers

    def answer(self, handler: BaseHTTPRequestHandler, *, with_body: bool) -> None:
        path = unquote(urlsplit(handler.path).path)
        self.record(f"{handler.command} {handler.path}")
        api = f"/api/models/{self.repo_id}/"
        resolve = f"/{self.repo_id}/resolve/"
        if path.startswith(api + "revision/"):
            self._repo_info(handler, path[len(api + "revision/") :], with_body)
        elif path.startswith(api + "tree/"):
            revision, _, inside = path[len(api + "tree/") :].partition("/")
            self._tree(handler, revision, inside, with_body)
        elif path.startswith(resolve):
            revision, _, name = path[len(resolve) :].partition("/")
            self._file(handler, revision, name, with_body)
        else:
            self._error(handler, 404, "RepoNotFound" if self.repo_id not in path else "EntryNotFound")

    def _json(self, handler: BaseHTTPRequestHandler, value: Any, with_body: bool, headers: dict[str, str]) -> None:
        body = json.dumps(value).encode()
        handler.send_response(200)
        handler.send_header("Content-Type", "application/json")
        handler.send_header("Content-Length", str(len(body)))
        for name, text in headers.items():
            handler.send_header(name, text)
        handler.end_headers()
        if with_body:
            handler.wfile.write(body)

    def _error(self, handler: BaseHTTPRequestHandler, status: int, code: str, commit: str | None = None) -> None:
        body = json.dumps({"error": code}).encode()
        handler.send_response(status)
        handler.send_header("X-Error-Code", code)
        handler.send_header("X-Error-Message", code)
        if commit:
            handler.send_header("X-Repo-Commit", commit)
        handler.send_header("Content-Type", "application/json")
        handler.send_header("Content-Length", str(len(body)))
        handler.end_headers()
        if handler.command != "HEAD":
            handler.wfile.write(body)

    def _entries(self, commit: str) -> list[tuple[str, Path]]:
        snapshot = self.repo_dir / "snapshots" / commit
        return [(path.relative_to(snapshot).as_posix(), path) for path in self.files(commit)]

    def _repo_info(self, handler: BaseHTTPRequestHandler, revision: str, with_body: bool) -> None:
        commit = self.commit(revision)
        if commit is None:
            self._error(handler, 404, "RevisionNotFound")
            return
        siblings = [{"rfilename": name, "size": path.stat().st_size} for name, path in self._entries(commit)]
        info = {"id": self.repo_id, "modelId": self.repo_id, "sha": commit, "private": False, "siblings": siblings}
        self._json(handler, info, with_body, {"X-Repo-Commit": commit})

    def _tree(self, handler: BaseHTTPRequestHandler, revision: str, inside: str, with_body: bool) -> None:
        commit = self.commit(revision)
        if commit is None:
            self._error(handler, 404, "RevisionNotFound")
            return
        prefix = inside.strip("/")
        entries = [
            {"type": "file", "path": name, "size": path.stat().st_size, "oid": path.resolve().name}
            for name, path in self._entries(commit)
            if not prefix or name.startswith(prefix + "/")
        ]
        self._json(handler, entries, with_body, {"X-Repo-Commit": commit})

    def _file(self, handler: BaseHTTPRequestHandler, revision: str, name: str, with_body: bool) -> None:
        commit = self.commit(revision)
        if commit is None:
            self._error(handler, 404, "RevisionNotFound")
            return
        path = self.repo_dir / "snapshots" / commit / name
        if not path.is_file():
            self._error(handler, 404, "EntryNotFound", commit)
            return
        blob = path.resolve()  # blobs/<sha256>: the name huggingface_hub looks the file up by
        size = blob.stat().st_size
        handler.send_response(200)
        handler.send_header("X-Repo-Commit", commit)
        handler.send_header("ETag", f'"{blob.name}"')
        handler.send_header("Content-Length", str(size))
        handler.send_header("Content-Type", "application/octet-stream")
        handler.end_headers()
        if with_body:
            self.record(f"download {name}", download=True)
            handler.wfile.write(blob.read_bytes())
