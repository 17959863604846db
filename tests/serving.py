"""A real uvicorn server on a free localhost port, in a thread of the test process: requests go
through real HTTP, and the app's engine stays inspectable from the test."""

import json
import socket
import threading
import time
from contextlib import contextmanager

import uvicorn


@contextmanager
def running_server(app, timeout: float = 30.0):
    """Serve `app` on 127.0.0.1 until the block ends; yields its base URL (no trailing slash)."""
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))  # the port is ours from here: no race with other tests for a free one
    port = sock.getsockname()[1]
    server = uvicorn.Server(uvicorn.Config(app, log_level="warning", timeout_graceful_shutdown=5))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, name=f"uvicorn-{port}", daemon=True)
    thread.start()
    deadline = time.monotonic() + timeout
    while not server.started:
        if not thread.is_alive() or time.monotonic() > deadline:
            raise RuntimeError(f"the test server on port {port} did not start")
        time.sleep(0.01)
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        server.should_exit = True
        thread.join(timeout)
        sock.close()


def sse_events(response) -> list:
    """The `data:` payloads of a server-sent event stream (an httpx response), "[DONE]" kept as is."""
    events = []
    for line in response.iter_lines():
        if line.startswith("data: "):
            data = line[len("data: ") :]
            events.append(data if data == "[DONE]" else json.loads(data))
    return events
