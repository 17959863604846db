"""Bounded requests: whatever a client sends, `kvrag serve` refuses what is too big before it costs the
other users anything. A body over the byte limit is refused as it arrives, a prompt that cannot fit
the context window before it is tokenized, and a prompt is built on a pool thread, so that both
answers come while the scheduler's worker is held mid-answer for another client (real HTTP, a tiny
random-weight engine)."""

import json
import threading
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest
from serving import running_server, sse_events
from test_server import KEY, MESSAGES, PASSAGE, FakeEmbedder, assert_error

from kvrag import scheduler
from kvrag.app.server import MAX_PASSAGES, create_app, default_max_request_bytes, prompt_char_limit

CHAT = "/v1/chat/completions"
JSON = {"Content-Type": "application/json"}


class Hold:
    """Holds the scheduler's worker at a model call until released: a request answered meanwhile needed
    nothing from the worker, and one in progress cannot end meanwhile."""

    def __init__(self, monkeypatch):
        self.after, self.calls = None, 0
        self.holding, self.released = threading.Event(), threading.Event()
        packed = scheduler.forward_packed

        def call(model, runs):
            self.calls += 1
            if self.after is not None and self.calls > self.after:
                self.holding.set()
                assert self.released.wait(60), "never released"
            return packed(model, runs)

        monkeypatch.setattr(scheduler, "forward_packed", call)

    def arm(self, calls: int) -> None:
        """Hold from the model call after the next `calls`."""
        self.after = self.calls + calls


def streamed(url: str, body: dict) -> str:
    with httpx.Client(base_url=url, timeout=60) as client, client.stream("POST", CHAT, json=body) as response:
        assert response.status_code == 200, response.read()
        events = sse_events(response)
    assert events[-1] == "[DONE]"
    return "".join(e["choices"][0]["delta"].get("content", "") for e in events[:-1] if e["choices"])


def chunked(data: bytes, size: int = 65536):
    """A body sent with `Transfer-Encoding: chunked`: no Content-Length tells its size."""
    return (data[i : i + size] for i in range(0, len(data), size))


def test_a_5mb_prompt_is_refused_while_another_client_streams_and_prompts_are_built_off_the_worker(
        engine, monkeypatch):
    engine.eos_ids = set()  # every answer runs its full length
    engine.index([PASSAGE])
    hold = Hold(monkeypatch)
    built, build = [], engine.prompt_from_text
    monkeypatch.setattr(engine, "prompt_from_text",
                        lambda text, spans=None: built.append((threading.current_thread().name, len(text)))
                        or build(text, spans))
    body = {"messages": MESSAGES, "max_tokens": 48, "stream": True}
    with running_server(create_app(engine)) as url:
        client = httpx.Client(base_url=url, timeout=30)  # a refusal that waited for the worker would time out
        alone = streamed(url, body)
        hold.arm(4)  # the other client's answer: its first tokens, then held
        with ThreadPoolExecutor(1) as pool:
            other = pool.submit(streamed, url, body)
            try:
                assert hold.holding.wait(30)

                five_mb = json.dumps({"messages": [{"role": "user", "content": "lighthouse " * 480_000}]}).encode()
                assert len(five_mb) > 5_000_000
                error = assert_error(client.post(CHAT, content=five_mb, headers=JSON), 400, code="request_too_large")
                assert str(default_max_request_bytes(engine.context_window)) in error["message"]
                assert_error(client.post(CHAT, content=chunked(five_mb), headers=JSON), 400, code="request_too_large")

                # under the byte limit, but more characters than the window can hold: refused untokenized
                limit = prompt_char_limit(engine)
                wide = [{"role": "user", "content": "x" * (limit + 1)}]
                error = assert_error(client.post(CHAT, json={"messages": wide}), 400, code="context_length_exceeded",
                                     param="messages")
                assert "characters" in error["message"] and all(n <= limit for _, n in built)
                # few enough characters, too many tokens: tokenized on a pool thread, refused before any header
                long = [{"role": "user", "content": "lighthouse river passages " * 400}]
                for stream in (False, True):
                    assert_error(client.post(CHAT, json={"messages": long, "stream": stream}), 400,
                                 code="context_length_exceeded", param="messages")
                assert client.get("/health").json()["status"] == "ok"
                assert not other.done()  # still held: every refusal came before its end
            finally:
                hold.released.set()
            assert other.result() == alone
    event_loop = f"uvicorn-{url.rsplit(':', 1)[1]}"  # running_server's thread
    assert len(built) == 4 and {name for name, _ in built}.isdisjoint({"kvrag-scheduler", event_loop, "MainThread"})


def test_the_body_limit_counts_bytes_with_or_without_a_content_length(engine):
    body = json.dumps({"messages": MESSAGES, "max_tokens": 4}).encode()
    limit = len(body) + 100
    with running_server(create_app(engine, max_request_bytes=limit)) as url:
        client = httpx.Client(base_url=url, timeout=60)
        expected = client.post(CHAT, content=body, headers=JSON).json()["choices"][0]["message"]["content"]
        at_limit = body + b" " * (limit - len(body))  # JSON may end in whitespace
        for content in (at_limit, chunked(at_limit, 50)):
            response = client.post(CHAT, content=content, headers=JSON)
            assert response.status_code == 200 and response.json()["choices"][0]["message"]["content"] == expected
        for content in (at_limit + b" ", chunked(at_limit + b" ", 50)):
            assert_error(client.post(CHAT, content=content, headers=JSON), 400, code="request_too_large")
        assert_error(client.post("/v1/passages", json={"passages": ["x" * limit]}), 400, code="request_too_large")
        assert client.post(CHAT, content=body, headers=JSON).status_code == 200  # the server goes on
        metrics = client.get("/metrics").text
        assert f'kvrag_requests_total{{endpoint="{CHAT}",status="400"}} 2.0' in metrics
    with pytest.raises(ValueError):
        create_app(engine, max_request_bytes=0)


def test_the_default_body_limit_follows_the_context_window():
    assert default_max_request_bytes(8192) == 1 << 20  # at least 1 MiB
    assert default_max_request_bytes(131072) == 64 * 131072  # 8 MiB for a 128K window


def test_max_tokens_over_the_context_window_is_400(engine):
    assert engine.context_window == 1024
    with running_server(create_app(engine)) as url:
        client = httpx.Client(base_url=url, timeout=60)
        for field in ("max_tokens", "max_completion_tokens"):
            for value in (2**70, 1e9, 10**30, 1024):
                response = client.post(CHAT, json={"messages": MESSAGES, field: value})
                error = assert_error(response, 400, code="context_length_exceeded", param=field)
                assert "1024" in error["message"]
            assert client.post(CHAT, json={"messages": MESSAGES, field: 4}).status_code == 200
        digits = b'{"messages": [{"role": "user", "content": "hi"}], "max_tokens": 1' + b"0" * 5000 + b"}"
        assert_error(client.post(CHAT, content=digits, headers=JSON), 400)  # past Python's int-parsing limit
        assert_error(client.post(CHAT, content=digits.replace(b"1" + b"0" * 5000, b"1e400"), headers=JSON), 400,
                     param="max_tokens")


def test_max_tokens_within_the_window_is_cut_to_what_the_prompt_leaves(engine):
    engine.eos_ids = set()
    with running_server(create_app(engine)) as url:
        body = {"messages": MESSAGES, "max_tokens": engine.context_window - 1}
        completion = httpx.post(f"{url}{CHAT}", json=body, timeout=120).json()
    usage = completion["usage"]
    assert completion["choices"][0]["finish_reason"] == "length"
    assert usage["total_tokens"] == usage["prompt_tokens"] + usage["completion_tokens"] == engine.context_window


def test_passages_per_call_are_limited(engine):
    with running_server(create_app(engine, max_passages=3)) as url:
        texts = [f"The river Olm freezes in winter number {i}." for i in range(4)]
        error = assert_error(httpx.post(f"{url}/v1/passages", json={"passages": texts}, timeout=60), 400,
                             param="passages")
        assert "at most 3" in error["message"]
        assert_error(httpx.post(f"{url}/v1/passages", json={"input": texts}, timeout=60), 400, param="input")
        data = httpx.post(f"{url}/v1/passages", json={"passages": texts[:3]}, timeout=60).json()["data"]
        assert [d["id"] for d in data] == engine.index(texts[:3])
        wide = "x" * (prompt_char_limit(engine) + 1)
        assert_error(httpx.post(f"{url}/v1/passages", json={"passages": ["fine", wide]}, timeout=60), 400,
                     code="context_length_exceeded", param="passages.1")
    with running_server(create_app(engine)) as url:
        many = [f"passage {i}" for i in range(MAX_PASSAGES + 1)]
        assert_error(httpx.post(f"{url}/v1/passages", json={"passages": many}, timeout=60), 400, param="passages")


def test_stop_sequences_and_embedding_inputs_are_limited(engine):
    with running_server(create_app(engine, embedder=FakeEmbedder())) as url:
        client = httpx.Client(base_url=url, timeout=60)
        for stop in (["a", "b", "c", "d", "e"], "x" * 1001):
            assert_error(client.post(CHAT, json={"messages": MESSAGES, "stop": stop}), 400, param="stop")
        four = {"messages": MESSAGES, "max_tokens": 4, "stop": ["a", "b", "c", "d"]}
        assert client.post(CHAT, json=four).status_code == 200
        assert_error(client.post("/v1/embeddings", json={"input": ["ab"] * 2049}), 400, param="input")
        assert len(client.post("/v1/embeddings", json={"input": ["ab"] * 2048}).json()["data"]) == 2048


def test_the_api_docs_need_the_key_health_and_metrics_do_not(engine):
    with running_server(create_app(engine, api_key=KEY)) as url:
        for path in ("/docs", "/redoc", "/openapi.json"):
            for headers in ({}, {"Authorization": "Bearer wrong"}):
                assert_error(httpx.get(f"{url}{path}", headers=headers), 401, code="invalid_api_key")
            assert httpx.get(f"{url}{path}", headers={"Authorization": f"Bearer {KEY}"}).status_code == 200
        assert httpx.get(f"{url}/openapi.json", headers={"Authorization": f"Bearer {KEY}"}).json()["paths"]
        assert httpx.get(f"{url}/health").status_code == 200 and httpx.get(f"{url}/metrics").status_code == 200
    with running_server(create_app(engine)) as url:  # no key: open, as before
        assert httpx.get(f"{url}/openapi.json").status_code == 200
