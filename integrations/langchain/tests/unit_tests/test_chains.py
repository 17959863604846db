"""The comparison chains with fake chat models: what each kind sends, how it picks, its input errors."""

import asyncio
import threading
from collections.abc import Callable

import pytest
from langchain_core.callbacks import CallbackManagerForRetrieverRun
from langchain_core.documents import Document
from langchain_core.language_models import BaseChatModel
from langchain_core.language_models.fake_chat_models import GenericFakeChatModel
from langchain_core.messages import AIMessage, BaseMessage, HumanMessage, SystemMessage
from langchain_core.outputs import ChatGeneration, ChatResult
from langchain_core.prompts import ChatPromptTemplate
from langchain_core.retrievers import BaseRetriever
from langchain_kvrag.chains import (
    CHAIN_KINDS,
    SYSTEM,
    format_documents,
    kv_blocks_chain,
    kv_blocks_message,
    map_reduce_chain,
    map_rerank_chain,
    rag_chain,
    stuff_chain,
)

DOCS = [
    Document(page_content="The Velloran Academy was founded in 1742.", metadata={"n": 0}),
    Document(page_content="The national dish of Orvanne is kellan stew.", metadata={"n": 1}),
    Document(page_content="The Glimmerhook Lighthouse was built in 1873.", metadata={"n": 2}),
]
QUESTION = "What is the national dish of Orvanne?"


class RecordingChat(BaseChatModel):
    """Answers with `respond(messages)` and records every call's messages (thread-safe: batch uses threads)."""

    respond: Callable[[list[BaseMessage]], str] = lambda messages: "an answer"
    calls: list = []
    lock: object = None

    def model_post_init(self, context):
        self.calls = []
        self.lock = threading.Lock()

    @property
    def _llm_type(self) -> str:
        return "recording-fake"

    def _generate(self, messages, stop=None, run_manager=None, **kwargs):
        with self.lock:
            self.calls.append(list(messages))
        reply = AIMessage(content=self.respond(messages), response_metadata={"ttft": 0.25, "mode": "fake"})
        return ChatResult(generations=[ChatGeneration(message=reply)])


class ListRetriever(BaseRetriever):
    docs: list[Document]
    queries: list = []

    def _get_relevant_documents(self, query: str, *, run_manager: CallbackManagerForRetrieverRun) -> list[Document]:
        self.queries.append(query)
        return list(self.docs)


def user_text(messages: list[BaseMessage]) -> str:
    """The text of the (last) human message."""
    return [m for m in messages if isinstance(m, HumanMessage)][-1].text


def passage_of(messages) -> Document:
    """The one DOCS passage in a per-passage call."""
    found = [d for d in DOCS if d.page_content in user_text(messages)]
    assert len(found) == 1, user_text(messages)
    return found[0]


# ---- stuff ------------------------------------------------------------------------------------------


def test_stuff_sends_all_passages_then_question_in_one_call():
    llm = RecordingChat(respond=lambda m: "  Kellan stew.  ")
    answer = stuff_chain(llm).invoke({"input_documents": DOCS, "question": QUESTION})
    assert answer == "Kellan stew."
    assert len(llm.calls) == 1
    text = user_text(llm.calls[0])
    context = "\n\n".join(d.page_content for d in DOCS)
    assert context == format_documents(DOCS)
    assert text.startswith(context)
    assert text.endswith(QUESTION)
    assert text.index(DOCS[2].page_content) < text.index(QUESTION)


def test_stuff_accepts_context_key_custom_prompt_and_generic_fake_model():
    llm = GenericFakeChatModel(messages=iter(["kellan stew"]))
    assert stuff_chain(llm).invoke({"context": DOCS, "question": QUESTION}) == "kellan stew"

    recorder = RecordingChat()
    prompt = ChatPromptTemplate.from_messages([("human", "DOCS<{context}> Q<{question}>")])
    stuff_chain(recorder, prompt=prompt, document_separator=" | ").invoke({"context": DOCS[:2], "question": "q?"})
    assert recorder.calls[0][0].text == f"DOCS<{DOCS[0].page_content} | {DOCS[1].page_content}> Q<q?>"


def test_documents_may_be_strings():
    llm = RecordingChat()
    stuff_chain(llm).invoke({"input_documents": ["first passage", "second passage"], "question": "q?"})
    assert user_text(llm.calls[0]).startswith("first passage\n\nsecond passage\n\n")


# ---- map-reduce ---------------------------------------------------------------------------------------


def map_reduce_model():
    def respond(messages):
        text = user_text(messages)
        if "NOTE[" in text:  # reduce
            return "Final: kellan stew"
        return f"NOTE[{passage_of(messages).metadata['n']}]"

    return RecordingChat(respond=respond)


def test_map_reduce_maps_once_per_passage_then_reduces_the_notes():
    llm = map_reduce_model()
    result = map_reduce_chain(llm, return_details=True).invoke({"input_documents": DOCS, "question": QUESTION})
    assert result["answer"] == "Final: kellan stew"
    assert len(llm.calls) == len(DOCS) + 1
    maps, reduce = llm.calls[:-1], llm.calls[-1]
    assert sorted(passage_of(m).metadata["n"] for m in maps) == [0, 1, 2]  # each passage mapped exactly once
    assert all(user_text(m).endswith(QUESTION) for m in maps)
    reduce_text = user_text(reduce)
    assert all(f"NOTE[{i}]" in reduce_text for i in range(3))
    assert not any(d.page_content in reduce_text for d in DOCS)  # the reduce step sees notes, not passages
    assert reduce_text.endswith(QUESTION)
    assert result["notes"] == ["NOTE[0]", "NOTE[1]", "NOTE[2]"]  # in document order
    assert result["message"].response_metadata["ttft"] == 0.25


def test_map_reduce_runs_the_map_calls_in_parallel():
    barrier = threading.Barrier(len(DOCS), timeout=10)

    def respond(messages):
        if "NOTE" in user_text(messages):
            return "done"
        barrier.wait()  # only passes when all map calls are in flight at once
        return "NOTE"

    llm = RecordingChat(respond=respond)
    assert map_reduce_chain(llm).invoke({"input_documents": DOCS, "question": QUESTION}) == "done"


def test_map_reduce_drops_empty_and_nothing_relevant_notes():
    def respond(messages):
        text = user_text(messages)
        if "Question:" in text and "useful" in text:
            return "answer"
        n = passage_of(messages).metadata["n"]
        return {0: "Nothing relevant.", 1: "a useful note", 2: "   "}[n]

    llm = RecordingChat(respond=respond)
    prompt = ChatPromptTemplate.from_messages([("human", "{notes}\n\nQuestion: {question}")])
    map_reduce_chain(llm, reduce_prompt=prompt).invoke({"input_documents": DOCS, "question": QUESTION})
    assert user_text(llm.calls[-1]) == f"a useful note\n\nQuestion: {QUESTION}"


# ---- map-rerank ---------------------------------------------------------------------------------------


def rerank_model(replies: dict[int, str]):
    return RecordingChat(respond=lambda messages: replies[passage_of(messages).metadata["n"]])


def test_map_rerank_keeps_the_highest_score():
    llm = rerank_model({0: "1742.\nScore: 20", 1: "Answer: Kellan stew.\nScore: 95", 2: "1873 (confidence 0.5)"})
    chain = map_rerank_chain(llm)
    assert chain.invoke({"input_documents": DOCS, "question": QUESTION}) == "Kellan stew."
    assert len(llm.calls) == len(DOCS)
    for messages in llm.calls:
        assert user_text(messages).endswith(QUESTION)
        assert "Score" in messages[0].text  # the system instruction asks for the score format


def test_map_rerank_details_expose_scored_candidates_in_document_order():
    llm = rerank_model({0: "Score: 10\nno idea", 1: "kellan stew score=80/100", 2: "lighthouse"})
    result = map_rerank_chain(llm, return_details=True).invoke({"context": DOCS, "question": QUESTION})
    assert [c.score for c in result["candidates"]] == [10.0, 80.0, None]
    assert [c.answer for c in result["candidates"]] == ["no idea", "kellan stew", "lighthouse"]
    assert [c.document.metadata["n"] for c in result["candidates"]] == [0, 1, 2]
    assert result["answer"] == "kellan stew" and result["score"] == 80.0
    assert result["message"].content == "kellan stew score=80/100"
    assert result["documents"] == DOCS and result["question"] == QUESTION


def test_map_rerank_ties_go_to_the_earlier_passage_and_missing_scores_rank_lowest():
    llm = rerank_model({0: "no score at all", 1: "first. Score: 50", 2: "second. Score: 50"})
    assert map_rerank_chain(llm).invoke({"input_documents": DOCS, "question": QUESTION}) == "first."
    llm = rerank_model({0: "unscored", 1: "zero. Score: 0", 2: "also unscored"})
    assert map_rerank_chain(llm).invoke({"input_documents": DOCS, "question": QUESTION}) == "zero."
    llm = rerank_model({0: "a", 1: "b", 2: "c"})  # nothing scored: the first passage's answer
    assert map_rerank_chain(llm).invoke({"input_documents": DOCS, "question": QUESTION}) == "a"


# ---- kv blocks ----------------------------------------------------------------------------------------


def test_kv_blocks_sends_one_message_with_text_plain_blocks_then_the_question():
    llm = RecordingChat(respond=lambda m: "kellan stew")
    result = kv_blocks_chain(llm, return_details=True).invoke({"input_documents": DOCS, "question": QUESTION})
    assert result["answer"] == "kellan stew"
    assert result["message"].response_metadata["ttft"] == 0.25
    (messages,) = llm.calls
    assert [type(m) for m in messages] == [SystemMessage, HumanMessage]
    assert messages[0].content == SYSTEM
    content = messages[1].content
    assert [b["type"] for b in content] == ["text-plain"] * len(DOCS) + ["text"]
    assert [b["text"] for b in content] == [d.page_content for d in DOCS] + [QUESTION]
    assert all(b["mime_type"] == "text/plain" for b in content[:-1])


def test_kv_blocks_without_system_message_sends_the_user_message_alone():
    llm = RecordingChat()
    kv_blocks_chain(llm, system=None).invoke({"input_documents": DOCS[:2], "question": QUESTION})
    (messages,) = llm.calls
    assert len(messages) == 1 and [b["type"] for b in messages[0].content] == ["text-plain", "text-plain", "text"]


def test_stuff_sends_the_kv_blocks_text_flattened():
    """Same system message, and the user text is the blocks joined the way ChatKVRag joins them."""
    stuff, blocks = RecordingChat(), RecordingChat()
    stuff_chain(stuff).invoke({"input_documents": DOCS, "question": QUESTION})
    kv_blocks_chain(blocks).invoke({"input_documents": DOCS, "question": QUESTION})
    (stuff_messages,), (block_messages,) = stuff.calls, blocks.calls
    assert stuff_messages[0] == block_messages[0]
    assert stuff_messages[1].content == "\n\n".join(b["text"] for b in block_messages[1].content)


def test_kv_blocks_message():
    message = kv_blocks_message(DOCS[:1], "q?")
    assert message.content[0]["type"] == "text-plain" and message.content[0]["text"] == DOCS[0].page_content
    assert message.content[1] == {"type": "text", "text": "q?"}


# ---- retriever, entry point, async --------------------------------------------------------------------


@pytest.mark.parametrize("kind", CHAIN_KINDS)
def test_every_kind_retrieves_from_the_question_when_built_with_a_retriever(kind):
    retriever = ListRetriever(docs=DOCS[1:2])
    llm = RecordingChat(respond=lambda m: "kellan stew\nScore: 90")
    chain = rag_chain(llm, kind, retriever=retriever)
    assert chain.invoke(QUESTION).startswith("kellan stew")
    assert chain.invoke({"question": QUESTION}).startswith("kellan stew")
    assert retriever.queries == [QUESTION, QUESTION]
    assert any(DOCS[1].page_content in str(m[-1].content) for m in llm.calls)
    # documents in the input win over the retriever
    llm.calls.clear()
    chain.invoke({"question": QUESTION, "input_documents": DOCS[2:]})
    assert retriever.queries == [QUESTION, QUESTION]
    assert any(DOCS[2].page_content in str(m[-1].content) for m in llm.calls)
    assert not any(DOCS[1].page_content in str(m[-1].content) for m in llm.calls)


def test_retriever_may_be_any_runnable_and_async_works():
    from langchain_core.runnables import RunnableLambda

    seen = []
    retriever = RunnableLambda(lambda q: seen.append(q) or DOCS[:2])
    llm = RecordingChat(respond=lambda m: "ok")
    chain = rag_chain(llm, "stuff", retriever=retriever)
    assert asyncio.run(chain.ainvoke(QUESTION)) == "ok"
    assert asyncio.run(rag_chain(llm, "map_reduce").ainvoke({"input_documents": DOCS, "question": QUESTION})) == "ok"
    assert seen == [QUESTION]
    assert chain.batch([QUESTION, "Another?"]) == ["ok", "ok"]


@pytest.mark.parametrize("kind", CHAIN_KINDS)
def test_rag_chain_builds_every_kind(kind):
    llm = RecordingChat(respond=lambda m: "kellan stew\nScore: 90")
    result = rag_chain(llm, kind, return_details=True).invoke({"input_documents": DOCS, "question": QUESTION})
    assert result["answer"] == "kellan stew" if kind == "map_rerank" else result["answer"].startswith("kellan stew")
    assert isinstance(result["message"], AIMessage)
    calls = {"stuff": 1, "kv_blocks": 1, "map_reduce": len(DOCS) + 1, "map_rerank": len(DOCS)}[kind]
    assert len(llm.calls) == calls


def test_prompts_reach_the_builders():
    llm = RecordingChat(respond=lambda m: "x")
    prompt = ChatPromptTemplate.from_messages([("human", "MAP {passage} / {question}")])
    rag_chain(llm, "map_reduce", map_prompt=prompt).invoke({"input_documents": DOCS[:1], "question": "q"})
    assert llm.calls[0][0].text == f"MAP {DOCS[0].page_content} / q"
    assert isinstance(llm.calls[1][0], SystemMessage)  # default reduce prompt
    with pytest.raises(TypeError):
        rag_chain(llm, "kv_blocks", prompt=prompt)  # kv_blocks has no prompt


# ---- input errors -------------------------------------------------------------------------------------


@pytest.mark.parametrize("kind", CHAIN_KINDS)
def test_missing_question_is_a_clear_error(kind):
    chain = rag_chain(RecordingChat(), kind)
    with pytest.raises(ValueError, match=r"needs a 'question' key \(got keys: \['input_documents'\]\)"):
        chain.invoke({"input_documents": DOCS})
    with pytest.raises(ValueError, match="'question' is empty"):
        chain.invoke({"input_documents": DOCS, "question": "  "})
    with pytest.raises(TypeError, match="'question' must be a str"):
        chain.invoke({"input_documents": DOCS, "question": 3})


@pytest.mark.parametrize("kind", CHAIN_KINDS)
def test_missing_documents_is_a_clear_error(kind):
    llm = RecordingChat()
    chain = rag_chain(llm, kind)
    with pytest.raises(ValueError, match=r"'input_documents' \(or 'context'\), or build the chain with retriever="):
        chain.invoke({"question": QUESTION})
    with pytest.raises(ValueError, match="no documents to answer from"):
        chain.invoke({"question": QUESTION, "input_documents": []})
    with pytest.raises(TypeError, match=r"must be a dict .*, got str"):
        chain.invoke(QUESTION)  # a bare question needs a retriever
    with pytest.raises(TypeError, match=r"'input_documents'\[1\] must be a Document or str, got int"):
        chain.invoke({"question": QUESTION, "input_documents": [DOCS[0], 7]})
    with pytest.raises(ValueError, match="retriever's result is empty"):
        rag_chain(llm, kind, retriever=ListRetriever(docs=[])).invoke(QUESTION)
    assert llm.calls == []  # nothing reached the model


def test_unknown_kind():
    with pytest.raises(ValueError, match="kind must be one of"):
        rag_chain(RecordingChat(), "refine")
