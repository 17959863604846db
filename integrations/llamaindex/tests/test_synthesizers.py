"""Query engines over a Chroma index of kvrag's sample corpus, on the real default model (greedy).

What is asserted about answers is what the 135M model does reliably on this corpus: it names the
head keeper of the Hallow Archive in every mode. The comparison synthesizers are only required to
answer. (How map-rerank picks its answer, with a scripted LLM: test_map_rerank.py.)
"""

import json
import re
import subprocess
import sys
from collections.abc import Sequence
from importlib import resources
from pathlib import Path

import pytest
from kvrag import ContextOverflowError, EmptyInputError
from llama_index.core import SimpleDirectoryReader, VectorStoreIndex, get_response_synthesizer
from llama_index.core.base.response.schema import AsyncStreamingResponse, StreamingResponse
from llama_index.core.ingestion import IngestionPipeline
from llama_index.core.instrumentation import get_dispatcher
from llama_index.core.instrumentation.event_handlers import BaseEventHandler
from llama_index.core.instrumentation.events.llm import LLMChatEndEvent
from llama_index.core.node_parser import SentenceSplitter
from llama_index.core.query_engine import RetrieverQueryEngine
from llama_index.core.schema import MetadataMode, NodeWithScore, TextNode

from llama_index.llms.kvrag import (
    KVBlockSynthesizer,
    KVPrecompute,
    MapRerankSynthesizer,
    default_vector_store,
)

pytestmark = pytest.mark.e2e

SAMPLE = Path(str(resources.files("kvrag") / "sample"))
EXAMPLE = Path(__file__).resolve().parents[3] / "examples" / "llamaindex_rag.py"
KEEPER = "Who is the head keeper of the Hallow Archive?"  # institutions.md: Agnes Thornbury


@pytest.fixture(scope="module")
def index(llm, embed_model, tmp_path_factory) -> VectorStoreIndex:
    documents = SimpleDirectoryReader(str(SAMPLE), required_exts=[".md"]).load_data()
    store = default_vector_store(tmp_path_factory.mktemp("chroma"))
    pipeline = IngestionPipeline(
        transformations=[SentenceSplitter(chunk_size=160, chunk_overlap=0), KVPrecompute(llm=llm), embed_model],
        vector_store=store,
    )
    pipeline.run(documents=documents)
    return VectorStoreIndex.from_vector_store(store, embed_model=embed_model)


@pytest.fixture(scope="module")
def retriever(index):
    return index.as_retriever(similarity_top_k=3)


@pytest.fixture
def llm_replies() -> list[dict]:
    """The `additional_kwargs` of every LLM chat response during the test (LlamaIndex instrumentation)."""
    replies: list[dict] = []

    class Recorder(BaseEventHandler):
        def handle(self, event, **kwargs) -> None:
            if isinstance(event, LLMChatEndEvent) and event.response is not None:
                replies.append(event.response.additional_kwargs)

    dispatcher, recorder = get_dispatcher(), Recorder()
    dispatcher.add_event_handler(recorder)
    yield replies
    dispatcher.event_handlers.remove(recorder)


def passage_tokens(llm, nodes: Sequence[NodeWithScore]) -> int:
    return sum(len(llm.engine.layout.passage_ids(n.node.get_content(metadata_mode=MetadataMode.LLM))) for n in nodes)


def test_block_synthesizer_answers_from_the_right_node_with_cached_kv(llm, retriever):
    response = RetrieverQueryEngine(retriever, response_synthesizer=KVBlockSynthesizer(llm)).query(KEEPER)
    assert "Thornbury" in str(response)
    assert len(response.source_nodes) == 3 and any("Thornbury" in n.node.get_content() for n in response.source_nodes)
    stats = response.metadata["kvrag"]
    assert stats["reused_tokens"] > passage_tokens(llm, response.source_nodes)  # the passages and the prefix
    assert "computed" not in stats["cache_hits"] and stats["prefilled_tokens"] < 40
    for node in response.source_nodes:
        assert response.metadata[node.node_id] == node.node.metadata


def test_the_block_prompt_is_the_engines_own(llm, retriever):
    nodes = retriever.retrieve(KEEPER)
    response = KVBlockSynthesizer(llm).synthesize(KEEPER, nodes)
    passages = [n.node.get_content(metadata_mode=MetadataMode.LLM) for n in nodes]
    assert str(response) == llm.engine.generate(KEEPER, passages, max_new_tokens=llm.max_new_tokens).text


def test_builtin_compact_reuses_the_ingested_kv_by_drop_in(llm, retriever, llm_replies):
    synthesizer = get_response_synthesizer(llm=llm, response_mode="compact")
    response = RetrieverQueryEngine(retriever, response_synthesizer=synthesizer).query(KEEPER)
    assert "Thornbury" in str(response)
    (stats,) = llm_replies
    assert stats["mode"] == "block" and stats["reused_tokens"] >= passage_tokens(llm, response.source_nodes)


@pytest.mark.parametrize("name", ["block", "compact", "simple_summarize", "tree_summarize", "map_rerank"])
def test_each_comparison_synthesizer_answers(llm, retriever, name):
    if name == "block":
        synthesizer = KVBlockSynthesizer(llm)
    elif name == "map_rerank":
        synthesizer = MapRerankSynthesizer(llm)
    else:
        synthesizer = get_response_synthesizer(llm=llm, response_mode=name)
    response = RetrieverQueryEngine(retriever, response_synthesizer=synthesizer).query(KEEPER)
    assert str(response).strip() and str(response) != "Empty Response"
    assert len(response.source_nodes) == 3


def test_streaming_gives_the_same_answer_and_its_figures_at_the_end(llm, retriever):
    expected = str(KVBlockSynthesizer(llm).synthesize(KEEPER, retriever.retrieve(KEEPER)))
    response = RetrieverQueryEngine(retriever, response_synthesizer=KVBlockSynthesizer(llm, streaming=True)).query(KEEPER)
    assert isinstance(response, StreamingResponse) and "kvrag" not in response.metadata
    deltas = list(response.response_gen)
    assert len(deltas) > 3 and "".join(deltas) == expected
    assert response.metadata["kvrag"]["reused_tokens"] > 0 and len(response.source_nodes) == 3


async def test_async_queries_answer_alike(llm, retriever):
    expected = str(KVBlockSynthesizer(llm).synthesize(KEEPER, retriever.retrieve(KEEPER)))
    plain = await RetrieverQueryEngine(retriever, response_synthesizer=KVBlockSynthesizer(llm)).aquery(KEEPER)
    assert str(plain) == expected and plain.metadata["kvrag"]["reused_tokens"] > 0
    streaming = KVBlockSynthesizer(llm, streaming=True)
    response = await RetrieverQueryEngine(retriever, response_synthesizer=streaming).aquery(KEEPER)
    assert isinstance(response, AsyncStreamingResponse)
    assert "".join([d async for d in response.async_response_gen()]) == expected
    assert response.metadata["kvrag"]["reused_tokens"] > 0


async def test_bad_nodes_get_clear_errors_and_store_nothing(llm, encoded):
    synthesizer = KVBlockSynthesizer(llm)
    with pytest.raises(EmptyInputError, match="no nodes"):
        synthesizer.synthesize(KEEPER, [])
    with pytest.raises(EmptyInputError, match="no nodes"):
        await synthesizer.asynthesize(KEEPER, [])
    blank = NodeWithScore(node=TextNode(id_="blank", text=" ", metadata={"source": "x.md"}))
    with pytest.raises(EmptyInputError, match="node blank has no text"):
        synthesizer.synthesize(KEEPER, [NodeWithScore(node=TextNode(text="Agnes Thornbury keeps the archive.")), blank])
    huge = NodeWithScore(node=TextNode(text="lighthouse " * 9000))
    with pytest.raises(ContextOverflowError, match="context window"):
        synthesizer.synthesize(KEEPER, [huge])
    assert encoded == []


def test_the_example_app_runs(tmp_path):
    questions = tmp_path / "questions.json"
    questions.write_text(json.dumps([{"question": KEEPER, "answers": ["thornbury"]}]))
    run = subprocess.run(
        [sys.executable, str(EXAMPLE), str(SAMPLE), str(questions)], capture_output=True, text=True, timeout=600
    )
    assert run.returncode == 0, run.stderr[-3000:]
    out = run.stdout
    assert re.search(r"^Ingested \d+ nodes from .*sample in [\d.]+ s", out, re.M), out
    for name in ("block", "compact/full", "compact/block"):
        assert re.search(rf"^  {re.escape(name)} +TTFT +\d+ ms  .*Thornbury.* \[ok\]$", out, re.M), out
    assert re.search(r"^median TTFT speed-up .*: [\d.]+x$", out, re.M)
