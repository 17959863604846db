"""KVRagEmbeddings without loading the model: construction is free, loading happens once per process."""

import pytest
from langchain_tests.unit_tests import EmbeddingsUnitTests
from pydantic import ValidationError

from langchain_kvrag import embeddings as embeddings_module
from langchain_kvrag.embeddings import KVRagEmbeddings


class TestKVRagEmbeddingsUnit(EmbeddingsUnitTests):
    @property
    def embeddings_class(self) -> type[KVRagEmbeddings]:
        return KVRagEmbeddings


class FakeEmbedder:
    """Stands in for kvrag.retrieval.Embedder and counts how often a model is loaded."""

    loads: list[tuple[str, str]] = []

    def __init__(self, path, device="cpu"):
        FakeEmbedder.loads.append((str(path), device))

    def embed(self, texts):
        return [[float(len(t)), 1.0] for t in texts]


@pytest.fixture
def fake_model(monkeypatch):
    FakeEmbedder.loads = []
    monkeypatch.setattr(embeddings_module, "Embedder", FakeEmbedder)
    monkeypatch.setattr(embeddings_module, "_LOADED", {})
    return FakeEmbedder.loads


def test_instances_load_nothing_until_used_then_share_one_model(fake_model):
    packaged = str(embeddings_module.embedding_model_path())
    models = [KVRagEmbeddings(), KVRagEmbeddings(), KVRagEmbeddings(model_path=packaged)]
    assert fake_model == []
    for model in models:
        model.embed_query("hello")
    assert fake_model == [(str(embeddings_module.embedding_model_path().resolve()), "cpu")]


def test_another_device_is_another_model(fake_model):
    KVRagEmbeddings().embed_query("a")
    KVRagEmbeddings(device="meta").embed_query("a")
    assert [device for _, device in fake_model] == ["cpu", "meta"]


def test_embed_query_is_the_document_embedding(fake_model):
    model = KVRagEmbeddings()
    assert model.embed_query("four") == model.embed_documents(["x", "four"])[1] == [4.0, 1.0]


def test_no_texts_load_nothing(fake_model):
    assert KVRagEmbeddings().embed_documents([]) == []
    assert fake_model == []


async def test_async_variants_give_the_sync_results(fake_model):
    model = KVRagEmbeddings()
    assert await model.aembed_documents(["ab", "abc"]) == [[2.0, 1.0], [3.0, 1.0]]
    assert await model.aembed_query("a") == [1.0, 1.0]


def test_unknown_options_are_rejected():
    with pytest.raises(ValidationError):
        KVRagEmbeddings(model_name="all-MiniLM-L6-v2")
