"""Response synthesizers: retrieved nodes as KV blocks, and map-rerank for comparison.

`KVBlockSynthesizer` hands every retrieved node to `KVRagLLM` as a passage of its own, so each is
served from its cached KV and only the question is prefilled. `MapRerankSynthesizer` completes
the comparison set next to LlamaIndex's built-in `simple_summarize` (like "stuff"),
`tree_summarize` (like MapReduce) and `compact`, which any LLM can run.
"""

import asyncio
import base64
from collections.abc import AsyncIterator, Iterator, Sequence
from typing import Any

from kvrag import EmptyInputError
from kvrag.chains import MAP_RERANK_SYSTEM, map_message, rerank
from llama_index.core.base.llms.types import ChatMessage, ChatResponse, DocumentBlock, MessageRole, TextBlock
from llama_index.core.base.response.schema import RESPONSE_TYPE, AsyncStreamingResponse, Response, StreamingResponse
from llama_index.core.callbacks import CallbackManager
from llama_index.core.callbacks.schema import CBEventType, EventPayload
from llama_index.core.instrumentation import get_dispatcher
from llama_index.core.instrumentation.events.synthesis import SynthesizeEndEvent, SynthesizeStartEvent
from llama_index.core.llms import LLM
from llama_index.core.prompts.mixin import PromptDictType
from llama_index.core.response_synthesizers import BaseSynthesizer
from llama_index.core.schema import NodeWithScore, QueryBundle, QueryType
from llama_index.core.types import RESPONSE_TEXT_TYPE

from .base import KVRagLLM
from .precompute import llm_texts

dispatcher = get_dispatcher(__name__)


class KVBlockSynthesizer(BaseSynthesizer):
    """Answers from the retrieved nodes as separate KV blocks: one `KVRagLLM` call, no re-reading.

    The LLM gets the system instruction and one user message holding a text `DocumentBlock` per
    node (its `MetadataMode.LLM` content, as `KVPrecompute` stored it) and the question. With
    kvrag's default instruction the prompt is exactly `engine.generate(question, passages)`'s.

    `Response.metadata["kvrag"]` holds the generation's figures (ttft, reused_tokens,
    prefilled_tokens, cache_hits, ...) next to the source nodes' metadata; a streaming response
    gets them once its generator is used up. No nodes, or a node without text, raise
    `kvrag.EmptyInputError` (the built-in synthesizers answer "Empty Response" instead).

    Example:
        ```python
        from llama_index.core.query_engine import RetrieverQueryEngine
        from llama_index.llms.kvrag import KVBlockSynthesizer, KVRagLLM

        query_engine = RetrieverQueryEngine(retriever, response_synthesizer=KVBlockSynthesizer(KVRagLLM()))
        response = query_engine.query("Who built the Varnholm lighthouse?")
        response.metadata["kvrag"]["reused_tokens"]
        ```
    """

    def __init__(
        self,
        llm: KVRagLLM | None = None,
        *,
        system_prompt: str | None = None,
        streaming: bool = False,
        callback_manager: CallbackManager | None = None,
    ) -> None:
        """`system_prompt`: the instruction before the passages; None is kvrag's (the engine's prompt format)."""
        llm = llm if llm is not None else KVRagLLM()
        if not isinstance(llm, KVRagLLM):
            raise TypeError(f"KVBlockSynthesizer needs a KVRagLLM, got {type(llm).__name__}; other LLMs can use 'compact'")
        super().__init__(llm=llm, callback_manager=callback_manager, streaming=streaming)
        prompt_format = llm.engine.layout.format
        self._system_prompt = prompt_format.system if system_prompt is None else system_prompt
        self._question_format = prompt_format.question

    def _get_prompts(self) -> PromptDictType:
        return {}

    def _update_prompts(self, prompts: PromptDictType) -> None:
        pass

    def messages(self, query_str: str, passages: Sequence[str]) -> list[ChatMessage]:
        """The instruction, then one user message: a text document per passage and the question."""
        # base64 already: DocumentBlock takes bytes that happen to be valid base64 ("abcd") for encoded data
        blocks: list = [
            DocumentBlock(data=base64.b64encode(text.encode("utf-8")), document_mimetype="text/plain", title=f"passage {i}")
            for i, text in enumerate(passages)
        ]
        blocks.append(TextBlock(text=self._question_format.format(question=query_str)))
        head = [ChatMessage(role=MessageRole.SYSTEM, content=self._system_prompt)] if self._system_prompt else []
        return [*head, ChatMessage(role=MessageRole.USER, blocks=blocks)]

    def get_response(self, query_str: str, text_chunks: Sequence[str], **response_kwargs: Any) -> RESPONSE_TEXT_TYPE:
        messages = self.messages(query_str, text_chunks)
        if self._streaming:
            return _deltas(self._llm.stream_chat(messages, **response_kwargs), {})
        return self._llm.chat(messages, **response_kwargs).message.content

    async def aget_response(self, query_str: str, text_chunks: Sequence[str], **response_kwargs: Any) -> RESPONSE_TEXT_TYPE:
        messages = self.messages(query_str, text_chunks)
        if self._streaming:
            return _adeltas(await self._llm.astream_chat(messages, **response_kwargs), {})
        return (await self._llm.achat(messages, **response_kwargs)).message.content

    def _start(self, query: QueryType, nodes: list[NodeWithScore], additional_source_nodes) -> tuple:
        """Checked inputs: the query bundle, the passages, the source nodes and the response metadata."""
        if not nodes:
            raise EmptyInputError("no nodes to answer from: the retriever returned none")
        passages = llm_texts([n.node for n in nodes])
        query = QueryBundle(query_str=query) if isinstance(query, str) else query
        source_nodes = list(nodes) + list(additional_source_nodes or [])
        return query, passages, source_nodes, self._get_metadata_for_response([n.node for n in source_nodes])

    @dispatcher.span
    def synthesize(
        self,
        query: QueryType,
        nodes: list[NodeWithScore],
        additional_source_nodes: Sequence[NodeWithScore] | None = None,
        **response_kwargs: Any,
    ) -> RESPONSE_TYPE:
        query, passages, source_nodes, metadata = self._start(query, nodes, additional_source_nodes)
        dispatcher.event(SynthesizeStartEvent(query=query))
        with self._callback_manager.event(CBEventType.SYNTHESIZE, payload={EventPayload.QUERY_STR: query.query_str}) as event:
            messages = self.messages(query.query_str, passages)
            if self._streaming:
                deltas = _deltas(self._llm.stream_chat(messages, **response_kwargs), metadata)
                response = StreamingResponse(deltas, source_nodes=source_nodes, metadata=metadata)
            else:
                reply = self._llm.chat(messages, **response_kwargs)
                metadata["kvrag"] = reply.additional_kwargs
                response = Response(reply.message.content, source_nodes=source_nodes, metadata=metadata)
            event.on_end(payload={EventPayload.RESPONSE: response})
        dispatcher.event(SynthesizeEndEvent(query=query, response=response))
        return response

    @dispatcher.span
    async def asynthesize(
        self,
        query: QueryType,
        nodes: list[NodeWithScore],
        additional_source_nodes: Sequence[NodeWithScore] | None = None,
        **response_kwargs: Any,
    ) -> RESPONSE_TYPE:
        query, passages, source_nodes, metadata = self._start(query, nodes, additional_source_nodes)
        dispatcher.event(SynthesizeStartEvent(query=query))
        with self._callback_manager.event(CBEventType.SYNTHESIZE, payload={EventPayload.QUERY_STR: query.query_str}) as event:
            messages = self.messages(query.query_str, passages)
            if self._streaming:
                deltas = _adeltas(await self._llm.astream_chat(messages, **response_kwargs), metadata)
                response = AsyncStreamingResponse(deltas, source_nodes=source_nodes, metadata=metadata)
            else:
                reply = await self._llm.achat(messages, **response_kwargs)
                metadata["kvrag"] = reply.additional_kwargs
                response = Response(reply.message.content, source_nodes=source_nodes, metadata=metadata)
            event.on_end(payload={EventPayload.RESPONSE: response})
        dispatcher.event(SynthesizeEndEvent(query=query, response=response))
        return response


def _deltas(stream: Iterator[ChatResponse], metadata: dict) -> Iterator[str]:
    """The text deltas of a KVRagLLM stream; its figures go to metadata["kvrag"] at the end."""
    for reply in stream:
        if reply.delta:
            yield reply.delta
        if reply.additional_kwargs:
            metadata["kvrag"] = reply.additional_kwargs


async def _adeltas(stream: AsyncIterator[ChatResponse], metadata: dict) -> AsyncIterator[str]:
    async for reply in stream:
        if reply.delta:
            yield reply.delta
        if reply.additional_kwargs:
            metadata["kvrag"] = reply.additional_kwargs


class MapRerankSynthesizer(BaseSynthesizer):
    """One call per node answers the question and rates the answer 0-100; the best-rated answer wins.

    LlamaIndex has no map-rerank mode; this one works with any LLM and is `kvrag.chains`'
    map-rerank (what `kvrag bench accuracy` runs): the same messages, and scores parsed leniently by
    the same `rerank`: an answer without a score ranks below every scored one, ties go to the earlier
    node, i.e. the retriever's better one. The async path runs the calls concurrently. A streaming
    response yields the winning answer in one piece.
    """

    def __init__(
        self,
        llm: LLM | None = None,
        *,
        system_prompt: str = MAP_RERANK_SYSTEM,
        streaming: bool = False,
        callback_manager: CallbackManager | None = None,
    ) -> None:
        super().__init__(llm=llm, callback_manager=callback_manager, streaming=streaming)
        self._system_prompt = system_prompt

    def _get_prompts(self) -> PromptDictType:
        return {}

    def _update_prompts(self, prompts: PromptDictType) -> None:
        pass

    def messages(self, query_str: str, passage: str) -> list[ChatMessage]:
        """The scoring instruction, then the passage, a blank line and the question as the user message."""
        return [
            ChatMessage(role=MessageRole.SYSTEM, content=self._system_prompt),
            ChatMessage(role=MessageRole.USER, content=map_message(passage, query_str)),
        ]

    def _best(self, replies: Sequence[ChatResponse]) -> str:
        best, _ = rerank([reply.message.content or "" for reply in replies])
        return best.answer

    def get_response(self, query_str: str, text_chunks: Sequence[str], **response_kwargs: Any) -> RESPONSE_TEXT_TYPE:
        answer = self._best([self._llm.chat(self.messages(query_str, c), **response_kwargs) for c in text_chunks])
        return _one(answer) if self._streaming else answer

    async def aget_response(self, query_str: str, text_chunks: Sequence[str], **response_kwargs: Any) -> RESPONSE_TEXT_TYPE:
        calls = [self._llm.achat(self.messages(query_str, c), **response_kwargs) for c in text_chunks]
        answer = self._best(await asyncio.gather(*calls))
        return _aone(answer) if self._streaming else answer


def _one(text: str) -> Iterator[str]:
    yield text


async def _aone(text: str) -> AsyncIterator[str]:
    yield text
