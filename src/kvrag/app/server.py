"""`kvrag serve`: an OpenAI-compatible HTTP API over one KVEngine.

An OpenAI client (the `openai` package, LangChain's ChatOpenAI, LlamaIndex's OpenAILike) reaches kvrag
by changing its base URL. Chat messages are rendered with the model's chat template and the indexed
passages found in the text reuse their KV, as `engine.generate_text` does in process; the reuse shows in
`usage.prompt_tokens_details.cached_tokens`. `/v1/completions` completes a prompt string as it is (no
template), for clients of the legacy API (LlamaIndex's OpenAILike unless `is_chat_model=True`). Passages
are indexed over HTTP (`POST /v1/passages`, kvrag's own endpoint) and `/v1/embeddings` serves the
packaged all-MiniLM-L6-v2, so one server backs both halves of an OpenAI-style RAG app. Given a passage
index (`kvrag serve`: the home's, or `--chroma URL`'s), the server also keeps the passages it indexes
there and retrieves from it (`POST /v1/passages/search`); replicas given the same Chroma server share
it. Every error has OpenAI's JSON shape, so the clients raise their usual exceptions.

Defaults where a request names nothing: greedy decoding (temperature 0, so the answer is the
in-process engine's) and at most `DEFAULT_MAX_TOKENS` tokens. With an API key set, every path but
/health and /metrics (open, as vLLM's are) needs `Authorization: Bearer KEY`, the API docs included.

Every request is bounded before it costs the others anything: its body by bytes as it arrives, a
prompt by characters before it is tokenized, and the prompt is built (template, tokenizer, passage
matching) on a pool thread, never on the event loop or the scheduler's worker that every answer's
next token waits for.
"""

import base64
import json
import re
import secrets
import time
import uuid
from collections.abc import Sequence
from contextlib import contextmanager
from dataclasses import replace
from pathlib import Path
from typing import Any, Literal

import numpy as np
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from pydantic import BaseModel, ConfigDict, Field
from starlette.concurrency import run_in_threadpool as _run_in_threadpool
from starlette.exceptions import HTTPException
from starlette.routing import Match

from kvrag import MODES, ChromaUnavailableError, ContextOverflowError, threads
from kvrag.errors import QueueFullError, RequestTimeoutError
from kvrag.blend import Select
from kvrag.modes import Mode

DEFAULT_MAX_TOKENS = 256
"""Longest answer when a request names no max_tokens (OpenAI's own limit is the rest of the context)."""
BYTES_PER_TOKEN, MIN_REQUEST_BYTES = 64, 1 << 20
"""The default body limit: a chat prompt holds at most the context window's tokens, about 4 bytes each
as English text and 6 to 12 as JSON-escaped CJK text; 64 leaves room for the JSON around them. Never
under 1 MiB, so that /v1/passages and /v1/embeddings batches pass (`kvrag index` sends 64 passages)."""
MAX_PASSAGES = 256
"""Passages one /v1/passages call may carry: each is encoded there and then, so the call's work is bounded."""
MAX_EMBEDDING_INPUTS = 2048  # OpenAI's own limit
MAX_STOPS, MAX_STOP_CHARS = 4, 1000
"""OpenAI's 4 stop sequences; each one is looked for in the answer after every token, on the worker."""
OPEN_PATHS = ("/health", "/metrics")  # no key needed, as vLLM's
EMBEDDING_MODEL = "all-MiniLM-L6-v2"
EMBEDDING_MODELS = (EMBEDDING_MODEL, f"sentence-transformers/{EMBEDDING_MODEL}")
TTFT_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)
_DONE = b"data: [DONE]\n\n"
_UNSUPPORTED = {  # OpenAI parameters asking for what kvrag cannot do: refused, never silently ignored
    "tools": bool,
    "functions": bool,
    "logprobs": bool,
    "top_logprobs": bool,
    "logit_bias": bool,
    "presence_penalty": bool,
    "frequency_penalty": bool,
    "audio": bool,
    "response_format": lambda v: not (isinstance(v, dict) and v.get("type") == "text"),
    "modalities": lambda v: v != ["text"],
    "echo": bool,  # /v1/completions's
    "suffix": bool,
    "best_of": lambda v: v != 1,
}


class APIError(Exception):
    """An error response in OpenAI's shape: {"error": {"message", "type", "param", "code"}}."""

    def __init__(self, status: int, message: str, *, type: str = "invalid_request_error", param: str | None = None,
                 code: str | None = None):
        super().__init__(message)
        self.status = status
        self.body = {"error": {"message": message, "type": type, "param": param, "code": code}}

    def response(self) -> JSONResponse:
        return JSONResponse(self.body, status_code=self.status)


@contextmanager
def _engine_errors():
    """The engine's refusals as API errors: the client's fault is a 400, a full queue a 429."""
    try:
        yield
    except ContextOverflowError as exc:
        raise APIError(400, str(exc), param="messages", code="context_length_exceeded") from exc
    except QueueFullError as exc:
        raise APIError(429, str(exc) or "the server's queue is full; retry later", type="rate_limit_error",
                       code="queue_full") from exc
    except RequestTimeoutError as exc:
        raise APIError(503, str(exc) or "the request waited too long in the queue", type="server_error",
                       code="timeout") from exc
    except (ValueError, TypeError) as exc:  # EmptyInputError, InputEncodingError, options out of range
        raise APIError(400, str(exc)) from exc


async def run_in_threadpool(fn, *args):
    """`fn` on one of the server's threads, which then gives up the OpenMP team it started (indexing and
    embedding run torch there): the scheduler's worker keeps the only one (see kvrag.threads)."""

    def alone():
        try:
            return fn(*args)
        finally:
            threads.hand_over()

    return await _run_in_threadpool(alone)


@contextmanager
def _chroma_errors():
    """A Chroma server that stopped answering as a 503 naming it."""
    try:
        yield
    except ChromaUnavailableError as exc:
        raise APIError(503, str(exc), type="server_error", code="chroma_unavailable") from exc


# ---- request bodies ----------------------------------------------------------------------------------


class Message(BaseModel):
    model_config = ConfigDict(extra="allow")  # name, refusal, ...

    role: Literal["system", "developer", "user", "assistant"]
    content: str | list[dict[str, Any]] | None = None


class KVRagOptions(BaseModel):
    """The request's `kvrag` object (`extra_body={"kvrag": {...}}` in the openai client)."""

    model_config = ConfigDict(extra="forbid")

    mode: Mode | None = None
    blend_ratio: float | None = Field(default=None, ge=0.0, le=1.0)  # BlendConfig.recompute_ratio, mode blend
    coverage: float | None = Field(default=None, gt=0.0, le=1.0)  # BlendConfig.coverage, mode auto
    select: Select | None = None  # BlendConfig.select, modes blend and auto


class StreamOptions(BaseModel):
    include_usage: bool = False


class _Generation(BaseModel):
    """What /v1/chat/completions and /v1/completions share."""

    model_config = ConfigDict(extra="allow")  # OpenAI's other parameters: ignored unless in _UNSUPPORTED

    model: str | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    max_tokens: int | None = Field(default=None, ge=1)
    max_completion_tokens: int | None = Field(default=None, ge=1)
    temperature: float | None = Field(default=None, ge=0.0, le=2.0)
    top_p: float | None = Field(default=None, gt=0.0, le=1.0)
    seed: int | None = Field(default=None, ge=-(2**63), lt=2**64)  # what torch's generator takes
    stop: str | list[str] | None = None
    n: int | None = None
    kvrag: KVRagOptions | None = None


class ChatRequest(_Generation):
    messages: list[Message] = Field(min_length=1)


class CompletionRequest(_Generation):
    """The legacy completions API's body: the prompt completed as it is, no chat template applied."""

    prompt: str | list[str] = Field(min_length=1)


class EmbeddingsRequest(BaseModel):
    model_config = ConfigDict(extra="allow")  # user

    input: str | list[str]
    model: str | None = None
    encoding_format: Literal["float", "base64"] = "float"
    dimensions: int | None = None


class PassagesRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")

    passages: str | list[str] | None = None
    input: str | list[str] | None = None  # the same, named as /v1/embeddings names it
    model: str | None = None


class SearchRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")

    query: str = Field(min_length=1)
    top_k: int = Field(default=4, ge=1, le=100)


# ---- streaming -----------------------------------------------------------------------------------------


class _EventStream(StreamingResponse):
    """Server-sent events whose generator is closed however the response ends: starlette stops
    reading it when the client disconnects, and only closing it cancels the generation behind it."""

    media_type = "text/event-stream"

    async def __call__(self, scope, receive, send):
        try:
            await super().__call__(scope, receive, send)
        finally:
            await self.body_iterator.aclose()


def _sse(payload: dict) -> bytes:
    return b"data: " + json.dumps(payload, ensure_ascii=False, separators=(",", ":")).encode() + b"\n\n"


# ---- metrics and the gate every request passes ----------------------------------------------------------


class Metrics:
    """Prometheus metrics in a registry of the app's own (two apps in one process never share counts)."""

    def __init__(self, engine):
        self.registry = registry = CollectorRegistry()
        self.requests = Counter("kvrag_requests", "HTTP requests by endpoint and status", ["endpoint", "status"],
                                registry=registry)
        self.ttft = Histogram("kvrag_ttft_seconds", "time to first token of chat completions", buckets=TTFT_BUCKETS,
                              registry=registry)
        self.queue = Gauge("kvrag_queue_depth", "requests waiting for the engine's scheduler", registry=registry)
        self.queue.set_function(lambda: queue_depth(engine))
        self.in_progress = 0
        self.active = Gauge("kvrag_active_requests", "chat completions in progress", registry=registry)
        self.active.set_function(lambda: self.in_progress)
        self.reused = Counter("kvrag_reused_tokens", "prompt tokens whose KV was reused", registry=registry)
        self.prefilled = Counter("kvrag_prefilled_tokens", "prompt tokens prefilled", registry=registry)
        self.generated = Counter("kvrag_generated_tokens", "completion tokens generated", registry=registry)
        self.cache_hits = Counter("kvrag_cache_hits", "blocks served from the KV store, by tier", ["tier"],
                                  registry=registry)
        if getattr(engine, "shadow", None) is not None:
            registry.register(ShadowCollector(engine.shadow))

    def record(self, result) -> None:
        if result.ttft is not None:
            self.ttft.observe(result.ttft)
        self.reused.inc(result.reused_tokens)
        self.prefilled.inc(result.prefilled_tokens)
        self.generated.inc(result.generated_tokens)
        for tier, hits in result.cache_hits.items():
            self.cache_hits.labels(tier).inc(hits)


class ShadowCollector:
    """The engine's shadow checks (kvrag.shadow) per mode: checks, agreements with full, the current window's share
    that agreed; the checks dropped; the mode of requests that name none."""

    def __init__(self, shadow):
        self.shadow = shadow

    def collect(self):
        from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

        checks = CounterMetricFamily("kvrag_shadow_checks", "requests answered again in full mode", labels=["mode"])
        agreed = CounterMetricFamily("kvrag_shadow_agreements", "shadow checks whose answer was full's",
                                     labels=["mode"])
        window = GaugeMetricFamily("kvrag_shadow_agreement", "share of the last shadow checks that agreed with full",
                                   labels=["mode"])
        for mode, counts in self.shadow.agreement().items():
            checks.add_metric([mode], counts["checks"])
            agreed.add_metric([mode], counts["agreed"])
            if counts["window"] is not None:
                window.add_metric([mode], counts["window"])
        dropped = CounterMetricFamily("kvrag_shadow_dropped", "shadow checks not made: the background queue was full")
        dropped.add_metric([], self.shadow.dropped)
        default = GaugeMetricFamily("kvrag_default_mode", "the mode of requests that name none (1)", labels=["mode"])
        default.add_metric([self.shadow.engine.default_mode], 1)
        yield from (checks, agreed, window, dropped, default)


def queue_depth(engine) -> int:
    return engine.scheduler.waiting


class Gate:
    """ASGI middleware: the API key before anything else is read, then the body, refused as soon as it
    passes `max_request_bytes`; and every request counted by route template and status (the stream of a
    completion counts as active until its last byte)."""

    def __init__(self, app, *, fastapi: FastAPI, metrics: Metrics, api_key: str | None, max_request_bytes: int):
        self.app, self.fastapi, self.metrics, self.api_key = app, fastapi, metrics, api_key
        self.max_request_bytes = max_request_bytes

    def _endpoint(self, scope) -> str:
        """The route's path template ("/v1/models/{model_id:path}"), also for a method it does not take."""
        matches = {route.matches(scope)[0]: route.path for route in reversed(self.fastapi.routes)}
        return matches.get(Match.FULL) or matches.get(Match.PARTIAL) or "unmatched"

    def _authorized(self, scope) -> bool:
        headers = dict(scope["headers"])
        scheme, _, key = headers.get(b"authorization", b"").decode("latin-1").partition(" ")
        return scheme.lower() == "bearer" and secrets.compare_digest(key.strip().encode(), self.api_key.encode())

    async def _body(self, scope, receive) -> bytes | dict | None:
        """The whole body; None once it is over the limit: by its Content-Length before a byte is read,
        else counted as a chunked upload's pieces arrive; the disconnect message if the client left."""
        length = dict(scope["headers"]).get(b"content-length", b"0")
        if not length.isdigit() or int(length) > self.max_request_bytes:
            return None
        chunks, size, more = [], 0, True
        while more:
            message = await receive()
            if message["type"] != "http.request":
                return message
            chunks.append(message.get("body", b""))
            size += len(chunks[-1])
            if size > self.max_request_bytes:
                return None
            more = message.get("more_body", False)
        return b"".join(chunks)

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        endpoint, status = self._endpoint(scope), 500
        active = endpoint in ("/v1/chat/completions", "/v1/completions")

        async def sending(message):
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
            await send(message)

        if active:
            self.metrics.in_progress += 1
        try:
            if self.api_key and scope["path"] not in OPEN_PATHS and not self._authorized(scope):
                error = APIError(401, "Incorrect or missing API key: send the header 'Authorization: Bearer KEY'.",
                                 code="invalid_api_key")
                return await error.response()(scope, receive, sending)
            body = await self._body(scope, receive)
            if body is None:  # what is left of it, uvicorn reads and drops
                error = APIError(400, f"The request body is over this server's limit of {self.max_request_bytes} "
                                      "bytes (kvrag serve --max-request-bytes).", code="request_too_large")
                return await error.response()(scope, receive, sending)
            if isinstance(body, dict):  # the client left before it finished sending
                status = 499
                return
            replayed = False

            async def replay():
                nonlocal replayed
                if replayed:
                    return await receive()  # the disconnect, for a stream that listens for it
                replayed = True
                return {"type": "http.request", "body": body, "more_body": False}

            await self.app(scope, replay, sending)
        finally:
            if active:
                self.metrics.in_progress -= 1
            self.metrics.requests.labels(endpoint, str(status)).inc()


# ---- the app --------------------------------------------------------------------------------------------


def create_app(engine, *, api_key: str | None = None, model_name: str | Sequence[str] | None = None,
               default_mode: str | None = None,
               embedder=None, passage_index=None, max_request_bytes: int | None = None,
               max_passages: int = MAX_PASSAGES) -> FastAPI:
    """The HTTP API over `engine`. `model_name`: the id clients send and /v1/models lists, or several the server
    answers to, the first listed (default: `default_model_name`). `default_mode`: the mode of requests that
    name none (default: the engine's `default_mode` at each request: calibrated, or stepped down by its shadow
    checks). `embedder`: what /v1/embeddings runs, with
    `embed(texts)` and `count_tokens(texts)` (default: the packaged MiniLM, loaded on first use).
    `passage_index`: a `kvrag.retrieval.PassageIndex` that /v1/passages also stores the passages in and
    /v1/passages/search retrieves from (default: none, and no search; `kvrag serve` gives it the home's or
    `--chroma`'s). `max_request_bytes`: the largest body taken, 400 beyond (default:
    `default_max_request_bytes`); `max_passages`: the most passages one /v1/passages call may carry, 400
    beyond."""
    if default_mode is not None and default_mode not in MODES:
        raise ValueError(f"default_mode must be one of {MODES}, got {default_mode!r}")
    if max_request_bytes is None:
        max_request_bytes = default_max_request_bytes(engine.context_window)
    if max_request_bytes < 1 or max_passages < 1:
        raise ValueError(f"max_request_bytes and max_passages must be >= 1, got {max_request_bytes}, {max_passages}")
    window, most_chars = engine.context_window, prompt_char_limit(engine)
    names = (model_name,) if isinstance(model_name, str) else tuple(model_name or ()) or (default_model_name(engine),)
    name = names[0]
    created = int(time.time())
    fingerprint = f"fp_{engine.fingerprint[:12]}"
    metrics = Metrics(engine)
    app = FastAPI(title="kvrag", summary="OpenAI-compatible API over kvrag's KV-reusing engine")
    app.state.engine, app.state.metrics = engine, metrics
    app.add_middleware(Gate, fastapi=app, metrics=metrics, api_key=api_key, max_request_bytes=max_request_bytes)
    if embedder is None:
        from kvrag.retrieval import Embedder

        embedder = Embedder()  # the model loads on the first /v1/embeddings or passage search

    @app.exception_handler(APIError)
    async def api_error(request, exc: APIError):
        return exc.response()

    @app.exception_handler(RequestValidationError)
    async def invalid(request, exc: RequestValidationError):
        """FastAPI's 422 as OpenAI's 400."""
        first = exc.errors()[0]
        if first.get("type") == "json_invalid":
            return APIError(400, f"We could not parse the JSON body of your request: {first.get('msg')}").response()
        where = ".".join(str(p) for p in first.get("loc", ()) if p != "body") or None
        message = f"Invalid {f'value for {where!r}' if where else 'request'}: {first.get('msg')}"
        return APIError(400, message, param=where).response()

    @app.exception_handler(HTTPException)
    async def http_error(request, exc: HTTPException):
        code = {404: "not_found", 405: "method_not_allowed"}.get(exc.status_code)
        return APIError(exc.status_code, str(exc.detail), code=code).response()

    @app.exception_handler(Exception)
    async def server_error(request, exc: Exception):
        return APIError(500, f"internal error: {type(exc).__name__}: {exc}", type="server_error").response()

    def check_model(model: str | None, served: tuple[str, ...] = names) -> None:
        if model is not None and model not in served:
            raise APIError(404, f"The model '{model}' does not exist: this server serves '{served[0]}'.",
                           param="model", code="model_not_found")

    def check_chars(text: str, param: str, what: str) -> None:
        """Refuse, untokenized, a text that cannot fit the context window (see `prompt_char_limit`)."""
        if len(text) > most_chars:
            raise APIError(400, f"{what} has {len(text)} characters: more tokens than the model's context window "
                                f"of {window} tokens whatever they are.", param=param, code="context_length_exceeded")

    def model_card() -> dict:
        return {"id": name, "object": "model", "created": created, "owned_by": "kvrag"}

    @app.get("/health")
    async def health():
        return {"status": "ok", "model": name, "queue_depth": queue_depth(engine),
                "active_requests": metrics.in_progress, "default_mode": default_mode or engine.default_mode,
                "shadow": engine.shadow.agreement() if getattr(engine, "shadow", None) else None}

    @app.get("/metrics")
    async def prometheus():
        return Response(generate_latest(metrics.registry), media_type=CONTENT_TYPE_LATEST)

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [model_card()]}

    @app.get("/v1/models/{model_id:path}")
    async def model(model_id: str):
        check_model(model_id)
        return model_card()

    @app.post("/v1/chat/completions")
    async def chat_completions(body: ChatRequest, request: Request):
        return await generate(body, request, lambda: _render(engine, body.messages), "messages", chat=True)

    @app.post("/v1/completions")
    async def completions(body: CompletionRequest, request: Request):
        prompts = [body.prompt] if isinstance(body.prompt, str) else body.prompt
        if len(prompts) != 1:
            raise APIError(400, f"prompt must be one string: kvrag completes one prompt per request, got "
                                f"{len(prompts)}", param="prompt")
        return await generate(body, request, lambda: prompts[0], "prompt", chat=False)

    async def generate(body: _Generation, request: Request, render, param: str, chat: bool):
        """Answer a chat (`chat`) or a text completion request: the prompt `render()` makes, completed by the
        engine, as OpenAI's objects of that kind."""
        check_model(body.model)
        refused = [k for k, asks in _UNSUPPORTED.items() if (body.model_extra or {}).get(k) is not None
                   and asks(body.model_extra[k])]
        if refused:
            raise APIError(400, f"'{refused[0]}' is not supported by kvrag", param=refused[0],
                           code="unsupported_parameter")
        if body.n not in (None, 1):
            raise APIError(400, "n must be 1: kvrag returns one choice per request", param="n")
        for field in ("max_tokens", "max_completion_tokens"):  # under the window, it is cut to what the prompt leaves
            if (getattr(body, field) or 0) >= window:
                raise APIError(400, f"{field} is too large: this model's maximum context length is {window} tokens, "
                                    f"the prompt's included, so an answer has at most {window - 1}.", param=field,
                               code="context_length_exceeded")
        stops = [body.stop] if isinstance(body.stop, str) else body.stop or []
        if len(stops) > MAX_STOPS or any(len(stop) > MAX_STOP_CHARS for stop in stops):
            raise APIError(400, f"stop takes at most {MAX_STOPS} sequences of at most {MAX_STOP_CHARS} characters",
                           param="stop")
        mode = (body.kvrag and body.kvrag.mode) or default_mode or engine.default_mode
        options = {
            "mode": mode,
            "max_new_tokens": body.max_completion_tokens or body.max_tokens or DEFAULT_MAX_TOKENS,
            "temperature": 0.0 if body.temperature is None else body.temperature,
            "top_p": 1.0 if body.top_p is None else body.top_p,
            "seed": body.seed,
            "stop": body.stop,
        }
        settings = {"recompute_ratio": body.kvrag.blend_ratio, "coverage": body.kvrag.coverage,
                    "select": body.kvrag.select} if body.kvrag else {}
        settings = {name: value for name, value in settings.items() if value is not None}
        if settings:
            options["blend"] = replace(engine.blend, **settings)

        def submit():
            """The template, the tokenizer and the passage matching take time in proportion to the prompt: on
            a pool thread, where neither the event loop nor the scheduler's worker waits for them."""
            text = render()
            check_chars(text, param, "The prompt")
            with _engine_errors():
                return engine.stream_text(text, None, **options)

        stream = await run_in_threadpool(submit)
        deltas = aiter(stream)  # read on the event loop; closing it early cancels the generation
        head = {"id": f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex}", "created": int(time.time()),
                "model": name, "system_fingerprint": fingerprint}
        kind = "chat.completion" if chat else "text_completion"

        def choice(text: str, finish_reason=None, first: bool = False) -> dict:
            """A streamed choice: chat's delta (the role first, nothing with the finish reason), or the text."""
            if not chat:
                return {"index": 0, "text": text, "logprobs": None, "finish_reason": finish_reason}
            delta = {} if finish_reason else {"role": "assistant", "content": text} if first else {"content": text}
            return {"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish_reason}

        if not body.stream:
            with _engine_errors():
                async for _ in deltas:
                    if await request.is_disconnected():  # nobody waits for the answer: free its slot
                        stream.cancel()
            result = stream.result
            metrics.record(result)
            answer = ({"message": {"role": "assistant", "content": result.text, "refusal": None}} if chat
                      else {"text": result.text})
            answered = {"index": 0, **answer, "logprobs": None, "finish_reason": _finish_reason(result)}
            return {**head, "object": kind, "choices": [answered], "usage": _usage(result), "kvrag": result.stats()}

        # the status is decided before any header is sent: the first delta (or the end) comes first
        with _engine_errors():
            first = await anext(deltas, None)
        usage = body.stream_options is not None and body.stream_options.include_usage
        kind = f"{kind}.chunk" if chat else kind

        def chunk(part: dict, **extra) -> bytes:
            payload = {**head, "object": kind, "choices": [part], **extra}
            return _sse({**payload, "usage": None} if usage else payload)

        async def events():
            try:
                if chat:
                    yield chunk(choice("", first=True))
                with _engine_errors():
                    if first is not None:
                        yield chunk(choice(first))
                        async for delta in deltas:
                            yield chunk(choice(delta))
            except APIError as exc:  # after the headers: the error goes as an event, as OpenAI sends it
                yield _sse(exc.body)
                yield _DONE
                return
            finally:
                await deltas.aclose()  # a stream not read to the end is cancelled
            result = stream.result
            metrics.record(result)
            yield chunk(choice("", _finish_reason(result)), kvrag=result.stats())
            if usage:
                yield _sse({**head, "object": kind, "choices": [], "usage": _usage(result)})
            yield _DONE

        return _EventStream(events(), headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})

    @app.post("/v1/passages")
    async def passages(body: PassagesRequest):
        """kvrag's own: compute and store the passages' KV now, so that prompts holding them reuse it."""
        check_model(body.model)
        texts = body.passages if body.passages is not None else body.input
        if texts is None:
            raise APIError(400, "send the passages as {\"passages\": [text, ...]}", param="passages")
        texts = [texts] if isinstance(texts, str) else texts
        param = "passages" if body.passages is not None else "input"
        if len(texts) > max_passages:
            raise APIError(400, f"{len(texts)} passages in one request: at most {max_passages}; send them in batches",
                           param=param)
        for i, text in enumerate(texts):
            check_chars(text, f"{param}.{i}", f"passage {i}")

        def index():
            ids = engine.index(texts, progress=False)
            return ids, [len(engine.layout.passage_ids(t)) for t in texts]

        with _engine_errors():
            ids, tokens = await run_in_threadpool(index)
        if passage_index is not None:
            with _chroma_errors():
                await run_in_threadpool(passage_index.add, texts, ["POST /v1/passages"] * len(texts))
        data = [{"object": "passage", "id": i, "tokens": n} for i, n in zip(ids, tokens)]
        return {"object": "list", "data": data, "model": name, "usage": {"prompt_tokens": sum(tokens)}}

    @app.post("/v1/passages/search")
    async def search(body: SearchRequest):
        """kvrag's own: the `top_k` stored passages nearest the query (all-MiniLM-L6-v2, cosine)."""
        if passage_index is None:
            raise APIError(404, "this server keeps no passage index: create_app(passage_index=...) gives it one, "
                                "as `kvrag serve` does", code="no_passage_index")
        with _chroma_errors():
            found = await run_in_threadpool(passage_index.search, body.query, body.top_k)
        return {"object": "list", "data": [{"object": "passage", "text": text} for text in found],
                "model": EMBEDDING_MODEL}

    @app.post("/v1/embeddings")
    async def embeddings(body: EmbeddingsRequest):
        check_model(body.model, EMBEDDING_MODELS)
        texts = [body.input] if isinstance(body.input, str) else body.input
        if not texts or any(not t for t in texts):
            raise APIError(400, "input must be a non-empty string or a list of non-empty strings", param="input")
        if len(texts) > MAX_EMBEDDING_INPUTS:
            raise APIError(400, f"input takes at most {MAX_EMBEDDING_INPUTS} texts, got {len(texts)}", param="input")

        def embed():
            return embedder.embed(texts), embedder.count_tokens(texts)

        vectors, tokens = await run_in_threadpool(embed)
        if body.dimensions is not None and body.dimensions != len(vectors[0]):
            raise APIError(400, f"{EMBEDDING_MODEL} has {len(vectors[0])} dimensions", param="dimensions")
        if body.encoding_format == "base64":
            vectors = [base64.b64encode(np.asarray(v, dtype="<f4").tobytes()).decode() for v in vectors]
        data = [{"object": "embedding", "index": i, "embedding": v} for i, v in enumerate(vectors)]
        return {"object": "list", "data": data, "model": EMBEDDING_MODEL,
                "usage": {"prompt_tokens": tokens, "total_tokens": tokens}}

    return app


def default_model_name(engine) -> str:
    """The model directory's name, less the digest a model converted from GGUF carries in it
    ("SmolLM2-135M-Instruct.Q4_1-b179c9523d0e6a0f" is served as "SmolLM2-135M-Instruct.Q4_1")."""
    return re.sub(r"-[0-9a-f]{16}$", "", Path(engine.model.name_or_path).name) or "kvrag"


def default_max_request_bytes(context_window: int) -> int:
    """`BYTES_PER_TOKEN` bytes a token of the context window, at least `MIN_REQUEST_BYTES`."""
    return max(MIN_REQUEST_BYTES, BYTES_PER_TOKEN * context_window)


def prompt_char_limit(engine) -> int:
    """Characters over which a text is over the context window whatever its tokens, so that it is refused
    before the tokenizer runs: a token stands for at most as many characters as the longest token string
    of the vocabulary has (a byte-level token's string has a character per byte, more than it stands for).
    A tokenizer that normalizes text first (Qwen2's NFC) may merge characters: 4x to spare then."""
    tokenizer = engine.tokenizer
    longest = max(len(t) for t in tokenizer.convert_ids_to_tokens(list(range(len(tokenizer)))) if t)
    backend = getattr(tokenizer, "backend_tokenizer", None)
    spare = 1 if backend is not None and backend.normalizer is None else 4
    return engine.context_window * longest * spare


def _render(engine, messages: list[Message]) -> str:
    """The chat-template text of OpenAI messages; text parts of one message are joined as
    `PromptLayout.render_chat` joins parts."""
    from jinja2 import TemplateError

    turns = []
    for i, message in enumerate(messages):
        content = message.content
        if isinstance(content, str):
            parts = [content]
        elif content is None:
            if message.role != "assistant" or (message.model_extra or {}).get("tool_calls"):
                raise APIError(400, f"messages[{i}] has no content", param=f"messages.{i}.content")
            parts = []
        else:
            parts = []
            for j, part in enumerate(content):
                if part.get("type") != "text" or not isinstance(part.get("text"), str):
                    raise APIError(400, f"messages[{i}].content[{j}]: only text parts are supported, got a "
                                        f"{part.get('type')!r} part", param=f"messages.{i}.content.{j}")
                parts.append(part["text"])
        turns.append(("system" if message.role == "developer" else message.role, parts))
    try:
        text, _ = engine.layout.render_chat(turns)
    except (ValueError, TemplateError) as exc:
        raise APIError(400, str(exc), param="messages") from exc
    return text


def _finish_reason(result) -> str:
    return "stop" if result.finish_reason == "stop" else "length"  # "timeout" ends by length of time


def _usage(result) -> dict:
    return {
        "prompt_tokens": result.prompt_tokens,
        "completion_tokens": result.generated_tokens,
        "total_tokens": result.prompt_tokens + result.generated_tokens,
        "prompt_tokens_details": {"cached_tokens": result.reused_tokens},
    }
