"""kvrag's figures of every ChatKVRag call inside a block, without writing a callback.

`create_retrieval_chain` and an output parser return text only, so the reply's `response_metadata`
(TTFT, reused and prefilled tokens) is out of reach at the end of a chain. As `get_openai_callback`
does for OpenAI's usage, a context manager collects it from every call made inside it, in any thread or
task the chain runs in:

    with kvrag_figures() as figures:
        answer = chain.invoke({"input": question})
    print(figures.ttft, figures.reused_tokens, figures.prefilled_tokens)
"""

import threading
from collections.abc import Iterator
from contextlib import contextmanager
from contextvars import ContextVar
from typing import Any

from langchain_core.callbacks import BaseCallbackHandler
from langchain_core.outputs import LLMResult
from langchain_core.tracers.context import register_configure_hook


class KVRagFigures(BaseCallbackHandler):
    """Sums of the ChatKVRag calls seen (`calls`, `prefilled_tokens`, `reused_tokens`, `total_time`) and the
    figures of the last one (`ttft`, `mode`, `last`: its whole `response_metadata`)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.calls = self.prefilled_tokens = self.reused_tokens = 0
        self.total_time = 0.0
        self.ttft: float | None = None
        self.mode: str | None = None
        self.last: dict[str, Any] = {}

    def on_llm_end(self, response: LLMResult, **kwargs: Any) -> None:
        for generations in response.generations:
            for generation in generations:
                metadata = getattr(getattr(generation, "message", None), "response_metadata", None) or {}
                if metadata.get("model_provider") == "kvrag":
                    self._add(metadata)

    def _add(self, metadata: dict[str, Any]) -> None:
        with self._lock:
            self.calls += 1
            self.prefilled_tokens += metadata["prefilled_tokens"]
            self.reused_tokens += metadata["reused_tokens"]
            self.total_time += metadata["total_time"]
            self.ttft, self.mode, self.last = metadata["ttft"], metadata["mode"], dict(metadata)

    def __repr__(self) -> str:
        ttft = "-" if self.ttft is None else f"{self.ttft * 1e3:.0f} ms"
        return (f"KVRagFigures(calls={self.calls}, last TTFT {ttft}, prefilled {self.prefilled_tokens}, "
                f"reused {self.reused_tokens} tokens)")


_var: ContextVar[KVRagFigures | None] = ContextVar("kvrag_figures", default=None)
register_configure_hook(_var, inheritable=True)


@contextmanager
def kvrag_figures() -> Iterator[KVRagFigures]:
    """A `KVRagFigures` that every ChatKVRag call inside the `with` block adds to."""
    figures = KVRagFigures()
    token = _var.set(figures)
    try:
        yield figures
    finally:
        _var.reset(token)
