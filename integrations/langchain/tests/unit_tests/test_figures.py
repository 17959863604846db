"""kvrag's figures at the end of a chain (langchain_kvrag.figures), on a tiny random-weight model."""

import asyncio

import pytest
import torch
from kvrag import KVEngine
from langchain_core.output_parsers import StrOutputParser
from langchain_core.prompts import ChatPromptTemplate

from tiny import tiny_configs, tiny_model, tiny_tokenizer

from langchain_kvrag import ChatKVRag, kvrag_figures

PASSAGE = "The Varnholm lighthouse was built in 1873 by the engineer Ilsa Brandt."


@pytest.fixture
def llm(tmp_path) -> ChatKVRag:
    tokenizer = tiny_tokenizer()
    engine = KVEngine(tiny_model(tiny_configs(len(tokenizer))["llama"]), tokenizer, home=tmp_path,
                      storage_dtype=torch.float32, default_mode="block")
    engine.index([PASSAGE])
    return ChatKVRag(engine=engine, max_tokens=3)


def test_figures_of_every_call_inside_the_block_reach_past_a_string_parser(llm):
    prompt = ChatPromptTemplate.from_messages([("system", "Answer from the context.\n\n{context}"), ("human", "{q}")])
    chain = prompt | llm | StrOutputParser()  # text only at the end, as create_retrieval_chain's answer
    inputs = {"context": PASSAGE, "q": "Who built it?"}
    chain.invoke(inputs)  # outside: not counted
    with kvrag_figures() as figures:
        answers = [chain.invoke(inputs), "".join(chain.stream(inputs)), *chain.batch([inputs, inputs])]
        asyncio.run(chain.ainvoke(inputs))
    assert all(isinstance(a, str) for a in answers)
    expected = llm.invoke(prompt.invoke(inputs)).response_metadata
    assert figures.calls == 5 and figures.mode == "block" and figures.ttft > 0
    assert figures.reused_tokens == 5 * expected["reused_tokens"] > 0
    assert figures.prefilled_tokens == 5 * expected["prefilled_tokens"]
    assert figures.last["model_provider"] == "kvrag" and figures.total_time > 0
    with kvrag_figures() as inner:
        pass
    assert inner.calls == 0 and inner.ttft is None and "calls=0" in repr(inner)
