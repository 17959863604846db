"""LangChain integration for kvrag: answers that reuse retrieved passages' cached KV."""

from langchain_kvrag.chains import (
    CHAIN_KINDS,
    kv_blocks_chain,
    map_reduce_chain,
    map_rerank_chain,
    parse_scored_answer,
    rag_chain,
    stuff_chain,
)
from langchain_kvrag.chat_models import ChatKVRag
from langchain_kvrag.embeddings import KVRagEmbeddings
from langchain_kvrag.figures import KVRagFigures, kvrag_figures
from langchain_kvrag.vectorstores import KVRagVectorStore

__all__ = [
    "CHAIN_KINDS",
    "ChatKVRag",
    "KVRagEmbeddings",
    "KVRagFigures",
    "KVRagVectorStore",
    "kv_blocks_chain",
    "kvrag_figures",
    "map_reduce_chain",
    "map_rerank_chain",
    "parse_scored_answer",
    "rag_chain",
    "stuff_chain",
]
