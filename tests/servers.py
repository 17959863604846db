"""Real servers that kvrag talks to, started as processes for a test and stopped after it: never mocked.

Shared by the core's tests and the integrations' (pytest's pythonpath holds tests/):
`from servers import chroma_server, RedisServer`.
"""

import subprocess
import sys
import time
from contextlib import contextmanager
from pathlib import Path

import httpx
import pytest

from kvrag.app.client import free_port
from kvrag.eval.scaleout import RedisServer, stop_process  # noqa: F401 - the bench's, which starts redis-server

CHROMA = Path(sys.executable).with_name("chroma")
"""The `chroma` command chromadb installs next to the interpreter."""


@pytest.fixture(scope="module")
def chroma(tmp_path_factory):
    """A `chroma run` server for a test module (import this fixture into it); yields its URL."""
    with chroma_server(tmp_path_factory.mktemp("chroma")) as url:
        yield url


@contextmanager
def chroma_server(directory: Path, timeout: float = 60.0):
    """`chroma run` on 127.0.0.1 and a free port, persisting under `directory`, until the block ends;
    yields its URL (`http://127.0.0.1:PORT`) once its heartbeat answers."""
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    log = directory / "chroma.log"
    for _ in range(3):
        port = free_port()
        url = f"http://127.0.0.1:{port}"
        with open(log, "ab") as out:
            process = subprocess.Popen(
                [str(CHROMA), "run", "--path", str(directory / "data"), "--host", "127.0.0.1", "--port", str(port)],
                stdin=subprocess.DEVNULL, stdout=out, stderr=subprocess.STDOUT,
            )
        try:
            if _wait_for_heartbeat(process, url, timeout):
                break
        except BaseException:
            stop_process(process)
            raise
        stop_process(process)  # it exited (the port was taken meanwhile): another port
    else:
        raise RuntimeError(f"`chroma run` did not start; its log:\n{log.read_text(errors='replace')[-2000:]}")
    try:
        yield url
    finally:
        stop_process(process)


def _wait_for_heartbeat(process: subprocess.Popen, url: str, timeout: float) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if process.poll() is not None:
            return False
        try:
            if httpx.get(f"{url}/api/v2/heartbeat", timeout=1.0).status_code == 200:
                return True
        except httpx.HTTPError:
            pass
        time.sleep(0.05)
    raise RuntimeError(f"`chroma run` at {url} gave no heartbeat within {timeout:.0f} s")

