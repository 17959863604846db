"""The one Chroma set-up (CLI, LangChain, LlamaIndex) and the CLI's passage index, with a fake embedder;
on a real Chroma server (`chroma run`), with the packaged MiniLM."""

import http.server
import json
import os
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



def test_passage_index_stores_more_passages_than_a_chroma_batch_holds(tmp_path):
    """A 5 MB corpus is some 9,000 passages; Chroma refuses an upsert of more than its max batch size (5,461 for
    an embedded one): `add` stores them all, in batches, a text repeated across batches once with its last
    source."""
    index = PassageIndex(tmp_path, embedder=LengthEmbedder())
    limit = index.collection._client.get_max_batch_size()
    passages = [f"passage {i}" for i in range(limit + 100)] + ["passage 0"]
    index.add(passages, ["a.md"] * (len(passages) - 1) + ["b.md"])
    assert len(index) == limit + 100
    assert index.collection.get(ids=[passage_id("passage 0")])["metadatas"] == [{"source": "b.md"}]


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


# ---- the packaged MiniLM, computed without sentence-transformers (kvrag.embedding) -------------------------

EMBEDDED = [
    "In what year was the Velloran Academy founded?", "", "   ", "Café naïve résumé — Zürich, Ørsted, ½ ©",
    "北京是中国的首都。東京", "The keeper's log, 1742: 'fog again'.\n\nA new paragraph\twith a tab", "😀 emoji 🤖",
    "UPPER lower MiXeD", "a" * 3000, "word " * 400,  # one word past WordPiece's limit; past 256 tokens
    *PASSAGES.values(),
]


@pytest.fixture(scope="module")
def sentence_transformer():
    """The packaged model through sentence-transformers, as kvrag loaded it before (what existing indexes hold)."""
    from sentence_transformers import SentenceTransformer

    from kvrag.retrieval import embedding_model_path

    return SentenceTransformer(str(embedding_model_path()), device="cpu", local_files_only=True)


def test_embeddings_are_sentence_transformers_own(embedder, sentence_transformer):
    """Indexes written before hold sentence-transformers' vectors: the same tokens, the same vectors to float32
    rounding, the same nearest passages, and the same token counts (the embeddings API's usage)."""
    import numpy as np

    from kvrag.embedding import MeanPoolingBert

    assert isinstance(embedder.model, MeanPoolingBert)
    st = sentence_transformer
    assert embedder.model.token_ids(EMBEDDED) == [st.tokenizer(t, truncation=True, max_length=st.max_seq_length)[
        "input_ids"] for t in EMBEDDED]
    ours = np.array(embedder.embed(EMBEDDED))
    theirs = st.encode(EMBEDDED, normalize_embeddings=True, convert_to_numpy=True)
    assert ours.shape == theirs.shape == (len(EMBEDDED), 384)
    assert np.abs(ours - theirs).max() < 1e-5
    assert np.allclose(np.linalg.norm(ours, axis=1), 1, atol=1e-6)
    assert (ours @ ours.T).argsort(axis=1).tolist() == (theirs @ theirs.T).argsort(axis=1).tolist()
    assert np.allclose(embedder.embed(EMBEDDED[:1]), ours[:1], atol=1e-6)  # alone (one thread) or in a batch
    assert embedder.count_tokens(EMBEDDED) == sum(min(len(i), st.max_seq_length)
                                                  for i in st.tokenizer(EMBEDDED)["input_ids"])


def test_retrieval_loads_no_sentence_transformers():
    """What made `kvrag ask` slow: sentence-transformers' import (scikit-learn; SciPy comes with transformers too)."""
    code = ("import sys; from kvrag.retrieval import Embedder; Embedder().embed(['a question?']); print(sorted(m for m "
            "in ('sentence_transformers', 'sklearn') if m in sys.modules))")
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stderr
    assert run.stdout.split("\n")[-2] == "[]"


@pytest.fixture
def minilm_copy(tmp_path):
    """The packaged model's folder, its files linked, for a test to change its settings."""
    import shutil

    from kvrag.retrieval import embedding_model_path

    folder = tmp_path / "minilm"
    shutil.copytree(embedding_model_path(), folder, copy_function=os.symlink)
    for path in [*folder.glob("*.json"), *folder.glob("*/*.json")]:  # the settings: copies of their own
        text = path.read_text()
        path.unlink()
        path.write_text(text)
    return folder


@pytest.mark.parametrize("change", [
    ("1_Pooling/config.json", {"pooling_mode_mean_tokens": False, "pooling_mode_cls_token": True}),
    ("1_Pooling/config.json", {"pooling_mode_max_tokens": True}),
    ("sentence_bert_config.json", {"do_lower_case": True}),
    ("config.json", {"position_embedding_type": "relative_key"}),
    ("config.json", {"hidden_act": "gelu_new"}),
    ("config.json", {"model_type": "roberta"}),
])
def test_folders_of_other_shapes_are_left_to_sentence_transformers(minilm_copy, change):
    from kvrag import embedding

    assert embedding.supported(minilm_copy) is not None
    name, settings = change
    path = minilm_copy / name
    path.write_text(json.dumps({**json.loads(path.read_text()), **settings}))
    assert embedding.supported(minilm_copy) is None and embedding.load(minilm_copy) is None


def test_a_folder_of_another_shape_embeds_with_sentence_transformers(minilm_copy):
    """CLS pooling: loaded by sentence-transformers, as before, and its vectors are not the mean's."""
    import numpy as np
    from sentence_transformers import SentenceTransformer

    from kvrag.retrieval import Embedder

    pooling = minilm_copy / "1_Pooling" / "config.json"
    pooling.write_text(json.dumps({**json.loads(pooling.read_text()), "pooling_mode_mean_tokens": False,
                                   "pooling_mode_cls_token": True}))
    embedder = Embedder(minilm_copy)
    texts = list(PASSAGES.values())
    expected = SentenceTransformer(str(minilm_copy), device="cpu").encode(texts, normalize_embeddings=True)
    assert np.abs(np.array(embedder.embed(texts)) - expected).max() < 1e-6
    assert embedder.count_tokens(texts) == sum(len(i) for i in embedder.model.model.tokenizer(texts)["input_ids"])
