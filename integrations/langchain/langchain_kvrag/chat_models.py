"""ChatKVRag: a LangChain chat model whose retrieved passages are served from their cached KV.

Passages reach the model in two ways:

* explicit: `text-plain` content blocks in a message (`create_plaintext_block(text=...)`), one per
  passage; the message's `text` blocks are the question;
* drop-in: any prompt at all (a `create_stuff_documents_chain`, a hand-written RAG template). The
  engine finds the passages it knows inside the rendered prompt by content and reuses their KV;
  everything else, including passages it never saw, is prefilled as ordinary text. It knows what
  was indexed (`KVRagVectorStore`, `engine.index`) and every document a retriever returned in this
  process (`callbacks`: no user step), whose KV is computed the first time a prompt holds it.

Both become one rendered chat-template string plus the passages' character spans in it, so a
prompt that renders to the same text gives the same blocks and the same answer either way.
"""

import asyncio
from collections.abc import AsyncIterator, Iterator, Sequence
from pathlib import Path
from typing import Any

from kvrag import GenerationResult, KVEngine, Mode, Passage
from langchain_core.callbacks import AsyncCallbackManagerForLLMRun, CallbackManagerForLLMRun
from langchain_core.language_models import BaseChatModel, LangSmithParams
from langchain_core.language_models.chat_models import agenerate_from_stream, generate_from_stream
from langchain_core.messages import (
    AIMessage,
    AIMessageChunk,
    BaseMessage,
    ChatMessage,
    HumanMessage,
    SystemMessage,
)
from langchain_core.messages.ai import UsageMetadata
from langchain_core.outputs import ChatGeneration, ChatGenerationChunk, ChatResult
from pydantic import ConfigDict, Field, model_validator

from langchain_kvrag import callbacks as kv_callbacks

_ROLES = {HumanMessage: "user", AIMessage: "assistant", SystemMessage: "system"}
_CALL_OPTIONS = ("mode", "max_tokens", "temperature", "top_p", "top_k", "seed")


class ChatKVRag(BaseChatModel):
    """Chat model over a local transformers model that reuses passages' KV caches (kvrag).

    Example:
        ```python
        from langchain_core.messages import HumanMessage
        from langchain_core.messages.content import create_plaintext_block
        from langchain_kvrag import ChatKVRag

        llm = ChatKVRag()  # the default SmolLM2-135M-Instruct, offline
        passages = ["The Varnholm lighthouse was built in 1873 by Ilsa Brandt."]
        llm.engine.index(passages)  # or add them through KVRagVectorStore
        message = HumanMessage(
            content=[create_plaintext_block(text=p) for p in passages]
            + [{"type": "text", "text": "Who built the Varnholm lighthouse?"}]
        )
        answer = llm.invoke([message])
        answer.response_metadata["ttft"], answer.usage_metadata["input_token_details"]
        ```
    """

    model_config = ConfigDict(arbitrary_types_allowed=True, extra="forbid")

    engine: KVEngine | None = Field(default=None, exclude=True)
    """The engine holding the model and the KV store; `KVEngine.shared(model)` when not given."""
    model: str | None = None
    """Local model directory, GGUF file or cached hub id; None is the embedded default model."""
    device: str = "auto"
    """Where the model runs when no engine is given: "auto" (a CUDA GPU when torch sees one, else the
    CPU), "cpu", "cuda" or "cuda:N"."""
    dtype: str = "auto"
    """Weights and compute when no engine is given: "auto" (bfloat16 or float16 on a GPU, float32 on
    the CPU), "float32", "float16" or "bfloat16"."""
    mode: Mode | None = None
    """How passages are used: `block` reuses their cached KV, `full` prefills everything (the
    "stuff" baseline), `blend` reuses it but recomputes the share of passage tokens whose KV changes most
    in context (after CacheBlend, the engine's `BlendConfig`), `auto` as many as hold most of that change,
    `prefix` reuses only exact leading runs, `composite` keeps encode positions.
    None: the engine's `default_mode`."""
    max_tokens: int = Field(default=256, ge=1)
    temperature: float = Field(default=0.0, ge=0.0)
    top_p: float = Field(default=1.0, gt=0.0, le=1.0)
    top_k: int = Field(default=0, ge=0)
    seed: int | None = None
    stop: list[str] | None = None
    streaming: bool = False
    """`invoke` streams internally (callbacks see each token)."""
    timeout: float | None = Field(default=None, gt=0)
    """Seconds a generation may take; it ends early with finish_reason "timeout"."""
    max_retries: int = 0
    """Accepted for LangChain's standard parameters; a local model has nothing to retry."""

    @model_validator(mode="after")
    def _load_engine(self) -> "ChatKVRag":
        if self.engine is None:
            self.engine = KVEngine.shared(self.model, device=self.device, dtype=self.dtype)
        kv_callbacks.register(self)  # documents any retriever returns reach this engine, no user step
        return self

    @property
    def _llm_type(self) -> str:
        return "kvrag"

    @property
    def model_name(self) -> str:
        return Path(self.engine.model.name_or_path).name or "kvrag"

    @property
    def _identifying_params(self) -> dict[str, Any]:
        mode = self.mode or self.engine.default_mode
        return {"model_name": self.model_name, "mode": mode, "fingerprint": self.engine.fingerprint}

    def _get_ls_params(self, stop: list[str] | None = None, **kwargs: Any) -> LangSmithParams:
        params = super()._get_ls_params(stop=stop, **kwargs)
        params["ls_provider"] = "kvrag"
        params["ls_model_name"] = kwargs.get("model") or self.model_name
        return params

    # ---- tokens -------------------------------------------------------------------------------------

    def get_token_ids(self, text: str) -> list[int]:
        return self.engine.layout.encode(text)

    def get_num_tokens_from_messages(self, messages: list[BaseMessage], tools: Sequence | None = None) -> int:
        if tools:
            raise NotImplementedError("ChatKVRag does not support tools")
        text, _ = self.render(messages)
        return len(self.engine.layout.encode(text))

    # ---- messages -> one rendered prompt --------------------------------------------------------------

    def render(self, messages: list[BaseMessage]) -> tuple[str, list[tuple[int, int]] | None]:
        """The chat-template text of `messages` and the character spans of their explicit passages
        (None when there are none: the engine then finds indexed passages in the text itself)."""
        if not messages:
            raise ValueError("ChatKVRag needs at least one message")
        turns = []
        for message in messages:
            parts = [Passage(text) if kind == "text-plain" else text for kind, text in _content_parts(message)]
            turns.append((_role(message), parts))
        return self.engine.layout.render_chat(turns)

    # ---- generation ---------------------------------------------------------------------------------

    def _options(self, stop: list[str] | None, kwargs: dict[str, Any]) -> dict[str, Any]:
        unknown = [k for k in kwargs if k not in _CALL_OPTIONS and not k.startswith("ls_")]
        if unknown:
            raise TypeError(f"ChatKVRag got unexpected call options {unknown}; it takes {list(_CALL_OPTIONS)}")
        options = {k: kwargs.get(k, getattr(self, k)) for k in _CALL_OPTIONS}
        options["max_new_tokens"] = options.pop("max_tokens")
        options["stop"] = list(dict.fromkeys([*(self.stop or []), *(stop or [])]))
        options["max_time"] = self.timeout
        options["mode"] = options["mode"] or self.engine.default_mode
        return options

    def _stream(
        self,
        messages: list[BaseMessage],
        stop: list[str] | None = None,
        run_manager: CallbackManagerForLLMRun | None = None,
        **kwargs: Any,
    ) -> Iterator[ChatGenerationChunk]:
        stream, mode = self._submit(messages, stop, kwargs)
        for delta in stream:
            chunk = ChatGenerationChunk(message=AIMessageChunk(content=delta))
            if run_manager:
                run_manager.on_llm_new_token(delta, chunk=chunk)
            yield chunk
        yield self._last_chunk(stream.result, mode)

    async def _astream(
        self,
        messages: list[BaseMessage],
        stop: list[str] | None = None,
        run_manager: AsyncCallbackManagerForLLMRun | None = None,
        **kwargs: Any,
    ) -> AsyncIterator[ChatGenerationChunk]:
        """Read from the engine's scheduler on the event loop: concurrent calls (`abatch`, many users) are
        decoded in one batch. The prompt is built (tokenized, its passages found) on a pool thread, so a
        long one never holds up the loop."""
        stream, mode = await asyncio.to_thread(self._submit, messages, stop, kwargs)
        async for delta in stream:
            chunk = ChatGenerationChunk(message=AIMessageChunk(content=delta))
            if run_manager:
                await run_manager.on_llm_new_token(delta, chunk=chunk)
            yield chunk
        yield self._last_chunk(stream.result, mode)

    def _generate(
        self,
        messages: list[BaseMessage],
        stop: list[str] | None = None,
        run_manager: CallbackManagerForLLMRun | None = None,
        **kwargs: Any,
    ) -> ChatResult:
        if self.streaming:
            return generate_from_stream(self._stream(messages, stop, run_manager, **kwargs))
        stream, mode = self._submit(messages, stop, kwargs)
        return self._chat_result(stream.drain(), mode)

    async def _agenerate(
        self,
        messages: list[BaseMessage],
        stop: list[str] | None = None,
        run_manager: AsyncCallbackManagerForLLMRun | None = None,
        **kwargs: Any,
    ) -> ChatResult:
        if self.streaming:
            return await agenerate_from_stream(self._astream(messages, stop, run_manager, **kwargs))
        stream, mode = await asyncio.to_thread(self._submit, messages, stop, kwargs)
        async for _ in stream:
            pass
        return self._chat_result(stream.result, mode)

    def _submit(self, messages: list[BaseMessage], stop: list[str] | None, kwargs: dict[str, Any]):
        options = self._options(stop, kwargs)
        text, spans = self.render(messages)
        return self.engine.stream_text(text, spans, **options), options["mode"]

    def _last_chunk(self, result: GenerationResult, mode: str) -> ChatGenerationChunk:
        return ChatGenerationChunk(
            message=AIMessageChunk(
                content="",
                usage_metadata=_usage(result),
                response_metadata=self._metadata(result, mode),
                chunk_position="last",
            ),
            generation_info={"finish_reason": result.finish_reason},
        )

    def _chat_result(self, result: GenerationResult, mode: str) -> ChatResult:
        message = AIMessage(content=result.text, usage_metadata=_usage(result), response_metadata=self._metadata(result, mode))
        return ChatResult(generations=[ChatGeneration(message=message, generation_info={"finish_reason": result.finish_reason})])

    def _metadata(self, result: GenerationResult, mode: str) -> dict[str, Any]:
        return {
            "model_name": self.model_name,
            "model_provider": "kvrag",
            "mode": mode,
            "ttft": result.ttft,
            "total_time": result.total_time,
            "prefilled_tokens": result.prefilled_tokens,
            "reused_tokens": result.reused_tokens,
            "cache_hits": dict(result.cache_hits),
            "finish_reason": result.finish_reason,
        }


def _usage(result: GenerationResult) -> UsageMetadata:
    output = len(result.token_ids)
    return UsageMetadata(
        input_tokens=result.prompt_tokens,
        output_tokens=output,
        total_tokens=result.prompt_tokens + output,
        input_token_details={"cache_read": result.reused_tokens},
    )


def _role(message: BaseMessage) -> str:
    if isinstance(message, ChatMessage):
        return message.role
    for cls, role in _ROLES.items():
        if isinstance(message, cls):
            return role
    raise ValueError(f"ChatKVRag takes system, human, AI and chat messages; got a {message.type} message (no tool support)")


def _content_parts(message: BaseMessage) -> list[tuple[str, str]]:
    """(kind, text) for each part of a message: kind "text" or "text-plain" (a passage)."""
    if isinstance(message.content, str):
        return [("text", message.content)]
    parts = []
    for block in message.content:
        if isinstance(block, str):
            parts.append(("text", block))
            continue
        kind = block.get("type")
        if kind not in ("text", "text-plain"):
            raise ValueError(f"ChatKVRag takes 'text' and 'text-plain' content blocks; got a {kind!r} block")
        if not isinstance(block.get("text"), str):
            raise ValueError(f"a {kind!r} block needs its text inline (url, base64 and file ids are not read)")
        parts.append((kind, block["text"]))
    return parts
