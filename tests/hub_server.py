"""A small Hugging Face Hub stand-in on 127.0.0.1, for tests of `ckpttool push`.

It answers the requests huggingface_hub (2.x, read in its hf_api.py, _commit_api.py,
_upload_pipeline.py and file_download.py) makes for `create_repo`, `repo_info`,
`create_branch`, `upload_folder` (preupload, README validation, commit) and `hf_hub_download`
(HEAD and GET of `/{repo}/resolve/{revision}/{path}`), with the status codes and the
`X-Error-Code` / `X-Error-Message` headers its `hf_raise_for_status` turns into typed errors.

Every file is a "regular" upload (base64 in the commit's NDJSON): the preupload answer never
says "lfs", so no LFS or Xet storage is needed. Repos live in memory; `requests` logs
`(method, path)` of every request and `commits` every commit made, for tests to assert on.

Example:
    >>> with HubServer(token="hf_valid") as hub:
    ...     HfApi(endpoint=hub.url, token="hf_valid").create_repo("tester/model")
"""

from __future__ import annotations

import base64
import hashlib
import json
import threading
import time
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from urllib.parse import unquote, urlsplit

INVALID_TOKEN = "Invalid credentials in Authorization header"  # the Hub's message; hf_raise_for_status checks it
EMPTY_TREE_COMMIT = "0" * 40


def git_blob_oid(content: bytes) -> str:
    """The git SHA-1 of a blob: what the Hub returns as a regular file's oid and ETag."""
    return hashlib.sha1(b"blob %d\0" % len(content) + content).hexdigest()


@dataclass
class Repo:
    private: bool
    branches: dict[str, str] = field(default_factory=dict)  # branch -> commit oid
    trees: dict[str, dict[str, bytes]] = field(default_factory=dict)  # commit oid -> path -> content

    def resolve(self, revision: str) -> str | None:
        return self.branches.get(revision) or (revision if revision in self.trees else None)


@dataclass
class Commit:
    repo_id: str
    revision: str
    oid: str
    summary: str
    files: dict[str, bytes]


class HubError(Exception):
    def __init__(self, status: int, message: str, code: str | None = None, headers: dict | None = None):
        super().__init__(message)
        self.status, self.message, self.code, self.headers = status, message, code, headers or {}


class HubServer:
    """The stand-in: `start()` serves on a free port of 127.0.0.1 in a thread; `url` is the
    endpoint to give huggingface_hub. Only `token` is accepted; `user` owns repos created
    without a namespace."""

    def __init__(self, token: str, user: str = "tester"):
        self.token, self.user = token, user
        self.repos: dict[str, Repo] = {}
        self.requests: list[tuple[str, str]] = []
        self.commits: list[Commit] = []
        self.refuse_commits: int | None = None
        self.hold_commits = 0.0
        self.lock = threading.Lock()
        self._server: ThreadingHTTPServer | None = None

    @property
    def url(self) -> str:
        host, port = self._server.server_address[:2]
        return f"http://{host}:{port}"

    def start(self) -> "HubServer":
        hub = self

        class Handler(_Handler):
            server_state = hub

        self._server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self._server.daemon_threads = True
        threading.Thread(target=self._server.serve_forever, name="hub-stand-in", daemon=True).start()
        return self

    def stop(self) -> None:
        self._server.shutdown()
        self._server.server_close()

    def __enter__(self) -> "HubServer":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()

    # -- state changes, called by the handler under `lock` ----------------------------------

    def create_repo(self, repo_id: str, private: bool) -> None:
        if repo_id in self.repos:
            raise HubError(409, "You already created this model repo")
        self.repos[repo_id] = Repo(private, {"main": EMPTY_TREE_COMMIT}, {EMPTY_TREE_COMMIT: {}})

    def repo(self, repo_id: str, authorized: bool) -> Repo:
        repo = self.repos.get(repo_id)
        if repo is None or (repo.private and not authorized):
            raise HubError(404, "Repository not found", "RepoNotFound")
        return repo

    def commit_oid(self, repo: Repo, revision: str) -> str:
        oid = repo.resolve(revision)
        if oid is None:
            raise HubError(404, f"Invalid rev id: {revision}", "RevisionNotFound")
        return oid

    def commit(self, repo_id: str, revision: str, lines: list[dict]) -> str:
        repo = self.repo(repo_id, True)
        parent = self.commit_oid(repo, revision)
        if revision not in repo.branches:
            raise HubError(400, f"{revision} is not a branch")
        header, *operations = lines
        if header.get("key") != "header":
            raise HubError(400, "the first line must be the commit header")
        tree = dict(repo.trees[parent])
        added = {}
        for operation in operations:
            value = operation["value"]
            if operation["key"] == "file" and value.get("encoding") == "base64":
                added[value["path"]] = tree[value["path"]] = base64.b64decode(value["content"], validate=True)
            elif operation["key"] == "deletedFile":
                tree.pop(value["path"], None)
            else:
                raise HubError(422, f"the stand-in Hub takes regular files only, not {operation['key']}")
        digest = hashlib.sha1(parent.encode() + json.dumps({p: git_blob_oid(c) for p, c in sorted(tree.items())}).encode())
        oid = digest.hexdigest()
        repo.trees[oid] = tree
        repo.branches[revision] = oid
        self.commits.append(Commit(repo_id, revision, oid, header["value"].get("summary", ""), added))
        return oid


class _Handler(BaseHTTPRequestHandler):
    server_state: HubServer

    def log_message(self, format, *args) -> None:  # quiet: the test output is the report
        pass

    # -- plumbing ---------------------------------------------------------------------------

    def do_GET(self) -> None:
        self._serve("GET")

    def do_HEAD(self) -> None:
        self._serve("HEAD")

    def do_POST(self) -> None:
        self._serve("POST")

    def _serve(self, method: str) -> None:
        hub = self.server_state
        path = urlsplit(self.path).path
        length = int(self.headers.get("Content-Length") or 0)
        body = self.rfile.read(length) if length else b""
        with hub.lock:
            hub.requests.append((method, path))
        if hub.hold_commits and method == "POST" and "/commit/" in path:
            time.sleep(hub.hold_commits)
        try:
            authorized = self._authorized()
            with hub.lock:
                self._route(method, [unquote(part) for part in path.strip("/").split("/")], body, authorized)
        except HubError as error:
            headers = {"X-Error-Message": error.message, **error.headers}
            if error.code:
                headers["X-Error-Code"] = error.code
            self._send(error.status, json.dumps({"error": error.message}).encode(), headers, method)

    def _authorized(self) -> bool:
        """True with the valid token, False with none; any other token is a 401."""
        value = self.headers.get("Authorization")
        if value is None:
            return False
        if value != f"Bearer {self.server_state.token}":
            raise HubError(401, INVALID_TOKEN)
        return True

    def _send(self, status: int, body: bytes, headers: dict | None = None, method: str = "GET",
              content_type: str = "application/json") -> None:
        self.send_response(status)
        self.send_header("Content-Type", content_type)
        self.send_header("Content-Length", str(len(body)))
        for name, value in (headers or {}).items():
            self.send_header(name, value)
        self.end_headers()
        if method != "HEAD":
            self.wfile.write(body)

    def _json(self, document: dict, status: int = 200) -> None:
        self._send(status, json.dumps(document).encode())

    @property
    def base(self) -> str:
        return f"http://{self.headers['Host']}"

    # -- the endpoints ----------------------------------------------------------------------

    def _route(self, method: str, parts: list[str], body: bytes, authorized: bool) -> None:
        if method == "POST" and parts == ["api", "repos", "create"]:
            return self._create_repo(json.loads(body), authorized)
        if method == "POST" and parts == ["api", "validate-yaml"]:
            return self._json({"errors": [], "warnings": []})
        if len(parts) >= 4 and parts[:2] == ["api", "models"]:
            repo_id, rest = "/".join(parts[2:4]), parts[4:]
            if method == "GET" and not rest:
                return self._repo_info(repo_id, "main", authorized)
            if method == "GET" and len(rest) == 2 and rest[0] == "revision":
                return self._repo_info(repo_id, rest[1], authorized)
            if method == "POST" and len(rest) == 2 and rest[0] in ("preupload", "commit", "branch"):
                if not authorized:
                    raise HubError(401, "You must be authenticated to write to a repo")
                return getattr(self, "_" + rest[0])(repo_id, rest[1], json.loads(body) if rest[0] != "commit" else body)
        if method in ("GET", "HEAD") and len(parts) >= 5 and parts[2] == "resolve":
            return self._resolve(method, "/".join(parts[:2]), parts[3], "/".join(parts[4:]), authorized)
        raise HubError(404, f"the stand-in Hub has no {method} /{'/'.join(parts)}")

    def _create_repo(self, payload: dict, authorized: bool) -> None:
        hub = self.server_state
        if not authorized:
            raise HubError(401, "You must be authenticated to create a repo")
        namespace = payload.get("organization") or hub.user
        if namespace != hub.user:
            raise HubError(403, f"You don't have the rights to create a model under the namespace \"{namespace}\"")
        if payload.get("type") not in (None, "model"):
            raise HubError(400, "the stand-in Hub holds model repos only")
        repo_id = f"{namespace}/{payload['name']}"
        if repo_id in hub.repos:  # the Hub's 409 names the repo's URL, which create_repo(exist_ok=True) returns
            self._json({"error": "You already created this model repo", "url": f"{self.base}/{repo_id}"}, 409)
            return
        hub.create_repo(repo_id, payload.get("visibility") == "private")
        self._json({"url": f"{self.base}/{repo_id}", "name": repo_id, "id": repo_id})

    def _repo_info(self, repo_id: str, revision: str, authorized: bool) -> None:
        hub = self.server_state
        repo = hub.repo(repo_id, authorized)
        oid = hub.commit_oid(repo, revision)
        files = [{"rfilename": path} for path in sorted(repo.trees[oid])]
        self._json({"id": repo_id, "sha": oid, "private": repo.private, "siblings": files})

    def _branch(self, repo_id: str, branch: str, payload: dict) -> None:
        hub = self.server_state
        repo = hub.repo(repo_id, True)
        if branch in repo.branches:
            raise HubError(409, f"Reference already exists: refs/heads/{branch}")
        repo.branches[branch] = hub.commit_oid(repo, payload.get("startingPoint") or "main")
        self._json({})

    def _preupload(self, repo_id: str, revision: str, payload: dict) -> None:
        hub = self.server_state
        repo = hub.repo(repo_id, True)
        tree = repo.trees[hub.commit_oid(repo, revision)]
        # "regular" for every file: the client then sends contents inline in the commit;
        # the oid of an identical file already there lets the client skip it, as the Hub does
        files = [
            {"path": f["path"], "uploadMode": "regular", "shouldIgnore": False,
             "oid": git_blob_oid(tree[f["path"]]) if f["path"] in tree else None}
            for f in payload["files"]
        ]
        self._json({"files": files, "commitOid": hub.commit_oid(repo, revision)})

    def _commit(self, repo_id: str, revision: str, body: bytes) -> None:
        hub = self.server_state
        if hub.refuse_commits:
            raise HubError(hub.refuse_commits, "commits are refused by this test")
        lines = [json.loads(line) for line in body.splitlines() if line.strip()]
        oid = hub.commit(repo_id, revision, lines)
        self._json({"success": True, "commitOid": oid, "commitUrl": f"{self.base}/{repo_id}/commit/{oid}",
                    "pullRequestUrl": None})

    def _resolve(self, method: str, repo_id: str, revision: str, path: str, authorized: bool) -> None:
        hub = self.server_state
        repo = hub.repo(repo_id, authorized)
        oid = hub.commit_oid(repo, revision)
        content = repo.trees[oid].get(path)
        if content is None:
            raise HubError(404, "Entry not found", "EntryNotFound", {"X-Repo-Commit": oid})
        headers = {"X-Repo-Commit": oid, "ETag": f'"{git_blob_oid(content)}"', "Accept-Ranges": "bytes"}
        self._send(200, content, headers, method, content_type="application/octet-stream")
