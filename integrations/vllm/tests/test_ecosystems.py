"""LangChain's ChatOpenAI and LlamaIndex's OpenAILike pointed at vLLM with kvrag's connector: the store hooks
index passages through the server, and the apps' own retrieval, prompts and clients then reuse their KV."""

import re
import urllib.request

import pytest

pytestmark = pytest.mark.e2e  # the default model, served by vLLM

HANDBOOK = [
    "The Larch Street library opens at nine on weekdays and at ten on Saturdays; it is closed on Sundays.",
    "Members may borrow up to twelve books at a time, for three weeks, renewable twice online.",
    "The reading room on the second floor holds the local newspaper archive back to 1887.",
    "Laptops can be borrowed at the front desk for four hours with a library card and photo ID.",
    "The children's corner hosts a story hour every Wednesday at four in the afternoon.",
    "Late returns cost ten cents a day per book, up to a maximum of five dollars per item.",
]
QUESTIONS = ["When does the library open on Saturdays?", "How many books may a member borrow?",
             "What does a late return cost?", "Where is the newspaper archive?"]


def external_hits(vllm) -> float:
    """Prompt tokens vLLM took from a KV connector so far (its Prometheus counter)."""
    with urllib.request.urlopen(vllm.url + "/metrics", timeout=30) as response:
        text = response.read().decode()
    return sum(float(m) for m in re.findall(r"^vllm:external_prefix_cache_hits_total\{[^}]*\} (\S+)$", text, re.M))


def test_langchain_chat_openai_reuses_what_the_vector_store_indexed(vllm, tmp_path):
    from langchain_core.prompts import ChatPromptTemplate
    from langchain_core.runnables import RunnablePassthrough
    from langchain_openai import ChatOpenAI

    from langchain_kvrag import KVRagVectorStore

    store = KVRagVectorStore(vllm_url=vllm.url, persist_directory=tmp_path / "chroma", collection_name="handbook")
    store.add_texts(HANDBOOK)
    prompt = ChatPromptTemplate.from_messages([("system", "Answer the question using only this context:\n\n{context}"),
                                               ("human", "{question}")])
    llm = ChatOpenAI(base_url=vllm.url + "/v1", api_key="unused", model=vllm.model, temperature=0, max_tokens=24)
    chain = ({"context": store.as_retriever(search_kwargs={"k": 4}) | (lambda docs: "\n\n".join(d.page_content for d in docs)),
              "question": RunnablePassthrough()} | prompt | llm)
    replies = [chain.invoke(q) for q in QUESTIONS]
    reused = [r.usage_metadata["input_token_details"].get("cache_read", 0) for r in replies]
    assert all(r.content.strip() for r in replies)
    assert all(count > 80 for count in reused[1:]), reused  # the system turn and four passages, from the second on


def test_llamaindex_openai_like_reuses_what_the_ingestion_indexed(vllm):
    from llama_index.core import Document, VectorStoreIndex
    from llama_index.core.node_parser import SentenceSplitter
    from llama_index.llms.openai_like import OpenAILike

    from llama_index.llms.kvrag import KVPrecompute, default_embed_model

    llm = OpenAILike(api_base=vllm.url + "/v1", api_key="unused", model=vllm.model, is_chat_model=True,
                     context_window=4096, max_tokens=24, temperature=0)
    documents = [Document(text=text) for text in HANDBOOK]
    index = VectorStoreIndex.from_documents(documents, embed_model=default_embed_model(),
                                            transformations=[SentenceSplitter(chunk_size=128, chunk_overlap=0), KVPrecompute(vllm_url=vllm.url)])
    engine = index.as_query_engine(llm=llm, similarity_top_k=4)
    engine.query(QUESTIONS[0])  # its prompt's header is new: prefilled, and kept for the next
    before = external_hits(vllm)
    answers = [engine.query(q) for q in QUESTIONS[1:]]
    assert all(str(a).strip() for a in answers)
    assert external_hits(vllm) - before > 3 * 80  # four passages a question, supplied by kvrag's connector
