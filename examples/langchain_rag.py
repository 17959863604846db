"""A LangChain RAG app over a folder of text files, answered with and without kvrag's cached KV.

    python examples/langchain_rag.py                       # kvrag's sample corpus and its questions
    python examples/langchain_rag.py notes/ questions.json --k 4 --max-tokens 64
    python examples/langchain_rag.py --compare kv_blocks,map_reduce,map_rerank

The files are split into passages and stored in a `KVRagVectorStore` (Chroma with offline
embeddings), which prefills every passage once as it is added. For each question the retriever
fetches k passages and the same ordinary `stuff` chain (passages pasted into the prompt) runs
twice: with `ChatKVRag(mode="full")`, which prefills the whole prompt, and with
`ChatKVRag(mode="block")`, which finds the indexed passages inside the prompt, reuses their cached
KV and prefills only the rest. `--compare` adds `kv_blocks` (the passages as explicit `text-plain`
blocks, block mode: the same text, so the same answer as stuff/block) and, on the full-prefill
model, `map_reduce` and `map_rerank`, which make several calls each and are timed end to end.
Everything runs offline.

Questions: a JSON list of strings or of {"question": ..., "answers": [...]} objects, or a text
file with one question per line. Given answers are checked: [ok] when one appears in the reply.
"""

import argparse
import hashlib
import json
import statistics
import time
from importlib import resources
from pathlib import Path

from kvrag import KVEngine
from kvrag.split import read_text, split_passages, text_files
from langchain_kvrag.chains import CHAIN_KINDS, rag_chain
from langchain_kvrag.chat_models import ChatKVRag
from langchain_kvrag.vectorstores import KVRagVectorStore

SAMPLE = Path(str(resources.files("kvrag") / "sample"))
BASELINES = [kind for kind in CHAIN_KINDS if kind != "stuff"]  # kv_blocks, map_reduce, map_rerank


def load_questions(path: Path) -> list[dict]:
    if path.suffix == ".json":
        items = json.loads(path.read_text())
    else:
        items = [line.strip() for line in path.read_text().splitlines() if line.strip()]
    return [{"question": item, "answers": []} if isinstance(item, str) else item for item in items]


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


def one_line(text: str, width: int = 100) -> str:
    text = " ".join(text.split())
    return text if len(text) <= width else text[: width - 3] + "..."


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("folder", nargs="?", type=Path, default=SAMPLE, help="text files (default: kvrag's sample)")
    parser.add_argument("questions", nargs="?", type=Path, help="questions file (default: FOLDER/questions.json)")
    parser.add_argument("--k", type=int, default=3, help="passages retrieved per question")
    parser.add_argument("--max-tokens", type=int, default=48, help="longest answer in tokens")
    parser.add_argument("--passage-tokens", type=int, default=200, help="longest passage in tokens")
    parser.add_argument("--compare", default="", help="also run these chains, comma-separated: " + ",".join(BASELINES))
    args = parser.parse_args(argv)
    compare = [kind for kind in args.compare.split(",") if kind]
    if unknown := set(compare) - set(BASELINES):
        parser.error(f"unknown chain(s) {sorted(unknown)} for --compare; choose from {', '.join(BASELINES)}")
    questions_file = args.questions or args.folder / "questions.json"
    if not questions_file.is_file():
        parser.error(f"no questions file {questions_file}: name one after the folder")
    questions = load_questions(questions_file)

    engine = KVEngine.shared()  # one model for the store and both chat models
    retriever = build_store(engine, args.folder, args.passage_tokens).as_retriever(search_kwargs={"k": args.k})
    models = {mode: ChatKVRag(engine=engine, mode=mode, max_tokens=args.max_tokens) for mode in ("full", "block")}
    chains = {f"stuff/{mode}": rag_chain(llm, "stuff", return_details=True) for mode, llm in models.items()}
    for kind in compare:
        mode = "block" if kind == "kv_blocks" else "full"
        chains[f"{kind}/{mode}"] = rag_chain(models[mode], kind, return_details=True)

    speedups = []
    for item in questions:
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
            answers = [a.lower() for a in item.get("answers", [])]
            mark = "" if not answers else " [ok]" if any(a in result["answer"].lower() for a in answers) else " [?]"
            print(f"  {name:<16} {timing}  {one_line(result['answer'])}{mark}")
        speedups.append(ttft["stuff/full"] / ttft["stuff/block"])
    print(f"\nmedian TTFT speed-up of block over full: {statistics.median(speedups):.1f}x")


if __name__ == "__main__":
    main()
