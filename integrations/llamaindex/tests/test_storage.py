"""The default vector store is idempotent: re-running an ingestion script stores nothing twice.

Model-free but for the packaged embedding model (all-MiniLM-L6-v2, on CPU): no LLM is loaded. The
same store on a Chroma server (`chroma run`, started for the tests) with `chroma_url=`.
"""

import os

import pytest
from kvrag import ChromaUnavailableError
from llama_index.core import SimpleDirectoryReader, StorageContext, VectorStoreIndex
from llama_index.core.ingestion import IngestionPipeline
from llama_index.core.node_parser import SentenceSplitter
from llama_index.core.schema import TextNode
from servers import free_port

from llama_index.llms.kvrag import default_vector_store
from llama_index.llms.kvrag.storage import CONTENT_KEY, IdempotentChromaVectorStore, content_hash

FILES = {
    "lighthouse.md": "The lighthouse of Varnholm was built in 1873 by the engineer Ilsa Brandt.",
    "archive.md": "The Hallow Archive is kept by Tomas Reyl, who catalogues the harbour ledgers.",
    "clock.md": "Mirela Kostavar invented the tide clock that hangs in the market hall.",
}


@pytest.fixture
def docs_dir(tmp_path):
    folder = tmp_path / "docs"
    folder.mkdir()
    for name, text in FILES.items():
        (folder / name).write_text(text)
    return folder


def starter_script(docs_dir, embed_model):
    """LlamaIndex's starter pattern with kvrag's default store, as a script runs it every time."""
    documents = SimpleDirectoryReader(str(docs_dir)).load_data()
    store = default_vector_store()
    context = StorageContext.from_defaults(vector_store=store)
    index = VectorStoreIndex.from_documents(documents, storage_context=context, embed_model=embed_model)
    found = index.as_retriever(similarity_top_k=2).retrieve("Who built the lighthouse?")
    return store.client.count(), [(n.node.node_id, n.node.get_content()) for n in found]


def test_re_running_the_starter_script_leaves_the_count_and_the_retrieved_set_unchanged(
    monkeypatch, tmp_path, docs_dir, embed_model
):
    monkeypatch.setenv("KVRAG_HOME", str(tmp_path / "home"))
    count, first = starter_script(docs_dir, embed_model)
    for path in docs_dir.iterdir():  # a later run sees other file dates: not other content
        os.utime(path, (1_000_000_000, 1_000_000_000))
    again, second = starter_script(docs_dir, embed_model)
    assert count == again == len(FILES)
    assert [text for _, text in second] == [text for _, text in first]
    assert second[0][1] == FILES["lighthouse.md"]


def test_re_running_an_ingestion_pipeline_into_it_adds_nothing(monkeypatch, tmp_path, docs_dir, embed_model):
    monkeypatch.setenv("KVRAG_HOME", str(tmp_path / "home"))
    for _ in range(2):
        store = default_vector_store(collection_name="pipeline")
        pipeline = IngestionPipeline(transformations=[SentenceSplitter(), embed_model], vector_store=store)
        pipeline.run(documents=SimpleDirectoryReader(str(docs_dir)).load_data())
        assert store.client.count() == len(FILES)
    changed = docs_dir / "clock.md"
    changed.write_text("Mirela Kostavar repaired the tide clock in the market hall.")
    pipeline.run(documents=SimpleDirectoryReader(input_files=[str(changed)]).load_data())
    assert store.client.count() == len(FILES) + 1  # new content is a new node


def node(text, id_, metadata=None):
    return TextNode(text=text, id_=id_, metadata=metadata or {}, embedding=[1.0, 0.0])


@pytest.fixture
def store(tmp_path) -> IdempotentChromaVectorStore:
    return default_vector_store(tmp_path, collection_name="nodes")


def stored(store):
    found = store.client.get(include=["documents"])
    return sorted(zip(found["ids"], found["documents"]))


def test_the_same_content_under_a_new_id_replaces_the_old_node(store):
    assert store.add([node("alpha", "run-1"), node("beta", "b")]) == ["run-1", "b"]
    assert store.add([node("alpha", "run-2")]) == ["run-2"]
    assert stored(store) == [("b", "beta"), ("run-2", "alpha")]
    assert store.get_nodes(["run-2"])[0].metadata == {}  # the hash is the store's, not the node's
    assert store.client.get(ids=["run-2"])["metadatas"][0][CONTENT_KEY] == content_hash(node("alpha", "x"))


def test_given_ids_are_kept_and_the_same_id_replaces(store):
    store.add([node("alpha", "a")])
    store.add([node("alpha, edited", "a")])
    assert stored(store) == [("a", "alpha, edited")]


def test_metadata_the_embedding_sees_is_content_and_a_repeat_in_one_batch_is_stored_once(store):
    nodes = [node("alpha", "1", {"file_path": "a.md"}), *(node("alpha", i, {"file_path": "b.md"}) for i in "23")]
    ids = store.add(nodes)
    assert ids == ["1", "3", "3"]
    assert stored(store) == [("1", "alpha"), ("3", "alpha")]


# ---- on a Chroma server (`chroma run`, started for these tests) --------------------------------------


def test_with_chroma_url_an_index_lives_in_the_chroma_server(chroma, monkeypatch, tmp_path, docs_dir, embed_model):
    monkeypatch.setenv("KVRAG_HOME", str(tmp_path / "home"))
    documents = SimpleDirectoryReader(str(docs_dir)).load_data()
    store = default_vector_store(collection_name="served", chroma_url=chroma)
    context = StorageContext.from_defaults(vector_store=store)
    VectorStoreIndex.from_documents(documents, storage_context=context, embed_model=embed_model)
    assert store.client.count() == len(FILES)
    # another store on the same URL and collection (as another replica opens it) retrieves from it
    other = VectorStoreIndex.from_vector_store(default_vector_store(collection_name="served", chroma_url=chroma),
                                               embed_model=embed_model)
    found = other.as_retriever(similarity_top_k=1).retrieve("Who built the lighthouse?")
    assert [n.node.get_content() for n in found] == [FILES["lighthouse.md"]]
    VectorStoreIndex.from_documents(documents, storage_context=context, embed_model=embed_model)
    assert store.client.count() == len(FILES)  # idempotent on the server too
    assert not (tmp_path / "home").exists()  # nothing embedded


def test_chroma_url_is_checked_and_excludes_a_path(tmp_path):
    url = f"http://127.0.0.1:{free_port()}"  # nothing listens there
    with pytest.raises(ChromaUnavailableError, match=f"no Chroma server at {url} "):
        default_vector_store(chroma_url=url)
    with pytest.raises(ValueError, match="not both"):
        default_vector_store(tmp_path, chroma_url=url)
