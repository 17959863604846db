"""Reuse without an extra step: documents any retriever returns reach every live `ChatKVRag`'s engine.

When the first `ChatKVRag` is created, one callback handler is added to every LangChain run of the
process (`register_configure_hook`); on each retriever's end it tells the engines about the
documents' text (`KVEngine.learn`). The first prompt that holds a document computes and stores its
KV, every later one reuses it: a plain `Chroma(...).as_retriever()` works, not only
`KVRagVectorStore` (which still pays that cost ahead, when documents are added). Documents fetched
without a retriever (`vector_store.similarity_search(...)`) run no callback and are not learned.
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

    def add(self, model: Any) -> None:
        self._models[id(model)] = weakref.ref(model, lambda _, key=id(model): self._models.pop(key, None))

    def engines(self) -> list[Any]:
        models = [m for ref in list(self._models.values()) if (m := ref()) is not None]
        return list({id(m.engine): m.engine for m in models}.values())

    def on_retriever_end(self, documents: list[Document], **kwargs: Any) -> None:
        texts = [d.page_content for d in documents]
        for engine in self.engines():
            engine.learn(texts)


_lock = threading.Lock()
_handler: LearnRetrievedDocuments | None = None
# Its default is the handler once registered, so every run in every thread and task gets it.
_var: ContextVar[LearnRetrievedDocuments | None] | None = None


def register(model: Any) -> None:
    """Let `model`'s engine learn what retrievers return; installs the hook the first time."""
    global _handler, _var
    with _lock:
        if _handler is None:
            _handler = LearnRetrievedDocuments()
            _var = ContextVar("kvrag_learn_retrieved", default=_handler)
            register_configure_hook(_var, inheritable=True)
        _handler.add(model)
