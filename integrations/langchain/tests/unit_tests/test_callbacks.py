"""Reuse without an extra step (langchain_kvrag.callbacks), on a tiny random-weight model: LangChain's
RAG tutorial with a plain in-memory Chroma and ChatKVRag reuses KV from the second question that
retrieves the same documents, and so does a context pasted into the message by hand."""

import gc
import uuid

import pytest
import torch
from kvrag import KVEngine
from langchain_chroma import Chroma
from langchain_core.documents import Document
from langchain_core.output_parsers import StrOutputParser
from langchain_core.prompts import ChatPromptTemplate
from langchain_core.runnables import RunnablePassthrough

from tiny import tiny_configs, tiny_model, tiny_tokenizer

from langchain_kvrag import ChatKVRag, KVRagEmbeddings, callbacks

QUESTION = "Who built the lighthouse?"


@pytest.fixture
def engine(tmp_path) -> KVEngine:
    tokenizer = tiny_tokenizer()
    return KVEngine(tiny_model(tiny_configs(len(tokenizer))["llama"]), tokenizer, home=tmp_path, storage_dtype=torch.float32,
                    default_mode="block")  # the reuse these tests are about


def _tutorial_chain(llm, retriever):
    """The classic tutorial: retriever | format_docs into a prompt, the chat model, a string parser."""
    prompt = ChatPromptTemplate.from_messages(
        [("system", "Answer from the context.\n\n{context}"), ("human", "{question}")]
    )

    def format_docs(docs):
        return "\n\n".join(d.page_content for d in docs)

    return {"context": retriever | format_docs, "question": RunnablePassthrough()} | prompt | llm


def test_tutorial_with_plain_chroma_reuses_from_the_second_question(engine):
    tag = uuid.uuid4().hex[:6]
    store = Chroma(collection_name=f"tutorial-{tag}", embedding_function=KVRagEmbeddings())
    store.add_documents(
        [
            Document(page_content=f"The Varnholm lighthouse ({tag}) was built in 1873 by the engineer Ilsa Brandt."),
            Document(page_content=f"The river Olm ({tag}) freezes every winter, and the ferry stops until March."),
        ]
    )
    llm = ChatKVRag(engine=engine, max_tokens=4)
    chain = _tutorial_chain(llm, store.as_retriever(search_kwargs={"k": 2}))

    first = chain.invoke(QUESTION)
    second = chain.invoke(QUESTION)

    assert first.response_metadata["cache_hits"].get("computed", 0) >= 1  # learned, encoded on first sight
    assert second.response_metadata["reused_tokens"] > 0
    assert second.response_metadata["cache_hits"].get("computed", 0) == 0
    streamed = list((chain | StrOutputParser()).stream(QUESTION))  # a streaming run learns and reuses too
    assert streamed


@pytest.mark.parametrize("model_first", [True, False])
def test_todays_tutorial_with_similarity_search_reuses_from_the_second_question(engine, model_first):
    """LangChain's current RAG tutorial fetches with `vector_store.similarity_search` (no retriever,
    no callback) and formats the rag-prompt itself: documents embedded with KVRagEmbeddings are
    learned as they are added, whether the chat model exists then or comes later."""
    from kvrag.eval.layouts import LAYOUTS

    tag = uuid.uuid4().hex[:6]
    llm = ChatKVRag(engine=engine, max_tokens=4) if model_first else None
    store = Chroma(collection_name=f"tutorial-{tag}", embedding_function=KVRagEmbeddings())
    store.add_documents(
        [
            Document(page_content=f"The Varnholm lighthouse ({tag}) was built in 1873 by the engineer Ilsa Brandt."),
            Document(page_content=f"The river Olm ({tag}) freezes every winter, and the ferry stops until March."),
        ]
    )
    llm = llm or ChatKVRag(engine=engine, max_tokens=4)
    prompt = ChatPromptTemplate.from_messages([("human", LAYOUTS["langchain-rag-prompt"].user)])

    def generate(question):
        docs = store.similarity_search(question, k=2)
        return llm.invoke(prompt.invoke({"question": question, "context": "\n\n".join(d.page_content for d in docs)}))

    first, second = generate(QUESTION), generate(QUESTION)
    assert first.response_metadata["cache_hits"].get("computed", 0) >= 2  # both documents, encoded on first sight
    assert second.response_metadata["reused_tokens"] > 0
    assert second.response_metadata["cache_hits"].get("computed", 0) == 0
    assert llm.engine.passages.find(store.similarity_search("Olm", k=1)[0].page_content)  # learned text, found


@pytest.mark.parametrize("context", ["joined", "documents"])
def test_todays_tutorial_with_other_embeddings_reuses_from_the_second_question(engine, context):
    """The same tutorial on a store with the user's own embeddings (nothing of kvrag's finds the documents):
    the prompt's `context` variable, text joined at blank lines or documents, is learned as it is formatted."""
    from kvrag.eval.layouts import LAYOUTS
    from langchain_core.embeddings import DeterministicFakeEmbedding

    tag = uuid.uuid4().hex[:6]
    llm = ChatKVRag(engine=engine, max_tokens=4)
    store = Chroma(collection_name=f"own-{tag}", embedding_function=DeterministicFakeEmbedding(size=32))
    store.add_documents(
        [
            Document(page_content=f"The Varnholm lighthouse ({tag}) was built in 1873 by the engineer Ilsa Brandt."),
            Document(page_content=f"The river Olm ({tag}) freezes every winter,\n\nand the ferry stops until March."),
        ]
    )
    prompt = ChatPromptTemplate.from_messages([("human", LAYOUTS["langchain-rag-prompt"].user)])

    def generate(question):
        docs = store.similarity_search(question, k=2)
        if context == "joined":
            return llm.invoke(prompt.invoke({"question": question, "context": "\n\n".join(d.page_content for d in docs)}))
        # given the documents themselves, formatted inside the chain, as create_stuff_documents_chain does
        chain = RunnablePassthrough.assign(context=lambda x: "\n\n".join(d.page_content for d in x["context"]))
        return (chain | prompt | llm).invoke({"question": question, "context": docs})

    first, second = generate(QUESTION), generate(QUESTION)
    assert first.response_metadata["cache_hits"].get("computed", 0) >= 2  # encoded on first sight
    assert second.response_metadata["reused_tokens"] > 0
    assert second.response_metadata["cache_hits"].get("computed", 0) == 0
    assert all(engine.passages.find(d.page_content.split("\n\n")[0]) for d in store.similarity_search("Olm", k=2))


def test_a_dropped_model_stops_learning(engine):
    llm = ChatKVRag(engine=engine)
    assert engine in callbacks._handler.engines()
    del llm
    gc.collect()
    assert engine not in callbacks._handler.engines()


def test_a_context_pasted_into_the_prompt_by_hand_is_reused_from_the_second_call(engine):
    """No retriever, no `context` variable, no kvrag embeddings: documents written into the message itself,
    a blank line between them, are learned by the engine from the first prompt."""
    llm = ChatKVRag(engine=engine, max_tokens=2)
    tag = uuid.uuid4().hex
    docs = "\n\n".join(f"Document {tag} {i}: nobody retrieved or indexed this text, ever." for i in range(2))
    first = llm.invoke(f"Answer from the documents.\n\n{docs}\n\n{QUESTION}")
    second = llm.invoke(f"Answer from the documents.\n\n{docs}\n\nWho else built it, and when?")
    assert first.response_metadata["reused_tokens"] == 0
    assert second.response_metadata["reused_tokens"] > 0
