"""Reuse without an extra step (llama_index.llms.kvrag.learning), on a tiny random-weight model:
LlamaIndex's starter pattern, unchanged but for `llm=KVRagLLM(...)`, reuses KV from the second
query over the same nodes, and so do nodes handed to a synthesizer by hand; the figures reach
`Response.metadata` for the built-in synthesizers."""

import uuid

import pytest
import torch
from kvrag import KVEngine
from llama_index.core import Document, VectorStoreIndex, get_response_synthesizer
from llama_index.core.schema import NodeWithScore, TextNode

from tiny import tiny_configs, tiny_model, tiny_tokenizer

from llama_index.llms.kvrag import KVRagLLM, default_embed_model, learning

QUESTION = "Who built the lighthouse?"


@pytest.fixture(scope="module")
def embed_model():
    return default_embed_model()


@pytest.fixture
def tiny_engine(tmp_path) -> KVEngine:
    tokenizer = tiny_tokenizer()
    return KVEngine(tiny_model(tiny_configs(len(tokenizer))["llama"]), tokenizer, home=tmp_path, storage_dtype=torch.float32,
                    default_mode="block")  # the reuse these tests are about


@pytest.fixture
def documents() -> list[Document]:
    tag = uuid.uuid4().hex[:6]  # texts no other test taught an engine
    return [
        Document(text=f"The Varnholm lighthouse ({tag}) was built in 1873 by the engineer Ilsa Brandt."),
        Document(text=f"The river Olm ({tag}) freezes every winter, and the ferry stops until March."),
    ]


@pytest.mark.parametrize("response_mode", ["compact", "tree_summarize"])
def test_starter_pattern_reuses_from_the_second_query(tiny_engine, documents, embed_model, response_mode):
    index = VectorStoreIndex.from_documents(documents, embed_model=embed_model)
    llm = KVRagLLM(engine=tiny_engine, max_new_tokens=4)
    query_engine = index.as_query_engine(llm=llm, response_mode=response_mode)

    first = query_engine.query(QUESTION)
    second = query_engine.query(QUESTION)

    assert first.metadata["kvrag"]["cache_hits"].get("computed", 0) >= 1  # learned, encoded on first sight
    assert second.metadata["kvrag"]["reused_tokens"] > 0
    assert second.metadata["kvrag"]["cache_hits"].get("computed", 0) == 0


def test_nodes_any_embeddings_retrieved_are_learned(tiny_engine, documents):
    """Not kvrag's embeddings: LlamaIndex's own offline MockEmbedding finds the nodes, the retrieval is learned."""
    from llama_index.core.embeddings import MockEmbedding

    index = VectorStoreIndex.from_documents(documents, embed_model=MockEmbedding(embed_dim=8))
    query_engine = index.as_query_engine(llm=KVRagLLM(engine=tiny_engine, max_new_tokens=4))
    query_engine.query(QUESTION)
    second = query_engine.query(QUESTION)
    assert second.metadata["kvrag"]["reused_tokens"] > 0
    assert second.metadata["kvrag"]["cache_hits"].get("computed", 0) == 0


def test_async_query_reuses_too(tiny_engine, documents, embed_model):
    import asyncio

    index = VectorStoreIndex.from_documents(documents, embed_model=embed_model)
    query_engine = index.as_query_engine(llm=KVRagLLM(engine=tiny_engine, max_new_tokens=4))
    asyncio.run(query_engine.aquery(QUESTION))
    second = asyncio.run(query_engine.aquery(QUESTION))
    assert second.metadata["kvrag"]["reused_tokens"] > 0


def test_a_dropped_llm_stops_learning(tiny_engine):
    llm = KVRagLLM(engine=tiny_engine)
    assert any(other is llm for other in learning.live_llms())
    del llm
    import gc

    gc.collect()
    assert all(other.engine is not tiny_engine for other in learning.live_llms())


def test_nodes_handed_to_a_synthesizer_are_reused_by_the_next_synthesis(tiny_engine):
    """Nodes nobody retrieved or indexed: the engine learns them from the text-QA prompt they are pasted
    into (between its rules and blank lines), so the second synthesis over them reuses their KV."""
    synthesizer = get_response_synthesizer(llm=KVRagLLM(engine=tiny_engine, max_new_tokens=2), response_mode="compact")
    tag = uuid.uuid4().hex
    nodes = [NodeWithScore(node=TextNode(text=f"Passage {tag} {i}: nobody retrieved or indexed this text, ever."))
             for i in range(2)]
    first = synthesizer.synthesize(QUESTION, nodes)
    second = synthesizer.synthesize("Who else built it, and when?", nodes)
    assert first.metadata["kvrag"]["reused_tokens"] == 0
    assert second.metadata["kvrag"]["reused_tokens"] > 0 and second.metadata["kvrag"]["cache_hits"].get("computed", 0) == 0


@pytest.mark.e2e
def test_starter_pattern_reuses_from_the_second_query_on_the_default_model(documents, embed_model):
    """As a user meets it: the starter pattern, unchanged but for `llm=KVRagLLM(mode="block")` (the real
    default model; by default it answers in full mode, which reuses nothing)."""
    index = VectorStoreIndex.from_documents(documents, embed_model=embed_model)
    query_engine = index.as_query_engine(llm=KVRagLLM(mode="block", max_new_tokens=24))
    query_engine.query(QUESTION)
    second = query_engine.query(QUESTION)
    assert second.metadata["kvrag"]["reused_tokens"] > 0
    assert second.metadata["kvrag"]["cache_hits"].get("computed", 0) == 0
    assert "ilsa brandt" in str(second).lower()
