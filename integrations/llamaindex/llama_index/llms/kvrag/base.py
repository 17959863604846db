"""KVRagLLM: a LlamaIndex LLM whose retrieved passages are served from their cached KV (kvrag).

Passages reach the model in two ways:

* explicit (`chat`): a message's `DocumentBlock`s holding text, and, when a message has several
  `TextBlock`s, every one but the last; the last text block is the question;
* drop-in: any prompt at all (the built-in `compact` and `simple_summarize` synthesizers, a
  hand-written template). The engine finds the passages it knows inside the rendered prompt by
  content and reuses their KV; everything else is prefilled as ordinary text. It knows what was
  indexed (`KVPrecompute`, `engine.index`) and every node a retriever returned in this process
  (`learning`: no user step), whose KV is computed the first time a prompt holds it.

Both become one rendered chat-template string plus the passages' character spans in it, so a
prompt that renders to the same text gets the same blocks and the same answer either way.
"""

import asyncio
from collections.abc import AsyncIterator, Iterator, Sequence
from dataclasses import asdict
from pathlib import Path
from typing import Any

from kvrag import EmptyInputError, GenerationResult, InputEncodingError, KVEngine, Mode, Passage
from llama_index.core.base.llms.types import (
    CachePoint,
    ChatMessage,
    ChatResponse,
    ChatResponseAsyncGen,
    ChatResponseGen,
    CompletionResponse,
    CompletionResponseAsyncGen,
    CompletionResponseGen,
    DocumentBlock,
    LLMMetadata,
    MessageRole,
    TextBlock,
    ThinkingBlock,
)
from llama_index.core.bridge.pydantic import ConfigDict, Field, PrivateAttr
from llama_index.core.llms.callbacks import llm_chat_callback, llm_completion_callback
from llama_index.core.llms.custom import CustomLLM

from . import learning

_CALL_OPTIONS = ("mode", "max_new_tokens", "temperature", "top_p", "top_k", "seed", "stop", "max_time")
_ROLES = {
    MessageRole.SYSTEM: "system",
    MessageRole.DEVELOPER: "system",
    MessageRole.USER: "user",
    MessageRole.ASSISTANT: "assistant",
    MessageRole.CHATBOT: "assistant",
    MessageRole.MODEL: "assistant",
}


class KVRagLLM(CustomLLM):
    """LLM over a local transformers model that reuses passages' KV caches (kvrag).

    Example:
        ```python
        from llama_index.core.base.llms.types import ChatMessage, DocumentBlock, TextBlock
        from llama_index.llms.kvrag import KVRagLLM

        llm = KVRagLLM()  # the default SmolLM2-135M-Instruct, offline
        passage = "The Varnholm lighthouse was built in 1873 by Ilsa Brandt."
        llm.engine.index([passage])  # or through KVPrecompute in an ingestion pipeline
        message = ChatMessage(
            role="user",
            blocks=[DocumentBlock(data=passage.encode(), document_mimetype="text/plain"),
                    TextBlock(text="Who built the Varnholm lighthouse?")],
        )
        response = llm.chat([message])
        response.additional_kwargs["ttft"], response.additional_kwargs["reused_tokens"]
        ```
    """

    model_config = ConfigDict(extra="forbid")

    model: str | None = Field(
        default=None, description="Local model directory, GGUF file or cached hub id; None is the embedded default model."
    )
    device: str = Field(
        default="auto", description='Where the model runs when no engine is given: "auto" (a CUDA GPU when torch '
        'sees one, else the CPU), "cpu", "cuda" or "cuda:N".'
    )
    dtype: str = Field(
        default="auto", description='Weights and compute when no engine is given: "auto" (bfloat16 or float16 on a '
        'GPU, float32 on the CPU), "float32", "float16" or "bfloat16".'
    )
    mode: Mode | None = Field(
        default=None,
        description="How passages are used: `block` reuses their cached KV, `full` prefills everything (the "
        "'stuff' baseline), `blend` reuses it but recomputes the share of passage tokens whose KV changes most "
        "in context (after CacheBlend, the engine's `BlendConfig`), `auto` as many as hold most of that "
        "change, `prefix` reuses only exact leading runs, `composite` keeps encode positions; "
        "None: the engine's `default_mode`.",
    )
    max_new_tokens: int = Field(default=256, ge=1, description="Tokens to generate at most (`metadata.num_output`).")
    temperature: float = Field(default=0.0, ge=0.0, description="0 is greedy decoding.")
    top_p: float = Field(default=1.0, gt=0.0, le=1.0)
    top_k: int = Field(default=0, ge=0, description="0 keeps every token.")
    seed: int | None = Field(default=None, description="Seed for sampling, for repeatable answers.")
    stop: list[str] | None = Field(default=None, description="Strings that end the answer (not included in it).")
    max_time: float | None = Field(
        default=None, gt=0, description='Seconds a generation may take; it ends early with finish_reason "timeout".'
    )

    _engine: KVEngine = PrivateAttr()

    def __init__(self, engine: KVEngine | None = None, **kwargs: Any) -> None:
        """`engine`: the engine holding the model and the KV store; `KVEngine.shared(model)` when not given."""
        super().__init__(**kwargs)
        self._engine = engine if engine is not None else KVEngine.shared(self.model, device=self.device, dtype=self.dtype)
        learning.register(self)  # retrieved nodes reach this engine with no user step

    @classmethod
    def class_name(cls) -> str:
        return "KVRagLLM"

    @property
    def engine(self) -> KVEngine:
        return self._engine

    @property
    def model_name(self) -> str:
        return Path(self._engine.model.name_or_path).name or "kvrag"

    @property
    def metadata(self) -> LLMMetadata:
        return LLMMetadata(
            context_window=self._engine.context_window,
            num_output=self.max_new_tokens,
            is_chat_model=True,
            model_name=self.model_name,
        )

    # ---- prompts ------------------------------------------------------------------------------------

    def render(self, messages: Sequence[ChatMessage]) -> tuple[str, list[tuple[int, int]] | None]:
        """The chat-template text of `messages` and the character spans of their explicit passages
        (None when there are none: the engine then finds indexed passages in the text itself)."""
        if not messages:
            raise ValueError("KVRagLLM needs at least one message")
        return self._engine.layout.render_chat([(_role(m), _parts(m)) for m in messages])

    def _render_completion(self, prompt: str, formatted: bool) -> tuple[str, None]:
        """A completion prompt is one user message under the chat template; `formatted` ones are used as is."""
        if formatted:
            return prompt, None
        return self._engine.layout.render_chat([("user", [prompt])])

    # ---- generation ---------------------------------------------------------------------------------

    def _options(self, kwargs: dict[str, Any]) -> dict[str, Any]:
        unknown = [k for k in kwargs if k not in _CALL_OPTIONS]
        if unknown:
            raise TypeError(f"KVRagLLM got unexpected options {unknown}; it takes {list(_CALL_OPTIONS)}")
        options = {k: kwargs.get(k, getattr(self, k)) for k in _CALL_OPTIONS}
        options["mode"] = options["mode"] or self._engine.default_mode
        return options

    def _stats(self, result: GenerationResult) -> dict[str, Any]:
        return {
            "model_name": self.model_name,
            "mode": result.mode,
            "ttft": result.ttft,
            "total_time": result.total_time,
            "prompt_tokens": result.prompt_tokens,
            "completion_tokens": len(result.token_ids),
            "prefilled_tokens": result.prefilled_tokens,
            "reused_tokens": result.reused_tokens,
            "cache_hits": dict(result.cache_hits),
            "finish_reason": result.finish_reason,
        }

    def _generate(self, rendered: tuple[str, Any], options: dict[str, Any]) -> tuple[str, dict, dict]:
        result = self._engine.generate_text(*rendered, **options)
        return result.text, *self._finish(result)

    async def _agenerate(self, rendered: tuple[str, Any], options: dict[str, Any]) -> tuple[str, dict, dict]:
        stream = await asyncio.to_thread(self._engine.stream_text, *rendered, **options)  # tokenized off the loop
        async for _ in stream:
            pass
        return stream.result.text, *self._finish(stream.result)

    def _stream(self, rendered: tuple[str, Any], options: dict[str, Any]) -> Iterator[tuple[str, str, dict, dict | None]]:
        """(text so far, delta, stats, raw) per token; a last item with an empty delta carries the stats."""
        stream = self._engine.stream_text(*rendered, **options)
        text = ""
        for delta in stream:
            text += delta
            yield text, delta, {}, None
        yield text, "", *self._finish(stream.result)

    async def _astream(self, rendered: tuple[str, Any], options: dict[str, Any]) -> AsyncIterator[tuple[str, str, dict, dict | None]]:
        stream = await asyncio.to_thread(self._engine.stream_text, *rendered, **options)  # tokenized off the loop
        text = ""
        async for delta in stream:
            text += delta
            yield text, delta, {}, None
        yield text, "", *self._finish(stream.result)

    def _finish(self, result: GenerationResult) -> tuple[dict, dict]:
        stats = self._stats(result)
        learning.observe(stats)
        return stats, asdict(result)

    # Prompts and options are checked when called; only generation waits for the first `next`.

    def _complete(self, prompt: str, formatted: bool = False, **kwargs: Any) -> CompletionResponse:
        text, stats, raw = self._generate(self._render_completion(prompt, formatted), self._options(kwargs))
        return CompletionResponse(text=text, raw=raw, additional_kwargs=stats)

    def _stream_complete(self, prompt: str, formatted: bool = False, **kwargs: Any) -> CompletionResponseGen:
        steps = self._stream(self._render_completion(prompt, formatted), self._options(kwargs))
        return (CompletionResponse(text=text, delta=delta, raw=raw, additional_kwargs=stats) for text, delta, stats, raw in steps)

    def _chat(self, messages: Sequence[ChatMessage], **kwargs: Any) -> ChatResponse:
        text, stats, raw = self._generate(self.render(messages), self._options(kwargs))
        return ChatResponse(message=_assistant(text), raw=raw, additional_kwargs=stats)

    def _stream_chat(self, messages: Sequence[ChatMessage], **kwargs: Any) -> ChatResponseGen:
        steps = self._stream(self.render(messages), self._options(kwargs))
        return (ChatResponse(message=_assistant(text), delta=delta, raw=raw, additional_kwargs=stats) for text, delta, stats, raw in steps)

    @llm_completion_callback()
    def complete(self, prompt: str, formatted: bool = False, **kwargs: Any) -> CompletionResponse:
        """Complete `prompt`, sent as one user message (`formatted=True`: the text already has the chat
        template). Options override the fields for this call: mode, max_new_tokens, temperature, top_p,
        top_k, seed, stop, max_time. `additional_kwargs` holds ttft, reused and prefilled tokens."""
        return self._complete(prompt, formatted, **kwargs)

    @llm_completion_callback()
    def stream_complete(self, prompt: str, formatted: bool = False, **kwargs: Any) -> CompletionResponseGen:
        """As `complete`, token by token; a last response with an empty delta carries the figures."""
        return self._stream_complete(prompt, formatted, **kwargs)

    @llm_chat_callback()
    def chat(self, messages: Sequence[ChatMessage], **kwargs: Any) -> ChatResponse:
        """Answer the conversation; text documents and all but a message's last text block are passages."""
        return self._chat(messages, **kwargs)

    @llm_chat_callback()
    def stream_chat(self, messages: Sequence[ChatMessage], **kwargs: Any) -> ChatResponseGen:
        return self._stream_chat(messages, **kwargs)

    # The async variants read from the engine's scheduler on the event loop, no thread per request: concurrent
    # calls are decoded in one batch.

    @llm_completion_callback()
    async def acomplete(self, prompt: str, formatted: bool = False, **kwargs: Any) -> CompletionResponse:
        text, stats, raw = await self._agenerate(self._render_completion(prompt, formatted), self._options(kwargs))
        return CompletionResponse(text=text, raw=raw, additional_kwargs=stats)

    @llm_completion_callback()
    async def astream_complete(self, prompt: str, formatted: bool = False, **kwargs: Any) -> CompletionResponseAsyncGen:
        steps = self._astream(self._render_completion(prompt, formatted), self._options(kwargs))
        return (CompletionResponse(text=text, delta=delta, raw=raw, additional_kwargs=stats) async for text, delta, stats, raw in steps)

    @llm_chat_callback()
    async def achat(self, messages: Sequence[ChatMessage], **kwargs: Any) -> ChatResponse:
        text, stats, raw = await self._agenerate(self.render(messages), self._options(kwargs))
        return ChatResponse(message=_assistant(text), raw=raw, additional_kwargs=stats)

    @llm_chat_callback()
    async def astream_chat(self, messages: Sequence[ChatMessage], **kwargs: Any) -> ChatResponseAsyncGen:
        steps = self._astream(self.render(messages), self._options(kwargs))
        return (ChatResponse(message=_assistant(text), delta=delta, raw=raw, additional_kwargs=stats) async for text, delta, stats, raw in steps)


def _assistant(text: str) -> ChatMessage:
    return ChatMessage(role=MessageRole.ASSISTANT, content=text)


def _role(message: ChatMessage) -> str:
    if message.role not in _ROLES:
        raise ValueError(f"KVRagLLM takes system, user and assistant messages; got a {message.role.value} message (no tool support)")
    return _ROLES[message.role]


def _parts(message: ChatMessage) -> list[str | Passage]:
    """A message's text: its text documents and, of several text blocks, all but the last, as passages."""
    parts: list[str | Passage] = []
    for block in message.blocks:
        if isinstance(block, TextBlock):
            if block.text.strip():
                parts.append(block.text)
        elif isinstance(block, DocumentBlock):
            parts.append(Passage(_document_text(block)))
        elif not isinstance(block, (CachePoint, ThinkingBlock)):  # a cache hint; a past answer's reasoning
            raise ValueError(f"KVRagLLM reads text and text documents; got a {block.block_type!r} block")
    texts = [i for i, part in enumerate(parts) if isinstance(part, str)]
    for i in texts[:-1]:
        parts[i] = Passage(parts[i])
    return parts


def _document_text(block: DocumentBlock) -> str:
    mimetype = block.document_mimetype or ""
    if not (mimetype.startswith("text/") or mimetype in ("application/json", "application/xml")):
        raise ValueError(f"KVRagLLM reads text documents only; got a {mimetype or 'untyped'} document {block.title!r}")
    if isinstance(block.data, bytes) and not block.data:
        raise EmptyInputError(f"document {block.title!r} is empty")
    data = block.resolve_document().read()
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise InputEncodingError(f"document {block.title!r} is not valid UTF-8: {exc}") from exc
