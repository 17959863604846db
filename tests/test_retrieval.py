"""The one Chroma set-up (CLI, LangChain, LlamaIndex) and the CLI's passage index, with a fake embedder;
on a real Chroma server (`chroma run`), with the packaged MiniLM."""

import http.server
import json
import socket
import subprocess
import sys
import threading
import time
import uuid
import warnings

import pytest
from servers import chroma_server, free_port

from kvrag import ChromaUnavailableError, KVRagError
from kvrag.retrieval import (
    COSINE,
    PassageIndex,
    chroma_client,
    chroma_collection,
    chroma_path,
    parse_chroma_url,
    passage_id,
)


class LengthEmbedder:
    """Unit vectors from the text's length: enough to tell three passages apart, no model."""

    def embed(self, texts):
        return [[1.0, 0.0] if len(t) < 20 else [0.0, 1.0] if len(t) < 40 else [0.6, 0.8] for t in texts]


def test_collections_are_cosine_and_take_the_vectors_they_are_given(tmp_path):
    collection = chroma_collection(tmp_path, "notes")
    assert collection.configuration_json["hnsw"]["space"] == COSINE["hnsw:space"] == "cosine"
    collection.upsert(ids=["a"], documents=["x"], embeddings=[[1.0, 0.0]])
    assert chroma_collection(tmp_path, "notes").count() == 1  # reopened, in the same process


def _forget(directory) -> None:
    """Drop this process's Chroma system for `directory` (Chroma keeps one per path), as a new process
    would start without it."""
    from chromadb.api.shared_system_client import SharedSystemClient

    SharedSystemClient._identifier_to_system.pop(str(directory)).stop()


@pytest.mark.parametrize("opener", ["collection", "client"])
def test_a_garbage_embedded_chroma_is_moved_aside_and_started_afresh(tmp_path, opener):
    """LangChain's and LlamaIndex's collections, opened through these, start empty; the CLI's is rebuilt
    (test_concurrent_index.py)."""
    directory = tmp_path / "chroma"
    chroma_collection(directory, "notes").upsert(ids=["a"], documents=["x"], embeddings=[[1.0, 0.0]])
    _forget(directory)
    garbage = b"not a database " * 100
    (directory / "chroma.sqlite3").write_bytes(garbage)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        if opener == "collection":
            collection = chroma_collection(directory, "notes")
        else:  # as LangChain's default_chroma also opens a client of its own
            chroma_client(directory)
            collection = chroma_collection(directory, "notes")
    [aside] = tmp_path.glob("chroma.damaged-*")
    assert [str(w.message) for w in caught] == [
        f"kvrag: the Chroma store {directory / 'chroma.sqlite3'} is unusable (file is not a database); "
        f"moved chroma to {aside.name}, starting afresh"]
    assert (aside / "chroma.sqlite3").read_bytes() == garbage  # kept as it was, for whoever wants to look
    assert collection.count() == 0
    collection.upsert(ids=["b"], documents=["y"], embeddings=[[0.0, 1.0]])
    assert chroma_collection(directory, "notes").get()["ids"] == ["b"]


def test_a_chroma_that_fails_to_open_for_another_reason_is_left_where_it_is(tmp_path):
    directory = tmp_path / "chroma"
    directory.write_text("a file where the directory should be")
    with pytest.raises(Exception, match="File exists"):
        chroma_collection(directory, "notes")
    assert directory.read_text() == "a file where the directory should be"
    assert not list(tmp_path.glob("*.damaged-*"))


def test_the_default_directory_is_under_kvrag_home(monkeypatch, tmp_path):
    monkeypatch.setenv("KVRAG_HOME", str(tmp_path))
    assert chroma_path() == tmp_path / "chroma"
    assert chroma_path("llamaindex") == tmp_path / "llamaindex" / "chroma"


def test_passage_index_adds_once_per_text_and_finds_the_nearest(tmp_path):
    index = PassageIndex(tmp_path, embedder=LengthEmbedder())
    assert len(index) == 0 and index.search("anything") == []
    passages = ["short one", "a passage of middle length", "a much longer passage than the other two are"]
    index.add(passages, ["a.md", "a.md", "b.md"])
    index.add(passages[:1], ["a.md"])  # ids are content hashes: the same text is stored once
    assert len(index) == 3
    assert index.search("tiny", k=1) == ["short one"]
    assert index.search("x" * 30, k=2)[0] == passages[1]
    assert len(index.search("tiny", k=10)) == 3
    found = index.collection.get(ids=[passage_id(passages[2])])
    assert found["documents"] == [passages[2]] and found["metadatas"] == [{"source": "b.md"}]


def test_passage_index_stores_a_text_repeated_in_one_batch_once(tmp_path):
    index = PassageIndex(tmp_path, embedder=LengthEmbedder())
    index.add(["same paragraph", "other", "same paragraph"], ["a.md", "a.md", "b.md"])
    assert len(index) == 2
    assert index.collection.get(ids=[passage_id("same paragraph")])["metadatas"] == [{"source": "b.md"}]
    index.add([], [])
    assert len(index) == 2


# ---- a Chroma server (`chroma run`, started for these tests) -------------------------------------------


PASSAGES = {
    "lighthouse.md": "The lighthouse of Varnholm was built in 1873 by the engineer Ilsa Brandt.",
    "archive.md": "The Hallow Archive is kept by Tomas Reyl, who catalogues the harbour ledgers.",
    "clock.md": "Mirela Kostavar invented the tide clock that hangs in the market hall.",
}

OTHER_PROCESS = """
import json, sys
import chromadb
from chromadb.config import Settings

url, name, query = sys.argv[1:]
host, port = url.removeprefix("http://").split(":")
client = chromadb.HttpClient(host=host, port=int(port), settings=Settings(anonymized_telemetry=False))
collection = client.get_collection(name)
found = collection.query(query_embeddings=[json.loads(query)], n_results=1)
print(json.dumps({"count": collection.count(), "found": found["documents"][0]}))
"""


def test_passage_indexes_on_one_chroma_server_share_their_passages(chroma, embedder):
    name = f"shared-{uuid.uuid4().hex[:8]}"
    index = PassageIndex(chroma, embedder=embedder, name=name)
    assert len(index) == 0 and index.search("anything") == []
    index.add(list(PASSAGES.values()), list(PASSAGES))
    index.add(list(PASSAGES.values())[:1], ["lighthouse.md"])  # content-hash ids: stored once, on the server too
    assert len(index) == 3
    assert index.search("Who built the lighthouse?", k=1) == [PASSAGES["lighthouse.md"]]
    assert PassageIndex(chroma, embedder=embedder, name=name).search("Who keeps the archive?", k=1) == [
        PASSAGES["archive.md"]]
    # another process (another replica; a plain Chroma client, without kvrag's start-up time) sees them too
    query = json.dumps(embedder.embed(["Who invented the tide clock?"])[0])
    run = subprocess.run([sys.executable, "-c", OTHER_PROCESS, chroma, name, query],
                         capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stderr
    assert json.loads(run.stdout.splitlines()[-1]) == {"count": 3, "found": [PASSAGES["clock.md"]]}
    found = chroma_collection(chroma, name).get(ids=[passage_id(PASSAGES["clock.md"])])
    assert found["metadatas"] == [{"source": "clock.md"}]
    assert chroma_collection(chroma, name).configuration_json["hnsw"]["space"] == "cosine"


def test_no_chroma_server_at_the_url_is_a_clear_error_at_once():
    url = f"http://127.0.0.1:{free_port()}"  # nothing listens there
    opens = (chroma_client, lambda u: chroma_collection(u, "notes"), lambda u: PassageIndex(u, LengthEmbedder()))
    for open_it in opens:
        start = time.monotonic()
        with pytest.raises(ChromaUnavailableError) as caught:
            open_it(url)
        assert time.monotonic() - start < 3
        message = str(caught.value)
        assert message.startswith(f"no Chroma server at {url} (") and "`chroma run --path DIR --port" in message
        assert isinstance(caught.value, ConnectionError) and isinstance(caught.value, KVRagError)


def test_a_server_that_never_answers_is_given_up_after_the_connect_timeout(monkeypatch):
    from kvrag import retrieval

    monkeypatch.setattr(retrieval, "CONNECT_TIMEOUT", 0.5)  # 5 s in use
    with socket.socket() as silent:  # takes connections (the kernel's backlog) and never answers
        silent.bind(("127.0.0.1", 0))
        silent.listen()
        url = f"http://127.0.0.1:{silent.getsockname()[1]}"
        start = time.monotonic()
        with pytest.raises(ChromaUnavailableError, match=f"no Chroma server at {url} "):
            PassageIndex(url, LengthEmbedder())
        assert time.monotonic() - start < 3


def test_a_web_server_that_is_not_chroma_is_named_too():
    class NotChroma(http.server.BaseHTTPRequestHandler):
        def do_GET(self):
            self.send_response(404)
            self.end_headers()

        def log_message(self, *args):
            pass

    web = http.server.ThreadingHTTPServer(("127.0.0.1", 0), NotChroma)
    threading.Thread(target=web.serve_forever, daemon=True).start()
    url = f"http://127.0.0.1:{web.server_address[1]}"
    try:
        with pytest.raises(ChromaUnavailableError, match=f"no Chroma server at {url} .*answered 404"):
            chroma_client(url)
    finally:
        web.shutdown()
        web.server_close()


def test_a_chroma_server_that_stops_later_is_a_clear_error(tmp_path):
    with chroma_server(tmp_path) as url:
        index = PassageIndex(url, embedder=LengthEmbedder(), name="stops")
        index.add(["short one"], ["a.md"])
        assert len(index) == 1
    for call in (len, lambda i: i.search("tiny"), lambda i: i.add(["other"], ["b.md"])):
        with pytest.raises(ChromaUnavailableError, match=f"no Chroma server at {url} "):
            call(index)


@pytest.mark.parametrize("url, expected", [
    ("http://127.0.0.1:8000", ("127.0.0.1", 8000, False)),
    ("http://chroma.internal:9000/", ("chroma.internal", 9000, False)),
    ("https://chroma.example.com", ("chroma.example.com", 443, True)),
    ("http://localhost", ("localhost", 80, False)),
])
def test_chroma_urls(url, expected):
    assert parse_chroma_url(url) == expected


@pytest.mark.parametrize("url", ["localhost:8000", "127.0.0.1", "ftp://host:21", "http://host:8000/chroma",
                                 "http://host:port", "http://:8000", "http://user@host:8000"])
def test_what_is_not_a_chroma_url_is_refused(url):
    with pytest.raises(ValueError, match="http://HOST"):
        parse_chroma_url(url)
