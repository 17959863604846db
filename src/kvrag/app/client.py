"""The `kvrag` command as a client of a running `kvrag serve`: the standard library's urllib only, so that
a second `kvrag ask` answers without importing torch or loading the model again.

`kvrag serve` writes where it listens to `KVRAG_HOME/serve.json` while it runs; `index` and `ask` in the
same home find it there (or are given `--server URL`) and let it compute, store and search the passages,
so that one process owns the home's KV and passage index while it is up.
"""

import json
import os
import socket
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import NamedTuple

from kvrag.errors import KVRagError

SERVER_FILE = "serve.json"


def free_port() -> int:
    """A port nothing listens on now (the server binds it itself, so another process could take it
    in between: a start that fails on it is retried)."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def private(path: Path):
    """`path` opened for writing, created readable by this user only: it may hold an API key."""
    return open(os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600), "w")


class Server(NamedTuple):
    """A `kvrag serve` that serve.json names: `key` where it advertised its API key, `idle_exit` (seconds) where it
    stops once idle (the one `kvrag ask` keeps warm)."""

    url: str
    pid: int
    model: dict
    key: str | None = None
    idle_exit: float | None = None


def advertise(home: Path, url: str, model: dict, key: str | None = None, idle_exit: float | None = None) -> Path:
    """Say where this process serves `home`, and the model options it answers with (removed by `withdraw`
    when it stops); with `key`, its API key too, in a file only this user may read."""
    path = home / SERVER_FILE
    tmp = path.with_name(f".{SERVER_FILE}.{os.getpid()}")
    found = {"url": url, "pid": os.getpid(), "model": model, "key": key, "idle_exit": idle_exit}
    with private(tmp) as f:
        json.dump({name: value for name, value in found.items() if value is not None}, f)
    os.replace(tmp, path)
    return path


def advertised(path: Path, pid: int | None = None) -> bool:
    """Whether `path` (from `advertise`) still names this process (or `pid`): a later server for the home replaces
    it."""
    try:
        return json.loads(path.read_text()).get("pid") == (os.getpid() if pid is None else pid)
    except (OSError, ValueError, AttributeError):
        return False


def withdraw(path: Path) -> None:
    if advertised(path):  # not a later server's
        path.unlink(missing_ok=True)


def discover(home: Path, timeout: float = 1.0) -> Server | None:
    """The `kvrag serve` running for `home`, if one answers /health; a stale or damaged file is ignored."""
    try:
        found = json.loads((home / SERVER_FILE).read_text())
        server = Server(str(found["url"]), int(found["pid"]), dict(found["model"]),
                        None if found.get("key") is None else str(found["key"]),
                        None if found.get("idle_exit") is None else float(found["idle_exit"]))
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        return None
    try:
        os.kill(server.pid, 0)
    except ProcessLookupError:
        return None
    except PermissionError:
        pass  # another user's process: /health decides
    return server if _healthy(server.url, timeout) else None


def _healthy(url: str, timeout: float) -> bool:
    try:
        with urllib.request.urlopen(f"{url}/health", timeout=timeout) as response:
            return json.loads(response.read()).get("status") == "ok"
    except (OSError, ValueError):
        return False


def stop(home: Path, server: Server, timeout: float = 120.0) -> None:
    """Have a server that stops once idle (`kvrag serve --idle-exit`) stop now: serve.json no longer names it, so it
    ends once its requests are answered; wait until it no longer answers."""
    if advertised(home / SERVER_FILE, server.pid):
        (home / SERVER_FILE).unlink(missing_ok=True)
    deadline = time.monotonic() + timeout
    while _healthy(server.url, 1.0):
        if time.monotonic() > deadline:
            raise KVRagError(f"the kvrag serve at {server.url} (pid {server.pid}) did not stop in {timeout:g} s")
        time.sleep(0.2)


def _post(url: str, path: str, body: dict, api_key: str | None, timeout: float = 3600):
    """POST JSON to the server's /v1 `path`; an error as one line naming the endpoint."""
    endpoint = url.rstrip("/").removesuffix("/v1") + "/v1" + path
    headers = {"Content-Type": "application/json"}
    if api_key:
        headers["Authorization"] = f"Bearer {api_key}"
    request = urllib.request.Request(endpoint, data=json.dumps(body).encode(), headers=headers, method="POST")
    try:
        return urllib.request.urlopen(request, timeout=timeout)
    except urllib.error.HTTPError as exc:
        try:
            message = json.loads(exc.read())["error"]["message"]
        except (ValueError, KeyError, TypeError):
            message = exc.reason
        raise KVRagError(f"{endpoint} answered {exc.code}: {message}") from exc
    except urllib.error.URLError as exc:
        raise KVRagError(f"cannot reach {endpoint}: {exc.reason}") from exc


def send_passages(url: str, api_key: str | None, passages: list[str], batch: int = 64) -> None:
    """Have the server compute and keep the passages' KV (and store them in its passage index), a batch at
    a time."""
    for start in range(0, len(passages), batch):
        with _post(url, "/passages", {"passages": passages[start : start + batch]}, api_key) as response:
            response.read()


def search(url: str, api_key: str | None, question: str, top_k: int) -> list[str]:
    with _post(url, "/passages/search", {"query": question, "top_k": top_k}, api_key, timeout=60) as response:
        return [item["text"] for item in json.loads(response.read())["data"]]


def ask(url: str, api_key: str | None, messages: list[dict], options: dict) -> Iterator[str | dict]:
    """Stream the answer's text deltas, then the final chunk's `kvrag` figures (a dict)."""
    body = {"messages": messages, "stream": True, **options}
    with _post(url, "/chat/completions", body, api_key) as response:
        for line in response:
            if not line.startswith(b"data: ") or line.strip() == b"data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            if "error" in chunk:
                raise KVRagError(f"{url} failed while answering: {chunk['error'].get('message')}")
            for choice in chunk.get("choices", []):
                if choice["delta"].get("content"):
                    yield choice["delta"]["content"]
            if "kvrag" in chunk:
                yield chunk["kvrag"]
