"""A Hugging Face Hub on 127.0.0.1 that the real huggingface_hub client talks to, for download and push tests.

It answers the endpoints huggingface_hub calls, with the Hub's paths, headers and error codes:
- download (`HfApi.model_info`, `snapshot_download`, `hf_hub_download`): GET /api/models/ID[/revision/REV],
  GET /api/models/ID/tree/REV, HEAD and GET /ID/resolve/REV/FILE with X-Repo-Commit, ETag (X-Linked-Etag and
  X-Linked-Size for LFS files), Content-Length and Range requests (206 + Content-Range);
- push (`whoami`, `create_repo`, `create_branch`, `create_commit`): GET /api/whoami-v2, POST /api/repos/create,
  POST /api/models/ID/branch/B, POST /api/validate-yaml, POST /api/models/ID/preupload/REV, the LFS batch API
  (POST /ID.git/info/lfs/objects/batch, then PUT of each object and POST of its verify link), and
  POST /api/models/ID/commit/REV (NDJSON);
- errors as X-Error-Code headers: RepoNotFound, RevisionNotFound, EntryNotFound, GatedRepo; an unknown token gets 401
  "Invalid credentials in Authorization header".
No Xet: no response carries Xet headers or hashes, so downloads use plain HTTP; uploads use the LFS "basic" transfer
only when the client runs with HF_HUB_DISABLE_XET (with hf_xet installed huggingface_hub sends LFS files through the
Xet storage protocol, which this server does not speak).

`interrupt(file, after_bytes, then_status)` makes the next download of `file` stop after `after_bytes` bytes (the
connection is closed mid-body), and the request after that answer `then_status` when one is given. A file's content
is bytes, or a Path served from disk in pieces (a real-size checkpoint never sits in the server's memory).
"""

from __future__ import annotations

import base64
import functools
import hashlib
import json
import re
import threading
from collections.abc import Iterator
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from urllib.parse import unquote, urlsplit

import yaml

LFS_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".gguf")
LFS_MIN_SIZE = 10 * 1024 * 1024  # the Hub stores larger files in LFS whatever their name
GITATTRIBUTES = b"*.safetensors filter=lfs diff=lfs merge=lfs -text\n*.bin filter=lfs diff=lfs merge=lfs -text\n"
Content = bytes | Path
PIECE = 1 << 20


def pieces(content: Content, start: int = 0) -> Iterator[bytes]:
    """The content from byte `start` on, a MiB at a time."""
    if isinstance(content, bytes):
        yield from (content[i : i + PIECE] for i in range(start, len(content), PIECE))
        return
    with open(content, "rb") as handle:
        handle.seek(start)
        while piece := handle.read(PIECE):
            yield piece


def size_of(content: Content) -> int:
    return len(content) if isinstance(content, bytes) else content.stat().st_size


def digests(content: Content) -> tuple[str, str]:
    """(git blob id, sha256): what the Hub reports as a file's oid and, for an LFS file, its LFS oid."""
    return _digests(content) if isinstance(content, bytes) else _file_digests(content, content.stat().st_mtime_ns)


def _digests(content: Content) -> tuple[str, str]:
    blob, sha256 = hashlib.sha1(b"blob %d\0" % size_of(content)), hashlib.sha256()
    for piece in pieces(content):
        blob.update(piece)
        sha256.update(piece)
    return blob.hexdigest(), sha256.hexdigest()


@functools.cache
def _file_digests(path: Path, mtime_ns: int) -> tuple[str, str]:
    return _digests(path)


def is_lfs(path: str, size: int) -> bool:
    return path.endswith(LFS_SUFFIXES) or size >= LFS_MIN_SIZE


@dataclass
class Repo:
    owner: str
    commits: dict[str, dict[str, Content]] = field(default_factory=dict)  # commit id -> {path: content}
    refs: dict[str, str] = field(default_factory=dict)  # branch or tag -> commit id
    messages: dict[str, str] = field(default_factory=dict)  # commit id -> summary
    private: bool = False
    gated: bool = False
    readers: set[str] = field(default_factory=set)  # users granted access to a gated repo

    def commit(self, files: dict[str, Content], message: str, branch: str = "main") -> str:
        digest = hashlib.sha1(json.dumps(sorted((p, digests(d)[0]) for p, d in files.items())).encode())
        digest.update(f"{self.refs.get(branch)}:{message}".encode())
        commit_id = digest.hexdigest()
        self.commits[commit_id], self.messages[commit_id], self.refs[branch] = dict(files), message, commit_id
        return commit_id

    def resolve(self, revision: str) -> str | None:
        if revision in self.refs:
            return self.refs[revision]
        return revision if revision in self.commits else None


@dataclass
class Request:
    method: str
    path: str  # unquoted, without the query
    headers: dict[str, str]  # lower-case names

    @property
    def token(self) -> str | None:
        value = self.headers.get("authorization", "")
        return value.removeprefix("Bearer ") if value.startswith("Bearer ") else None


class HubError(Exception):
    def __init__(self, status: int, code: str | None, message: str, headers: dict | None = None, **body):
        super().__init__(message)
        self.status, self.code, self.message, self.headers, self.body = status, code, message, headers or {}, body


class LocalHub:
    """The server and its state: repositories, users (token -> name), uploaded LFS objects, the requests received."""

    def __init__(self):
        self.repos: dict[str, Repo] = {}
        self.users: dict[str, str] = {}
        self.lfs_objects: dict[str, bytes] = {}
        self.requests: list[Request] = []
        self.faults: dict[str, list] = {}  # file path -> [bytes sent before the drop, status of the next request]
        self.lock = threading.Lock()
        self.server = ThreadingHTTPServer(("127.0.0.1", 0), _Handler)
        self.server.daemon_threads = True
        self.server.hub = self
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"

    def __enter__(self) -> LocalHub:
        threading.Thread(target=self.server.serve_forever, kwargs={"poll_interval": 0.02}, daemon=True).start()
        return self

    def __exit__(self, *exc) -> None:
        self.server.shutdown()
        self.server.server_close()

    def add_repo(self, repo_id: str, files: dict[str, Content], *, branch: str = "main", gated: bool = False,
                 readers: tuple[str, ...] = ()) -> str:
        """Create `repo_id` (or add a branch to it) holding `files`; returns the commit id."""
        repo = self.repos.setdefault(repo_id, Repo(owner=repo_id.split("/")[0], gated=gated, readers=set(readers)))
        return repo.commit({".gitattributes": GITATTRIBUTES, **files}, f"files of {branch}", branch)

    def interrupt(self, path: str, after_bytes: int, then_status: int | None = None) -> None:
        self.faults[path] = [after_bytes, then_status]

    def file_requests(self, method: str = "GET") -> list[Request]:
        return [r for r in self.requests if r.method == method and "/resolve/" in r.path]

    def files(self, repo_id: str, revision: str = "main") -> dict[str, Content]:
        repo = self.repos[repo_id]
        return repo.commits[repo.resolve(revision)]


class _Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    ROUTES = [
        ("GET", r"/api/whoami-v2", "whoami"),
        ("POST", r"/api/repos/create", "create_repo"),
        ("POST", r"/api/validate-yaml", "validate_yaml"),
        ("GET", r"/api/models/(?P<repo>[^/]+/[^/]+)/tree/(?P<rev>[^/]+)(?:/(?P<sub>.+))?", "tree"),
        ("GET", r"/api/models/(?P<repo>[^/]+/[^/]+)(?:/revision/(?P<rev>[^/]+))?", "model_info"),
        ("POST", r"/api/models/(?P<repo>[^/]+/[^/]+)/preupload/(?P<rev>[^/]+)", "preupload"),
        ("POST", r"/api/models/(?P<repo>[^/]+/[^/]+)/commit/(?P<rev>[^/]+)", "commit"),
        ("POST", r"/api/models/(?P<repo>[^/]+/[^/]+)/branch/(?P<branch>[^/]+)", "create_branch"),
        ("POST", r"/(?P<repo>[^/]+/[^/]+)\.git/info/lfs/objects/batch", "lfs_batch"),
        ("PUT", r"/lfs/(?P<oid>[0-9a-f]{64})", "lfs_put"),
        ("POST", r"/lfs/(?P<oid>[0-9a-f]{64})/verify", "lfs_verify"),
        ("HEAD", r"/(?P<repo>[^/]+/[^/]+)/resolve/(?P<rev>[^/]+)/(?P<file>.+)", "resolve"),
        ("GET", r"/(?P<repo>[^/]+/[^/]+)/resolve/(?P<rev>[^/]+)/(?P<file>.+)", "resolve"),
    ]

    def log_message(self, *args):  # quiet
        pass

    @property
    def hub(self) -> LocalHub:
        return self.server.hub

    def do_GET(self):
        self.route("GET")

    def do_HEAD(self):
        self.route("HEAD")

    def do_POST(self):
        self.route("POST")

    def do_PUT(self):
        self.route("PUT")

    def route(self, method: str) -> None:
        raw_path = urlsplit(self.path).path
        request = Request(method, unquote(raw_path), {k.lower(): v for k, v in self.headers.items()})
        with self.hub.lock:
            self.hub.requests.append(request)
        self.body = self.read_body()
        try:
            for verb, pattern, name in self.ROUTES:
                match = re.fullmatch(pattern, raw_path)
                if verb == method and match:
                    params = {k: unquote(v) for k, v in match.groupdict().items() if v is not None}
                    return getattr(self, name)(request, **params)
            raise HubError(404, None, f"no route {method} {raw_path}")
        except HubError as error:
            body = json.dumps({"error": error.message, **error.body}).encode()
            headers = {"X-Error-Message": error.message, **error.headers}
            if error.code:
                headers["X-Error-Code"] = error.code
            self.respond(error.status, body, "application/json", headers)

    def read_body(self) -> bytes:
        if self.headers.get("Transfer-Encoding", "").lower() == "chunked":
            chunks = []
            while size := int(self.rfile.readline().split(b";")[0], 16):
                chunks.append(self.rfile.read(size))
                self.rfile.readline()
            self.rfile.readline()
            return b"".join(chunks)
        return self.rfile.read(int(self.headers.get("Content-Length") or 0))

    def respond(self, status: int, body: bytes = b"", content_type: str = "application/json", headers=None) -> None:
        self.send_headers(status, len(body), content_type, headers)
        if self.command != "HEAD":
            self.wfile.write(body)

    def send_headers(self, status: int, length: int, content_type: str, headers: dict | None) -> None:
        self.send_response(status)
        self.send_header("Content-Type", content_type)
        self.send_header("Content-Length", str(length))
        for name, value in (headers or {}).items():
            self.send_header(name, str(value))
        self.end_headers()

    def json(self, data, status: int = 200) -> None:
        self.respond(status, json.dumps(data).encode())

    # ------------------------------------------------------------------------------------------------ access

    def user(self, request: Request) -> str | None:
        """The token's user; None when anonymous; 401 for a token the Hub does not know."""
        if request.token is None:
            return None
        if request.token not in self.hub.users:
            raise HubError(401, None, "Invalid credentials in Authorization header")
        return self.hub.users[request.token]

    def readable(self, request: Request, repo_id: str) -> Repo:
        user = self.user(request)
        repo = self.hub.repos.get(repo_id)
        if repo is None or (repo.private and user != repo.owner):
            raise HubError(401 if user is None else 404, "RepoNotFound", "Repository not found")
        return repo

    def writable(self, request: Request, repo_id: str) -> Repo:
        user = self.user(request)
        repo = self.readable(request, repo_id)
        if user != repo.owner:
            raise HubError(403, None, f"You don't have the rights to write to {repo_id}")
        return repo

    def commit_of(self, repo: Repo, revision: str) -> str:
        commit = repo.resolve(revision)
        if commit is None:
            raise HubError(404, "RevisionNotFound", f"Invalid rev id: {revision}")
        return commit

    # ------------------------------------------------------------------------------------------------ download

    def model_info(self, request: Request, repo: str, rev: str = "main") -> None:
        found = self.readable(request, repo)
        commit = self.commit_of(found, rev)
        self.json({
            "id": repo, "author": found.owner, "sha": commit, "private": found.private,
            "gated": "manual" if found.gated else False, "disabled": False,
            "siblings": [{"rfilename": path} for path in sorted(found.commits[commit])],
        })

    def tree(self, request: Request, repo: str, rev: str, sub: str = "") -> None:
        found = self.readable(request, repo)
        files = found.commits[self.commit_of(found, rev)]
        entries, folders = [], set()
        for path, content in sorted(files.items()):
            if sub and not path.startswith(sub.rstrip("/") + "/"):
                continue
            parts = path.split("/")
            folders.update("/".join(parts[:i]) for i in range(1, len(parts)))
            (blob, sha256), size = digests(content), size_of(content)
            entry = {"type": "file", "oid": blob, "size": size, "path": path}
            if is_lfs(path, size):
                entry["lfs"] = {"oid": sha256, "size": size, "pointerSize": 134}
            entries.append(entry)
        entries += [{"type": "directory", "oid": hashlib.sha1(f.encode()).hexdigest(), "size": 0, "path": f}
                    for f in sorted(folders)]
        self.json(entries)

    def resolve(self, request: Request, repo: str, rev: str, file: str) -> None:
        found = self.readable(request, repo)
        commit = self.commit_of(found, rev)
        user = self.user(request)
        if found.gated and user not in found.readers:
            message = f"Access to model {repo} is restricted" + (
                ". You must have access to it and be authenticated to access it. Please log in." if user is None
                else " and you are not in the authorized list. Visit the model page to ask for access."
            )
            raise HubError(401 if user is None else 403, "GatedRepo", message)
        content = found.commits[commit].get(file)
        if content is None:
            raise HubError(404, "EntryNotFound", f"{file} does not exist on {rev}", {"X-Repo-Commit": commit})
        (blob, sha256), size = digests(content), size_of(content)
        headers = {"X-Repo-Commit": commit, "Accept-Ranges": "bytes", "ETag": f'"{blob}"'}
        if is_lfs(file, size):
            headers.update({"X-Linked-Etag": f'"{sha256}"', "X-Linked-Size": size, "ETag": f'"{sha256}"'})
        if request.method == "HEAD":
            return self.send_headers(200, size, "application/octet-stream", headers)
        self.send_file(file, content, headers)

    def send_file(self, file: str, content: Content, headers: dict) -> None:
        start, status, size = 0, 200, size_of(content)
        ranged = re.fullmatch(r"bytes=(\d+)-", self.headers.get("Range", ""))
        if ranged:
            start, status = int(ranged.group(1)), 206
            headers["Content-Range"] = f"bytes {start}-{size - 1}/{size}"
        with self.hub.lock:
            fault = self.hub.faults.get(file)
            drop_at = then_status = None
            if fault is not None and fault[0] is not None:
                drop_at, fault[0] = fault[0], None
            elif fault is not None and fault[1] is not None:
                then_status, fault[1] = fault[1], None
        if then_status is not None:
            raise HubError(then_status, None, "Service Unavailable")
        self.send_headers(status, size - start, "application/octet-stream", headers)
        sent = 0
        for piece in pieces(content, start):
            if drop_at is not None and sent + len(piece) >= drop_at:
                self.wfile.write(piece[: drop_at - sent])
                self.wfile.flush()
                self.close_connection = True  # the client sees the body end early
                return
            self.wfile.write(piece)
            sent += len(piece)

    # ------------------------------------------------------------------------------------------------ push

    def whoami(self, request: Request) -> None:
        user = self.user(request)
        if user is None:
            raise HubError(401, None, "Invalid credentials in Authorization header")
        self.json({"type": "user", "name": user, "auth": {"type": "access_token", "accessToken": {"role": "write"}}})

    def create_repo(self, request: Request) -> None:
        user = self.user(request)
        payload = json.loads(self.body)
        repo_id = f"{payload.get('organization') or user}/{payload['name']}"
        if user is None or repo_id.split("/")[0] != user:
            raise HubError(403 if user else 401, None, f"You don't have the rights to create a model under "
                                                        f"{repo_id.split('/')[0]}")
        with self.hub.lock:
            if repo_id in self.hub.repos:
                raise HubError(409, None, "You already created this model repo", url=f"{self.hub.url}/{repo_id}")
            private = payload.get("visibility") == "private" or payload.get("private") is True
            self.hub.repos[repo_id] = Repo(owner=user, private=private)
            self.hub.repos[repo_id].commit({".gitattributes": GITATTRIBUTES}, "initial commit")
        self.json({"url": f"{self.hub.url}/{repo_id}", "name": repo_id})

    def create_branch(self, request: Request, repo: str, branch: str) -> None:
        found = self.writable(request, repo)
        start = json.loads(self.body or b"{}").get("startingPoint") or "main"
        with self.hub.lock:
            if branch in found.refs:
                raise HubError(409, None, f"Reference already exists: refs/heads/{branch}")
            found.refs[branch] = self.commit_of(found, start)
        self.json({})

    def validate_yaml(self, request: Request) -> None:
        content = json.loads(self.body)["content"]
        match = re.match(r"---\n(.*?)\n---\n", content, re.S)
        try:
            metadata = yaml.safe_load(match.group(1)) if match else {}
        except yaml.YAMLError as error:
            return self.json({"errors": [{"message": str(error)}], "warnings": []}, status=400)
        if metadata is not None and not isinstance(metadata, dict):
            return self.json({"errors": [{"message": "metadata must be a mapping"}], "warnings": []}, status=400)
        self.json({"errors": [], "warnings": []})

    def preupload(self, request: Request, repo: str, rev: str) -> None:
        self.commit_of(self.writable(request, repo), rev)
        files = json.loads(self.body)["files"]
        self.json({"files": [
            {"path": f["path"], "uploadMode": "lfs" if is_lfs(f["path"], f["size"]) else "regular",
             "shouldIgnore": False, "oid": None}
            for f in files
        ]})

    def lfs_batch(self, request: Request, repo: str) -> None:
        self.writable(request, repo)
        payload = json.loads(self.body)
        objects = []
        for item in payload["objects"]:
            entry = {"oid": item["oid"], "size": item["size"], "authenticated": True}
            if item["oid"] not in self.hub.lfs_objects:
                entry["actions"] = {
                    "upload": {"href": f"{self.hub.url}/lfs/{item['oid']}", "header": {}},
                    "verify": {"href": f"{self.hub.url}/lfs/{item['oid']}/verify", "header": {}},
                }
            objects.append(entry)
        self.respond(200, json.dumps({"transfer": "basic", "objects": objects}).encode(),
                     "application/vnd.git-lfs+json")

    def lfs_put(self, request: Request, oid: str) -> None:
        if hashlib.sha256(self.body).hexdigest() != oid:
            raise HubError(400, None, f"the uploaded content does not hash to {oid}")
        with self.hub.lock:
            self.hub.lfs_objects[oid] = self.body
        self.respond(200)

    def lfs_verify(self, request: Request, oid: str) -> None:
        size = json.loads(self.body)["size"]
        if len(self.hub.lfs_objects.get(oid, b"")) != size or oid not in self.hub.lfs_objects:
            raise HubError(404, None, f"object {oid} of {size} bytes was not uploaded")
        self.json({"success": True})

    def commit(self, request: Request, repo: str, rev: str) -> None:
        found = self.writable(request, repo)
        lines = [json.loads(line) for line in self.body.decode().splitlines() if line.strip()]
        header = next(line["value"] for line in lines if line["key"] == "header")
        with self.hub.lock:
            files = dict(found.commits[self.commit_of(found, rev)])
            for line in lines:
                value = line["value"]
                if line["key"] == "file":
                    files[value["path"]] = base64.b64decode(value["content"])
                elif line["key"] == "lfsFile":
                    if value["oid"] not in self.hub.lfs_objects:
                        raise HubError(422, None, f"LFS object {value['oid']} of {value['path']} was never uploaded")
                    files[value["path"]] = self.hub.lfs_objects[value["oid"]]
                elif line["key"] == "deletedFile":
                    files.pop(value["path"], None)
            commit = found.commit(files, header["summary"], rev)
        self.json({"commitUrl": f"{self.hub.url}/{repo}/commit/{commit}", "commitOid": commit,
                   "pullRequestUrl": None, "success": True})


def serve_tree(folder: Path, extra: dict[str, Content] | None = None, *, from_disk: bool = False) -> dict[str, Content]:
    """The files of a local checkpoint folder as a repository's content (path -> bytes, or the Path itself with
    `from_disk`), plus `extra`."""
    files = {str(p.relative_to(folder)): p if from_disk else p.read_bytes()
             for p in sorted(folder.rglob("*")) if p.is_file()}
    return {**files, **(extra or {})}
