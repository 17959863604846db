"""KVRagEmbeddings with the real packaged all-MiniLM-L6-v2 (offline)."""

import math

from langchain_tests.integration_tests import EmbeddingsIntegrationTests

from langchain_kvrag import embeddings as embeddings_module
from langchain_kvrag.embeddings import KVRagEmbeddings


class TestKVRagEmbeddingsIntegration(EmbeddingsIntegrationTests):
    @property
    def embeddings_class(self) -> type[KVRagEmbeddings]:
        return KVRagEmbeddings


def cosine(a, b):
    return sum(x * y for x, y in zip(a, b))


def test_vectors_are_normalized_and_meaningful():
    model = KVRagEmbeddings()
    query = model.embed_query("Who keeps the lighthouse?")
    related, unrelated = model.embed_documents(
        ["Ada Pell has kept the lighthouse on the north cape since 1891.", "Bread is baked at dawn in the village."]
    )
    assert len(query) == 384
    assert math.isclose(math.sqrt(cosine(query, query)), 1.0, rel_tol=1e-4)
    assert cosine(query, related) > cosine(query, unrelated) + 0.2


def test_instances_share_one_loaded_model():
    first, second = KVRagEmbeddings(), KVRagEmbeddings()
    first.embed_query("a")
    second.embed_query("b")
    loaded = [key for key in embeddings_module._LOADED if key[1] == "cpu"]
    assert len(loaded) == 1
