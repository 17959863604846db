"""Reuse without an extra step: retrieved nodes reach every live `KVRagLLM`'s engine by themselves.

One event handler on LlamaIndex's root instrumentation dispatcher, installed when the first
`KVRagLLM` is created, sees every retrieval of the process (`RetrievalEndEvent`) and tells the
engines about the nodes' text (`KVEngine.learn`): the first prompt that holds a node computes and
stores its KV, every later one reuses it. So `VectorStoreIndex.from_documents(...)` then
`as_query_engine(llm=KVRagLLM())` reuses KV from the second query over the same nodes, without
`KVPrecompute` (which stays the way to pay that cost at ingestion instead).

The same handler brackets each synthesis (`SynthesizeStartEvent` / `SynthesizeEndEvent`): the
figures of the last `KVRagLLM` completion inside it go to `Response.metadata["kvrag"]`, for the
built-in synthesizers too (`compact`, `tree_summarize`, ...; not for streaming responses, whose
completion has not run yet when the synthesis ends).
"""

import threading
import weakref
from contextvars import ContextVar
from typing import Any

from llama_index.core.base.response.schema import Response
from llama_index.core.instrumentation import get_dispatcher
from llama_index.core.instrumentation.event_handlers import BaseEventHandler
from llama_index.core.instrumentation.events import BaseEvent
from llama_index.core.instrumentation.events.retrieval import RetrievalEndEvent
from llama_index.core.instrumentation.events.synthesis import SynthesizeEndEvent, SynthesizeStartEvent
from llama_index.core.schema import MetadataMode

# id -> weak reference of each live KVRagLLM (pydantic models are unhashable: no WeakSet); a dropped one stops learning
_llms: dict[int, weakref.ref] = {}
_lock = threading.Lock()
_handler: "KVRagEventHandler | None" = None
# The figures of the synthesis running in this context: a dict shared by reference with the worker
# threads and tasks that the synthesizer's LLM calls run in (they copy the context, not the dict).
_synthesis: ContextVar[dict | None] = ContextVar("kvrag_synthesis", default=None)


class KVRagEventHandler(BaseEventHandler):
    """Feeds retrieved nodes to the engines of live KVRagLLMs and puts figures in responses' metadata."""

    @classmethod
    def class_name(cls) -> str:
        return "KVRagEventHandler"

    def handle(self, event: BaseEvent, **kwargs: Any) -> None:
        if isinstance(event, RetrievalEndEvent):
            learn([n.node.get_content(metadata_mode=MetadataMode.LLM) for n in event.nodes or []])
        elif isinstance(event, SynthesizeStartEvent):
            _synthesis.set({})
        elif isinstance(event, SynthesizeEndEvent):
            state = _synthesis.get()
            _synthesis.set(None)
            if state is None:
                return
            response = event.response
            if state and isinstance(response, Response):
                if response.metadata is None:
                    response.metadata = {}
                response.metadata.setdefault("kvrag", state)


def register(llm: Any) -> None:
    """Let `llm`'s engine learn retrieved nodes; installs the process-wide handler the first time."""
    global _handler
    with _lock:
        _llms[id(llm)] = weakref.ref(llm, lambda _, key=id(llm): _llms.pop(key, None))
        if _handler is None:
            _handler = KVRagEventHandler()
            get_dispatcher().add_event_handler(_handler)


def live_llms() -> list[Any]:
    return [llm for ref in list(_llms.values()) if (llm := ref()) is not None]


def learn(texts: list[str]) -> None:
    """Tell every live KVRagLLM's engine (once each, engines are often shared) about `texts`."""
    engines = {id(llm.engine): llm.engine for llm in live_llms()}
    for engine in engines.values():
        engine.learn(texts)


def observe(stats: dict[str, Any]) -> None:
    """After each completion inside a synthesis: keep its figures (the last one's win)."""
    state = _synthesis.get()
    if state is not None:
        state.clear()
        state.update(stats)
