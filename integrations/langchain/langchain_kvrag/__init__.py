"""LangChain integration for kvrag: answers that reuse retrieved passages' cached KV."""

from langchain_kvrag.chat_models import ChatKVRag
from langchain_kvrag.embeddings import KVRagEmbeddings
from langchain_kvrag.vectorstores import KVRagVectorStore

__all__ = ["ChatKVRag", "KVRagEmbeddings", "KVRagVectorStore"]
