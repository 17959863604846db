"""Reuse without an extra step: documents any retriever returns reach every live `ChatKVRag`'s engine.

When the first `ChatKVRag` is created, one callback handler is added to every LangChain run of the
process (`register_configure_hook`); on each retriever's end it tells the engines about the
documents' text (`KVEngine.learn`). The first prompt that holds a document computes and stores its
KV, every later one reuses it: a plain `Chroma(...).as_retriever()` works, not only
`KVRagVectorStore` (which still pays that cost ahead, when documents are added).

Documents fetched without a retriever (`vector_store.similarity_search(...)`, as LangChain's current
RAG tutorial does) run no callback, but they reach the prompt as its `context` variable (the name
the hub's rag-prompt, `create_stuff_documents_chain` and the tutorials use): on every run's start, a
`context` input that is a list of documents, or text (cut at its blank lines, where `"\n\n".join`
put the documents together), is learned as well, whatever embeddings found it. Those embedded with
`KVRagEmbeddings` are learned when they are embedded (`learn_documents`), by the engines live then
and by those created later in the process.
"""

import threading
import weakref
from contextvars import ContextVar
from typing import Any

from langchain_core.callbacks import BaseCallbackHandler
from langchain_core.documents import Document
from langchain_core.tracers.context import register_configure_hook


class LearnRetrievedDocuments(BaseCallbackHandler):
    """On retriever end: `engine.learn` the documents' page contents, for each live ChatKVRag's engine."""

    run_inline = True  # cheap, and keeps the learning ahead of the chat model's call

    def __init__(self) -> None:
        # id -> weak reference of each live ChatKVRag (pydantic models are unhashable: no WeakSet)
        self._models: dict[int, weakref.ref] = {}
        self._embedded: list[str] = []  # documents KVRagEmbeddings embedded in this process
        self._taught: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # engine -> how many of them it learned

    def add(self, model: Any) -> None:
        self._models[id(model)] = weakref.ref(model, lambda _, key=id(model): self._models.pop(key, None))
        self._catch_up(model.engine)

    def _catch_up(self, engine: Any) -> None:
        start = self._taught.get(engine, 0)
        if start < len(self._embedded):
            engine.learn(self._embedded[start:])
        self._taught[engine] = len(self._embedded)

    def embedded(self, texts: list[str]) -> None:
        """Documents a vector store embedded: every live engine learns them now, later ones on creation."""
        if len(self._embedded) < _KEEP_EMBEDDED:
            self._embedded.extend(texts[: _KEEP_EMBEDDED - len(self._embedded)])
        for engine in self.engines():
            engine.learn(texts)
            self._taught[engine] = len(self._embedded)

    def engines(self) -> list[Any]:
        models = [m for ref in list(self._models.values()) if (m := ref()) is not None]
        return list({id(m.engine): m.engine for m in models}.values())

    def on_retriever_end(self, documents: list[Document], **kwargs: Any) -> None:
        texts = [d.page_content for d in documents]
        for engine in self.engines():
            engine.learn(texts)

    def on_chain_start(self, serialized: Any, inputs: Any, **kwargs: Any) -> None:
        """A prompt's `context` (or a chain's): the documents it is made of, however they were fetched."""
        context = inputs.get(CONTEXT) if isinstance(inputs, dict) else None
        if isinstance(context, str):
            texts = [part.strip() for part in context.split("\n\n")]
        elif isinstance(context, list):
            texts = [d.page_content for d in context if isinstance(d, Document)]
        else:
            return
        texts = [t for t in texts if t]
        for engine in self.engines() if texts else ():
            engine.learn(texts)


CONTEXT = "context"
"""The prompt variable that holds the retrieved documents in LangChain's RAG prompts and chains."""
_KEEP_EMBEDDED = 200_000  # documents kept for engines created later; beyond, only live engines learn them
_lock = threading.Lock()
_handler = LearnRetrievedDocuments()
# Its default is the handler once registered, so every run in every thread and task gets it.
_var: ContextVar[LearnRetrievedDocuments | None] | None = None


def register(model: Any) -> None:
    """Let `model`'s engine learn what retrievers return; installs the hook the first time."""
    global _var
    with _lock:
        if _var is None:
            _var = ContextVar("kvrag_learn_retrieved", default=_handler)
            register_configure_hook(_var, inheritable=True)
        _handler.add(model)


def learn_documents(texts: list[str]) -> None:
    """Documents a vector store embeds with `KVRagEmbeddings`: learned without a retriever in between."""
    with _lock:
        _handler.embedded([t for t in texts if isinstance(t, str) and t.strip()])
