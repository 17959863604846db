"""ChatKVRag on the real default model: LangChain's standard integration suite and drop-in reuse."""

import asyncio
import time

import pytest
from langchain_classic.chains.combine_documents import create_stuff_documents_chain
from langchain_core.documents import Document
from langchain_core.messages import AIMessage, HumanMessage, SystemMessage
from langchain_core.messages.content import create_plaintext_block
from langchain_core.prompts import ChatPromptTemplate
from langchain_tests.integration_tests import ChatModelIntegrationTests

from langchain_kvrag.chat_models import ChatKVRag

pytestmark = pytest.mark.e2e  # the real default model

PASSAGES = [  # not the core tests' passages: one session shares the passage list, and a longer known
    # passage (the core's CLI test indexes two of its passages as one) would rightly win the match
    "The Varnholm lighthouse was built in 1873 by the engineer Ilsa Brandt. It stands on the cliff above Varn.",
    "Orrin Vale is a painter from the town of Selby Cross. His best known mural is called The Tin Harvest.",
    "The river Olm freezes every winter. The fishermen of Kettering Bay cross it on foot in January.",
]
QUESTION = "Who built the Varnholm lighthouse?"
SYSTEM = "Answer the question using only the passages in the user's message. Answer briefly, in one sentence."


class TestChatKVRagIntegration(ChatModelIntegrationTests):
    """Declared honestly: no tools, no structured output, text only; usage reports cache reads."""

    @property
    def chat_model_class(self) -> type[ChatKVRag]:
        return ChatKVRag

    @property
    def chat_model_params(self) -> dict:
        return {"max_tokens": 24}

    @property
    def supported_usage_metadata_details(self) -> dict:
        return {"invoke": ["cache_read_input"], "stream": ["cache_read_input"]}

    def invoke_with_cache_read_input(self, *, stream: bool = False) -> AIMessage:
        llm = ChatKVRag(**self.chat_model_params, mode="block")
        llm.engine.index(PASSAGES)
        message = HumanMessage(content=[create_plaintext_block(text=p) for p in PASSAGES] + [{"type": "text", "text": QUESTION}])
        if not stream:
            result = llm.invoke([message])
        else:
            result = None
            for chunk in llm.stream([message]):
                result = chunk if result is None else result + chunk
        assert result.usage_metadata["input_token_details"]["cache_read"] > 0
        return result


@pytest.fixture(scope="module")
def llm():
    engine = ChatKVRag().engine
    engine.index(PASSAGES)
    return ChatKVRag(engine=engine, mode="block", max_tokens=30)


def explicit_blocks(passages, question):
    content = [create_plaintext_block(text=p) for p in passages] + [{"type": "text", "text": f"Question: {question}"}]
    return [SystemMessage(SYSTEM), HumanMessage(content=content)]


def test_plain_rag_prompt_reuses_indexed_passages_and_answers_as_explicit_blocks(llm):
    prompt = ChatPromptTemplate.from_messages([("system", SYSTEM), ("human", "{context}\n\nQuestion: {question}")])
    drop_in = (prompt | llm).invoke({"context": "\n\n".join(PASSAGES), "question": QUESTION})
    explicit = llm.invoke(explicit_blocks(PASSAGES, QUESTION))
    passage_tokens = sum(len(llm.engine.layout.block_ids(p)) for p in PASSAGES)
    assert drop_in.usage_metadata["input_token_details"]["cache_read"] >= passage_tokens
    assert drop_in.usage_metadata["input_tokens"] == explicit.usage_metadata["input_tokens"]
    assert drop_in.content == explicit.content
    assert "brandt" in drop_in.content.lower()


def test_unmodified_stuff_documents_chain_reuses_indexed_passages(llm, monkeypatch):
    streams = []
    stream_text = llm.engine.stream_text

    def recording(text, spans=None, **options):
        streams.append(stream_text(text, spans, **options))
        return streams[-1]

    monkeypatch.setattr(llm.engine, "stream_text", recording)
    prompt = ChatPromptTemplate.from_messages(
        [("system", "Answer the question from this context:\n\n{context}"), ("human", "{input}")]
    )
    docs = [Document(page_content=p) for p in PASSAGES]
    block = create_stuff_documents_chain(llm, prompt).invoke({"context": docs, "input": QUESTION})
    full = create_stuff_documents_chain(llm.bind(mode="full"), prompt).invoke({"context": docs, "input": QUESTION})
    assert block.strip() and full.strip()
    block_result, full_result = (s.result for s in streams)
    passage_tokens = sum(len(llm.engine.layout.block_ids(p)) for p in PASSAGES)
    assert block_result.reused_tokens >= passage_tokens
    assert block_result.prompt_tokens == full_result.prompt_tokens == full_result.prefilled_tokens
    assert block_result.prefilled_tokens < full_result.prefilled_tokens - passage_tokens


def test_unindexed_passages_are_prefilled_as_text(llm):
    other = "The island of Mettle has no lighthouse at all; ships use the bell buoy at Crane Point."
    result = llm.invoke(f"{other}\n\nDoes Mettle have a lighthouse?")
    assert result.response_metadata["reused_tokens"] == 0
    assert result.response_metadata["prefilled_tokens"] == result.usage_metadata["input_tokens"]


def test_full_mode_prefills_everything_block_mode_only_the_question(llm):
    messages = explicit_blocks(PASSAGES, QUESTION)
    full = llm.invoke(messages, mode="full")
    block = llm.invoke(messages)
    assert full.response_metadata["prefilled_tokens"] == full.usage_metadata["input_tokens"]
    assert full.usage_metadata["input_tokens"] == block.usage_metadata["input_tokens"]
    assert block.response_metadata["prefilled_tokens"] < 30
    assert "brandt" in full.content.lower()


def test_blend_mode_recomputes_a_share_of_the_passages(llm):
    messages = explicit_blocks(PASSAGES, QUESTION)
    llm.invoke(messages)  # stores the system prompt's block: from now on only recomputation is prefilled
    block = llm.invoke(messages)
    blend = llm.invoke(messages, mode="blend")  # the engine's BlendConfig: 15% of the passage tokens
    metadata = blend.response_metadata
    assert metadata["mode"] == "blend" and "brandt" in blend.content.lower()
    assert block.response_metadata["prefilled_tokens"] < metadata["prefilled_tokens"] < blend.usage_metadata["input_tokens"] / 2
    assert metadata["prefilled_tokens"] + metadata["reused_tokens"] == blend.usage_metadata["input_tokens"]
    auto = llm.invoke(messages, mode="auto")  # the share its passages' deviation asks for
    metadata = auto.response_metadata
    assert metadata["mode"] == "auto" and block.response_metadata["prefilled_tokens"] < metadata["prefilled_tokens"]
    assert metadata["prefilled_tokens"] + metadata["reused_tokens"] == auto.usage_metadata["input_tokens"]
    text, spans = llm.render(messages)
    assert auto.content == llm.engine.generate_text(text, spans, mode="auto", max_new_tokens=llm.max_tokens).text


def test_streamed_chunks_carry_usage_once_and_join_to_the_invoked_answer(llm):
    messages = explicit_blocks(PASSAGES, QUESTION)
    chunks = list(llm.stream(messages))
    assert sum(c.usage_metadata is not None for c in chunks) == 1
    joined = sum(chunks[1:], chunks[0])
    assert joined.content == llm.invoke(messages).content
    assert joined.response_metadata["ttft"] > 0 and joined.usage_metadata["output_tokens"] > 0


def test_async_streaming_does_not_block_the_event_loop(llm):
    async def main():
        ticks = 0
        done = asyncio.Event()

        async def ticker():
            nonlocal ticks
            while not done.is_set():
                ticks += 1
                await asyncio.sleep(0.005)

        task = asyncio.create_task(ticker())
        started = time.perf_counter()
        text = "".join([c.content async for c in llm.astream(explicit_blocks(PASSAGES, QUESTION), max_tokens=20)])
        elapsed = time.perf_counter() - started
        done.set()
        await task
        return text, ticks, elapsed

    text, ticks, elapsed = asyncio.run(main())
    assert text
    assert ticks >= 3 and ticks >= elapsed / 0.005 / 10  # the loop kept turning during generation
