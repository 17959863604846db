"""KVPrecompute in LlamaIndex's ingestion paths, on the real default model and a persistent Chroma.

Computed blocks are counted through `engine.blocks.encode_many` (the `encoded` fixture); each test ingests
documents of its own so that nothing was stored before it.
"""

import pytest
from kvrag import ContextOverflowError, EmptyInputError, KVEngine
from llama_index.core import Document, StorageContext, VectorStoreIndex
from llama_index.core.ingestion import IngestionCache, IngestionPipeline
from llama_index.core.ingestion.pipeline import get_transformation_hash
from llama_index.core.node_parser import SentenceSplitter
from llama_index.core.schema import MetadataMode, NodeWithScore, TextNode

from llama_index.llms.kvrag import KVBlockSynthesizer, KVPrecompute, KVRagLLM, default_vector_store

pytestmark = pytest.mark.e2e  # the real default model (conftest's engine)


def documents(passages: list[str]) -> list[Document]:
    return [Document(text=p, metadata={"ledger": i}) for i, p in enumerate(passages)]


def pipeline(llm, embed_model, vector_store=None, cache=None) -> IngestionPipeline:
    return IngestionPipeline(
        transformations=[SentenceSplitter(chunk_size=128, chunk_overlap=0), KVPrecompute(llm=llm), embed_model],
        vector_store=vector_store,
        cache=cache if cache is not None else IngestionCache(),
    )


def assert_computed_once(encoded, llm, nodes):
    """Each node's block (its LLM-visible content, metadata included) was computed exactly once;
    besides them, at most the prompt's prefix and separator blocks (stored with a session's first passages)."""
    blocks = [llm.engine.layout.passage_ids(n.get_content(metadata_mode=MetadataMode.LLM)) for n in nodes]
    assert all(encoded.count(ids) == 1 for ids in blocks)
    assert all(ids in (llm.engine.layout.prefix_ids, llm.engine.layout.separator_ids) for ids in encoded if ids not in blocks)


def ask(llm, nodes, question="How many ships does the ledger list on day 1?"):
    return KVBlockSynthesizer(llm).synthesize(question, [NodeWithScore(node=n, score=1.0) for n in nodes])


def test_a_pipeline_computes_each_nodes_kv_once_and_a_rerun_computes_nothing(llm, embed_model, fresh_passages, encoded, tmp_path):
    docs = documents(fresh_passages(3))
    store = default_vector_store(tmp_path / "chroma")
    nodes = pipeline(llm, embed_model, store).run(documents=docs)
    assert len(nodes) == 3 and "ledger: 0" in nodes[0].get_content(metadata_mode=MetadataMode.LLM)
    assert_computed_once(encoded, llm, nodes)

    encoded.clear()
    cached = pipeline(llm, embed_model, store)
    cached.run(documents=docs)
    cached.run(documents=docs)  # the pipeline's cache skips KVPrecompute
    uncached = pipeline(llm, embed_model, store)
    uncached.disable_cache = True
    uncached.run(documents=docs)  # KVPrecompute runs and finds every block stored
    assert encoded == []

    response = ask(llm, nodes)
    assert "computed" not in response.metadata["kvrag"]["cache_hits"] and encoded == []


def test_kv_is_found_on_disk_or_computed_at_query_time_when_the_cache_skipped_the_transform(
    llm, embed_model, fresh_passages, tmp_path
):
    docs, cache = documents(fresh_passages(2)), IngestionCache()
    nodes = pipeline(llm, embed_model, cache=cache).run(documents=docs)
    answer = ask(llm, nodes)

    engine = llm.engine  # the same weights, new engines: a fresh process on the same / another KVRAG_HOME
    same = dict(fingerprint=engine.fingerprint, storage_dtype=engine.storage_dtype)
    same_home = KVRagLLM(engine=KVEngine(engine.model, engine.tokenizer, home=engine.home, **same), mode="block")
    from_disk = ask(same_home, nodes)
    assert set(from_disk.metadata["kvrag"]["cache_hits"]) == {"disk"}

    new_home = KVRagLLM(engine=KVEngine(engine.model, engine.tokenizer, home=tmp_path, **same), mode="block")
    rerun = pipeline(new_home, embed_model, cache=cache).run(documents=docs)  # cached: nothing runs
    assert not any(tmp_path.glob("kv/*/*/*.safetensors"))
    computed = ask(new_home, rerun)
    assert computed.metadata["kvrag"]["cache_hits"]["computed"] >= len(nodes)
    assert str(computed) == str(from_disk) == str(answer)


def test_vector_store_index_runs_it_on_from_documents_and_insert(llm, embed_model, fresh_passages, encoded, tmp_path):
    first, second = fresh_passages(2)
    transformations = [SentenceSplitter(chunk_size=128, chunk_overlap=0), KVPrecompute(llm=llm)]
    storage = StorageContext.from_defaults(vector_store=default_vector_store(tmp_path / "chroma"))
    index = VectorStoreIndex.from_documents(
        [Document(text=first)], storage_context=storage, embed_model=embed_model, transformations=transformations
    )
    assert_computed_once(encoded, llm, [TextNode(text=first)])
    encoded.clear()
    index.insert(Document(text=second))
    assert encoded == [llm.engine.layout.passage_ids(second)]
    retrieved = index.as_retriever(similarity_top_k=2).retrieve("ledger")
    assert sorted(n.node.get_content() for n in retrieved) == sorted([first, second])


async def test_the_async_pipeline_runs_it_too(llm, embed_model, fresh_passages, encoded):
    nodes = await pipeline(llm, embed_model).arun(documents=documents(fresh_passages(2)))
    assert_computed_once(encoded, llm, nodes)


@pytest.mark.parametrize(
    "bad, error, match",
    [
        (TextNode(id_="empty-node", text="  \n"), EmptyInputError, "node empty-node has no text"),
        (TextNode(id_="huge-node", text="lighthouse " * 9000), ContextOverflowError, "node huge-node needs"),
    ],
)
def test_a_bad_node_stores_nothing_anywhere(llm, embed_model, fresh_passages, encoded, tmp_path, bad, error, match):
    good = [TextNode(text=p) for p in fresh_passages(2)]
    store = default_vector_store(tmp_path / "chroma")
    ingest = IngestionPipeline(transformations=[KVPrecompute(llm=llm), embed_model], vector_store=store)
    with pytest.raises(error, match=match):
        ingest.run(nodes=[*good, bad])
    assert encoded == []
    assert store.client.count() == 0


def test_no_nodes_is_nothing_to_do(llm, encoded):
    assert KVPrecompute(llm=llm)([]) == []
    assert encoded == []


def test_the_pipeline_cache_keys_it_by_the_model_alone(llm, engine):
    nodes = [TextNode(text="Stable hashing needs a serializable transform.")]
    other_settings = KVRagLLM(engine=engine, mode="full", max_new_tokens=7)
    assert get_transformation_hash(nodes, KVPrecompute(llm=llm)) == get_transformation_hash(nodes, KVPrecompute(llm=other_settings))
    assert KVPrecompute(llm=llm).to_dict() == {"fingerprint": engine.fingerprint, "class_name": "KVPrecompute"}


def test_with_document_context_each_node_is_encoded_after_the_node_before_it(fresh_passages):
    """An engine of block context "document": a node parser's nodes of one document carry their previous node, and
    each node whose previous one is in the batch is encoded after it (its block starts where that text ends); the
    document's first node alone."""
    from kvrag.engine import DOCUMENT_LEAD

    engine = KVEngine.shared(block_context="document")
    llm = KVRagLLM(engine=engine, mode="block", max_new_tokens=8)
    splitter = SentenceSplitter(chunk_size=48, chunk_overlap=0)
    nodes = IngestionPipeline(transformations=[splitter, KVPrecompute(llm=llm)]).run(
        documents=[Document(text=" ".join(fresh_passages(8)))])
    assert len(nodes) >= 3 and all(n.prev_node.node_id == p.node_id for p, n in zip(nodes, nodes[1:]))
    ids = [engine.layout.passage_ids(n.get_content(metadata_mode=MetadataMode.LLM)) for n in nodes]
    starts = [engine.store.get(key, "document")[0].start for key in engine.blocks.keys(engine.layout.prefix_ids, ids)]
    assert starts == [0] + [min(len(before), DOCUMENT_LEAD) for before in ids[:-1]]
    assert ask(llm, nodes).metadata["kvrag"]["cache_hits"].get("computed", 0) <= 2  # the prefix and separator at most
