"""KVRagVectorStore's contract with a spy engine: index every add (whole batch checked first), delegate the rest.

The spy runs the core's own passage check (`kvrag.check_text`) and a small context
limit, so "a bad text adds nothing" is tested without a model. The real engine is in
tests/integration_tests.
"""

import json
import os
import subprocess
import sys

import pytest
from kvrag import (
    ChromaUnavailableError,
    ContextOverflowError,
    EmptyInputError,
    InputEncodingError,
    KVEngine,
    check_text,
)
from langchain_chroma import Chroma
from langchain_core.documents import Document
from langchain_core.embeddings import DeterministicFakeEmbedding
from langchain_core.indexing import InMemoryRecordManager, index
from langchain_core.vectorstores import InMemoryVectorStore
from servers import free_port

from langchain_kvrag.embeddings import KVRagEmbeddings
from langchain_kvrag.vectorstores import DEFAULT_COLLECTION, KVRagVectorStore, document_id

TEXTS = ["the lighthouse keeper is Ada", "the ferry leaves at noon", "bread is baked at dawn"]
MAX_CHARS = 200


class SpyEngine:
    """KVEngine.index's checks and nothing else; records what was indexed into a shared event log."""

    def __init__(self, events: list, block_context: str = "none"):
        self.events, self.block_context = events, block_context

    def index(self, texts, *, progress=True, preceding=None):
        texts = [check_text(t, f"passage {i}") for i, t in enumerate(texts)]
        for i, text in enumerate(texts):
            if len(text) > MAX_CHARS:
                raise ContextOverflowError(f"passage {i} does not fit")
        self.events.append(("index", texts) if preceding is None else ("index", texts, preceding))
        return [f"kv_{i:032x}" for i in range(len(texts))]


class LoggingStore(InMemoryVectorStore):
    """An in-memory store that logs what reaches it, to check the order: index first, then add."""

    def __init__(self, embedding, events: list):
        super().__init__(embedding)
        self.events = events

    def add_documents(self, documents, ids=None, **kwargs):
        self.events.append(("add", [d.page_content for d in documents]))
        return super().add_documents(documents, ids=ids, **kwargs)

    async def aadd_documents(self, documents, ids=None, **kwargs):
        self.events.append(("add", [d.page_content for d in documents]))
        return await super().aadd_documents(documents, ids=ids, **kwargs)


@pytest.fixture
def events():
    return []


@pytest.fixture
def store(events):
    return KVRagVectorStore(LoggingStore(DeterministicFakeEmbedding(size=8), events), engine=SpyEngine(events))


async def add(store, path, texts, ids=None):
    """Add through one of the instance add paths; the async ones are awaited."""
    docs = [Document(page_content=t, metadata={"n": i}) for i, t in enumerate(texts)]
    if path == "add_texts":
        return store.add_texts(texts, [d.metadata for d in docs], ids=ids)
    if path == "add_documents":
        return store.add_documents(docs, ids=ids)
    if path == "aadd_texts":
        return await store.aadd_texts(texts, [d.metadata for d in docs], ids=ids)
    return await store.aadd_documents(docs, ids=ids)


ADD_PATHS = ["add_texts", "add_documents", "aadd_texts", "aadd_documents"]


@pytest.mark.parametrize("path", ADD_PATHS)
async def test_every_add_indexes_the_batch_before_storing_it(store, events, path):
    ids = await add(store, path, TEXTS, ids=["a", "b", "c"])
    assert ids == ["a", "b", "c"]
    assert events == [("index", TEXTS), ("add", TEXTS)]
    stored = store.get_by_ids(["b"])
    assert stored == [Document(id="b", page_content=TEXTS[1], metadata={"n": 1})]


@pytest.mark.parametrize("path", ADD_PATHS)
async def test_with_document_context_a_text_is_indexed_after_the_one_before_it_from_the_same_source(events, path):
    """An engine of block context "document" encodes each text after the one before it in the batch when both
    come from the same `source` (a loader's file, split in order); the first of a source, or one without, alone."""
    store = KVRagVectorStore(LoggingStore(DeterministicFakeEmbedding(size=8), events),
                             engine=SpyEngine(events, block_context="document"))
    docs = [Document(page_content=t, metadata=m) for t, m in
            zip(TEXTS + ["the mill turns on windy days"], [{"source": "a.txt"}, {"source": "a.txt"}, {"source": "b.txt"}, {}])]
    texts = [d.page_content for d in docs]
    if path.endswith("add_texts"):
        added = store.add_texts(texts, [d.metadata for d in docs]) if path == "add_texts" else \
            await store.aadd_texts(texts, [d.metadata for d in docs])
    else:
        added = store.add_documents(docs) if path == "add_documents" else await store.aadd_documents(docs)
    assert len(added) == 4
    assert events[0] == ("index", texts, [None, TEXTS[0], None, None])


@pytest.mark.parametrize("path", ADD_PATHS)
@pytest.mark.parametrize(
    ("bad", "error"),
    [
        ("", EmptyInputError),
        (" \n\t", EmptyInputError),
        ("\ud800 lone surrogate", InputEncodingError),
        ("x" * (MAX_CHARS + 1), ContextOverflowError),
    ],
)
async def test_a_bad_text_in_a_batch_adds_nothing(store, events, path, bad, error):
    with pytest.raises(error):
        await add(store, path, [TEXTS[0], bad, TEXTS[1]])
    assert events == []
    assert store.vectorstore.store == {}


@pytest.mark.parametrize("path", ADD_PATHS)
async def test_adding_nothing_is_a_no_op(store, events, path):
    assert await add(store, path, []) == []
    assert events == []


async def from_classmethod(name, texts, tmp_path, events, ids=None):
    """Build a store through one of the from_* classmethods; the async ones are awaited."""
    kwargs = dict(engine=SpyEngine(events), persist_directory=tmp_path, collection_name="unit-from")
    embedding = DeterministicFakeEmbedding(size=8)
    metadatas = [{"n": i} for i in range(len(texts))]
    if name == "from_texts":
        return KVRagVectorStore.from_texts(texts, embedding, metadatas, ids=ids, **kwargs)
    if name == "afrom_texts":
        return await KVRagVectorStore.afrom_texts(texts, embedding, metadatas, ids=ids, **kwargs)
    docs = [Document(page_content=t, metadata=m, id=i) for t, m, i in zip(texts, metadatas, ids or [None] * len(texts))]
    if name == "from_documents":
        return KVRagVectorStore.from_documents(docs, embedding, **kwargs)
    return await KVRagVectorStore.afrom_documents(docs, embedding, **kwargs)


FROM_PATHS = ["from_texts", "from_documents", "afrom_texts", "afrom_documents"]


@pytest.mark.parametrize("name", FROM_PATHS)
async def test_from_classmethods_index_then_store_in_chroma(tmp_path, events, name):
    store = await from_classmethod(name, TEXTS, tmp_path, events, ids=["a", "b", "c"])
    assert events == [("index", TEXTS)]
    assert isinstance(store.vectorstore, Chroma)
    assert store.get_by_ids(["c"]) == [Document(id="c", page_content=TEXTS[2], metadata={"n": 2})]


@pytest.mark.parametrize("name", FROM_PATHS)
async def test_from_classmethods_with_a_bad_text_store_nothing(tmp_path, events, name):
    with pytest.raises(EmptyInputError):
        await from_classmethod(name, [TEXTS[0], "  "], tmp_path, events)
    assert events == []
    reopened = KVRagVectorStore(engine=SpyEngine(events), persist_directory=tmp_path, collection_name="unit-from")
    assert reopened.vectorstore.get()["ids"] == []


def test_the_default_engine_is_the_shared_one_and_loads_on_first_add(monkeypatch, tmp_path, events):
    shared = []
    monkeypatch.setattr(KVEngine, "shared", classmethod(lambda cls: shared.append(1) or SpyEngine(events)))
    store = KVRagVectorStore(InMemoryVectorStore(DeterministicFakeEmbedding(size=8)))
    assert shared == []
    store.add_texts(TEXTS[:1])
    store.add_texts(TEXTS[1:])
    assert shared == [1]
    assert events == [("index", TEXTS[:1]), ("index", TEXTS[1:])]


def test_the_default_inner_store_is_a_persistent_chroma_under_kvrag_home(monkeypatch, tmp_path, events):
    monkeypatch.setenv("KVRAG_HOME", str(tmp_path))
    store = KVRagVectorStore(engine=SpyEngine(events))
    assert isinstance(store.vectorstore, Chroma)
    assert isinstance(store.embeddings, KVRagEmbeddings)
    assert store.vectorstore._collection.name == DEFAULT_COLLECTION
    assert (tmp_path / "chroma" / "chroma.sqlite3").is_file()
    assert store._select_relevance_score_fn() is KVRagVectorStore._cosine_relevance_score_fn

    options = dict(engine=SpyEngine(events), embedding=DeterministicFakeEmbedding(size=8), collection_name="notes")
    KVRagVectorStore(**options).add_texts(TEXTS, ids=["a", "b", "c"])  # no metadata: langchain-chroma 1.1 trips on that
    reopened = KVRagVectorStore(**options)
    assert sorted(reopened.get_by_ids(["a", "b", "c"]), key=lambda d: d.id) == [
        Document(id=i, page_content=t, metadata={}) for i, t in zip("abc", TEXTS)
    ]


def test_options_for_the_default_chroma_are_refused_with_an_own_store(events):
    inner = InMemoryVectorStore(DeterministicFakeEmbedding(size=8))
    with pytest.raises(ValueError, match="default Chroma"):
        KVRagVectorStore(inner, engine=SpyEngine(events), collection_name="notes")


@pytest.fixture
def chroma_store(tmp_path, events):
    """Chroma inside, because it has every search variant (relevance scores, filters, MMR)."""
    store = KVRagVectorStore(
        engine=SpyEngine(events), embedding=DeterministicFakeEmbedding(size=8), persist_directory=tmp_path
    )
    store.add_texts(TEXTS, [{"n": i} for i in range(3)], ids=["a", "b", "c"])
    return store


def contents(docs):
    return [d.page_content for d in docs]


# A text's own cosine relevance comes out as 1.0000001; langchain-core warns about anything above 1.
round_off = pytest.mark.filterwarnings("ignore:Relevance scores must be between 0 and 1:UserWarning")


@round_off
def test_searches_are_the_inner_stores(chroma_store):
    inner, query = chroma_store.vectorstore, TEXTS[1]
    vector = chroma_store.embeddings.embed_query(query)
    assert contents(chroma_store.similarity_search(query, k=1)) == [query]
    assert contents(chroma_store.similarity_search(query, k=3, filter={"n": 2})) == [TEXTS[2]]
    assert chroma_store.similarity_search_with_score(query, k=2) == inner.similarity_search_with_score(query, k=2)
    scored = chroma_store.similarity_search_with_relevance_scores(query, k=3)
    assert scored[0][0].page_content == query and scored[0][1] == pytest.approx(1.0)
    assert contents(chroma_store.similarity_search_by_vector(vector, k=1)) == [query]
    assert len(chroma_store.max_marginal_relevance_search(query, k=2, fetch_k=3)) == 2
    assert contents(chroma_store.max_marginal_relevance_search_by_vector(vector, k=1, fetch_k=3)) == [query]
    assert contents(chroma_store.search(query, "similarity", k=1)) == [query]


@round_off
async def test_async_searches_are_the_inner_stores(chroma_store):
    query = TEXTS[2]
    vector = chroma_store.embeddings.embed_query(query)
    assert contents(await chroma_store.asimilarity_search(query, k=1)) == [query]
    assert (await chroma_store.asimilarity_search_with_score(query, k=1))[0][1] == pytest.approx(0.0, abs=1e-6)
    assert (await chroma_store.asimilarity_search_with_relevance_scores(query, k=1))[0][1] == pytest.approx(1.0)
    assert contents(await chroma_store.asimilarity_search_by_vector(vector, k=1)) == [query]
    assert len(await chroma_store.amax_marginal_relevance_search(query, k=2, fetch_k=3)) == 2
    assert contents(await chroma_store.amax_marginal_relevance_search_by_vector(vector, k=1, fetch_k=3)) == [query]
    assert contents(await chroma_store.aget_by_ids(["a"])) == [TEXTS[0]]
    await chroma_store.adelete(["a"])
    assert await chroma_store.aget_by_ids(["a"]) == []


def test_delete_and_get_by_ids_reach_the_inner_store(chroma_store):
    chroma_store.delete(["a", "b"])
    assert chroma_store.vectorstore.get()["ids"] == ["c"]
    assert contents(chroma_store.get_by_ids(["a", "c"])) == [TEXTS[2]]


@round_off
def test_the_retriever_searches_and_its_additions_are_indexed(chroma_store, events):
    retriever = chroma_store.as_retriever(search_kwargs={"k": 1})
    assert contents(retriever.invoke(TEXTS[0])) == [TEXTS[0]]
    retriever.add_documents([Document(page_content="the mill turns at dusk")])
    assert events[-1] == ("index", ["the mill turns at dusk"])
    threshold = chroma_store.as_retriever(
        search_type="similarity_score_threshold", search_kwargs={"score_threshold": 0.99}
    )
    assert contents(threshold.invoke("the mill turns at dusk")) == ["the mill turns at dusk"]


def test_langchain_indexing_skips_unchanged_documents_and_deletes_stale_ones(store, events):
    manager = InMemoryRecordManager("unit")
    manager.create_schema()
    docs = [Document(page_content=t, metadata={"source": f"s{i}"}) for i, t in enumerate(TEXTS)]
    incremental = dict(cleanup="incremental", source_id_key="source", key_encoder="sha256")

    first = index(docs, manager, store, **incremental)
    assert (first["num_added"], first["num_skipped"]) == (3, 0)
    assert events == [("index", TEXTS), ("add", TEXTS)]

    events.clear()
    again = index(docs, manager, store, **incremental)
    assert (again["num_added"], again["num_skipped"]) == (0, 3)
    assert events == []

    changed = [*docs[:2], Document(page_content="bread is baked at six", metadata={"source": "s2"})]
    result = index(changed, manager, store, **incremental)
    assert (result["num_added"], result["num_skipped"], result["num_deleted"]) == (1, 2, 1)
    assert events == [("index", ["bread is baked at six"]), ("add", ["bread is baked at six"])]
    assert sorted(d["text"] for d in store.vectorstore.store.values()) == sorted([*TEXTS[:2], "bread is baked at six"])


# ---- idempotent adds: re-running a script stores nothing twice --------------------------------------

TUTORIAL = [
    Document(page_content=t, metadata={"source": f"page-{i}"}) for i, t in enumerate([*TEXTS, "the mill turns at dusk"])
]


def run_tutorial_script(home, events, name="from_documents"):
    """What a tutorial script does on every run: open the default persistent store, add the documents, ask."""
    options = dict(engine=SpyEngine(events), persist_directory=home, collection_name="tutorial")
    embedding = DeterministicFakeEmbedding(size=8)
    if name == "from_documents":
        store = KVRagVectorStore.from_documents(TUTORIAL, embedding, **options)
    else:
        store = KVRagVectorStore(embedding=embedding, **options)
        store.add_texts([d.page_content for d in TUTORIAL], [d.metadata for d in TUTORIAL])
    retrieved = store.as_retriever(search_kwargs={"k": 4}).invoke(TEXTS[1])
    return len(store.vectorstore.get()["ids"]), [(d.id, d.page_content) for d in retrieved]


@round_off
@pytest.mark.parametrize("name", ["from_documents", "add_texts"])
def test_re_running_a_script_leaves_the_count_and_the_retrieved_set_unchanged(tmp_path, events, name):
    first = run_tutorial_script(tmp_path, events, name)
    second = run_tutorial_script(tmp_path, events, name)
    assert first[0] == second[0] == len(TUTORIAL)
    assert second[1] == first[1] and len({content for _, content in first[1]}) == 4


@pytest.mark.parametrize("path", ADD_PATHS)
async def test_adding_the_same_documents_again_does_not_duplicate_them(chroma_store, path):
    first = await add(chroma_store, path, TEXTS)
    second = await add(chroma_store, path, TEXTS)
    assert first == second == [document_id(t, {"n": i}) for i, t in enumerate(TEXTS)]
    assert len(chroma_store.vectorstore.get()["ids"]) == 3 + 3  # the fixture's a, b, c and one copy of each


async def test_content_ids_depend_on_text_and_metadata(chroma_store):
    assert document_id("x", {"a": 1, "b": 2}) == document_id("x", {"b": 2, "a": 1}) != document_id("x", {"a": 2})
    assert document_id("x") == document_id("x", {}) != document_id("y")
    chroma_store.add_documents([Document(page_content=TEXTS[0], metadata={"n": 9})])
    assert len(chroma_store.vectorstore.get()["ids"]) == 4  # other metadata: another document


@pytest.mark.parametrize("path", ADD_PATHS)
async def test_given_ids_are_kept_and_the_same_id_replaces(chroma_store, path):
    ids = await add(chroma_store, path, ["the lighthouse keeper is Bo"], ids=["a"])
    assert ids == ["a"]
    assert sorted(chroma_store.vectorstore.get()["ids"]) == ["a", "b", "c"]
    assert contents(chroma_store.get_by_ids(["a"])) == ["the lighthouse keeper is Bo"]


def test_document_ids_are_kept_and_a_repeat_in_one_batch_is_stored_once(chroma_store):
    docs = [Document(page_content="new keeper", id="a"), Document(page_content="twice"), Document(page_content="twice")]
    assert chroma_store.add_documents(docs) == ["a", document_id("twice"), document_id("twice")]
    assert len(chroma_store.vectorstore.get()["ids"]) == 4
    assert chroma_store.add_texts(["x", "y"], ids=["d", "d"]) == ["d", "d"]
    assert contents(chroma_store.get_by_ids(["d"])) == ["y"]  # the last one wins, as a later add would
    with pytest.raises(ValueError, match="2 ids for 1 texts"):
        chroma_store.add_texts(["z"], ids=["e", "f"])


SCRIPT = """
import json
from langchain_core.documents import Document
from langchain_core.embeddings import DeterministicFakeEmbedding
from langchain_kvrag import KVRagVectorStore

class NoKV:  # the KV cache is not what this checks
    def index(self, texts, progress=True):
        return []

texts = ["the lighthouse keeper is Ada", "the ferry leaves at noon", "bread is baked at dawn", "the mill turns at dusk"]
docs = [Document(page_content=t, metadata={"source": f"page-{i}"}) for i, t in enumerate(texts)]
store = KVRagVectorStore.from_documents(docs, DeterministicFakeEmbedding(size=8), engine=NoKV(), collection_name="tut")
found = store.as_retriever(search_kwargs={"k": 4}).invoke(texts[1])
print(json.dumps([len(store.vectorstore.get()["ids"]), [[d.id, d.page_content] for d in found]]))
"""


def test_a_script_run_twice_in_new_processes_stores_each_document_once(tmp_path):
    """The default store under one KVRAG_HOME, as two runs of the same script see it."""
    env = {**os.environ, "KVRAG_HOME": str(tmp_path)}
    runs = [
        json.loads(subprocess.run([sys.executable, "-c", SCRIPT], env=env, capture_output=True, text=True, check=True).stdout)
        for _ in range(2)
    ]
    assert runs[0] == runs[1]
    assert runs[0][0] == 4 and len({text for _, text in runs[0][1]}) == 4


# ---- the default collection on a Chroma server (`chroma run`, started for these tests) ----------------


def test_with_chroma_url_the_collection_lives_in_the_chroma_server(chroma, tmp_path, monkeypatch, events):
    monkeypatch.setenv("KVRAG_HOME", str(tmp_path))
    options = dict(embedding=DeterministicFakeEmbedding(size=8), collection_name="replicas", chroma_url=chroma)
    one = KVRagVectorStore(engine=SpyEngine(events), **options)
    ids = one.add_texts(TEXTS, [{"n": i} for i in range(3)])
    assert ids == [document_id(t, {"n": i}) for i, t in enumerate(TEXTS)]
    assert events == [("index", TEXTS)]
    assert contents(one.similarity_search(TEXTS[1], k=1)) == [TEXTS[1]]
    # another store on the same URL (another replica) finds them; adding them again stores nothing twice
    two = KVRagVectorStore(engine=SpyEngine(events), **options)
    assert two.similarity_search(TEXTS[2], k=1) == [Document(id=ids[2], page_content=TEXTS[2], metadata={"n": 2})]
    assert two.add_texts(TEXTS, [{"n": i} for i in range(3)]) == ids
    assert len(one.vectorstore.get()["ids"]) == 3
    assert not (tmp_path / "chroma").exists()  # nothing embedded
    assert one.vectorstore._collection.metadata == {"hnsw:space": "cosine"}


def test_chroma_url_is_checked_and_excludes_a_directory(tmp_path, events):
    url = f"http://127.0.0.1:{free_port()}"  # nothing listens there
    with pytest.raises(ChromaUnavailableError, match=f"no Chroma server at {url} "):
        KVRagVectorStore(engine=SpyEngine(events), chroma_url=url)
    with pytest.raises(ValueError, match="not both"):
        KVRagVectorStore(engine=SpyEngine(events), chroma_url=url, persist_directory=tmp_path)
    with pytest.raises(ValueError, match="http://HOST"):
        KVRagVectorStore(engine=SpyEngine(events), chroma_url="localhost:8000")
    with pytest.raises(ValueError, match="default Chroma"):
        KVRagVectorStore(InMemoryVectorStore(DeterministicFakeEmbedding(size=8)), chroma_url=url)
