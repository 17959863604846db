"""ChatKVRag on a tiny random-weight model: LangChain's standard unit suite, how messages become one
prompt with passage spans, and the call options. (The real default model: integration_tests.)"""

import asyncio
import functools

import pytest
import torch
from kvrag import ContextOverflowError, KVEngine
from langchain_core.messages import AIMessage, HumanMessage, SystemMessage, ToolMessage
from langchain_core.messages.content import create_plaintext_block
from langchain_tests.unit_tests import ChatModelUnitTests

from tiny import tiny_configs, tiny_model, tiny_tokenizer

from langchain_kvrag.chat_models import ChatKVRag

P1 = "The Varnholm lighthouse was built in 1873 by the engineer Ilsa Brandt on the northern cliff."
P2 = "Orrin Vale painted The Tin Harvest, a mural on the old grain store of Selby Cross, in 1921."


@functools.cache
def tiny_engine() -> KVEngine:
    """One engine over a tiny random llama for the module (the standard suite's properties need it
    outside fixtures); its KV goes under the session's KVRAG_HOME."""
    from kvrag.paths import kvrag_home

    tokenizer = tiny_tokenizer()
    model = tiny_model(tiny_configs(len(tokenizer))["llama"])
    return KVEngine(model, tokenizer, home=kvrag_home() / "tiny-langchain", storage_dtype=torch.float32, default_mode="block")


@pytest.fixture
def engine() -> KVEngine:
    return tiny_engine()


class TestChatKVRagUnit(ChatModelUnitTests):
    @property
    def chat_model_class(self) -> type[ChatKVRag]:
        return ChatKVRag

    @property
    def chat_model_params(self) -> dict:
        return {"engine": tiny_engine()}

    @property
    def standard_chat_model_params(self) -> dict:
        params = super().standard_chat_model_params
        del params["api_key"]  # a local model has no API key, and refuses unknown arguments
        return params


@pytest.fixture
def llm(engine):
    return ChatKVRag(engine=engine, max_tokens=8)


def question(text="Who built the lighthouse?"):
    return {"type": "text", "text": text}


def test_explicit_passages_are_spans_of_the_rendered_prompt(llm):
    message = HumanMessage(content=[create_plaintext_block(text=P1), create_plaintext_block(text=P2), question()])
    text, spans = llm.render([SystemMessage("Be brief."), message])
    assert [text[a:b] for a, b in spans] == [P1, P2]
    assert f"{P1}\n\n{P2}\n\nWho built the lighthouse?" in text
    assert text == llm.engine.tokenizer.apply_chat_template(
        [{"role": "system", "content": "Be brief."}, {"role": "user", "content": f"{P1}\n\n{P2}\n\nWho built the lighthouse?"}],
        tokenize=False,
        add_generation_prompt=True,
    )


def test_plain_prompts_leave_passage_finding_to_the_engine(llm):
    text, spans = llm.render([HumanMessage(f"{P1}\n\nWho built it?")])
    assert spans is None and P1 in text


def test_explicit_passages_are_blocks_even_when_not_indexed(llm):
    passage = "Kestrune is the harbour town where the ferry from the mainland docks twice a day."
    message = HumanMessage(content=[create_plaintext_block(text=passage), question("Where does the ferry dock?")])
    result = llm.invoke([message])
    assert result.response_metadata["cache_hits"].get("computed", 0) >= 1
    again = llm.invoke([message])
    assert again.response_metadata["cache_hits"].get("computed", 0) == 0
    assert again.usage_metadata["input_token_details"]["cache_read"] > 0
    assert again.content == result.content


@pytest.mark.parametrize(
    "messages, error, match",
    [
        ([], ValueError, "at least one message"),
        ([HumanMessage(content=[create_plaintext_block(text=P1)])], ValueError, "no question"),
        ([HumanMessage(content=[create_plaintext_block(text=P1), question("  ")])], ValueError, "no question"),
        ([HumanMessage(content=[{"type": "image", "url": "http://x/y.png"}, question()])], ValueError, "'image' block"),
        ([HumanMessage(content=[create_plaintext_block(url="http://x/y.txt"), question()])], ValueError, "inline"),
        ([HumanMessage("hi"), AIMessage("", tool_calls=[{"name": "f", "args": {}, "id": "1"}]), ToolMessage("3", tool_call_id="1")], ValueError, "tool"),
    ],
)
def test_bad_messages_are_refused_before_generation(llm, messages, error, match):
    with pytest.raises(error, match=match):
        llm.invoke(messages)


def test_passage_larger_than_the_context_is_refused(llm):
    huge = "Orvanne has many lighthouses. " * 2000
    with pytest.raises(ContextOverflowError, match="context window"):
        llm.invoke([HumanMessage(content=[create_plaintext_block(text=huge), question()])])


def test_unknown_call_options_are_refused(llm):
    with pytest.raises(TypeError, match="unexpected call options"):
        llm.invoke("hi", max_new_tokens=3)


def test_call_options_override_fields(llm):
    result = llm.invoke("Count from one to twenty.", max_tokens=2, mode="full")
    assert result.usage_metadata["output_tokens"] <= 2
    assert result.response_metadata["mode"] == "full"
    assert result.response_metadata["finish_reason"] == "length"


def test_a_model_naming_no_mode_follows_the_engines_default(engine):
    engine.default_mode = "full"
    try:
        result = ChatKVRag(engine=engine, max_tokens=2).invoke("Count from one to twenty.")
        assert result.response_metadata["mode"] == "full"
        assert ChatKVRag(engine=engine)._identifying_params["mode"] == "full"
    finally:
        engine.default_mode = "block"


def test_tokens_are_counted_with_the_engines_tokenizer(llm):
    assert llm.get_token_ids("Varnholm") == llm.engine.tokenizer("Varnholm", add_special_tokens=False)["input_ids"]
    messages = [HumanMessage("Who built the lighthouse?")]
    assert llm.get_num_tokens_from_messages(messages) == llm.invoke(messages).usage_metadata["input_tokens"]


def test_timeout_ends_generation_early(engine):
    slow = ChatKVRag(engine=engine, max_tokens=200, timeout=1e-9)
    result = slow.invoke("Tell me a long story.")
    assert result.response_metadata["finish_reason"] == "timeout"
    assert result.usage_metadata["output_tokens"] == 1


@pytest.mark.parametrize("name", ["langchain-rag-prompt", "langchain-system-context"])
def test_the_bench_layouts_render_as_langchains_prompts_reach_chatkvrag(llm, engine, name):
    """`kvrag bench accuracy --prompts` asks in the text the tutorials' prompts send: the same
    messages, formatted by LangChain (context joined as create_stuff_documents_chain joins it) and
    rendered by ChatKVRag."""
    from kvrag.eval.layouts import LAYOUTS
    from langchain_classic.chains.combine_documents.base import DEFAULT_DOCUMENT_SEPARATOR
    from langchain_core.prompts import ChatPromptTemplate

    layout = LAYOUTS[name]
    messages = [("system", layout.system)] if layout.system else []
    prompt = ChatPromptTemplate.from_messages([*messages, ("human", layout.user)])
    context = DEFAULT_DOCUMENT_SEPARATOR.join([P1, P2])
    sent = prompt.invoke({"context": context, "question": "Who built the lighthouse?"}).to_messages()
    assert llm.render(sent)[0] == layout.render(engine, "Who built the lighthouse?", [P1, P2])[0]


async def test_abatch_and_astream_are_decoded_together(engine, monkeypatch):
    """Concurrent async calls reach the engine's scheduler as one batch, and each answer is the one
    its call gets alone (greedy)."""
    from kvrag import scheduler

    sizes = []
    packed = scheduler.forward_packed
    monkeypatch.setattr(scheduler, "forward_packed", lambda model, runs: sizes.append(len(runs)) or packed(model, runs))
    llm = ChatKVRag(engine=engine, max_tokens=12)
    questions = [f"Who painted mural number {i}?" for i in range(6)]
    alone = [llm.invoke(q).content for q in questions]
    assert max(sizes) == 1
    assert [m.content for m in await llm.abatch(questions)] == alone
    assert max(sizes) > 1
    sizes.clear()

    async def streamed(q):
        return "".join([chunk.content async for chunk in llm.astream(q)])

    assert await asyncio.gather(*(streamed(q) for q in questions)) == alone
    assert max(sizes) > 1
