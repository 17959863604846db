"""Two `kvrag serve` processes (replicas, each with a home of its own) on one redis-server and one
`chroma run`: what is indexed through one is answered through the other from the remote tier, and a
Redis restart while both serve fails no request."""

import threading
import time

import httpx
import pytest
from servers import RedisServer, chroma_server

from kvrag.eval.serving import Server

TEXTS = [
    "The lighthouse on Harrow Point was built by Edda Marsh in 1871 from granite blocks.",
    "The tide clock of Port Alder was invented by Mirela Kostavar, a clockmaker and sailor.",
    "The Hallow Archive keeps the island's charters; its keeper is Tomas Vell, since 1902.",
]
QUESTION = "Who built the lighthouse?"


@pytest.fixture
def replicas(saved_model_and_adapter, tmp_path, monkeypatch):
    """Redis (with a password, as the docs deploy it), Chroma and two `kvrag serve` processes on them (the
    serving bench's `Server`), sharing a secret."""
    model_dir, _ = saved_model_and_adapter
    monkeypatch.setenv("KVRAG_SECRET", "the replicas' shared secret")
    with RedisServer(tmp_path / "redis", password="the redis password") as redis_server, chroma_server(tmp_path / "chroma") as chroma_url:
        options = ["--model", str(model_dir), "--adapter", "none", "--device", "cpu", "--remote", redis_server.url,
                   "--chroma", chroma_url]
        servers = []
        try:
            for name in ("a", "b"):
                servers.append(Server(tmp_path / name, max_batch=16, extra=options, mode="block"))
            yield redis_server, [server.url for server in servers]
        finally:
            for server in servers:
                server.close()


def ask(url: str, passages: list[str], max_tokens: int = 4) -> dict:
    messages = [{"role": "system", "content": "Answer from the context.\n\n" + "\n\n".join(passages)},
                {"role": "user", "content": QUESTION}]
    response = httpx.post(f"{url}/v1/chat/completions", json={"messages": messages, "max_tokens": max_tokens},
                          timeout=120)
    assert response.status_code == 200, response.text
    return response.json()


def test_indexed_through_one_replica_answered_through_the_other(replicas):
    _, (a, b) = replicas
    indexed = httpx.post(f"{a}/v1/passages", json={"passages": TEXTS}, timeout=120)
    assert indexed.status_code == 200, indexed.text
    found = httpx.post(f"{b}/v1/passages/search", json={"query": QUESTION, "top_k": 3}, timeout=60).json()
    passages = [p["text"] for p in found["data"]]
    assert sorted(passages) == sorted(TEXTS)  # the vectors are in the one Chroma server
    on_b = ask(b, passages)
    assert on_b["kvrag"]["cache_hits"].get("remote", 0) >= len(TEXTS)  # no passage computed on B
    assert on_b["usage"]["prompt_tokens_details"]["cached_tokens"] >= sum(p["tokens"] for p in indexed.json()["data"])
    on_a = ask(a, passages)
    assert on_a["choices"][0]["message"]["content"] == on_b["choices"][0]["message"]["content"]


def test_a_redis_restart_while_both_replicas_serve_fails_no_request(replicas):
    redis_server, urls = replicas
    httpx.post(f"{urls[0]}/v1/passages", json={"passages": TEXTS}, timeout=120).raise_for_status()
    phase, answers, errors = ["up"], [], []

    def client(i):
        while phase[0] != "done":
            started = phase[0]
            try:
                answers.append((started, ask(urls[i % 2], TEXTS)["choices"][0]["message"]["content"]))
            except Exception as exc:  # noqa: BLE001 - what the test counts
                errors.append(exc)

    threads = [threading.Thread(target=client, args=(i,)) for i in range(4)]
    for t in threads:
        t.start()
    for name, action in (("down", redis_server.kill), ("back", redis_server.start), ("done", None)):
        time.sleep(1.0)
        phase[0] = name
        if action:
            action()
    for t in threads:
        t.join()
    assert errors == []
    assert {started for started, _ in answers} >= {"up", "down", "back"}  # requests in every phase
    assert len({text for _, text in answers}) == 1
