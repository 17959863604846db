"""The `kvrag` command as a client of a running `kvrag serve`: the standard library's urllib only, so that
a second `kvrag ask` answers without importing torch or loading the model again.

`kvrag serve` writes where it listens to `KVRAG_HOME/serve.json` while it runs; `index` and `ask` in the
same home find it there (or are given `--server URL`) and let it compute, store and search the passages,
so that one process owns the home's KV and passage index while it is up.
"""

import json
import os
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path

from kvrag.errors import KVRagError

SERVER_FILE = "serve.json"


def advertise(home: Path, url: str, model: dict) -> Path:
    """Say where this process serves `home`, and the model options it answers with (removed by `withdraw`
    when it stops)."""
    path = home / SERVER_FILE
    tmp = path.with_name(f".{SERVER_FILE}.{os.getpid()}")
    tmp.write_text(json.dumps({"url": url, "pid": os.getpid(), "model": model}))
    os.replace(tmp, path)
    return path


def withdraw(path: Path) -> None:
    try:
        if json.loads(path.read_text()).get("pid") == os.getpid():  # not a later server's
            path.unlink()
    except (OSError, ValueError, AttributeError):
        pass


def discover(home: Path, timeout: float = 1.0) -> tuple[str, dict] | None:
    """(URL, model options) of the `kvrag serve` running for `home`, if one answers /health; a stale or
    damaged file is ignored."""
    try:
        found = json.loads((home / SERVER_FILE).read_text())
        url, pid, model = str(found["url"]), int(found["pid"]), dict(found["model"])
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        return None
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return None
    except PermissionError:
        pass  # another user's process: /health decides
    try:
        with urllib.request.urlopen(f"{url}/health", timeout=timeout) as response:
            return (url, model) if json.loads(response.read()).get("status") == "ok" else None
    except (OSError, ValueError):
        return None


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
