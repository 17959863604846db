"""The shipped adapter's block and blend answers to examples/heldout through both example apps.

    KVRAG_HOME=DIR python docs/results/eighth-stage/heldout.py langchain|llamaindex OUT.jsonl

As the sixth and seventh stages' held-out runs: k = 4, 48 new tokens, passages of at most 200
tokens; LangChain's stuff chain in the chain's own prompt and three other layouts, LlamaIndex's
`compact` with its chat and text QA templates and `KVBlockSynthesizer`. One JSON line per answer
after a settings line; `correct` is the example apps' own check.
"""

import json
import sys
from datetime import date
from pathlib import Path

sys.path.insert(0, "examples")

from common import is_right, load_questions  # noqa: E402
from kvrag import KVEngine  # noqa: E402
from kvrag.eval.layouts import LAYOUTS  # noqa: E402

HELDOUT = Path("examples/heldout")
ENGINE = "KVEngine.shared() (the eighth stage, adapter_scope='block', CPU)"
DEVICE = "CPU, float32, greedy"


def langchain(engine, questions):
    from langchain_kvrag.chains import rag_chain
    from langchain_kvrag.chat_models import ChatKVRag
    from langchain_rag import app_prompt, build_store

    yield {"corpus": str(HELDOUT), "app": "examples/langchain_rag.py's stuff chain (KVRagVectorStore, k=4, passages of at most 200 tokens)",
           "max_tokens": 48, "engine": ENGINE,
           "methods": {"block": "ChatKVRag(mode='block')", "blend": "ChatKVRag(mode='blend'), the default BlendConfig()"},
           "date": date.today().isoformat(), "device": DEVICE}
    retriever = build_store(engine, HELDOUT, 200).as_retriever(search_kwargs={"k": 4})
    models = {m: ChatKVRag(engine=engine, mode=m, max_tokens=48) for m in ("block", "blend")}
    for layout in ("own", "langchain-rag-prompt", "rag-prompt-question-last", "langchain-system-context"):
        stuff = {} if layout == "own" else {"prompt": app_prompt(layout), "document_separator": LAYOUTS[layout].join}
        chains = {m: rag_chain(model, "stuff", return_details=True, **stuff) for m, model in models.items()}
        for n, item in enumerate(questions):
            docs = retriever.invoke(item["question"])
            for m, chain in chains.items():
                result = chain.invoke({"question": item["question"], "input_documents": docs})
                yield {"layout": layout, "n": n, "question": item["question"], "method": m, "output": result["answer"],
                       "correct": is_right(result["answer"], item),
                       "reused_tokens": result["message"].response_metadata["reused_tokens"]}


def llamaindex(engine, questions):
    from llama_index.core import get_response_synthesizer
    from llama_index.core.instrumentation import get_dispatcher
    from llama_index.core.instrumentation.event_handlers import BaseEventHandler
    from llama_index.core.instrumentation.events.llm import LLMChatEndEvent, LLMCompletionEndEvent
    from llama_index.core.prompts.default_prompts import DEFAULT_TEXT_QA_PROMPT
    from llama_index.llms.kvrag import KVBlockSynthesizer, KVRagLLM
    from llamaindex_rag import build_index

    class LastCall(BaseEventHandler):  # the figures of the LLM call a built-in synthesizer made
        stats: dict = {}

        def handle(self, event, **kwargs):
            if isinstance(event, (LLMChatEndEvent, LLMCompletionEndEvent)) and event.response is not None:
                self.stats = event.response.additional_kwargs

    last = LastCall()
    get_dispatcher().add_event_handler(last)
    yield {"corpus": str(HELDOUT), "app": "examples/llamaindex_rag.py's index (SentenceSplitter chunk_size=200, KVPrecompute, Chroma), k=4, RetrieverQueryEngine",
           "max_new_tokens": 48, "engine": ENGINE,
           "methods": {"block": "KVRagLLM(mode='block')", "blend": "KVRagLLM(mode='blend'), the default BlendConfig()"},
           "date": date.today().isoformat(), "device": DEVICE}
    llms = {m: KVRagLLM(engine=engine, mode=m, max_new_tokens=48) for m in ("block", "blend")}
    retriever = build_index(llms["block"], HELDOUT, 200).as_retriever(similarity_top_k=4)
    synthesizers = {(layout, m): get_response_synthesizer(llm=llm, response_mode="compact", **templates)
                    for layout, templates in (("llamaindex-chat-qa", {}), ("llamaindex-text-qa", {"text_qa_template": DEFAULT_TEXT_QA_PROMPT}))
                    for m, llm in llms.items()}
    synthesizers["kv-blocks", "block"] = KVBlockSynthesizer(llms["block"])
    for n, item in enumerate(questions):
        nodes = retriever.retrieve(item["question"])
        for (layout, m), synthesizer in synthesizers.items():
            last.stats = {}
            response = synthesizer.synthesize(item["question"], nodes)
            stats = response.metadata["kvrag"] if layout == "kv-blocks" else last.stats
            yield {"layout": layout, "n": n, "question": item["question"], "method": m, "output": response.response,
                   "correct": is_right(response.response, item), "reused_tokens": stats["reused_tokens"],
                   "sources": [node.node.get_content()[:40] for node in nodes]}


def main(app, out):
    questions = load_questions(HELDOUT / "questions.json")
    with Path(out).open("w", encoding="utf-8") as f:
        for record in {"langchain": langchain, "llamaindex": llamaindex}[app](KVEngine.shared(), questions):
            f.write(json.dumps(record if "layout" in record else {"settings": record}) + "\n")
            f.flush()


if __name__ == "__main__":
    main(*sys.argv[1:])
