"""KVPrecompute: the ingestion step that computes each node's KV cache once, when it is indexed.

Use it in an `IngestionPipeline`, or in `VectorStoreIndex.from_documents(..., transformations=[...])`
(`index.insert` then runs it too), after the node parser and before the embedding. It stores the
KV of each node's LLM-visible text, `node.get_content(MetadataMode.LLM)`, which is exactly what
LlamaIndex's synthesizers put in the prompt, and returns the nodes unchanged.

Nothing at query time depends on this step having run in the current process: the KV lives in the
engine's store on disk, keyed by content, and a passage whose KV is missing (a re-run that the
pipeline's cache skipped, a fresh KVRAG_HOME) is computed when a question first needs it.
"""

import asyncio
from collections.abc import Sequence
from typing import Any

from kvrag import EmptyInputError
from kvrag.vllm_client import index as index_through_vllm
from llama_index.core.bridge.pydantic import Field
from pydantic import computed_field
from llama_index.core.schema import BaseNode, MetadataMode, TransformComponent

from .base import KVRagLLM


class KVPrecompute(TransformComponent):
    """Precompute and store the KV cache of every node's LLM-visible content.

    Every node is checked before anything is computed: a node with no text, or one too long for
    the model's context window, raises an error naming the node and nothing is stored.

    Example:
        ```python
        from llama_index.core.ingestion import IngestionPipeline
        from llama_index.core.node_parser import SentenceSplitter
        from llama_index.llms.kvrag import KVPrecompute, KVRagLLM, default_embed_model, default_vector_store

        llm = KVRagLLM()
        pipeline = IngestionPipeline(
            transformations=[SentenceSplitter(chunk_size=256), KVPrecompute(llm=llm), default_embed_model()],
            vector_store=default_vector_store(),
        )
        pipeline.run(documents=documents)
        ```
    """

    llm: KVRagLLM | None = Field(default=None, exclude=True, description="The LLM whose engine stores the KV (default: "
                                 "KVRagLLM(), made on first use).")
    vllm_url: str | None = Field(default=None, exclude=True, description="A vLLM server running kvrag's connector (http://HOST:PORT) "
                                 "that answers instead (OpenAILike(api_base=URL + '/v1')): nodes are indexed through "
                                 "it, and `llm` is not used.")

    @computed_field
    @property
    def fingerprint(self) -> str:
        """The model's fingerprint: what an ingestion cache keys this step by (generation settings are not)."""
        if self.vllm_url is not None:
            return f"vllm:{self.vllm_url}"
        return self._engine().fingerprint

    def _engine(self):
        if self.llm is None:
            self.llm = KVRagLLM()
        return self.llm.engine

    @classmethod
    def class_name(cls) -> str:
        return "KVPrecompute"

    def __call__(self, nodes: Sequence[BaseNode], **kwargs: Any) -> Sequence[BaseNode]:
        if not nodes:  # a pipeline re-run whose documents are all unchanged passes none
            return nodes
        if self.vllm_url is not None:
            index_through_vllm(self.vllm_url, llm_texts(nodes))
            return nodes
        engine, texts = self._engine(), llm_texts(nodes)
        preceding = None  # block context "document": a node after the node before it, where the batch holds that one
        if engine.block_context == "document":
            text_of = {node.node_id: text for node, text in zip(nodes, texts)}
            preceding = [text_of.get(node.prev_node.node_id) if node.prev_node else None for node in nodes]
        engine.index(texts, names=[f"node {node.node_id}" for node in nodes],
                     progress=kwargs.get("show_progress", False), preceding=preceding)
        return nodes

    async def acall(self, nodes: Sequence[BaseNode], **kwargs: Any) -> Sequence[BaseNode]:
        return await asyncio.to_thread(self.__call__, nodes, **kwargs)


def llm_texts(nodes: Sequence[BaseNode]) -> list[str]:
    """What LlamaIndex's synthesizers show the LLM of each node; a node without text is an error."""
    for node in nodes:
        if not node.get_content(metadata_mode=MetadataMode.NONE).strip():
            raise EmptyInputError(f"node {node.node_id} has no text")
    return [node.get_content(metadata_mode=MetadataMode.LLM) for node in nodes]
