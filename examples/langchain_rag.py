"""A LangChain RAG app over a folder of text files, answered with and without kvrag's cached KV.

    python examples/langchain_rag.py                       # kvrag's sample corpus and its questions
    python examples/langchain_rag.py notes/ questions.json --k 4 --max-tokens 64
    python examples/langchain_rag.py --compare kv_blocks,map_reduce,map_rerank
    python examples/langchain_rag.py --prompt langchain-rag-prompt --compare blend   # LangChain's rag-prompt
    python examples/langchain_rag.py examples/heldout --compare blend   # hand-written text nothing trains on

The files are split into passages and stored in a `KVRagVectorStore` (Chroma with offline
embeddings), which prefills every passage once as it is added. For each question the retriever
fetches k passages and the same ordinary `stuff` chain (passages pasted into the prompt) runs
twice: with `ChatKVRag(mode="full")`, which prefills the whole prompt, and with
`ChatKVRag(mode="block")`, which finds the indexed passages inside the prompt, reuses their cached
KV and prefills only the rest. `--compare` adds `kv_blocks` (the passages as explicit `text-plain`
blocks, block mode: the same text, so the same answer as stuff/block) and, on the full-prefill
model, `map_reduce` and `map_rerank`, which make several calls each and are timed end to end;
`blend` the stuff chain in blend mode. `--prompt` asks in the prompt of another app instead of the
chain's own (kvrag.eval.layouts: LangChain's `rag-prompt`, which puts the question first, the
`create_retrieval_chain` tutorial's, LlamaIndex's text-QA prompts). Everything runs offline.

Questions: a JSON list of strings or of {"question": ..., "answers": [...], "wrong": [...]} objects,
or a text file with one question per line. Given answers are checked: [ok] when one appears in the
reply before any wrong one (a comparison's other candidate).
"""

import hashlib
import statistics
import time
from pathlib import Path

from kvrag import KVEngine
from kvrag.app.split import read_text, split_passages, text_files
from kvrag.eval.layouts import LAYOUTS
from langchain_core.prompts import ChatPromptTemplate
from langchain_kvrag.chains import CHAIN_KINDS, rag_chain
from langchain_kvrag.chat_models import ChatKVRag
from langchain_kvrag.vectorstores import KVRagVectorStore

from common import answer_line, is_right, parse_args

BASELINES = [kind for kind in CHAIN_KINDS if kind != "stuff"] + ["blend"]  # kv_blocks, map_reduce, map_rerank, blend
PROMPTS = [name for name, layout in LAYOUTS.items() if layout.passage == "{text}"]  # the stuff chain writes passages as is


def app_prompt(name: str) -> ChatPromptTemplate:
    """The messages of another app's prompt layout, with {context} and {question}."""
    layout = LAYOUTS[name]
    return ChatPromptTemplate.from_messages([*([("system", layout.system)] if layout.system else []), ("human", layout.user)])


def build_store(engine: KVEngine, folder: Path, passage_tokens: int) -> KVRagVectorStore:
    """The folder's passages in a Chroma collection of their own; their KV is computed on add."""
    count_tokens = lambda text: len(engine.layout.encode(text))  # noqa: E731
    passages, sources = [], []
    for path in text_files([folder]):
        for passage in split_passages(read_text(path), count_tokens, passage_tokens):
            passages.append(passage)
            sources.append({"source": str(path)})
    # one collection per corpus version, so a rerun adds nothing and stale passages never come back
    version = hashlib.sha256("\x00".join(passages).encode()).hexdigest()[:12]
    store = KVRagVectorStore(engine=engine, collection_name=f"langchain-rag-{version}")
    ids = [hashlib.sha256(p.encode()).hexdigest()[:32] for p in passages]
    start = time.perf_counter()
    store.add_texts(passages, sources, ids=ids)
    elapsed = time.perf_counter() - start
    print(f"Stored {len(passages)} passages from {folder} in {elapsed:.1f} s (KV computed once).")
    return store


def main(argv=None) -> None:
    args = parse_args(
        __doc__.split("\n\n")[0],
        BASELINES,
        argv,
        **{"--passage-tokens": dict(type=int, default=200, help="longest passage in tokens"),
           "--prompt": dict(choices=PROMPTS, help="ask in this app's prompt instead of the stuff chain's own")},
    )

    engine = KVEngine.shared()  # one model for the store and every chat model
    retriever = build_store(engine, args.folder, args.passage_tokens).as_retriever(search_kwargs={"k": args.k})
    models = {mode: ChatKVRag(engine=engine, mode=mode, max_tokens=args.max_tokens) for mode in ("full", "block", "blend")}
    stuff = {"prompt": app_prompt(args.prompt), "document_separator": LAYOUTS[args.prompt].join} if args.prompt else {}
    chains = {f"stuff/{mode}": rag_chain(models[mode], "stuff", return_details=True, **stuff) for mode in ("full", "block")}
    for kind in args.compare:
        if kind == "blend":
            chains["stuff/blend"] = rag_chain(models["blend"], "stuff", return_details=True, **stuff)
        else:
            mode = "block" if kind == "kv_blocks" else "full"
            chains[f"{kind}/{mode}"] = rag_chain(models[mode], kind, return_details=True)

    speedups, right = [], {}
    for item in args.questions:
        docs = retriever.invoke(item["question"])
        print(f"\nQ: {item['question']}")
        ttft = {}
        for name, chain in chains.items():
            start = time.perf_counter()
            result = chain.invoke({"question": item["question"], "input_documents": docs})
            elapsed = time.perf_counter() - start
            if name.startswith(("kv_blocks/", "stuff/")):  # one model call: its time to first token
                ttft[name] = result["message"].response_metadata["ttft"]
                timing = f"TTFT {ttft[name] * 1e3:6.0f} ms"
            else:  # map_reduce, map_rerank: several calls, the whole chain's time is what the user waits
                timing = f"total {elapsed:6.2f} s"
            print(answer_line(name, timing, result["answer"], item))
            if item["answers"]:
                right.setdefault(name, []).append(is_right(result["answer"], item))
        speedups.append(ttft["stuff/full"] / ttft["stuff/block"])
    print(f"\nmedian TTFT speed-up of block over full: {statistics.median(speedups):.1f}x")
    if right:
        print("right answers: " + ", ".join(f"{name} {sum(oks)}/{len(oks)}" for name, oks in right.items()))


if __name__ == "__main__":
    main()
