"""The remote tier on a real redis-server: replicas share KV and passages; damage, outages, slowness and
a full server never fail a request."""

import socket
import threading
import time
import warnings

import pytest
import redis
import torch
from kvfiles import kvrag_warnings
from servers import RedisServer, free_port

from kvrag import remote as remote_module
from kvrag.store import unpack

TEXTS = [
    "The lighthouse on Harrow Point was built by Edda Marsh in 1871 from granite blocks.",
    "The tide clock of Port Alder was invented by Mirela Kostavar, a clockmaker and sailor.",
    "The Hallow Archive keeps the island's charters; its keeper is Tomas Vell, since 1902.",
]
QUESTION = "Who built the lighthouse?"


@pytest.fixture(scope="module")
def redis_server(tmp_path_factory):
    with RedisServer(tmp_path_factory.mktemp("redis")) as server:
        yield server


@pytest.fixture
def url(redis_server):
    redis.Redis.from_url(redis_server.url).flushall()
    return redis_server.url


@pytest.fixture(autouse=True)
def quick_backoff(monkeypatch):
    monkeypatch.setenv("KVRAG_SECRET", "the replicas' shared secret")
    monkeypatch.setattr(remote_module, "BACKOFF", 0.05)
    monkeypatch.setattr(remote_module, "MAX_BACKOFF", 0.2)


def replicas(make_engine, tmp_path, url, n=2):
    """Engines on the same weights with homes of their own (machines) and one remote tier."""
    return [make_engine(home=tmp_path / f"replica{i}", remote=url) for i in range(n)]


def count_encodings(engine, monkeypatch) -> list:
    calls = []
    encode_many = engine.blocks.encode_many
    monkeypatch.setattr(engine.blocks, "encode_many",
                        lambda ids_list, *args, **kwargs: calls.extend(ids_list) or encode_many(ids_list, *args, **kwargs))
    return calls


def test_passages_indexed_on_one_replica_are_read_on_another_from_the_remote_tier(make_engine, tmp_path, url,
                                                                                  monkeypatch):
    a, b = replicas(make_engine, tmp_path, url)
    a.index(TEXTS, progress=False)
    encoded_on_b = count_encodings(b, monkeypatch)
    assert b.index(TEXTS, progress=False)  # already in the remote tier: nothing to compute
    first = b.generate(QUESTION, TEXTS, max_new_tokens=6)
    assert encoded_on_b == []
    assert first.cache_hits.get("remote") == len(TEXTS) and "computed" not in first.cache_hits
    second = b.generate(QUESTION, TEXTS, max_new_tokens=6)
    assert "remote" not in second.cache_hits  # the remote hit filled the local tiers
    alone = make_engine(home=tmp_path / "alone").generate(QUESTION, TEXTS, max_new_tokens=6)
    assert first.token_ids == second.token_ids == alone.token_ids
    assert (tmp_path / "replica1" / "kv").exists()  # and the disk


def test_a_replica_finds_passages_registered_by_another_in_a_rendered_prompt(make_engine, tmp_path, url, monkeypatch):
    a, b = replicas(make_engine, tmp_path, url)
    a.index(TEXTS, progress=False)
    text = "Context:\n" + "\n\n".join(TEXTS) + "\n\nQuestion: " + QUESTION
    assert [text[s:e] for s, e in b.passages.find(text)] == TEXTS
    encoded_on_b = count_encodings(b, monkeypatch)
    result = b.generate_text(text, max_new_tokens=4)
    assert result.cache_hits.get("remote", 0) >= len(TEXTS)
    passage_ids = [b.layout.passage_ids(t) for t in TEXTS]
    assert not [ids for ids in encoded_on_b if ids in passage_ids], [len(i) for i in encoded_on_b]


def test_a_damaged_or_planted_remote_value_is_deleted_and_recomputed(make_engine, tmp_path, url):
    a, b = replicas(make_engine, tmp_path, url)
    ids = [k.removeprefix("kv_") for k in a.index(TEXTS, progress=False)]
    client = redis.Redis.from_url(url)
    stored = client.get(f"kvrag:kv:{ids[0]}")
    other = client.get(f"kvrag:kv:{ids[1]}")
    client.set(f"kvrag:kv:{ids[0]}", stored[:-7] + bytes(7))  # corrupted tensors
    client.set(f"kvrag:kv:{ids[1]}", stored)  # another block's value under this key
    client.set(f"kvrag:kv:{ids[2]}", b"\xff" * 100)  # not a block at all
    with warnings.catch_warnings(record=True) as records:
        warnings.simplefilter("always")
        result = b.generate(QUESTION, TEXTS, max_new_tokens=6)
    dropped = [str(w.message) for w in kvrag_warnings(records) if "unusable remote KV value" in str(w.message)]
    assert len(dropped) == 3
    assert result.cache_hits.get("computed", 0) == 3
    assert result.token_ids == a.generate(QUESTION, TEXTS, max_new_tokens=6).token_ids
    context = a.blocks.context(a.layout.prefix_ids)
    rewritten, original = (unpack(v, a.fingerprint, ids[1], context) for v in (client.get(f"kvrag:kv:{ids[1]}"), other))
    assert rewritten.token_ids.tolist() == original.token_ids.tolist()  # recomputed and written back intact
    assert torch.equal(rewritten.keys, original.keys) and torch.equal(rewritten.values, original.values)


def test_an_unreachable_remote_tier_warns_once_and_changes_no_answer(make_engine, tmp_path):
    url = f"redis://127.0.0.1:{free_port()}/0"
    engine = make_engine(home=tmp_path / "a", remote=url)
    with warnings.catch_warnings(record=True) as records:
        warnings.simplefilter("always")
        engine.index(TEXTS, progress=False)
        results = [engine.generate(QUESTION, TEXTS, max_new_tokens=6) for _ in range(3)]
    remote_warnings = [w for w in kvrag_warnings(records) if "remote tier" in str(w.message)]
    assert len(remote_warnings) == 1 and url in str(remote_warnings[0].message)
    alone = make_engine(home=tmp_path / "alone").generate(QUESTION, TEXTS, max_new_tokens=6)
    assert all(r.token_ids == alone.token_ids for r in results)


def test_a_remote_tier_lost_mid_run_is_used_again_once_back(make_engine, tmp_path, redis_server, url):
    a, b = replicas(make_engine, tmp_path, url)
    a.index(TEXTS, progress=False)
    assert len(b.passages) == len(TEXTS)  # b has read the registry up to its third entry
    redis_server.stop()
    try:
        with warnings.catch_warnings(record=True) as records:
            warnings.simplefilter("always")
            down = b.generate(QUESTION, TEXTS, max_new_tokens=6)
        assert len([w for w in kvrag_warnings(records) if "remote tier" in str(w.message)]) == 1
        assert "remote" not in down.cache_hits and down.cache_hits.get("computed", 0) >= len(TEXTS)
    finally:
        redis_server.start()  # same port, empty: a restarted cache
    time.sleep(0.25)  # past the backoff
    later = "A passage indexed once the server is back, long enough to be matched."
    a.index([later], progress=False)
    assert redis.Redis.from_url(url).dbsize() > 0  # writes reach it again
    assert b.passages.find(f"Context: {later}") == [(9, 9 + len(later))]  # the emptied registry is read afresh
    c = make_engine(home=tmp_path / "c", remote=url)
    assert c.generate("Which passage?", [later], max_new_tokens=2).cache_hits.get("remote", 0) >= 1


def test_requests_through_a_redis_restart_all_succeed(make_engine, tmp_path, redis_server, url):
    a, b = replicas(make_engine, tmp_path, url)
    a.index(TEXTS, progress=False)
    expected = make_engine(home=tmp_path / "alone").generate(QUESTION, TEXTS, max_new_tokens=4).token_ids
    errors, answers = [], []

    def client(i):
        engine = (a, b)[i % 2]
        for _ in range(6):
            try:
                answers.append(engine.generate(QUESTION, TEXTS, max_new_tokens=4).token_ids)
            except Exception as exc:  # noqa: BLE001 - what the test counts
                errors.append(exc)

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        threads = [threading.Thread(target=client, args=(i,)) for i in range(4)]
        for t in threads:
            t.start()
        redis_server.kill()  # mid-reply, for the requests reading from it now
        time.sleep(0.1)
        redis_server.start()
        for t in threads:
            t.join()
    assert errors == [] and len(answers) == 24 and all(ids == expected for ids in answers)


def test_a_server_that_never_answers_costs_one_timeout(make_engine, tmp_path):
    silent = socket.socket()
    silent.bind(("127.0.0.1", 0))
    silent.listen()  # accepts connections (the kernel does) and never answers a command
    url = f"redis://127.0.0.1:{silent.getsockname()[1]}/0?socket_timeout=0.2&socket_connect_timeout=0.2"
    try:
        engine = make_engine(home=tmp_path / "a", remote=url)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            start = time.monotonic()
            engine.index(TEXTS, progress=False)
            result = engine.generate(QUESTION, TEXTS, max_new_tokens=4)
        assert time.monotonic() - start < 20  # bounded, where a call without a timeout would hang for ever
        assert result.text is not None
    finally:
        silent.close()


def test_a_full_server_that_refuses_writes_fails_no_request(make_engine, tmp_path):
    with RedisServer(tmp_path / "redis", policy="noeviction") as full:
        client = redis.Redis.from_url(full.url)
        client.set("ballast", b"x" * (2 << 20))
        client.config_set("maxmemory", "1mb")  # over it now: every write is refused (OOM)
        with pytest.raises(redis.ResponseError, match="maxmemory"):
            client.set("probe", b"y")
        a, b = replicas(make_engine, tmp_path, full.url)
        with warnings.catch_warnings(record=True) as records:
            warnings.simplefilter("always")
            a.index(TEXTS, progress=False)
            result = b.generate(QUESTION, TEXTS, max_new_tokens=4)
        assert not [w for w in kvrag_warnings(records) if "remote tier" in str(w.message)]  # refused, not down
        assert result.cache_hits.get("computed", 0) >= len(TEXTS) and client.dbsize() == 1


def test_values_hold_what_the_disk_files_hold(make_engine, tmp_path, url):
    engine = make_engine(home=tmp_path / "a", remote=url)
    key = engine.index(TEXTS[:1], progress=False)[0].removeprefix("kv_")
    context = engine.blocks.context(engine.layout.prefix_ids)
    value = redis.Redis.from_url(url).get(f"kvrag:kv:{key}")
    on_disk = engine.store.disk.path(key).read_bytes()
    remote, disk = (unpack(v, engine.fingerprint, key, context) for v in (value, on_disk))
    assert torch.equal(remote.keys, disk.keys) and torch.equal(remote.values, disk.values) and remote.start == disk.start
    with pytest.raises(ValueError, match="header field 'key'"):
        unpack(value, engine.fingerprint, "0" * 32, context)


def test_the_url_is_checked(make_engine, tmp_path):
    with pytest.raises(ValueError, match="redis://"):
        make_engine(home=tmp_path, remote="http://127.0.0.1:6379")


@pytest.mark.filterwarnings("error::pytest.PytestUnhandledThreadExceptionWarning")  # a client thread that died
def test_bench_remote_runs_its_three_parts(make_engine, tmp_path):
    from kvrag.eval import scaleout

    lines = []
    scaleout.benchmark(lambda home, url: make_engine(home=home, remote=url), lengths=(64,), runs=1, requests=12,
                       out=lines.append)
    text = "\n".join(lines)
    assert [line.split()[1] for line in lines if line.strip().startswith(tuple("0123456789"))] == [
        "memory", "disk", "remote", "computed"]
    encodings = next(line for line in lines if line.startswith("corpus "))
    corpus = int(encodings.split()[1])
    assert f"passage encodings A {corpus}, B 0, total {corpus}; passages encoded twice: 0" in encodings
    assert "of 12 requests (4 clients, A and B in turn): 0 failed, 0 answers unlike before the restart" in text
