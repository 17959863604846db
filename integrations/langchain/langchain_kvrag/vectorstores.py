"""A vector store that prefills every passage it stores, so questions over it only prefill the question.

kvrag's speed-up needs each passage's KV cache to exist before the question arrives. Indexing
is the natural moment: `KVRagVectorStore` runs `KVEngine.index` on every text it is given,
then hands the text to an ordinary LangChain vector store (an embedded, persistent Chroma by
default, or a collection on a Chroma server with `chroma_url=`) that does the storing and
searching. Retrieved documents carry the exact text that was indexed, which is how the chat model
finds their cached blocks in a prompt.
"""

import hashlib
import json
import uuid
from collections.abc import Callable, Iterable, Sequence
from functools import partial
from pathlib import Path
from typing import Any

from kvrag import KVEngine, preceding_in_documents
from kvrag.retrieval import chroma_client, chroma_collection, chroma_path, parse_chroma_url
from kvrag.vllm_client import index as index_through_vllm
from langchain_chroma import Chroma
from langchain_core.documents import Document
from langchain_core.embeddings import Embeddings
from langchain_core.runnables.config import run_in_executor
from langchain_core.vectorstores import VectorStore
from typing_extensions import Self

from .embeddings import KVRagEmbeddings

DEFAULT_COLLECTION = "kvrag-langchain"
ID_NAMESPACE = uuid.UUID("5b0e3c1a-7a55-4c1e-9d6f-6b7a7c9e2f10")


def document_id(text: str, metadata: dict | None = None) -> str:
    """A content-derived id: the same text and metadata give the same id in every run, so adding a
    document again replaces it instead of storing a copy (LangChain's indexing API hashes documents
    the same way). A UUID, because some stores (Qdrant) take no other ids."""
    payload = json.dumps([text, metadata or {}], sort_keys=True, default=str)
    return str(uuid.uuid5(ID_NAMESPACE, hashlib.sha256(payload.encode()).hexdigest()))


def _ids(texts: list[str], metadatas: Sequence[dict | None] | None, ids: Sequence[str | None] | None) -> list[str]:
    """The given id where there is one, else the content-derived one."""
    if ids is not None and len(ids) != len(texts):
        raise ValueError(f"got {len(ids)} ids for {len(texts)} texts")
    metadatas = metadatas if metadatas is not None else [None] * len(texts)
    ids = ids if ids is not None else [None] * len(texts)
    return [id_ or document_id(text, metadata) for text, metadata, id_ in zip(texts, metadatas, ids)]


def _last_of_each(ids: list[str]) -> list[int]:
    """Positions to store, one per id, the last one winning (same id → replaced): Chroma refuses a
    batch that repeats an id, and a document given twice in one batch is one document."""
    return sorted({id_: i for i, id_ in enumerate(ids)}.values())


class _Chroma(Chroma):
    """langchain-chroma 1.1's `get_by_ids` fails on documents stored without metadata (Chroma
    returns None for them; its searches already read that as {}): it does the same here."""

    def get_by_ids(self, ids: Sequence[str], /) -> list[Document]:
        found = self.get(ids=list(ids))
        return [
            Document(page_content=text, metadata=metadata or {}, id=id_)
            for text, metadata, id_ in zip(found["documents"], found["metadatas"], found["ids"])
            if text is not None
        ]


def default_chroma(
    embedding: Embeddings | None = None,
    collection_name: str | None = None,
    persist_directory: str | Path | None = None,
    chroma_url: str | None = None,
) -> Chroma:
    """An embedded Chroma collection on disk (`$KVRAG_HOME/chroma` unless told otherwise), or with
    `chroma_url` (`http://HOST:PORT`) a collection on that Chroma server, shared by every process
    that opens it there.

    Opened by `kvrag.retrieval.chroma_collection`, as the kvrag CLI opens its own: cosine space
    (kvrag's embeddings are unit vectors), telemetry off, the same client settings, so both can open
    the same directory in one process. A server that does not answer raises
    `kvrag.ChromaUnavailableError` naming the URL.
    """
    if chroma_url is not None and persist_directory is not None:
        raise ValueError("give persist_directory (an embedded Chroma) or chroma_url (a Chroma server), not both")
    if chroma_url is not None:
        location: str | Path = chroma_url
        parse_chroma_url(chroma_url)
    else:
        location = Path(persist_directory) if persist_directory is not None else chroma_path()
    name = collection_name or DEFAULT_COLLECTION
    chroma_collection(location, name)
    return _Chroma(
        collection_name=name,
        embedding_function=embedding if embedding is not None else KVRagEmbeddings(),
        client=chroma_client(location),
        create_collection_if_not_exists=False,
    )


class KVRagVectorStore(VectorStore):
    """Computes and stores each passage's KV on every add, then delegates to an inner vector store.

    Every add path (`add_texts`, `add_documents`, `from_texts`, `from_documents` and their
    async forms) first calls `engine.index(texts)`, which checks the whole batch (empty,
    non-UTF-8 or longer than the model's context window raise `kvrag.EmptyInputError`,
    `InputEncodingError`, `ContextOverflowError`) before it encodes anything, and skips
    passages whose KV is already stored. Only then do the texts reach the inner store, so a
    bad text means nothing of its batch is added.

    Adding is idempotent: a document without an id gets one derived from its text and metadata
    (`document_id`), and the default Chroma upserts, so re-running a script that adds the same
    documents leaves one copy of each. Ids you give (`ids=` or `Document.id`) are kept: the same id
    again replaces the document. With an inner store of your own, a repeated id does what that store
    does with it (most replace it; some, FAISS among them, refuse). Searching, `get_by_ids` and `delete` are the
    inner store's; `as_retriever` searches through this store, so documents added through the
    retriever get their KV too. Deleting a document leaves its KV behind: blocks are
    content-addressed and may serve other documents with the same text; the KV store's own
    budget evicts them.

    Works as the destination of `langchain_core.indexing.index`: unchanged documents are
    skipped by the record manager (and would not be re-encoded anyway), and documents the
    cleanup removes are deleted from the inner store.

    Example:
        ```python
        from langchain_kvrag import KVRagVectorStore

        store = KVRagVectorStore(collection_name="handbook")  # Chroma under $KVRAG_HOME/chroma
        store.add_texts(["The observatory was founded in 1891 by Ada Pell."])
        docs = store.as_retriever(search_kwargs={"k": 4}).invoke("Who founded the observatory?")
        ```

    Args:
        vectorstore: The store that keeps and searches the documents. Default: a persistent
            Chroma collection (see `collection_name`, `persist_directory`, `chroma_url`,
            `embedding`).
        engine: The `kvrag.KVEngine` whose KV store is filled; it must be the engine that
            answers the questions. Default: `KVEngine.shared()` (the default model, loaded
            once per process on the first add, not when the store is built).
        vllm_url: A vLLM server running kvrag's connector (`http://HOST:PORT`, docs/vllm.md)
            that answers the questions instead (`ChatOpenAI(base_url=URL + "/v1")`): passages
            are indexed through it and no model is loaded here. Not with `engine`.
        embedding: Embeddings for the default Chroma. Default: `KVRagEmbeddings`.
        collection_name: Collection of the default Chroma. Default: "kvrag-langchain".
        persist_directory: Directory of the default Chroma. Default: `$KVRAG_HOME/chroma`.
        chroma_url: A Chroma server (`chroma run`) holding the default collection instead, as
            `http://HOST:PORT`: every store (every replica) on the same URL and collection shares
            it. Not with `persist_directory`. A server that does not answer raises
            `kvrag.ChromaUnavailableError` naming the URL.
        show_progress: Show a progress bar while passages are encoded.
    """

    def __init__(
        self,
        vectorstore: VectorStore | None = None,
        *,
        engine: KVEngine | None = None,
        embedding: Embeddings | None = None,
        collection_name: str | None = None,
        persist_directory: str | Path | None = None,
        chroma_url: str | None = None,
        show_progress: bool = False,
        vllm_url: str | None = None,
    ) -> None:
        default_options = (embedding, collection_name, persist_directory, chroma_url)
        if vectorstore is not None and any(option is not None for option in default_options):
            raise ValueError(
                "embedding, collection_name, persist_directory and chroma_url configure the default Chroma "
                "store; pass them to your own vectorstore instead"
            )
        if vectorstore is None:
            vectorstore = default_chroma(embedding, collection_name, persist_directory, chroma_url)
        if engine is not None and vllm_url is not None:
            raise ValueError("engine and vllm_url both name who answers the questions: pass one")
        self.vectorstore = vectorstore
        self._engine = engine
        self.show_progress = show_progress
        self.vllm_url = vllm_url

    @property
    def engine(self) -> KVEngine:
        """The engine that precomputes KV; the shared default model unless one was given."""
        if self._engine is None:
            self._engine = KVEngine.shared()
        return self._engine

    @property
    def embeddings(self) -> Embeddings | None:
        return self.vectorstore.embeddings

    # ---- adding: index first, then store ----------------------------------------------------------

    def _index(self, texts: list[str], metadatas: list[dict] | None = None) -> None:
        """With an engine of block context "document", a text that follows one of the same `source` (a loader's
        file, a splitter's chunks of it in order) is encoded after it."""
        if self.vllm_url is not None:
            index_through_vllm(self.vllm_url, texts)
        elif getattr(self.engine, "block_context", "none") == "document":  # any object with `index` may stand in
            sources = [(m or {}).get("source") for m in metadatas] if metadatas else [None] * len(texts)
            self.engine.index(texts, progress=self.show_progress, preceding=preceding_in_documents(texts, sources))
        else:
            self.engine.index(texts, progress=self.show_progress)

    def add_texts(
        self,
        texts: Iterable[str],
        metadatas: list[dict] | None = None,
        *,
        ids: list[str] | None = None,
        **kwargs: Any,
    ) -> list[str]:
        """Encode and store the texts' KV (all checked first), then add them to the inner store.

        Returns one id per text: the given one, else `document_id(text, metadata)`."""
        texts = list(texts)
        if not texts:
            return []
        self._index(texts, metadatas)
        ids = _ids(texts, metadatas, ids)
        unique_texts, unique_metadatas, unique_ids = self._unique(texts, metadatas, ids)
        self.vectorstore.add_texts(unique_texts, unique_metadatas, ids=unique_ids, **kwargs)
        return ids

    @staticmethod
    def _unique(texts: list[str], metadatas: list[dict] | None, ids: list[str]) -> tuple:
        """(texts, metadatas, ids) with one entry per id, for the inner store's add_texts."""
        keep = _last_of_each(ids)
        kept_metadatas = [metadatas[i] for i in keep] if metadatas is not None else None
        return [texts[i] for i in keep], kept_metadatas, [ids[i] for i in keep]

    @staticmethod
    def _with_ids(documents: list[Document], ids: list[str] | None) -> tuple[list[Document], list[str], list[str]]:
        """(documents to store, their ids, one id per given document): `ids`, else `Document.id`,
        else the content-derived id."""
        texts, metadatas = [d.page_content for d in documents], [d.metadata for d in documents]
        ids = _ids(texts, metadatas, ids if ids is not None else [d.id for d in documents])
        keep = _last_of_each(ids)
        return [documents[i] for i in keep], [ids[i] for i in keep], ids

    def add_documents(self, documents: list[Document], **kwargs: Any) -> list[str]:
        """Encode and store the documents' KV (all checked first), then add them to the inner store."""
        if not documents:
            return []
        self._index([doc.page_content for doc in documents], [doc.metadata for doc in documents])
        unique, unique_ids, ids = self._with_ids(documents, kwargs.pop("ids", None))
        self.vectorstore.add_documents(unique, ids=unique_ids, **kwargs)
        return ids

    async def aadd_texts(
        self,
        texts: Iterable[str],
        metadatas: list[dict] | None = None,
        *,
        ids: list[str] | None = None,
        **kwargs: Any,
    ) -> list[str]:
        """`add_texts` without blocking the event loop: encoding runs in an executor thread."""
        texts = list(texts)
        if not texts:
            return []
        await run_in_executor(None, self._index, texts, metadatas)
        ids = _ids(texts, metadatas, ids)
        unique_texts, unique_metadatas, unique_ids = self._unique(texts, metadatas, ids)
        await self.vectorstore.aadd_texts(unique_texts, unique_metadatas, ids=unique_ids, **kwargs)
        return ids

    async def aadd_documents(self, documents: list[Document], **kwargs: Any) -> list[str]:
        """`add_documents` without blocking the event loop: encoding runs in an executor thread."""
        if not documents:
            return []
        await run_in_executor(None, self._index, [doc.page_content for doc in documents],
                              [doc.metadata for doc in documents])
        unique, unique_ids, ids = self._with_ids(documents, kwargs.pop("ids", None))
        await self.vectorstore.aadd_documents(unique, ids=unique_ids, **kwargs)
        return ids

    @classmethod
    def from_texts(
        cls,
        texts: list[str],
        embedding: Embeddings,
        metadatas: list[dict] | None = None,
        *,
        ids: list[str] | None = None,
        **kwargs: Any,
    ) -> Self:
        """A store over the default Chroma with `embedding`, holding `texts` (their KV computed).

        `kwargs` are the constructor's (`engine`, `collection_name`, `persist_directory`, `chroma_url`,
        ...).
        `from_documents` comes through here.
        """
        store = cls(embedding=embedding, **kwargs)
        store.add_texts(texts, metadatas, ids=ids)
        return store

    @classmethod
    async def afrom_texts(
        cls,
        texts: list[str],
        embedding: Embeddings,
        metadatas: list[dict] | None = None,
        *,
        ids: list[str] | None = None,
        **kwargs: Any,
    ) -> Self:
        """`from_texts` without blocking the event loop. `afrom_documents` comes through here."""
        store = await run_in_executor(None, partial(cls, embedding=embedding, **kwargs))
        await store.aadd_texts(texts, metadatas, ids=ids)
        return store

    # ---- everything else is the inner store's -----------------------------------------------------

    def delete(self, ids: list[str] | None = None, **kwargs: Any) -> bool | None:
        """Delete from the inner store (the KV stays cached; see the class docstring)."""
        return self.vectorstore.delete(ids, **kwargs)

    async def adelete(self, ids: list[str] | None = None, **kwargs: Any) -> bool | None:
        return await self.vectorstore.adelete(ids, **kwargs)

    def get_by_ids(self, ids: Sequence[str], /) -> list[Document]:
        return self.vectorstore.get_by_ids(ids)

    async def aget_by_ids(self, ids: Sequence[str], /) -> list[Document]:
        return await self.vectorstore.aget_by_ids(ids)

    def similarity_search(self, query: str, k: int = 4, **kwargs: Any) -> list[Document]:
        return self.vectorstore.similarity_search(query, k, **kwargs)

    async def asimilarity_search(self, query: str, k: int = 4, **kwargs: Any) -> list[Document]:
        return await self.vectorstore.asimilarity_search(query, k, **kwargs)

    def similarity_search_with_score(self, *args: Any, **kwargs: Any) -> list[tuple[Document, float]]:
        return self.vectorstore.similarity_search_with_score(*args, **kwargs)

    async def asimilarity_search_with_score(self, *args: Any, **kwargs: Any) -> list[tuple[Document, float]]:
        return await self.vectorstore.asimilarity_search_with_score(*args, **kwargs)

    def similarity_search_with_relevance_scores(
        self, query: str, k: int = 4, **kwargs: Any
    ) -> list[tuple[Document, float]]:
        return self.vectorstore.similarity_search_with_relevance_scores(query, k, **kwargs)

    async def asimilarity_search_with_relevance_scores(
        self, query: str, k: int = 4, **kwargs: Any
    ) -> list[tuple[Document, float]]:
        return await self.vectorstore.asimilarity_search_with_relevance_scores(query, k, **kwargs)

    def _select_relevance_score_fn(self) -> Callable[[float], float]:
        return self.vectorstore._select_relevance_score_fn()

    def similarity_search_by_vector(self, embedding: list[float], k: int = 4, **kwargs: Any) -> list[Document]:
        return self.vectorstore.similarity_search_by_vector(embedding, k, **kwargs)

    async def asimilarity_search_by_vector(self, embedding: list[float], k: int = 4, **kwargs: Any) -> list[Document]:
        return await self.vectorstore.asimilarity_search_by_vector(embedding, k, **kwargs)

    def max_marginal_relevance_search(
        self, query: str, k: int = 4, fetch_k: int = 20, lambda_mult: float = 0.5, **kwargs: Any
    ) -> list[Document]:
        return self.vectorstore.max_marginal_relevance_search(query, k, fetch_k, lambda_mult, **kwargs)

    async def amax_marginal_relevance_search(
        self, query: str, k: int = 4, fetch_k: int = 20, lambda_mult: float = 0.5, **kwargs: Any
    ) -> list[Document]:
        return await self.vectorstore.amax_marginal_relevance_search(query, k, fetch_k, lambda_mult, **kwargs)

    def max_marginal_relevance_search_by_vector(
        self, embedding: list[float], k: int = 4, fetch_k: int = 20, lambda_mult: float = 0.5, **kwargs: Any
    ) -> list[Document]:
        return self.vectorstore.max_marginal_relevance_search_by_vector(embedding, k, fetch_k, lambda_mult, **kwargs)

    async def amax_marginal_relevance_search_by_vector(
        self, embedding: list[float], k: int = 4, fetch_k: int = 20, lambda_mult: float = 0.5, **kwargs: Any
    ) -> list[Document]:
        return await self.vectorstore.amax_marginal_relevance_search_by_vector(
            embedding, k, fetch_k, lambda_mult, **kwargs
        )

