"""RAG chains to compare: stuff, map-reduce, map-rerank, and cached KV blocks.

Every chain is an LCEL runnable built from langchain-core only and works with any chat model.
Input: ``{"question": str, "input_documents": list[Document]}`` (``"context"`` is accepted in
place of ``"input_documents"``, so retriever output can be passed as is). A chain built with
``retriever=`` retrieves from the question when the input carries no documents; then a plain
question string is a valid input too. Output: the answer string, or with ``return_details=True``
a dict with ``question``, ``documents``, ``answer``, ``message`` (the final ``AIMessage``, whose
``response_metadata`` carries e.g. ChatKVRag's ``ttft``) and, per kind, ``notes`` (map_reduce)
or ``candidates`` and ``score`` (map_rerank).

Kinds:

* ``stuff`` - all passages (``page_content`` joined with ``"\\n\\n"``) then the question, one call.
* ``map_reduce`` - one call per passage (through ``.batch``, so in parallel; limit it with
  ``config={"max_concurrency": n}``) writes notes for the question; one call answers from the notes.
* ``map_rerank`` - one call per passage answers and rates the answer 0-100; the best-rated answer
  wins (ties: the earlier passage). Scores are parsed leniently, see `parse_scored_answer`.
* ``kv_blocks`` - one ``HumanMessage`` whose content is a ``text-plain`` block per passage and a
  ``text`` block with the question (after a ``SystemMessage`` with the instruction). Meant for
  ``ChatKVRag``, which serves every ``text-plain`` block from its cached KV and prefills only the
  question; other chat models may reject ``text-plain`` blocks.

``map_reduce`` and ``map_rerank`` are `kvrag.chains`' baselines as LCEL: the same instructions,
user messages, note filter and reply parsing, so on ``ChatKVRag(mode="full")`` they answer exactly as
the ``kvrag bench accuracy`` runs of ``map_reduce`` / ``map_rerank`` do.

``stuff`` and ``kv_blocks`` send the same text by default (kvrag's instruction as the system
message; the passages, a blank line between each, and the question as the user message). With
``ChatKVRag(mode="full")`` they prefill the same tokens and give the same answer; with
``mode="block"`` ``kv_blocks`` names its passages, while ``stuff`` relies on ChatKVRag finding
the indexed passages inside the text.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass
from typing import Any, Literal

from kvrag import PromptFormat
from kvrag.chains import (
    MAP_NOTES_SYSTEM,
    MAP_RERANK_SYSTEM,
    MAP_USER,
    REDUCE_USER,
    best_answer,
    join_notes,
    parse_scored_answer,
)
from kvrag.chains import ScoredAnswer as BaseScoredAnswer  # extended below with the document and message
from langchain_core.documents import Document
from langchain_core.language_models import BaseLanguageModel
from langchain_core.messages import BaseMessage, HumanMessage, SystemMessage
from langchain_core.messages.content import create_plaintext_block
from langchain_core.output_parsers import StrOutputParser
from langchain_core.prompts import BasePromptTemplate, ChatPromptTemplate
from langchain_core.retrievers import BaseRetriever
from langchain_core.runnables import Runnable, RunnableConfig, RunnableLambda, RunnablePassthrough

__all__ = [
    "CHAIN_KINDS",
    "MAP_PROMPT",
    "MAP_RERANK_PROMPT",
    "REDUCE_PROMPT",
    "STUFF_PROMPT",
    "SYSTEM",
    "ChainKind",
    "ScoredAnswer",
    "best_answer",
    "format_documents",
    "kv_blocks_chain",
    "kv_blocks_message",
    "map_reduce_chain",
    "map_rerank_chain",
    "parse_scored_answer",
    "rag_chain",
    "stuff_chain",
]

ChainKind = Literal["stuff", "map_reduce", "map_rerank", "kv_blocks"]
CHAIN_KINDS: tuple[str, ...] = ("stuff", "map_reduce", "map_rerank", "kv_blocks")

SYSTEM = PromptFormat().system
"""kvrag's instruction (what its engine puts in the system turn): the default system message of
``stuff``, ``kv_blocks`` and the reduce step. Without one, SmolLM2's chat template inserts its own
generic system prompt and the default model answers noticeably worse."""

STUFF_PROMPT = ChatPromptTemplate.from_messages([("system", SYSTEM), ("human", "{context}\n\n{question}")])
"""Variables: ``context`` (the passages joined), ``question``."""

MAP_PROMPT = ChatPromptTemplate.from_messages([("system", MAP_NOTES_SYSTEM), ("human", MAP_USER)])
"""Variables: ``passage`` (one passage), ``question``."""

REDUCE_PROMPT = ChatPromptTemplate.from_messages([("system", SYSTEM), ("human", REDUCE_USER)])
"""Variables: ``notes`` (the map step's notes joined like passages), ``question``."""

MAP_RERANK_PROMPT = ChatPromptTemplate.from_messages([("system", MAP_RERANK_SYSTEM), ("human", MAP_USER)])
"""Variables: ``passage`` (one passage), ``question``. The reply should end with ``Score: N``."""


# ---- inputs ---------------------------------------------------------------------------------------


def _as_documents(value: Any, key: str) -> list[Document]:
    if isinstance(value, (str, Document)):
        value = [value]
    if not isinstance(value, Sequence):
        raise TypeError(f"{key!r} must be a list of Documents, got {type(value).__name__}")
    docs = []
    for i, item in enumerate(value):
        if isinstance(item, Document):
            docs.append(item)
        elif isinstance(item, str):
            docs.append(Document(page_content=item))
        else:
            raise TypeError(f"{key!r}[{i}] must be a Document or str, got {type(item).__name__}")
    return docs


def _read_inputs(inputs: Any, has_retriever: bool) -> tuple[str, list[Document] | None]:
    """The question and the given documents (None: retrieve them)."""
    if isinstance(inputs, str) and has_retriever:
        question, docs, key = inputs, None, ""
    elif isinstance(inputs, Mapping):
        if "question" not in inputs:
            raise ValueError(
                f"the chain's input needs a 'question' key (got keys: {sorted(map(str, inputs))}); "
                "pass {'question': ..., 'input_documents': [...]}"
            )
        question = inputs["question"]
        key = next((k for k in ("input_documents", "context") if inputs.get(k) is not None), "")
        docs = inputs[key] if key else None
    else:
        raise TypeError(
            "the chain's input must be a dict {'question': ..., 'input_documents': [...]}"
            + (" or a question string" if has_retriever else "")
            + f", got {type(inputs).__name__}"
        )
    if not isinstance(question, str):
        raise TypeError(f"'question' must be a str, got {type(question).__name__}")
    if not question.strip():
        raise ValueError("'question' is empty")
    if docs is None:
        if not has_retriever:
            raise ValueError(
                "the chain's input needs the passages under 'input_documents' (or 'context'), "
                "or build the chain with retriever=... to retrieve them from the question"
            )
        return question, None
    return question, _check_found(_as_documents(docs, key), key)


def _check_found(docs: list[Document], where: str) -> list[Document]:
    if not docs:
        raise ValueError(f"no documents to answer from ({where} is empty)")
    return docs


def _prepare(retriever: BaseRetriever | Runnable | None) -> Runnable:
    """Input -> {"question": str, "documents": list[Document]}, retrieving when needed."""

    def prepare(inputs: Any, config: RunnableConfig) -> dict:
        question, docs = _read_inputs(inputs, retriever is not None)
        if docs is None:
            found = retriever.invoke(question, config)
            docs = _check_found(_as_documents(found, "retriever"), "the retriever's result")
        return {"question": question, "documents": docs}

    async def aprepare(inputs: Any, config: RunnableConfig) -> dict:
        question, docs = _read_inputs(inputs, retriever is not None)
        if docs is None:
            found = await retriever.ainvoke(question, config)
            docs = _check_found(_as_documents(found, "retriever"), "the retriever's result")
        return {"question": question, "documents": docs}

    return RunnableLambda(prepare, afunc=aprepare, name="prepare_inputs")


def _text(message: Any) -> str:
    """Text of a chat model's message (or an LLM's string)."""
    return message if isinstance(message, str) else message.text


def _finish(return_details: bool) -> Runnable:
    def finish(state: dict) -> Any:
        if "answer" not in state:
            state = {**state, "answer": _text(state["message"]).strip()}
        return state if return_details else state["answer"]

    return RunnableLambda(finish, name="answer")


def format_documents(docs: Sequence[Document], separator: str = "\n\n") -> str:
    """The passages as the model sees them in ``stuff``: each ``page_content``, joined."""
    return separator.join(doc.page_content for doc in docs)


def _per_document(state: dict) -> list[dict]:
    return [{"passage": doc.page_content, "question": state["question"]} for doc in state["documents"]]


# ---- stuff ----------------------------------------------------------------------------------------


def stuff_chain(
    llm: BaseLanguageModel,
    *,
    retriever: BaseRetriever | Runnable | None = None,
    prompt: BasePromptTemplate | None = None,
    document_separator: str = "\n\n",
    return_details: bool = False,
) -> Runnable:
    """All passages in one prompt (the "stuff" / full-prefill baseline). ``prompt`` gets ``context``
    and ``question``."""
    prompt = prompt or STUFF_PROMPT
    answer = (
        RunnableLambda(
            lambda s: {"context": format_documents(s["documents"], document_separator), "question": s["question"]},
            name="stuff_documents",
        )
        | prompt
        | llm
    )
    chain = _prepare(retriever) | RunnablePassthrough.assign(message=answer) | _finish(return_details)
    return chain.with_config(run_name="stuff")


# ---- map-reduce -----------------------------------------------------------------------------------

def _notes(state: dict) -> dict:
    return {"notes": join_notes(state["notes"]), "question": state["question"]}


def map_reduce_chain(
    llm: BaseLanguageModel,
    *,
    retriever: BaseRetriever | Runnable | None = None,
    map_prompt: BasePromptTemplate | None = None,
    reduce_prompt: BasePromptTemplate | None = None,
    return_details: bool = False,
) -> Runnable:
    """Notes per passage (one call each, batched), then an answer from the notes.

    ``map_prompt`` gets ``passage`` and ``question``; ``reduce_prompt`` gets ``notes`` (the non-empty
    notes joined with blank lines; "nothing relevant" notes are dropped) and ``question``.
    """
    map_step = (map_prompt or MAP_PROMPT) | llm | StrOutputParser()
    notes = RunnableLambda(_per_document, name="per_document") | map_step.map()
    reduce = RunnableLambda(_notes, name="join_notes") | (reduce_prompt or REDUCE_PROMPT) | llm
    chain = (
        _prepare(retriever)
        | RunnablePassthrough.assign(notes=notes)
        | RunnablePassthrough.assign(message=reduce)
        | _finish(return_details)
    )
    return chain.with_config(run_name="map_reduce")


# ---- map-rerank -----------------------------------------------------------------------------------


@dataclass(frozen=True)
class ScoredAnswer(BaseScoredAnswer):
    """One passage's answer in map_rerank, with the document it came from and the model's message."""

    document: Document | None = None
    message: BaseMessage | None = None


def _rerank(state: dict) -> dict:
    candidates = []
    for doc, reply in zip(state["documents"], state["replies"]):
        message = reply if isinstance(reply, BaseMessage) else None  # an LLM (not chat model) replies with str
        candidates.append(ScoredAnswer(**asdict(parse_scored_answer(_text(reply))), document=doc, message=message))
    best = best_answer(candidates)
    return {
        "question": state["question"],
        "documents": state["documents"],
        "answer": best.answer,
        "score": best.score,
        "message": best.message,
        "candidates": candidates,
    }


def map_rerank_chain(
    llm: BaseLanguageModel,
    *,
    retriever: BaseRetriever | Runnable | None = None,
    prompt: BasePromptTemplate | None = None,
    return_details: bool = False,
) -> Runnable:
    """An answer and a 0-100 score per passage (one call each, batched); the best-scored answer wins.

    ``prompt`` gets ``passage`` and ``question``. With ``return_details=True`` the output also holds
    ``candidates`` (a `ScoredAnswer` per passage, in document order, with its document and message)
    and ``score`` (the winner's).
    """
    replies = RunnableLambda(_per_document, name="per_document") | ((prompt or MAP_RERANK_PROMPT) | llm).map()
    chain = (
        _prepare(retriever)
        | RunnablePassthrough.assign(replies=replies)
        | RunnableLambda(_rerank, name="rerank")
        | _finish(return_details)
    )
    return chain.with_config(run_name="map_rerank")


# ---- kv blocks ------------------------------------------------------------------------------------


def kv_blocks_message(documents: Sequence[Document], question: str) -> HumanMessage:
    """One user message: a ``text-plain`` block per passage, then the question as a ``text`` block."""
    content: list = [create_plaintext_block(text=doc.page_content) for doc in documents]
    content.append({"type": "text", "text": question})
    return HumanMessage(content=content)


def kv_blocks_chain(
    llm: BaseLanguageModel,
    *,
    retriever: BaseRetriever | Runnable | None = None,
    system: str | None = SYSTEM,
    return_details: bool = False,
) -> Runnable:
    """The passages as explicit blocks (see `kv_blocks_message`), for ``ChatKVRag``: each ``text-plain``
    block is served from its cached KV and only the question is prefilled. Other chat models may not
    accept ``text-plain`` content blocks.

    ``system``: a ``SystemMessage`` sent before the user message (default: kvrag's instruction, the
    same as ``stuff``'s); None sends the user message alone.
    """
    head = [SystemMessage(content=system)] if system else []
    messages = RunnableLambda(lambda s: [*head, kv_blocks_message(s["documents"], s["question"])], name="kv_blocks")
    chain = _prepare(retriever) | RunnablePassthrough.assign(message=messages | llm) | _finish(return_details)
    return chain.with_config(run_name="kv_blocks")


# ---- one entry point ------------------------------------------------------------------------------

_BUILDERS = {
    "stuff": stuff_chain,
    "map_reduce": map_reduce_chain,
    "map_rerank": map_rerank_chain,
    "kv_blocks": kv_blocks_chain,
}


def rag_chain(
    llm: BaseLanguageModel,
    kind: ChainKind = "stuff",
    *,
    retriever: BaseRetriever | Runnable | None = None,
    return_details: bool = False,
    **prompts: Any,
) -> Runnable:
    """The chain of the given kind over ``llm``: ``stuff``, ``map_reduce``, ``map_rerank`` or ``kv_blocks``.

    ``prompts`` go to the builder: ``prompt`` (stuff, map_rerank), ``map_prompt`` and ``reduce_prompt``
    (map_reduce), ``document_separator`` (stuff), ``system`` (kv_blocks).
    """
    if kind not in _BUILDERS:
        raise ValueError(f"kind must be one of {CHAIN_KINDS}, got {kind!r}")
    return _BUILDERS[kind](llm, retriever=retriever, return_details=return_details, **prompts)
