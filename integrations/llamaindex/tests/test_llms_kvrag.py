"""KVRagLLM on the real default model: the LLM contract, passages in message blocks, drop-in reuse, errors."""

import asyncio
import base64

import pytest
from kvrag import ContextOverflowError, EmptyInputError, InputEncodingError
from llama_index.core.base.llms.base import BaseLLM
from llama_index.core.base.llms.types import (
    CachePoint,
    CacheControl,
    ChatMessage,
    DocumentBlock,
    ImageBlock,
    MessageRole,
    TextBlock,
)

from llama_index.llms.kvrag import KVRagLLM

pytestmark = pytest.mark.e2e  # the real default model (conftest's engine)

PASSAGES = [
    "The Quillmere observatory was founded in 1911 by the astronomer Petra Vaskane on the slopes of Mount Odrun.",
    "The ferry between Lisk and Harrowgate leaves every morning at seven and takes four hours in calm weather.",
]
QUESTION = "Who founded the Quillmere observatory?"


def document(text: str | bytes, mimetype: str = "text/plain") -> DocumentBlock:
    data = text.encode() if isinstance(text, str) else text
    return DocumentBlock(data=base64.b64encode(data), document_mimetype=mimetype, title="doc")


def user(*blocks) -> ChatMessage:
    return ChatMessage(role=MessageRole.USER, blocks=list(blocks))


@pytest.fixture(scope="module")
def indexed(engine):
    engine.index(PASSAGES, progress=False)
    return PASSAGES


def test_is_a_llama_index_llm(llm):
    assert BaseLLM.__name__ in [base.__name__ for base in KVRagLLM.__mro__]
    assert KVRagLLM.class_name() == "KVRagLLM"
    assert llm.to_dict()["class_name"] == "KVRagLLM"


def test_metadata_describes_the_model(llm, engine):
    metadata = llm.metadata
    assert metadata.context_window == engine.context_window == 8192
    assert metadata.num_output == llm.max_new_tokens == 40
    assert metadata.is_chat_model and not metadata.is_function_calling_model
    assert "SmolLM2-135M-Instruct" in metadata.model_name


def test_unknown_fields_are_refused(engine):
    with pytest.raises(ValueError, match="max_tokens"):
        KVRagLLM(engine=engine, max_tokens=10)


async def test_every_entry_point_gives_the_same_greedy_text(llm):
    prompt = "Name three colours of the rainbow."
    messages = [ChatMessage(role=MessageRole.USER, content=prompt)]
    completed = llm.complete(prompt)
    texts = {
        "complete": completed.text,
        "chat": llm.chat(messages).message.content,
        "acomplete": (await llm.acomplete(prompt)).text,
        "achat": (await llm.achat(messages)).message.content,
    }
    streams = {
        "stream_complete": list(llm.stream_complete(prompt)),
        "stream_chat": list(llm.stream_chat(messages)),
        "astream_complete": [r async for r in await llm.astream_complete(prompt)],
        "astream_chat": [r async for r in await llm.astream_chat(messages)],
    }
    for name, responses in streams.items():
        joined = "".join(r.delta for r in responses)
        last_text = responses[-1].text if name.endswith("complete") else responses[-1].message.content
        assert joined == last_text, name
        assert len(responses) > 2 and all(not r.additional_kwargs for r in responses[:-1]), name
        assert responses[-1].delta == "" and responses[-1].additional_kwargs["completion_tokens"] > 0, name
        texts[name] = joined
    assert completed.text.strip()
    assert set(texts.values()) == {completed.text}, texts
    stats = completed.additional_kwargs
    assert stats["ttft"] > 0 and stats["total_time"] >= stats["ttft"]
    assert stats["mode"] == "block" and stats["finish_reason"] in ("stop", "length")
    assert stats["prompt_tokens"] == stats["prefilled_tokens"] + stats["reused_tokens"]
    assert completed.raw["text"] == completed.text and completed.raw["token_ids"]


def test_passages_as_documents_text_blocks_or_plain_text_render_alike_and_reuse_their_kv(llm, indexed):
    question = llm.engine.layout.format.question.format(question=QUESTION)
    system = ChatMessage(role=MessageRole.SYSTEM, content=llm.engine.layout.format.system)
    as_documents = [system, user(*map(document, PASSAGES), TextBlock(text=question))]
    as_text_blocks = [system, user(*(TextBlock(text=p) for p in PASSAGES), TextBlock(text=question))]
    as_one_string = [system, ChatMessage(role=MessageRole.USER, content="\n\n".join([*PASSAGES, question]))]

    rendered = {name: llm.render(m) for name, m in [("docs", as_documents), ("blocks", as_text_blocks), ("text", as_one_string)]}
    text = rendered["text"][0]
    assert rendered["docs"] == rendered["blocks"] and rendered["docs"][0] == text and rendered["text"][1] is None
    assert [text[a:b] for a, b in rendered["docs"][1]] == PASSAGES

    replies = [llm.chat(m) for m in (as_documents, as_text_blocks, as_one_string)]
    reference = llm.engine.generate(QUESTION, PASSAGES, mode="block", max_new_tokens=40)  # the engine's own prompt: the same text
    assert {r.message.content for r in replies} == {reference.text}
    assert "Vaskane" in reference.text
    for reply in replies:
        stats = reply.additional_kwargs
        assert stats["reused_tokens"] == reference.reused_tokens > sum(len(llm.engine.layout.encode(p)) for p in PASSAGES)
        assert "computed" not in stats["cache_hits"]


def test_a_passage_the_engine_has_not_seen_is_stored_on_first_use(llm, fresh_passages, encoded):
    passage = fresh_passages(1)[0]
    message = user(document(passage), TextBlock(text="How many ships does the ledger list?"))
    first = llm.chat([message], max_new_tokens=4)
    assert encoded.count(llm.engine.layout.passage_ids(passage)) == 1
    second = llm.chat([message], max_new_tokens=4)
    assert "computed" not in second.additional_kwargs["cache_hits"]
    assert encoded.count(llm.engine.layout.passage_ids(passage)) == 1
    assert second.message.content == first.message.content


def test_call_options_override_the_fields(llm, indexed):
    messages = [user(document(PASSAGES[0]), TextBlock(text=QUESTION))]
    short = llm.chat(messages, max_new_tokens=3)
    assert short.additional_kwargs["completion_tokens"] == 3 and short.additional_kwargs["finish_reason"] == "length"
    full = llm.chat(messages, mode="full", max_new_tokens=3)
    assert full.additional_kwargs["mode"] == "full" and full.additional_kwargs["reused_tokens"] == 0
    block = llm.chat(messages, max_new_tokens=1)  # now every block is stored
    blend = llm.chat(messages, mode="blend", max_new_tokens=3)
    stats = blend.additional_kwargs
    assert stats["mode"] == "blend" and block.additional_kwargs["prefilled_tokens"] < stats["prefilled_tokens"]
    assert stats["prefilled_tokens"] + stats["reused_tokens"] == stats["prompt_tokens"]
    auto = llm.chat(messages, mode="auto", max_new_tokens=3).additional_kwargs
    assert auto["mode"] == "auto" and block.additional_kwargs["prefilled_tokens"] < auto["prefilled_tokens"]
    assert auto["prefilled_tokens"] + auto["reused_tokens"] == auto["prompt_tokens"]
    stopped = llm.chat(messages, stop=["Petra"])
    assert "Petra" not in stopped.message.content and stopped.additional_kwargs["finish_reason"] == "stop"


def test_a_formatted_prompt_is_completed_as_is(llm):
    prompt = "What is the capital of France?"
    rendered, _ = llm.engine.layout.render_chat([("user", [prompt])])
    assert llm.complete(rendered, formatted=True).text == llm.complete(prompt).text
    assert llm.complete(prompt, formatted=True).additional_kwargs["prompt_tokens"] < len(llm.engine.layout.encode(rendered))


def test_cache_hints_are_ignored(llm, indexed):
    plain = llm.chat([user(document(PASSAGES[0]), TextBlock(text=QUESTION))], max_new_tokens=8)
    hinted = llm.chat([user(document(PASSAGES[0]), CachePoint(cache_control=CacheControl(type="ephemeral")), TextBlock(text=QUESTION))], max_new_tokens=8)
    assert hinted.message.content == plain.message.content


@pytest.mark.parametrize(
    "messages, error, match",
    [
        ([], ValueError, "at least one message"),
        ([user(document(PASSAGES[0]))], ValueError, "no question"),
        ([user(document(PASSAGES[0]), TextBlock(text="  "))], ValueError, "no question"),
        ([ChatMessage(role=MessageRole.TOOL, content="42")], ValueError, "tool"),
        ([user(ImageBlock(image=b"\x89PNG\r\n\x1a\n"), TextBlock(text=QUESTION))], ValueError, "'image' block"),
        ([user(document(b"%PDF-1.4", "application/pdf"), TextBlock(text=QUESTION))], ValueError, "text documents only"),
        ([user(DocumentBlock(data=b"", document_mimetype="text/plain"), TextBlock(text=QUESTION))], EmptyInputError, "empty|whitespace"),
        ([user(document(b"caf\xe9 au lait"), TextBlock(text=QUESTION))], InputEncodingError, "UTF-8"),
        ([user(document("   \n "), TextBlock(text=QUESTION))], EmptyInputError, "empty|whitespace"),
    ],
)
def test_bad_messages_get_clear_errors(llm, messages, error, match):
    with pytest.raises(error, match=match):
        llm.chat(messages)


def test_errors_come_at_the_call_for_streams_too(llm):
    with pytest.raises(TypeError, match="unexpected options"):
        llm.stream_complete("hello", temprature=0.5)
    with pytest.raises(ValueError, match="no question"):
        llm.stream_chat([user(document(PASSAGES[0]))])
    with pytest.raises(ValueError, match="mode"):
        llm.complete("hello", mode="turbo")


def test_a_prompt_longer_than_the_context_is_refused(llm):
    with pytest.raises(ContextOverflowError, match="context window"):
        llm.complete("lighthouse " * 9000)


async def test_async_streaming_leaves_the_event_loop_free(llm):
    ticks = 0

    async def tick():
        nonlocal ticks
        while True:
            await asyncio.sleep(0.005)
            ticks += 1

    ticker = asyncio.create_task(tick())
    try:
        deltas = [r.delta async for r in await llm.astream_complete("Count from one to ten.", max_new_tokens=24)]
    finally:
        ticker.cancel()
    assert "".join(deltas).strip() and ticks >= len(deltas) // 2


async def test_concurrent_async_calls_are_decoded_together(llm, monkeypatch):
    from kvrag import scheduler

    sizes = []
    packed = scheduler.forward_packed
    monkeypatch.setattr(scheduler, "forward_packed", lambda model, runs: sizes.append(len(runs)) or packed(model, runs))
    prompts = ["Name a colour.", "Name a fruit.", "Name a season.", "Name an animal."]
    alone = [llm.complete(p, max_new_tokens=12).text for p in prompts]
    together = await asyncio.gather(*(llm.acomplete(p, max_new_tokens=12) for p in prompts))
    assert [r.text for r in together] == alone
    assert max(sizes) > 1
