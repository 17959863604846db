"""`kvrag serve`: the OpenAI-compatible API over real HTTP, on a tiny random-weight engine (every
error path, streaming, metrics, the CLI's wiring) and, marked e2e, on the real default model with
the clients people use: openai, LangChain's ChatOpenAI in an unmodified chain, LlamaIndex's OpenAILike."""

import asyncio
import base64
import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import numpy as np
import pytest
from servers import chroma_server
from serving import running_server, sse_events

from kvrag import BlendConfig
from kvrag.app import cli
from kvrag.app.cli import common
from kvrag.app.server import DEFAULT_MAX_TOKENS, create_app
from kvrag.errors import QueueFullError, RequestTimeoutError

KEY = "sk-test-key"
PASSAGE = "The lighthouse of Varnholm was built in 1873 by the engineer Ilsa Brandt."
QUESTION = "Who built the lighthouse?"
MESSAGES = [
    {"role": "system", "content": "Answer from the passages."},
    {"role": "user", "content": f"{PASSAGE}\n\nQuestion: {QUESTION}"},
]
TURNS = [("system", ["Answer from the passages."]), ("user", [f"{PASSAGE}\n\nQuestion: {QUESTION}"])]


class FakeEmbedder:
    """Three-dimensional vectors from the text's length: no model."""

    def embed(self, texts):
        return [[len(t) / 100, 0.5, -1.0] for t in texts]

    def count_tokens(self, texts):
        return sum(len(t.split()) for t in texts)


@pytest.fixture
def server(engine):
    with running_server(create_app(engine, embedder=FakeEmbedder())) as url:
        yield httpx.Client(base_url=url, timeout=60)


def chat(client, **body):
    return client.post("/v1/chat/completions", json={"model": "kvrag", "messages": MESSAGES, "max_tokens": 8, **body})


def reference(engine, turns=TURNS, **options):
    """The in-process answer to the same request, on a warm store as the server's will be: the first
    request computes the prompt's own text before the passages (a block that counts as prefilled)."""
    text = engine.layout.render_chat(turns)[0]
    engine.generate_text(text, **{**options, "max_new_tokens": 1})
    return engine.generate_text(text, **{"max_new_tokens": 8, **options})


def assert_error(response, status, *, code=None, param=None, type="invalid_request_error"):
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["message"]
    assert (error["type"], error["code"]) == (type, code)
    if param is not None:
        assert error["param"] == param
    return error


# ---- the models, errors and authorization ------------------------------------------------------------


def test_models_list_the_served_model(engine):
    with running_server(create_app(engine, model_name="tiny")) as url:
        models = httpx.get(f"{url}/v1/models").json()
        assert models["object"] == "list" and [m["id"] for m in models["data"]] == ["tiny"]
        assert models["data"][0]["object"] == "model"
        assert httpx.get(f"{url}/v1/models/tiny").json()["id"] == "tiny"
        assert_error(httpx.get(f"{url}/v1/models/gpt-4o"), 404, code="model_not_found")


def test_the_default_model_name_is_the_model_directory(engine):
    engine.model.name_or_path = "/models/SmolLM2-135M-Instruct"
    with running_server(create_app(engine)) as url:
        assert httpx.get(f"{url}/v1/models").json()["data"][0]["id"] == "SmolLM2-135M-Instruct"
    engine.model.name_or_path = "/home/kvrag/models/SmolLM2-135M-Instruct.Q4_1-b179c9523d0e6a0f"  # converted
    with running_server(create_app(engine)) as url:
        assert httpx.get(f"{url}/v1/models").json()["data"][0]["id"] == "SmolLM2-135M-Instruct.Q4_1"


def test_served_model_names(engine):
    """As vLLM's --served-model-name: the first is the id listed, every one is answered to."""
    with running_server(create_app(engine, model_name=["smollm", "gpt-3.5-turbo"])) as url:
        client = httpx.Client(base_url=url, timeout=60)
        assert [m["id"] for m in client.get("/v1/models").json()["data"]] == ["smollm"]
        for name in ("smollm", "gpt-3.5-turbo"):
            assert chat(client, model=name).json()["model"] == "smollm"
        assert_error(chat(client, model="kvrag"), 404, code="model_not_found")


@pytest.mark.parametrize(
    "body, status, code, param",
    [
        ({"model": "gpt-4o"}, 404, "model_not_found", "model"),
        ({"n": 2}, 400, None, "n"),
        ({"temperature": 3}, 400, None, "temperature"),
        ({"temperature": -0.5}, 400, None, "temperature"),
        ({"temperature": "hot"}, 400, None, "temperature"),
        ({"top_p": 0}, 400, None, "top_p"),
        ({"max_tokens": 0}, 400, None, "max_tokens"),
        ({"messages": []}, 400, None, "messages"),
        ({"messages": [{"role": "tool", "content": "x"}]}, 400, None, "messages.0.role"),
        ({"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]}, 400, None,
         "messages.0.content.0"),
        ({"messages": [{"role": "user", "content": "   "}]}, 400, None, "messages"),
        ({"tools": [{"type": "function", "function": {"name": "f"}}]}, 400, "unsupported_parameter", "tools"),
        ({"logprobs": True}, 400, "unsupported_parameter", "logprobs"),
        ({"kvrag": {"mode": "fast"}}, 400, None, "kvrag.mode"),
        ({"kvrag": {"blend_ratio": 2}}, 400, None, "kvrag.blend_ratio"),
        ({"kvrag": {"mode": "auto", "coverage": 0}}, 400, None, "kvrag.coverage"),
        ({"kvrag": {"mode": "blend", "select": "random"}}, 400, None, "kvrag.select"),
        ({"kvrag": {"speed": 1}}, 400, None, "kvrag.speed"),
        ({"stream": True, "n": 3}, 400, None, "n"),
    ],
)
def test_bad_requests_get_openai_shaped_errors(server, body, status, code, param):
    assert_error(chat(server, **body), status, code=code, param=param)


def test_malformed_json_and_a_missing_body_are_400(server):
    json_type = {"Content-Type": "application/json"}
    error = assert_error(server.post("/v1/chat/completions", content=b'{"messages": [', headers=json_type), 400)
    assert "JSON" in error["message"]
    assert_error(server.post("/v1/chat/completions", json={"model": "kvrag"}), 400, param="messages")
    assert_error(server.post("/v1/chat/completions"), 400)
    assert_error(server.get("/v1/nothing"), 404, code="not_found")
    assert_error(server.get("/v1/chat/completions"), 405, code="method_not_allowed")


@pytest.mark.parametrize("stream", [False, True])
def test_a_prompt_over_the_context_window_is_400_before_any_stream_begins(server, engine, stream):
    long = [{"role": "user", "content": "lighthouse river passages " * 400}]
    response = chat(server, messages=long, stream=stream)
    assert response.headers["content-type"].startswith("application/json")
    error = assert_error(response, 400, code="context_length_exceeded", param="messages")
    assert str(engine.context_window) in error["message"]
    assert chat(server).status_code == 200  # and the server goes on


def test_engine_refusals_map_to_429_and_503(server, engine, monkeypatch):
    def full(*args, **kwargs):
        raise QueueFullError("256 requests are already waiting")

    monkeypatch.setattr(engine, "stream_text", full)
    for stream in (False, True):
        assert_error(chat(server, stream=stream), 429, type="rate_limit_error", code="queue_full")

    class TimedOut:
        async def __aiter__(self):
            raise RequestTimeoutError("waited too long")
            yield

    monkeypatch.setattr(engine, "stream_text", lambda *a, **k: TimedOut())
    for stream in (False, True):
        assert_error(chat(server, stream=stream), 503, type="server_error", code="timeout")


def test_api_key(engine):
    with running_server(create_app(engine, api_key=KEY)) as url:
        for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": KEY}):
            assert_error(httpx.get(f"{url}/v1/models", headers=headers), 401, code="invalid_api_key")
            bad_json = httpx.post(f"{url}/v1/chat/completions", content=b"{", headers=headers)
            assert_error(bad_json, 401, code="invalid_api_key")  # the key is checked before the body is read
        headers = {"Authorization": f"Bearer {KEY}"}
        assert httpx.get(f"{url}/v1/models", headers=headers).status_code == 200
        assert chat(httpx.Client(base_url=url, headers=headers)).status_code == 200
        assert httpx.get(f"{url}/health").json()["status"] == "ok"  # health and metrics stay open
        assert 'status="401"' in httpx.get(f"{url}/metrics").text


# ---- chat completions --------------------------------------------------------------------------------


def test_indexed_passages_are_reused_and_the_answer_is_the_in_process_one(server, engine):
    indexed = server.post("/v1/passages", json={"passages": [PASSAGE]}).json()
    assert indexed["object"] == "list" and indexed["data"][0]["object"] == "passage"
    assert indexed["data"][0]["id"] == engine.index([PASSAGE])[0]
    assert indexed["data"][0]["tokens"] == len(engine.layout.passage_ids(PASSAGE))
    expected = reference(engine)
    response = chat(server)
    assert response.status_code == 200, response.text
    completion = response.json()
    assert completion["object"] == "chat.completion" and completion["id"].startswith("chatcmpl-")
    assert completion["model"] == "kvrag" and completion["system_fingerprint"].startswith("fp_")
    [choice] = completion["choices"]
    assert choice["message"] == {"role": "assistant", "content": expected.text, "refusal": None}
    assert choice["finish_reason"] == {"stop": "stop", "length": "length"}[expected.finish_reason]
    usage = completion["usage"]
    assert usage["prompt_tokens"] == expected.prompt_tokens
    assert usage["completion_tokens"] == len(expected.token_ids)
    assert usage["total_tokens"] == usage["prompt_tokens"] + usage["completion_tokens"]
    assert usage["prompt_tokens_details"]["cached_tokens"] == expected.reused_tokens >= indexed["data"][0]["tokens"]
    stats = completion["kvrag"]
    assert stats["mode"] == "block" and stats["ttft"] > 0
    assert stats["reused_tokens"] == expected.reused_tokens and stats["prefilled_tokens"] == expected.prefilled_tokens
    assert stats["cache_hits"] and all(n > 0 for n in stats["cache_hits"].values())


def test_text_parts_developer_role_and_options_render_as_the_engine_renders(server, engine):
    engine.index([PASSAGE])
    messages = [{"role": "developer", "content": "Answer from the passages."},
                {"role": "user", "content": [{"type": "text", "text": PASSAGE},
                                             {"type": "text", "text": f"Question: {QUESTION}"}]}]
    response = chat(server, messages=messages, max_completion_tokens=5, temperature=0.7, top_p=0.9, seed=3)
    expected = engine.generate_text(engine.layout.render_chat(TURNS)[0], max_new_tokens=5, temperature=0.7, top_p=0.9,
                                    seed=3)
    assert response.json()["choices"][0]["message"]["content"] == expected.text
    assert response.json()["usage"]["completion_tokens"] == len(expected.token_ids) <= 5


def test_kvrag_mode_and_blend_ratio(server, engine):
    engine.index([PASSAGE])
    full = chat(server, kvrag={"mode": "full"}).json()
    assert full["kvrag"]["mode"] == "full" and full["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
    for ratio in (0.5, 1.0):
        expected = reference(engine, mode="blend", blend=BlendConfig(recompute_ratio=ratio))
        blend = chat(server, kvrag={"mode": "blend", "blend_ratio": ratio}).json()
        assert blend["kvrag"]["mode"] == "blend" and blend["choices"][0]["message"]["content"] == expected.text
        assert blend["kvrag"]["prefilled_tokens"] == expected.prefilled_tokens  # the share recomputed: the ratio's
    for coverage in (0.3, 1.0):
        expected = reference(engine, mode="auto", blend=BlendConfig(coverage=coverage))
        auto = chat(server, kvrag={"mode": "auto", "coverage": coverage}).json()
        assert auto["kvrag"]["mode"] == "auto" and auto["choices"][0]["message"]["content"] == expected.text
        assert auto["kvrag"]["prefilled_tokens"] == expected.prefilled_tokens
    expected = reference(engine, mode="blend", blend=BlendConfig(recompute_ratio=0.5, select="lookahead"))
    ahead = chat(server, kvrag={"mode": "blend", "blend_ratio": 0.5, "select": "lookahead"}).json()
    assert ahead["choices"][0]["message"]["content"] == expected.text
    assert ahead["kvrag"]["prefilled_tokens"] == expected.prefilled_tokens


def test_the_default_mode_and_max_tokens(engine):
    with running_server(create_app(engine, default_mode="full")) as url:
        completion = chat(httpx.Client(base_url=url, timeout=60), max_tokens=None).json()
        assert completion["kvrag"]["mode"] == "full"
        assert completion["usage"]["completion_tokens"] <= DEFAULT_MAX_TOKENS
    with pytest.raises(ValueError):
        create_app(engine, default_mode="fast")
    engine.default_mode = "auto"  # a request naming no mode, served without --mode: the engine's default
    try:
        with running_server(create_app(engine)) as url:
            assert chat(httpx.Client(base_url=url, timeout=60)).json()["kvrag"]["mode"] == "auto"
    finally:
        engine.default_mode = "block"


@pytest.mark.parametrize("include_usage", [False, True])
def test_streaming_sends_openai_chunks_and_done(server, engine, include_usage):
    engine.index([PASSAGE])
    body = {"model": "kvrag", "messages": MESSAGES, "max_tokens": 8, "stream": True}
    if include_usage:
        body["stream_options"] = {"include_usage": True}
    expected = reference(engine)
    with server.stream("POST", "/v1/chat/completions", json=body) as response:
        assert response.status_code == 200 and response.headers["content-type"].startswith("text/event-stream")
        events = sse_events(response)
    assert events[-1] == "[DONE]"
    chunks = events[:-1]
    assert all(c["object"] == "chat.completion.chunk" and c["model"] == "kvrag" for c in chunks)
    assert len({c["id"] for c in chunks}) == 1
    assert chunks[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    if include_usage:
        *chunks, last = chunks
        assert last["choices"] == [] and last["usage"]["prompt_tokens"] == expected.prompt_tokens
        assert last["usage"]["completion_tokens"] == len(expected.token_ids)
        assert last["usage"]["prompt_tokens_details"]["cached_tokens"] == expected.reused_tokens > 0
        assert all(c["usage"] is None for c in chunks)
    else:
        assert all("usage" not in c for c in chunks)
    final = chunks[-1]
    assert final["choices"][0]["delta"] == {} and final["choices"][0]["finish_reason"] in ("stop", "length")
    assert final["kvrag"]["reused_tokens"] == expected.reused_tokens and final["kvrag"]["ttft"] > 0
    assert all(c["choices"][0]["finish_reason"] is None for c in chunks[:-1])
    assert "".join(c["choices"][0]["delta"].get("content", "") for c in chunks) == expected.text


def test_completions_complete_the_prompt_as_it_is(server, engine):
    """/v1/completions (the legacy API): no chat template; reuse, usage and errors as chat's."""
    engine.index([PASSAGE])
    prompt = f"{PASSAGE}\n\nQuestion: {QUESTION}\nAnswer:"
    engine.generate_text(prompt, max_new_tokens=1)  # the text before the passage, stored as chat's reference does
    expected = engine.generate_text(prompt, max_new_tokens=8)
    body = {"model": "kvrag", "prompt": prompt, "max_tokens": 8}
    completion = server.post("/v1/completions", json=body).json()
    assert completion["object"] == "text_completion" and completion["id"].startswith("cmpl-")
    [choice] = completion["choices"]
    assert choice["text"] == expected.text and choice["finish_reason"] in ("stop", "length")
    assert completion["usage"]["prompt_tokens"] == expected.prompt_tokens
    assert completion["usage"]["prompt_tokens_details"]["cached_tokens"] == expected.reused_tokens > 0
    assert server.post("/v1/completions", json={**body, "prompt": [prompt]}).json()["choices"][0]["text"] == expected.text
    with server.stream("POST", "/v1/completions", json={**body, "stream": True,
                                                        "stream_options": {"include_usage": True}}) as response:
        events = sse_events(response)
    assert events[-1] == "[DONE]"
    *chunks, last = events[:-1]
    assert all(c["object"] == "text_completion" for c in events[:-1])
    assert "".join(c["choices"][0]["text"] for c in chunks) == expected.text
    assert chunks[-1]["choices"][0]["finish_reason"] in ("stop", "length")
    assert last["choices"] == [] and last["usage"]["prompt_tokens_details"]["cached_tokens"] == expected.reused_tokens
    assert_error(server.post("/v1/completions", json={**body, "prompt": [prompt, prompt]}), 400, param="prompt")
    assert_error(server.post("/v1/completions", json={**body, "echo": True}), 400, code="unsupported_parameter")
    assert_error(server.post("/v1/completions", json={**body, "max_tokens": 10**9}), 400,
                 code="context_length_exceeded", param="max_tokens")
    assert_error(server.post("/v1/completions", json={"model": "kvrag"}), 400, param="prompt")


class EndlessStream:
    """An answer that never ends until cancelled, as the engine's stream is consumed asynchronously."""

    def __init__(self):
        self.cancelled, self.result = threading.Event(), None

    async def __aiter__(self):  # as GenerationStream's: an iteration left early cancels
        try:
            while not self.cancelled.is_set():
                yield "word "
                await asyncio.sleep(0.01)
        finally:
            self.cancel()

    def cancel(self):
        self.cancelled.set()


def test_a_client_that_disconnects_cancels_its_generation(server, engine, monkeypatch):
    fake = EndlessStream()
    monkeypatch.setattr(engine, "stream_text", lambda *a, **k: fake)
    with server.stream("POST", "/v1/chat/completions", json={"messages": MESSAGES, "stream": True}) as response:
        lines = response.iter_lines()
        assert next(lines).startswith("data: ")
    assert fake.cancelled.wait(10), "the generation went on after its client left"
    deadline = time.monotonic() + 10
    while server.get("/health").json()["active_requests"] and time.monotonic() < deadline:
        time.sleep(0.05)
    assert server.get("/health").json()["active_requests"] == 0


def test_a_client_that_disconnects_frees_the_engine(server, engine, monkeypatch):
    streams, stream_text = [], engine.stream_text
    monkeypatch.setattr(engine, "stream_text", lambda *a, **k: streams.append(stream_text(*a, **k)) or streams[-1])
    body = {"messages": MESSAGES, "stream": True, "max_tokens": 900}
    with server.stream("POST", "/v1/chat/completions", json=body) as response:
        lines = response.iter_lines()
        assert next(lines).startswith("data: ")
    [stream] = streams
    deadline = time.monotonic() + 10
    while not stream.done and time.monotonic() < deadline:
        time.sleep(0.01)
    assert stream.result.finish_reason == "cancelled" and len(stream.result.token_ids) < 900
    assert engine.scheduler.active == 0


def test_a_bad_request_never_disturbs_the_others(server, engine):
    engine.index([PASSAGE])
    expected = engine.generate_text(engine.layout.render_chat(TURNS)[0], max_new_tokens=8).text
    long = [{"role": "user", "content": "lighthouse " * 2000}]

    def good(stream):
        if not stream:
            return chat(server).json()["choices"][0]["message"]["content"]
        body = {"messages": MESSAGES, "max_tokens": 8, "stream": True}
        with server.stream("POST", "/v1/chat/completions", json=body) as r:
            return "".join(c["choices"][0]["delta"].get("content", "") for c in sse_events(r)[:-1] if c["choices"])

    with ThreadPoolExecutor(6) as pool:
        goods = [pool.submit(good, stream) for stream in (True, False, True)]
        bads = [pool.submit(chat, server, messages=long), pool.submit(chat, server, n=2),
                pool.submit(server.post, "/v1/chat/completions", content=b"{")]
        assert [b.result().status_code for b in bads] == [400, 400, 400]
        assert [g.result() for g in goods] == [expected] * 3


# ---- passages, embeddings, health and metrics -----------------------------------------------------------


def test_passages_pasted_into_messages_are_reused_by_the_next_request(server):
    """An OpenAI client's own RAG prompt, its documents never sent to /v1/passages: the second question over
    them reuses their KV (learned from the first prompt), in block mode."""
    docs = [f"Document {uuid.uuid4().hex}: nobody indexed this text through the passages endpoint." for _ in range(2)]
    ask = lambda q: chat(server, messages=[
        {"role": "system", "content": "Answer from the documents."},
        {"role": "user", "content": "Documents:\n\n" + "\n\n".join(docs) + f"\n\nQuestion: {q}"}],
        max_tokens=2, kvrag={"mode": "block"}).json()
    first, second = ask(QUESTION), ask("Which text did nobody index, and why?")
    assert first["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
    assert second["usage"]["prompt_tokens_details"]["cached_tokens"] > 0
    assert second["kvrag"]["cache_hits"].get("computed", 0) == 0


def test_passages_endpoint(server, engine):
    other = "The river Olm freezes every winter."
    data = server.post("/v1/passages", json={"input": other}).json()["data"]
    assert [d["id"] for d in data] == engine.index([other])
    assert_error(server.post("/v1/passages", json={}), 400, param="passages")
    assert_error(server.post("/v1/passages", json={"passages": ["fine", "  "]}), 400)
    assert_error(server.post("/v1/passages", json={"passages": [1, 2]}), 400)
    assert_error(server.post("/v1/passages", json={"passages": ["x " * 2000]}), 400, code="context_length_exceeded")


def test_embeddings(server):
    floats = server.post("/v1/embeddings", json={"model": "all-MiniLM-L6-v2", "input": ["ab", "abcd"]}).json()
    assert floats["object"] == "list" and floats["model"] == "all-MiniLM-L6-v2"
    assert [d["embedding"] for d in floats["data"]] == FakeEmbedder().embed(["ab", "abcd"])
    assert [d["index"] for d in floats["data"]] == [0, 1] and floats["usage"] == {"prompt_tokens": 2, "total_tokens": 2}
    encoded = server.post("/v1/embeddings", json={"input": "ab", "encoding_format": "base64"}).json()
    vector = np.frombuffer(base64.b64decode(encoded["data"][0]["embedding"]), dtype="<f4")
    assert np.allclose(vector, FakeEmbedder().embed(["ab"])[0])
    assert_error(server.post("/v1/embeddings", json={"model": "text-embedding-3-small", "input": "ab"}), 404,
                 code="model_not_found")
    assert_error(server.post("/v1/embeddings", json={"input": ""}), 400, param="input")
    assert_error(server.post("/v1/embeddings", json={"input": [[1, 2, 3]]}), 400)
    assert_error(server.post("/v1/embeddings", json={"input": "ab", "dimensions": 2}), 400, param="dimensions")


def test_health_and_metrics(server, engine):
    health = server.get("/health").json()
    assert health == {"status": "ok", "model": "kvrag", "queue_depth": 0, "active_requests": 0, "default_mode": "block",
                      "shadow": None}
    engine.index([PASSAGE])
    assert chat(server).status_code == 200
    assert chat(server, n=2).status_code == 400
    text = server.get("/metrics").text
    for name in ("kvrag_requests_total", "kvrag_ttft_seconds_bucket", "kvrag_queue_depth", "kvrag_active_requests",
                 "kvrag_reused_tokens_total", "kvrag_prefilled_tokens_total", "kvrag_generated_tokens_total",
                 "kvrag_cache_hits_total"):
        assert name in text, name
    assert 'kvrag_requests_total{endpoint="/v1/chat/completions",status="200"} 1.0' in text
    assert 'kvrag_requests_total{endpoint="/v1/chat/completions",status="400"} 1.0' in text
    assert 'kvrag_requests_total{endpoint="/health",status="200"} 1.0' in text
    assert "kvrag_ttft_seconds_count 1.0" in text
    reused = float(next(line.split()[-1] for line in text.splitlines() if line.startswith("kvrag_reused_tokens_total")))
    assert reused >= len(engine.layout.passage_ids(PASSAGE))


def test_each_app_counts_its_own_requests(engine):
    with running_server(create_app(engine)) as one, running_server(create_app(engine)) as two:
        httpx.get(f"{one}/v1/models")
        assert "/v1/models" in httpx.get(f"{one}/metrics").text
        assert "/v1/models" not in httpx.get(f"{two}/metrics").text


# ---- the command line ----------------------------------------------------------------------------------


def test_kvrag_serve_wires_its_options(monkeypatch, capsys, tmp_path):
    import types

    import uvicorn

    from kvrag import retrieval
    from kvrag.app import server as server_module

    calls, app = {}, types.SimpleNamespace(router=types.SimpleNamespace(on_shutdown=[]))

    def record(name, returns):
        return lambda first, **options: calls.update({name: (first, options)}) or returns

    class Server:
        def __init__(self, config):
            self.config = config

        def run(self):
            config = self.config
            calls["run"] = (config.app.app, {"host": config.host, "port": config.port, "log_level": config.log_level})
            calls["advertised"] = json.loads((tmp_path / "serve.json").read_text())

    class Index:
        embedder = "the embedder"

        def __init__(self, location):
            calls["index"] = location

    engine = types.SimpleNamespace(calibration=None, default_mode="full")
    monkeypatch.setattr(common, "engine", record("engine", engine))
    monkeypatch.setattr(server_module, "create_app", record("app", app))
    monkeypatch.setattr(retrieval, "PassageIndex", Index)
    monkeypatch.setattr(uvicorn, "Server", Server)
    monkeypatch.setenv("KVRAG_API_KEY", "from-env")
    monkeypatch.setenv("KVRAG_CHROMA", "")
    home = ["--home", str(tmp_path)]
    assert cli.main([*home, "serve", "--mode", "full", "--port", "9001", "--max-queue", "3",
                     "--served-model-name", "smollm", "gpt-3.5-turbo", "--learn-prompts", "0"]) == 0
    assert calls["engine"][1] == {"max_batch": 16, "max_queue": 3, "learn_prompts": 0, "default_mode": "full",
                                  "shadow": 0.0}
    assert calls["index"] == tmp_path / "chroma"  # the home's passage index, which `kvrag index` and `ask` use
    assert calls["app"] == (engine, {"api_key": "from-env", "max_request_bytes": None,
                                           "max_passages": 256, "model_name": ["smollm", "gpt-3.5-turbo"],
                                           "passage_index": calls["app"][1]["passage_index"],
                                           "embedder": "the embedder"})
    assert calls["run"] == (app, {"host": "127.0.0.1", "port": 9001, "log_level": "info"})
    assert calls["advertised"]["url"] == "http://127.0.0.1:9001" and calls["advertised"]["model"]["adapter"] == "auto"
    assert "key" not in calls["advertised"]  # only with --advertise-key
    assert not (tmp_path / "serve.json").exists() and len(app.router.on_shutdown) == 1
    assert "http://127.0.0.1:9001/v1 (API key required)" in capsys.readouterr().err
    assert cli.main([*home, "serve", "--api-key", "k"]) == 0 and calls["app"][1]["api_key"] == "k"
    assert cli.main([*home, "serve", "--api-key", "k", "--advertise-key"]) == 0 and calls["advertised"]["key"] == "k"
    assert cli.main([*home, "serve", "--max-request-bytes", "2048", "--max-passages", "8"]) == 0
    assert (calls["app"][1]["max_request_bytes"], calls["app"][1]["max_passages"]) == (2048, 8)


def test_kvrag_index_server_sends_the_passages_it_splits(engine, tok, tmp_path, capsys):
    tok.save_pretrained(tmp_path / "tokenizer")
    docs = tmp_path / "docs"
    docs.mkdir()
    (docs / "a.md").write_text(f"{PASSAGE}\n\nThe river Olm freezes every winter. " * 3)
    with running_server(create_app(engine, api_key=KEY)) as url:
        argv = ["--model", str(tmp_path / "tokenizer"), "index", str(docs), "--server", url, "--max-tokens", "40"]
        assert cli.main(argv) == 2  # no key
        assert "401" in capsys.readouterr().err
        assert cli.main([*argv, "--api-key", KEY]) == 0
        assert f"on {url}" in capsys.readouterr().out
    passages, _ = common.passages(engine.layout.encode, {docs / "a.md": (docs / "a.md").read_text()}, 40)
    assert len(passages) > 1
    assert all(engine.store.key(engine.blocks.context(engine.layout.prefix_ids), engine.layout.passage_ids(p))
               in engine.store for p in passages)
    assert cli.main(["--model", str(tmp_path / "tokenizer"), "index", str(docs), "--server", "http://127.0.0.1:9"]) == 2
    assert "cannot reach" in capsys.readouterr().err


def test_replicas_share_one_passage_index_in_a_chroma_server(engine, chroma, embedder):
    """Two apps (two replicas of `kvrag serve --chroma URL`): what one indexes, the other retrieves."""
    from kvrag.retrieval import PassageIndex

    name = f"replicas-{uuid.uuid4().hex[:8]}"
    other = "The river Olm freezes every winter, and the ferry stops until spring."
    one = create_app(engine, embedder=embedder, passage_index=PassageIndex(chroma, embedder, name=name))
    two = create_app(engine, embedder=embedder, passage_index=PassageIndex(chroma, embedder, name=name))
    with running_server(one) as first, running_server(two) as second:
        data = httpx.post(f"{first}/v1/passages", json={"passages": [PASSAGE, other]}, timeout=60).json()["data"]
        assert [d["id"] for d in data] == engine.index([PASSAGE, other])
        found = httpx.post(f"{second}/v1/passages/search", json={"query": QUESTION, "top_k": 1}, timeout=60).json()
        assert found == {"object": "list", "data": [{"object": "passage", "text": PASSAGE}],
                         "model": "all-MiniLM-L6-v2"}
        both = httpx.post(f"{second}/v1/passages/search", json={"query": QUESTION}, timeout=60).json()["data"]
        assert sorted(d["text"] for d in both) == sorted([PASSAGE, other])
        assert_error(httpx.post(f"{second}/v1/passages/search", json={"query": ""}), 400)


def test_search_needs_a_passage_index(server):
    assert_error(server.post("/v1/passages/search", json={"query": QUESTION}), 404, code="no_passage_index")


def test_a_chroma_server_that_stops_is_a_503_naming_it(engine, tmp_path):
    from kvrag.retrieval import PassageIndex

    embedder = FakeEmbedder()
    with chroma_server(tmp_path) as url:
        app = create_app(engine, embedder=embedder, passage_index=PassageIndex(url, embedder))
    with running_server(app) as replica:
        for path, body in (("/v1/passages/search", {"query": QUESTION}), ("/v1/passages", {"passages": [PASSAGE]})):
            response = httpx.post(f"{replica}{path}", json=body, timeout=60)
            assert_error(response, 503, code="chroma_unavailable", type="server_error")
            assert response.json()["error"]["message"].startswith(f"no Chroma server at {url} (")


def test_kvrag_serve_keeps_its_passage_index_in_the_chroma_server_named(chroma, monkeypatch, capsys, tmp_path):
    import types

    import uvicorn

    from kvrag.app import server as server_module

    calls, app = {}, types.SimpleNamespace(router=types.SimpleNamespace(on_shutdown=[]))
    engine = types.SimpleNamespace(calibration=None, default_mode="full")
    monkeypatch.setattr(common, "engine", lambda args, **options: engine)
    monkeypatch.setattr(server_module, "create_app", lambda engine, **options: calls.update(options) or app)
    monkeypatch.setattr(uvicorn, "Server", lambda config: types.SimpleNamespace(run=lambda: None))
    monkeypatch.setenv("KVRAG_CHROMA", chroma)  # as --chroma URL does
    assert cli.main(["--home", str(tmp_path), "serve"]) == 0
    index = calls["passage_index"]
    assert index.location == chroma and calls["embedder"] is index.embedder
    assert index.collection.name == "kvrag-passages"
    assert f"passages in Chroma at {chroma}" in capsys.readouterr().err


def test_passages_indexed_by_another_process_on_the_same_home_are_reused(make_engine, tmp_path):
    """`kvrag index` into a KVRAG_HOME that a server shares: here two engines on the same home."""
    indexer, served = make_engine(home=tmp_path / "shared"), make_engine(home=tmp_path / "shared")
    indexer.index([PASSAGE])
    with running_server(create_app(served)) as url:
        body = {"messages": MESSAGES, "max_tokens": 4}
        completion = httpx.post(f"{url}/v1/chat/completions", json=body, timeout=60).json()
    assert completion["usage"]["prompt_tokens_details"]["cached_tokens"] >= len(indexer.layout.passage_ids(PASSAGE))
    assert completion["kvrag"]["cache_hits"]["disk"] >= 1  # the indexer's KV, read from the shared home


# ---- end to end: the real default model and the clients people use ------------------------------------------

SAMPLE = Path(__file__).parents[1] / "src" / "kvrag" / "sample"


@pytest.fixture(scope="module")
def corpus(default_engine):
    """The sample corpus's passages, cut as `kvrag index` cuts them, and its questions."""
    texts = {path: path.read_text() for path in sorted(SAMPLE.glob("*.md"))}
    passages, _ = common.passages(default_engine.layout.encode, texts, 200)
    return passages, json.loads((SAMPLE / "questions.json").read_text())


@pytest.fixture(scope="module")
def served(default_engine, corpus):
    """A server over the default engine in block mode (`kvrag serve --mode block`) with the corpus indexed
    through it: (base URL, model name)."""
    with running_server(create_app(default_engine, api_key=KEY, default_mode="block")) as url:
        passages, _ = corpus
        headers = {"Authorization": f"Bearer {KEY}"}
        response = httpx.post(f"{url}/v1/passages", json={"passages": passages}, headers=headers, timeout=600)
        assert response.status_code == 200, response.text
        yield url, httpx.get(f"{url}/v1/models", headers=headers).json()["data"][0]["id"]


def rag_request(corpus, index: int, k: int = 3):
    """Sample question `index` with its gold passage and the next k-1 passages, in kvrag's own layout:
    (OpenAI messages, the same as engine turns, the passages, the question, its gold answers)."""
    passages, questions = corpus
    item = questions[index]
    gold = next(i for i, p in enumerate(passages) if any(a in p.lower() for a in item["answers"]))
    chosen = [passages[(gold + j) % len(passages)] for j in range(k)]
    system = "You are a helpful assistant. Answer the question using only the passages in the user's message."
    user = "\n\n".join(chosen) + f"\n\nQuestion: {item['question']}"
    messages = [{"role": "system", "content": system}, {"role": "user", "content": user}]
    return messages, [("system", [system]), ("user", [user])], chosen, item["question"], item["answers"]


@pytest.mark.e2e
def test_openai_client_streams_and_reuses_the_indexed_passages(served, corpus, default_engine):
    import openai

    url, model = served
    client = openai.OpenAI(base_url=f"{url}/v1", api_key=KEY)
    messages, turns, _, _, answers = rag_request(corpus, 2)  # the Glimmerhook Lighthouse
    expected = reference(default_engine, turns, max_new_tokens=48, mode="block")
    completion = client.chat.completions.create(model=model, messages=messages, max_tokens=48, temperature=0)
    assert completion.choices[0].message.content == expected.text
    assert any(a in expected.text.lower() for a in answers), expected.text
    assert completion.usage.prompt_tokens_details.cached_tokens == expected.reused_tokens > 0
    assert completion.model_extra["kvrag"]["mode"] == "block"

    deltas, usage = [], None
    stream = client.chat.completions.create(model=model, messages=messages, max_tokens=48, stream=True,
                                            stream_options={"include_usage": True})
    for chunk in stream:
        deltas += [c.delta.content for c in chunk.choices if c.delta.content]
        usage = chunk.usage or usage
    assert len(deltas) > 1 and "".join(deltas) == expected.text
    assert usage.prompt_tokens_details.cached_tokens == expected.reused_tokens

    full = client.chat.completions.create(model=model, messages=messages, max_tokens=48,
                                          extra_body={"kvrag": {"mode": "full"}})
    assert full.usage.prompt_tokens_details.cached_tokens == 0 and full.usage.prompt_tokens == expected.prompt_tokens

    with pytest.raises(openai.NotFoundError):
        client.chat.completions.create(model="gpt-4o", messages=messages)
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=f"{url}/v1", api_key="wrong").models.list()
    with pytest.raises(openai.BadRequestError, match="context"):
        client.chat.completions.create(model=model, messages=[{"role": "user", "content": "word " * 9000}], stream=True)


@pytest.mark.e2e
def test_sixteen_concurrent_clients_get_the_answers_each_gets_alone(served, corpus, default_engine, monkeypatch):
    import openai

    from kvrag import scheduler

    sizes, packed = [], scheduler.forward_packed
    monkeypatch.setattr(scheduler, "forward_packed", lambda model, runs: sizes.append(len(runs)) or packed(model, runs))
    url, model = served
    client = openai.OpenAI(base_url=f"{url}/v1", api_key=KEY, max_retries=0)
    requests = [rag_request(corpus, i % len(corpus[1]), k=2 + i % 3)[0] for i in range(16)]

    def ask(messages):
        stream = client.chat.completions.create(model=model, messages=messages, max_tokens=24, stream=True)
        return "".join(c.choices[0].delta.content or "" for c in stream if c.choices)

    alone = [ask(messages) for messages in requests]
    assert max(sizes) == 1
    barrier = threading.Barrier(16)

    def together(messages):
        barrier.wait()
        return ask(messages)

    with ThreadPoolExecutor(16) as pool:
        assert list(pool.map(together, requests)) == alone
    assert max(sizes) >= 8  # decoded together, not in turn


@pytest.mark.e2e
def test_openai_embeddings_are_the_packaged_minilm(served):
    import openai

    from kvrag.retrieval import Embedder

    url, _ = served
    client = openai.OpenAI(base_url=f"{url}/v1", api_key=KEY)
    texts = ["Who built the Glimmerhook Lighthouse?", "Saltmere is the capital."]
    response = client.embeddings.create(model="all-MiniLM-L6-v2", input=texts)  # sent as base64 by the client
    vectors = np.array([d.embedding for d in response.data])
    assert vectors.shape == (2, 384) and np.allclose(vectors, Embedder().embed(texts), atol=1e-5)
    assert response.usage.prompt_tokens > 10


@pytest.mark.e2e
def test_langchain_chat_openai_in_an_unmodified_stuff_chain(served, corpus, default_engine):
    from langchain_classic.chains.combine_documents import create_stuff_documents_chain
    from langchain_core.documents import Document
    from langchain_core.prompts import ChatPromptTemplate
    from langchain_openai import ChatOpenAI

    url, model = served
    _, _, passages, question, answers = rag_request(corpus, 3)  # the Hallow Archive's keeper
    docs = [Document(page_content=p) for p in passages]
    system = "Answer the question using only these passages.\n\n{context}"
    prompt = ChatPromptTemplate.from_messages([("system", system), ("human", "{input}")])
    llm = ChatOpenAI(base_url=f"{url}/v1", api_key=KEY, model=model, temperature=0, max_tokens=48)
    answer = create_stuff_documents_chain(llm, prompt).invoke({"context": docs, "input": question})
    context = "\n\n".join(passages)  # as the chain joins documents
    expected = reference(default_engine, [("system", [system.format(context=context)]), ("user", [question])],
                         max_new_tokens=48, mode="block")
    assert answer == expected.text and expected.reused_tokens > 0
    assert any(a in answer.lower() for a in answers), answer
    message = llm.invoke(prompt.invoke({"context": context, "input": question}))
    assert message.content == expected.text
    assert message.usage_metadata["input_token_details"]["cache_read"] == expected.reused_tokens


@pytest.mark.e2e
def test_llamaindex_openai_like_chat_and_stream_chat(served, corpus, default_engine):
    from llama_index.core.llms import ChatMessage
    from llama_index.llms.openai_like import OpenAILike

    url, model = served
    messages, turns, _, _, answers = rag_request(corpus, 4)  # the national dish
    expected = reference(default_engine, turns, max_new_tokens=48, mode="block")
    llm = OpenAILike(api_base=f"{url}/v1", model=model, is_chat_model=True, api_key=KEY, temperature=0, max_tokens=48)
    chat_messages = [ChatMessage(role=m["role"], content=m["content"]) for m in messages]
    assert llm.chat(chat_messages).message.content == expected.text
    assert any(a in expected.text.lower() for a in answers), expected.text
    deltas = [r.delta for r in llm.stream_chat(chat_messages) if r.delta]
    assert len(deltas) > 1 and "".join(deltas) == expected.text


@pytest.mark.e2e
def test_llamaindex_openai_like_completes_through_the_legacy_api(served, corpus, default_engine):
    """OpenAILike's default (is_chat_model=False) sends the text-QA prompt to /v1/completions as it is."""
    from llama_index.core.prompts.default_prompts import DEFAULT_TEXT_QA_PROMPT
    from llama_index.llms.openai_like import OpenAILike

    url, model = served
    _, _, chosen, question, _ = rag_request(corpus, 4)
    text = DEFAULT_TEXT_QA_PROMPT.format(context_str="\n\n".join(chosen), query_str=question)
    default_engine.generate_text(text, mode="block", max_new_tokens=1)  # the text before the passages, stored
    expected = default_engine.generate_text(text, mode="block", max_new_tokens=48)
    llm = OpenAILike(api_base=f"{url}/v1", model=model, api_key=KEY, temperature=0, max_tokens=48)
    completion = llm.complete(text)
    assert completion.text == expected.text and expected.reused_tokens > 0
    assert completion.raw.usage.prompt_tokens_details.cached_tokens == expected.reused_tokens
    assert "".join(r.delta for r in llm.stream_complete(text) if r.delta) == expected.text


@pytest.mark.e2e
def test_the_kvrag_serve_command(default_engine):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    kvrag = Path(sys.executable).parent / "kvrag"
    process = subprocess.Popen([str(kvrag), "serve", "--port", str(port)],  # KVRAG_HOME: the session's
                               stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        url, deadline = f"http://127.0.0.1:{port}", time.monotonic() + 300
        while True:
            assert process.poll() is None, process.stdout.read()[-3000:]
            assert time.monotonic() < deadline, "kvrag serve did not answer /health"
            try:
                health = httpx.get(f"{url}/health", timeout=2)
                break
            except httpx.TransportError:
                time.sleep(0.5)
        assert health.json()["status"] == "ok"
        body = {"messages": [{"role": "user", "content": "What is the capital of France?"}], "max_tokens": 8}
        completion = httpx.post(f"{url}/v1/chat/completions", json=body, timeout=120).json()
        assert completion["choices"][0]["message"]["content"].strip() and completion["usage"]["completion_tokens"] <= 8
    finally:
        process.terminate()
        output = process.communicate(timeout=60)[0]
    # uvicorn shuts down gracefully, then re-raises the signal so that its parent sees how it ended
    assert process.returncode in (0, -signal.SIGTERM) and "Finished server process" in output, output[-3000:]
    assert f"http://127.0.0.1:{port}/v1" in output


def test_index_and_ask_go_through_the_kvrag_serve_running_for_their_home(saved_model_and_adapter, tmp_path):
    """`kvrag serve` says where it listens in KVRAG_HOME; `index` and `ask` there (same model options) let it
    compute, store and search, and `ask` answers without importing torch. Once it stops, they work alone."""
    from servers import free_port

    model_dir, _ = saved_model_and_adapter
    home, docs, port = tmp_path / "home", tmp_path / "docs", free_port()
    docs.mkdir()
    (docs / "a.md").write_text(PASSAGE)
    model = ["--model", str(model_dir), "--adapter", "none", "--device", "cpu", "--home", str(home)]
    kvrag = str(Path(sys.executable).parent / "kvrag")
    env = {**os.environ, "KVRAG_CHROMA": "", "KVRAG_API_KEY": ""}
    server = subprocess.Popen([kvrag, *model, "serve", "--port", str(port), "--mode", "block"],
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)
    ask = ("import sys\nfrom kvrag.app.cli import main\n"
           f"code = main({[*model, 'ask', QUESTION, '--max-new-tokens', '4', '--top-k', '1']!r})\n"
           "print('exit', code, 'torch' in sys.modules)\n")
    try:
        deadline = time.monotonic() + 300
        while not (home / "serve.json").exists() or httpx.get(f"http://127.0.0.1:{port}/health").status_code != 200:
            assert server.poll() is None and time.monotonic() < deadline, server.stdout.read()[-3000:]
            time.sleep(0.5)
        indexed = subprocess.run([kvrag, *model, "index", str(docs)], capture_output=True, text=True, env=env)
        assert indexed.stdout.strip() == f"indexed 1 passages from 1 files on http://127.0.0.1:{port}", indexed.stderr
        asked = subprocess.run([sys.executable, "-c", ask], capture_output=True, text=True, env=env)
        assert asked.stdout.splitlines()[-1:] == ["exit 0 False"], asked.stdout + asked.stderr[-3000:]
        assert f"(kvrag serve at http://127.0.0.1:{port})" in asked.stderr and "[block] TTFT" in asked.stderr
        assert "reused 0 tokens" not in asked.stderr
        other = subprocess.run([sys.executable, "-c", ask.replace("'none'", "'auto'")], capture_output=True, text=True,
                               env=env)  # other model options: not this server's answers
        assert "kvrag serve at" not in other.stderr
    finally:
        server.terminate()
        server.communicate(timeout=60)
    assert not (home / "serve.json").exists()
    alone = subprocess.run([sys.executable, "-c", ask], capture_output=True, text=True, env=env)
    assert alone.stdout.splitlines()[-1:] == ["exit 0 True"] and "kvrag serve at" not in alone.stderr, alone.stderr[-3000:]


def test_the_bench_serve_workload_is_the_sample_corpus_retrieved(engine):
    from kvrag.eval import serving as bench

    passages, requests = bench.workload(engine, 8)
    assert len(requests) == 8 and len(set(passages)) == len(passages)
    for system, user in requests:
        assert sum(p in system["content"] for p in passages) == 4 and user["role"] == "user"
