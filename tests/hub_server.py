"""A local stand-in for the Hugging Face Hub's file API, enough for `huggingface_hub.snapshot_download` with
`HF_ENDPOINT` pointing here: the repo info (`/api/models/{repo}/revision/{rev}`), the recursive tree listing
(`/api/models/{repo}/tree/{rev}`) and `HEAD` / `GET /{repo}/resolve/{rev}/{file}` with the headers the client
checks (X-Repo-Commit, ETag, Content-Length, Range -> 206). Errors carry the hub's X-Error-Code. It records every
request, and can drop a file's connection once after N bytes or answer one GET with a 500."""

from __future__ import annotations

import contextlib
import hashlib
import json
import re
import threading
from dataclasses import dataclass, field
from email.message import Message
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from urllib.parse import unquote, urlsplit

_API = re.compile(r"^/api/models/(?P<repo>[^/]+/[^/]+)/(?P<kind>revision|tree)/(?P<rev>[^/]+)$")
_RESOLVE = re.compile(r"^/(?P<repo>[^/]+/[^/]+)/resolve/(?P<rev>[^/]+)/(?P<file>.+)$")


@dataclass
class Repo:
    revisions: dict[str, dict[str, bytes]]  # branch or tag -> {path: content}
    token: str | None = None  # gated: served only with "Authorization: Bearer <token>"

    def commit(self, rev: str) -> str | None:
        """A revision name or a commit hash -> the commit hash (sha1 of the name: stable and 40 hex digits)."""
        for name in self.revisions:
            sha = hashlib.sha1(name.encode()).hexdigest()
            if rev in (name, sha):
                return sha
        return None

    def files(self, commit: str) -> dict[str, bytes]:
        return next(f for n, f in self.revisions.items() if hashlib.sha1(n.encode()).hexdigest() == commit)


@dataclass
class Request:
    method: str
    path: str
    headers: Message  # case-insensitive `get`


@dataclass
class Hub:
    repos: dict[str, Repo] = field(default_factory=dict)
    drop_after: dict[str, int] = field(default_factory=dict)  # file -> bytes sent before the connection drops, once
    fail_once: set[str] = field(default_factory=set)  # files whose next GET answers 500
    requests: list[Request] = field(default_factory=list)
    url: str = ""

    def add(self, repo_id: str, files: dict[str, bytes], token: str | None = None, **revisions) -> None:
        self.repos[repo_id] = Repo({"main": files, **revisions}, token)

    def resolved(self, method: str = "GET") -> list[str]:
        """The files requested with `method` through /resolve/, in order."""
        return [_RESOLVE.match(r.path)["file"] for r in self.requests if r.method == method and _RESOLVE.match(r.path)]


def checkpoint_files(directory: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(directory.iterdir()) if p.is_file()}


class _Handler(BaseHTTPRequestHandler):
    hub: Hub

    def log_message(self, *args) -> None:  # quiet
        pass

    def do_HEAD(self) -> None:
        self._serve(body=False)

    def do_GET(self) -> None:
        self._serve(body=True)

    def _serve(self, body: bool) -> None:
        path = unquote(urlsplit(self.path).path)
        self.hub.requests.append(Request(self.command, path, self.headers))
        if m := _API.match(path):
            return self._api(m["repo"], m["kind"], m["rev"])
        if m := _RESOLVE.match(path):
            return self._file(m["repo"], m["rev"], m["file"], body)
        self._error(404, "RepoNotFound", "not found")

    def _api(self, repo_id: str, kind: str, rev: str) -> None:
        repo = self.hub.repos.get(repo_id)
        if repo is None:
            return self._error(404, "RepoNotFound", "Repository not found")
        commit = repo.commit(rev)
        if commit is None:
            return self._error(404, "RevisionNotFound", f"Invalid rev id: {rev}")
        files = repo.files(commit)
        if kind == "revision":  # a gated repo's listing is public, like the hub's
            info = {"id": repo_id, "sha": commit, "private": False, "gated": "manual" if repo.token else False,
                    "siblings": [{"rfilename": name} for name in files]}
            return self._json(info, commit)
        tree = [{"type": "file", "path": name, "size": len(data), "oid": hashlib.sha1(data).hexdigest()}
                for name, data in files.items()]
        self._json(tree, commit)

    def _file(self, repo_id: str, rev: str, name: str, body: bool) -> None:
        repo = self.hub.repos.get(repo_id)
        if repo is None:
            return self._error(404, "RepoNotFound", "Repository not found")
        if repo.token is not None and (auth := self.headers.get("Authorization")) != f"Bearer {repo.token}":
            status, what = (401, "You must be authenticated") if auth is None else (403, "You are not authorized")
            return self._error(status, "GatedRepo", f"Access to model {repo_id} is restricted. {what}.")
        commit = repo.commit(rev)
        if commit is None:
            return self._error(404, "RevisionNotFound", f"Invalid rev id: {rev}")
        data = repo.files(commit).get(name)
        if data is None:
            return self._error(404, "EntryNotFound", f"{name} does not exist", commit)
        if body and name in self.hub.fail_once:
            self.hub.fail_once.discard(name)
            return self._error(500, None, "Internal Error", commit)
        start = int(m[1]) if (m := re.fullmatch(r"bytes=(\d+)-", self.headers.get("Range", ""))) else 0
        self.send_response(206 if start else 200)
        self.send_header("X-Repo-Commit", commit)
        self.send_header("ETag", f'"{hashlib.sha256(data).hexdigest()}"')
        self.send_header("Accept-Ranges", "bytes")
        self.send_header("Content-Type", "application/octet-stream")
        self.send_header("Content-Length", str(len(data) - start))
        if start:
            self.send_header("Content-Range", f"bytes {start}-{len(data) - 1}/{len(data)}")
        self.end_headers()
        if not body:
            return
        cut = self.hub.drop_after.pop(name, None) if not start else None
        self.wfile.write(data[start:] if cut is None else data[:cut])
        self.wfile.flush()
        self.close_connection = True  # with a cut: the client sees fewer bytes than Content-Length

    def _json(self, value, commit: str) -> None:
        data = json.dumps(value).encode()
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("X-Repo-Commit", commit)
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        if self.command == "GET":
            self.wfile.write(data)

    def _error(self, status: int, code: str | None, message: str, commit: str | None = None) -> None:
        data = json.dumps({"error": message}).encode()
        self.send_response(status)
        if code is not None:
            self.send_header("X-Error-Code", code)
        self.send_header("X-Error-Message", message)
        if commit is not None:
            self.send_header("X-Repo-Commit", commit)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        if self.command == "GET":
            self.wfile.write(data)


@contextlib.contextmanager
def serve_hub(hub: Hub):
    """`hub` on a free loopback port (`hub.url`), in a thread, for the `with` block."""
    handler = type("Handler", (_Handler,), {"hub": hub})
    server = ThreadingHTTPServer(("127.0.0.1", 0), handler)
    hub.url = f"http://127.0.0.1:{server.server_address[1]}"
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield hub
    finally:
        server.shutdown()
        server.server_close()
        thread.join()
