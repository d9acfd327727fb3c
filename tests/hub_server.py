"""A small local HTTP server speaking the part of the Hugging Face hub API that
huggingface_hub's `create_repo` and `upload_folder` use (legacy LFS path, no Xet):

    POST /api/repos/create                                   {name, organization, visibility}
    POST /api/models/{repo}/preupload/{revision}             which files go through LFS
    POST /{repo}.git/info/lfs/objects/batch                  where to PUT each LFS object
    PUT  /lfs/{oid}                                          the object's bytes (sha256 checked)
    POST /api/models/{repo}/commit/{revision}                NDJSON: header, file, lfsFile lines
    POST /api/validate-yaml                                  the README's front matter (parsed, checked)
    GET  /api/models/{repo}                                  the repo's info: its visibility (`private`)

Like a hub without Xet storage, it answers 404 to `GET /api/models/{repo}/xet-write-token/...` (huggingface_hub then
needs HF_HUB_DISABLE_XET=1). It keeps what arrived (repos, commits with their files' bytes, the Authorization headers)
for the test to check. Anything else gets a 404 and is recorded in `unknown`.
"""

from __future__ import annotations

import base64
import hashlib
import json
import re
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from urllib.parse import unquote, urlparse


class FakeHub:
    def __init__(self):
        self.repos: dict[str, dict] = {}
        self.commits: list[dict] = []
        self.lfs: dict[str, bytes] = {}
        self.auth: set[str] = set()
        self.unknown: list[str] = []
        self.validated: list[dict] = []  # front matter of each README validated
        hub = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *a):  # quiet
                pass

            def _body(self) -> bytes:
                n = int(self.headers.get("Content-Length") or 0)
                if n:
                    return self.rfile.read(n)
                if self.headers.get("Transfer-Encoding", "").lower() == "chunked":
                    out = b""
                    while True:
                        size = int(self.rfile.readline().strip() or b"0", 16)
                        if size == 0:
                            self.rfile.readline()
                            return out
                        out += self.rfile.read(size)
                        self.rfile.readline()
                return b""

            def _send(self, code: int, body=None):
                data = b"" if body is None else json.dumps(body).encode()
                self.send_response(code)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def do_POST(self):
                path = unquote(urlparse(self.path).path)
                body = self._body()
                if self.headers.get("Authorization"):
                    hub.auth.add(self.headers["Authorization"])
                if path == "/api/repos/create":
                    req = json.loads(body)
                    repo = f"{req['organization']}/{req['name']}" if req.get("organization") else req["name"]
                    if repo in hub.repos:
                        return self._send(
                            409, {"error": "You already created this model repo", "url": f"{hub.url}/{repo}"}
                        )
                    hub.repos[repo] = req
                    return self._send(200, {"url": f"{hub.url}/{repo}"})
                if path == "/api/validate-yaml":
                    import yaml

                    text = json.loads(body)["content"]
                    m = re.match(r"\A---\n(.*?)\n---\n", text, re.S)
                    try:
                        meta = yaml.safe_load(m.group(1)) if m else None
                    except yaml.YAMLError as e:
                        return self._send(400, {"errors": [{"message": f"invalid YAML: {e}"}]})
                    if not isinstance(meta, dict) or not isinstance(meta.get("tags", []), list):
                        return self._send(
                            400, {"errors": [{"message": "metadata must be a mapping with a list of tags"}]}
                        )
                    if meta.get("base_model_relation") not in (None, "adapter", "merge", "quantized", "finetune"):
                        return self._send(400, {"errors": [{"message": "bad base_model_relation"}]})
                    hub.validated.append(meta)
                    return self._send(200, {"errors": [], "warnings": []})
                if m := re.fullmatch(r"/api/models/(.+)/preupload/(.+)", path):
                    files = json.loads(body)["files"]
                    return self._send(
                        200,
                        {
                            "files": [
                                {
                                    "path": f["path"],
                                    "uploadMode": "lfs" if f["path"].endswith(".safetensors") else "regular",
                                    "shouldIgnore": False,
                                }
                                for f in files
                            ]
                        },
                    )
                if m := re.fullmatch(r"/(.+)\.git/info/lfs/objects/batch", path):
                    objs = json.loads(body)["objects"]
                    return self._send(
                        200,
                        {
                            "transfer": "basic",
                            "objects": [
                                {
                                    "oid": o["oid"],
                                    "size": o["size"],
                                    "actions": {"upload": {"href": f"{hub.url}/lfs/{o['oid']}"}},
                                }
                                for o in objs
                            ],
                        },
                    )
                if m := re.fullmatch(r"/api/models/(.+)/commit/(.+)", path):
                    repo, revision = m.group(1), m.group(2)
                    lines = [json.loads(line) for line in body.decode().splitlines() if line.strip()]
                    commit = {"repo": repo, "revision": revision, "files": {}, "header": None}
                    for line in lines:
                        v = line["value"]
                        if line["key"] == "header":
                            commit["header"] = v
                        elif line["key"] == "file":
                            commit["files"][v["path"]] = base64.b64decode(v["content"])
                        elif line["key"] == "lfsFile":
                            commit["files"][v["path"]] = hub.lfs[v["oid"]]
                    if repo not in hub.repos:
                        return self._send(404, {"error": f"Repository {repo} not found"})
                    hub.commits.append(commit)
                    oid = hashlib.sha1(body).hexdigest()
                    return self._send(200, {"commitUrl": f"{hub.url}/{repo}/commit/{oid}", "commitOid": oid})
                hub.unknown.append(f"POST {path}")
                return self._send(404, {"error": "unknown endpoint"})

            def do_PUT(self):
                path = unquote(urlparse(self.path).path)
                body = self._body()
                if m := re.fullmatch(r"/lfs/([0-9a-f]{64})", path):
                    if hashlib.sha256(body).hexdigest() != m.group(1):
                        return self._send(400, {"error": "sha256 mismatch"})
                    hub.lfs[m.group(1)] = body
                    return self._send(200)
                hub.unknown.append(f"PUT {path}")
                return self._send(404, {"error": "unknown endpoint"})

            def do_GET(self):
                path = unquote(urlparse(self.path).path)
                if (m := re.fullmatch(r"/api/models/([^/]+/[^/]+|[^/]+)", path)) and m.group(1) in hub.repos:
                    repo = hub.repos[m.group(1)]
                    return self._send(200, {"id": m.group(1), "private": repo.get("visibility", "public") == "private"})
                hub.unknown.append(f"GET {self.path}")
                return self._send(404, {"error": "unknown endpoint"})

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)

    def __enter__(self) -> "FakeHub":
        self.thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self.server.shutdown()
        self.server.server_close()
