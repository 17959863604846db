"""The prompt layouts of real RAG apps, for measuring block mode the way users meet it.

kvrag's own layout (system instructions, passages, then the question) is where block attention looks
best. The ecosystems' standard prompts put the question first (LangChain's `rag-prompt`), the
context in the system message (`create_retrieval_chain`'s tutorial prompt), the context between
rulers (LlamaIndex's text-QA templates), or number the passages. Each layout here renders a question
and its passages as chat messages with the ecosystem's own wording; the rendered text goes through
the drop-in path (`KVEngine.generate_text`, passages found in it by content), as the integrations
send it.
"""

from collections.abc import Sequence
from dataclasses import dataclass

_RAG_PROMPT = (  # LangChain hub "rlm/rag-prompt", the template of LangChain's RAG tutorials
    "You are an assistant for question-answering tasks. Use the following pieces of retrieved context to answer "
    "the question. If you don't know the answer, just say that you don't know. Use three sentences maximum and "
    "keep the answer concise.\nQuestion: {question} \nContext: {context} \nAnswer:"
)
_RAG_PROMPT_QUESTION_LAST = _RAG_PROMPT.replace("Question: {question} \nContext: {context}",
                                                "Context: {context} \nQuestion: {question}")
_RETRIEVAL_CHAIN_SYSTEM = (  # the system prompt of LangChain's create_retrieval_chain tutorial
    "You are an assistant for question-answering tasks. Use the following pieces of retrieved context to answer "
    "the question. If you don't know the answer, say that you don't know. Use three sentences maximum and keep the "
    "answer concise.\n\n{context}"
)
_TEXT_QA = (  # llama_index.core.prompts.default_prompts.DEFAULT_TEXT_QA_PROMPT_TMPL
    "Context information is below.\n---------------------\n{context}\n---------------------\n"
    "Given the context information and not prior knowledge, answer the query.\nQuery: {question}\nAnswer: "
)
_TEXT_QA_SYSTEM = (  # llama_index.core.prompts.chat_prompts.TEXT_QA_SYSTEM_PROMPT
    "You are an expert Q&A system that is trusted around the world.\nAlways answer the query using the provided "
    "context information, and not prior knowledge.\nSome rules to follow:\n1. Never directly reference the given "
    "context in your answer.\n2. Avoid statements like 'Based on the context, ...' or 'The context information "
    "...' or anything along those lines."
)


@dataclass(frozen=True)
class Layout:
    """Chat messages around a question and its passages. `system` (None: no system message, the chat
    template's default) and `user` are templates with {context} and {question}; the context is the
    passages, each written as `passage` ({n} counts from 1), joined by `join`."""

    name: str
    user: str
    system: str | None = None
    passage: str = "{text}"
    join: str = "\n\n"
    question_first: bool = False  # the question comes before the passages: block mode's passages cannot see it

    def context(self, passages: Sequence[str]) -> str:
        return self.join.join(self.passage.format(n=n, text=text) for n, text in enumerate(passages, start=1))

    def turns(self, question: str, passages: Sequence[str]) -> list[tuple[str, list[str]]]:
        """(role, parts) pairs for `PromptLayout.render_chat`."""
        fill = {"context": self.context(passages), "question": question}
        turns = [("system", [self.system.format(**fill)])] if self.system is not None else []
        return turns + [("user", [self.user.format(**fill)])]

    def render(self, engine, question: str, passages: Sequence[str]) -> tuple[str, list[tuple[int, int]]]:
        """The prompt text the model reads, as an integration renders these messages, and the
        character spans of the passages in it (which the drop-in path finds by content instead)."""
        text, _ = engine.layout.render_chat(self.turns(question, passages))
        spans, end = [], 0
        for passage in passages:  # in order: `context` joins them so
            start = text.index(passage, end)
            spans.append((start, start + len(passage)))
            end = start + len(passage)
        return text, spans


OWN = "kvrag"
"""kvrag's own layout: `KVEngine.generate(question, passages)`, the engine's `PromptFormat`."""

LAYOUTS: dict[str, Layout] = {layout.name: layout for layout in (
    Layout("langchain-rag-prompt", _RAG_PROMPT, question_first=True),
    Layout("rag-prompt-question-last", _RAG_PROMPT_QUESTION_LAST),  # the same words, re-laid for block attention
    Layout("langchain-system-context", "{question}", system=_RETRIEVAL_CHAIN_SYSTEM),
    Layout("llamaindex-text-qa", _TEXT_QA),
    Layout("llamaindex-chat-qa", _TEXT_QA, system=_TEXT_QA_SYSTEM),
    Layout("numbered", "Sources:\n{context}\n\nQuestion: {question}", passage="[{n}] {text}", join="\n"),
    Layout("separated", "Documents:\n{context}\n\nQuestion: {question}\nAnswer:", join="\n\n---\n\n"),
)}
NAMES = (OWN, *LAYOUTS)


def check_layouts(names: Sequence[str]) -> None:
    unknown = [n for n in names if n not in NAMES]
    if unknown or not names:
        raise ValueError(f"unknown prompt layout(s) {unknown or names}; choose from {', '.join(NAMES)}")
