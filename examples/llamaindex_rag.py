"""A LlamaIndex query engine over a folder of text files, answered with kvrag's block synthesizer and with `compact`.

    python examples/llamaindex_rag.py                      # kvrag's sample corpus and its questions
    python examples/llamaindex_rag.py notes/ questions.json --k 4 --max-tokens 64
    python examples/llamaindex_rag.py --compare tree_summarize,map_rerank

`SimpleDirectoryReader` loads the folder; an `IngestionPipeline` splits it into nodes, computes
every node's KV once (`KVPrecompute`) and embeds them into a persistent Chroma collection. For
each question a `RetrieverQueryEngine` retrieves k nodes and answers, streaming, with:

* `block`: `KVBlockSynthesizer` - the nodes go to the model as separate cached KV blocks, only the
  question is prefilled;
* `compact/full`: LlamaIndex's built-in `compact` synthesizer on `KVRagLLM(mode="full")`, which
  prefills the whole prompt (the usual way);
* `compact/block`: the same `compact` synthesizer on `KVRagLLM(mode="block")`, which finds the
  indexed nodes inside the prompt and reuses their KV (drop-in: the app's prompt is unchanged).

TTFT is measured from `query()` to the first streamed token, retrieval included. `--compare` adds
more synthesizers on the full-prefill model (`simple_summarize`, `tree_summarize`, `refine`,
`map_rerank`), timed end to end. Everything runs offline.

Questions: a JSON list of strings or of {"question": ..., "answers": [...]} objects, or a text
file with one question per line. Given answers are checked: [ok] when one appears in the reply.
"""

import hashlib
import statistics
import time
from pathlib import Path

from kvrag import KVEngine
from llama_index.core import SimpleDirectoryReader, VectorStoreIndex, get_response_synthesizer
from llama_index.core.ingestion import IngestionPipeline
from llama_index.core.node_parser import SentenceSplitter
from llama_index.core.query_engine import RetrieverQueryEngine

from llama_index.llms.kvrag import (
    KVBlockSynthesizer,
    KVPrecompute,
    KVRagLLM,
    MapRerankSynthesizer,
    default_embed_model,
    default_vector_store,
)

from common import answer_line, parse_args

BASELINES = ["simple_summarize", "tree_summarize", "refine", "map_rerank"]


def build_index(llm: KVRagLLM, folder: Path, chunk_size: int) -> VectorStoreIndex:
    """The folder's nodes in a Chroma collection of their own; their KV is computed as they are ingested."""
    documents = SimpleDirectoryReader(str(folder), required_exts=[".txt", ".md"], recursive=True).load_data()
    for document in documents:  # keep the file name in what the model reads, not the volatile dates and sizes
        document.excluded_llm_metadata_keys = [k for k in document.metadata if k != "file_name"]
        document.excluded_embed_metadata_keys = list(document.metadata)
    # one collection per corpus version, so a rerun adds nothing and stale nodes never come back
    version = hashlib.sha256("\x00".join(d.text for d in documents).encode()).hexdigest()[:12]
    embed_model = default_embed_model()
    store = default_vector_store(collection_name=f"llamaindex-rag-{version}-{chunk_size}")
    if store.client.count() == 0:
        pipeline = IngestionPipeline(
            transformations=[SentenceSplitter(chunk_size=chunk_size, chunk_overlap=0), KVPrecompute(llm=llm), embed_model],
            vector_store=store,
        )
        start = time.perf_counter()
        nodes = pipeline.run(documents=documents)
        print(f"Ingested {len(nodes)} nodes from {folder} in {time.perf_counter() - start:.1f} s (KV computed once).")
    else:
        print(f"Reusing the {store.client.count()} nodes already ingested from {folder}.")
    return VectorStoreIndex.from_vector_store(store, embed_model=embed_model)


def first_token(query_engine: RetrieverQueryEngine, question: str) -> tuple[float, str]:
    """Seconds from `query` to the first streamed token, and the whole answer."""
    start = time.perf_counter()
    response = query_engine.query(question)
    ttft, text = None, ""
    for delta in response.response_gen:
        if ttft is None and delta.strip():
            ttft = time.perf_counter() - start
        text += delta
    return ttft if ttft is not None else time.perf_counter() - start, text


def main(argv=None) -> None:
    args = parse_args(
        __doc__.split("\n\n")[0],
        BASELINES,
        argv,
        **{"--chunk-size": dict(type=int, default=200, help="node size for SentenceSplitter (in its own tokens)")},
    )

    engine = KVEngine.shared()  # one model for ingestion and every synthesizer
    llms = {mode: KVRagLLM(engine=engine, mode=mode, max_new_tokens=args.max_tokens) for mode in ("full", "block")}
    retriever = build_index(llms["block"], args.folder, args.chunk_size).as_retriever(similarity_top_k=args.k)
    synthesizers = {
        "block": KVBlockSynthesizer(llms["block"], streaming=True),
        "compact/full": get_response_synthesizer(llm=llms["full"], response_mode="compact", streaming=True),
        "compact/block": get_response_synthesizer(llm=llms["block"], response_mode="compact", streaming=True),
    }
    for name in args.compare:
        synthesizers[f"{name}/full"] = (
            MapRerankSynthesizer(llms["full"], streaming=True)
            if name == "map_rerank"
            else get_response_synthesizer(llm=llms["full"], response_mode=name, streaming=True)
        )
    engines = {name: RetrieverQueryEngine(retriever, response_synthesizer=s) for name, s in synthesizers.items()}

    speedups = []
    for item in args.questions:
        print(f"\nQ: {item['question']}")
        ttft = {}
        for name, query_engine in engines.items():
            start = time.perf_counter()
            ttft[name], answer = first_token(query_engine, item["question"])
            if name in ("block", "compact/full", "compact/block"):  # one model call: its time to first token
                timing = f"TTFT {ttft[name] * 1e3:6.0f} ms"
            else:  # several calls, or an answer that streams only once complete: the whole wait
                timing = f"total {time.perf_counter() - start:6.2f} s"
            print(answer_line(name, timing, answer, item))
        speedups.append(ttft["compact/full"] / ttft["block"])
    print(f"\nmedian TTFT speed-up of the block synthesizer over compact with full prefill: {statistics.median(speedups):.1f}x")


if __name__ == "__main__":
    main()
