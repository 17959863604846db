"""A small RAG web app on `kvrag serve`, the way any OpenAI-style app talks to it.

    .venv/bin/python examples/webapp/app.py [--port 8080] [--server URL] [--api-key KEY]

Starts `kvrag serve` (the one installed next to this Python) on a free port, unless --server names one
already running, and serves a page at http://127.0.0.1:8080: add documents, ask, watch the answer
stream, see the passages used and the time to first token (TTFT) and reused tokens, in full, block,
blend or auto mode. Nothing here imports kvrag: the documents are indexed with POST /v1/passages (each
passage's KV computed once), embedded with /v1/embeddings and kept in memory; a question is answered
by /v1/chat/completions with the retrieved passages in the system message, which the server finds
there and reuses.
"""

import argparse
import json
import os
import re
import signal
import socket
import subprocess
import sys
import time
from contextlib import asynccontextmanager
from pathlib import Path

import httpx
import uvicorn
from fastapi import FastAPI, HTTPException
from fastapi.responses import FileResponse, StreamingResponse
from fastapi.staticfiles import StaticFiles
from pydantic import BaseModel, Field

HERE = Path(__file__).resolve().parent
SAMPLE = HERE.parents[1] / "src" / "kvrag" / "sample"  # the package's sample corpus, read as plain files
EMBEDDING_MODEL = "all-MiniLM-L6-v2"
BATCH = 64  # passages per POST /v1/passages: well under the server's limit (256 by default)
# The system prompt of LangChain's create_retrieval_chain tutorial (create_stuff_documents_chain joins
# the documents with blank lines into {context}); the question goes alone in the user turn.
SYSTEM_PROMPT = (
    "You are an assistant for question-answering tasks. Use the following pieces of retrieved context to answer "
    "the question. If you don't know the answer, say that you don't know. Use three sentences maximum and keep the "
    "answer concise.\n\n{context}"
)
_SENTENCE_END = re.compile(r"(?<=[.!?])\s+")


def split_passages(text: str, max_chars: int = 600, min_chars: int = 80) -> list[str]:
    """Paragraphs of a few sentences: long ones cut at sentence ends, short ones (headings) joined to the next."""
    pieces = []
    for para in re.split(r"\n\s*\n", text):
        current = ""
        for sentence in _SENTENCE_END.split(" ".join(para.split())):
            if current and len(current) + 1 + len(sentence) > max_chars:
                pieces.append(current)
                current = ""
            current = f"{current} {sentence}".strip()
        if current:
            pieces.append(current)
    passages, current = [], ""
    for piece in pieces:
        if current and (len(current) >= min_chars or len(current) + 2 + len(piece) > max_chars):
            passages.append(current)
            current = ""
        current = f"{current}\n\n{piece}" if current else piece
    if current:
        passages.append(current)
    return passages


def sse(event: str, data: dict) -> str:
    return f"event: {event}\ndata: {json.dumps(data)}\n\n"


class Documents(BaseModel):
    text: str


class Question(BaseModel):
    question: str = Field(min_length=1)
    mode: str = Field("block", pattern="^(full|block|blend|auto)$")
    k: int = Field(3, ge=1, le=10)
    max_tokens: int = Field(96, ge=1, le=1024)


def create_app(server: str, api_key: str | None = None) -> FastAPI:
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    upstream = httpx.AsyncClient(base_url=server, headers=headers, timeout=httpx.Timeout(600, connect=10))
    passages: dict[str, dict] = {}  # text -> {"id", "text", "tokens", "vector"}: the in-memory vector store
    models: list[str] = []  # the served model's name, asked once

    @asynccontextmanager
    async def lifespan(app):
        yield
        await upstream.aclose()

    app = FastAPI(title="kvrag web app", lifespan=lifespan)
    app.mount("/static", StaticFiles(directory=HERE / "static"), name="static")

    async def call(path: str, body: dict) -> dict:
        try:
            response = await upstream.post(path, json=body)
        except httpx.HTTPError as exc:
            raise HTTPException(502, f"kvrag serve at {server} did not answer: {exc}") from exc
        if response.status_code != 200:
            raise HTTPException(502, f"{path}: {response.status_code} {response.text[:500]}")
        return response.json()

    async def model() -> str:
        if not models:
            try:
                response = await upstream.get("/v1/models")
                response.raise_for_status()
            except httpx.HTTPError as exc:
                raise HTTPException(502, f"kvrag serve at {server}: /v1/models: {exc}") from exc
            models.append(response.json()["data"][0]["id"])
        return models[0]

    async def embed(texts: list[str]) -> list[list[float]]:
        data = (await call("/v1/embeddings", {"model": EMBEDDING_MODEL, "input": texts}))["data"]
        return [item["embedding"] for item in sorted(data, key=lambda item: item["index"])]

    async def add(text: str) -> dict:
        new = [p for p in dict.fromkeys(split_passages(text)) if p not in passages]
        for start in range(0, len(new), BATCH):  # the server takes a bounded number of passages a call
            batch = new[start : start + BATCH]
            indexed = (await call("/v1/passages", {"passages": batch}))["data"]  # each passage's KV, computed once
            for passage, item, vector in zip(batch, indexed, await embed(batch)):
                passages[passage] = {"id": item["id"], "text": passage, "tokens": item["tokens"], "vector": vector}
        return {"added": len(new), "passages": len(passages)}

    @app.get("/")
    async def page():
        return FileResponse(HERE / "static" / "index.html")

    @app.get("/api/documents")
    async def count():
        return {"passages": len(passages), "sample": SAMPLE.is_dir()}

    @app.post("/api/documents")
    async def add_documents(documents: Documents):
        if not documents.text.strip():
            raise HTTPException(422, "no text to add")
        return await add(documents.text)

    @app.post("/api/sample")
    async def add_sample():
        if not SAMPLE.is_dir():
            raise HTTPException(404, f"no sample corpus at {SAMPLE}")
        result = await add("\n\n".join(path.read_text() for path in sorted(SAMPLE.glob("*.md"))))
        questions = SAMPLE / "questions.json"
        result["questions"] = [q["question"] for q in json.loads(questions.read_text())] if questions.is_file() else []
        return result

    @app.post("/api/ask")
    async def ask(question: Question):
        if not passages:
            raise HTTPException(409, "add documents first")
        start = time.perf_counter()
        [q] = await embed([question.question])
        scored = sorted(((sum(a * b for a, b in zip(q, p["vector"])), p) for p in passages.values()),
                        key=lambda pair: -pair[0])[: question.k]
        used = [{"id": p["id"], "text": p["text"], "tokens": p["tokens"], "score": round(score, 3)} for score, p in scored]
        context = "\n\n".join(p["text"] for p in used)
        body = {
            "model": await model(),
            "messages": [{"role": "system", "content": SYSTEM_PROMPT.format(context=context)},
                         {"role": "user", "content": question.question}],
            "stream": True,
            "stream_options": {"include_usage": True},
            "temperature": 0,
            "max_tokens": question.max_tokens,
            "kvrag": {"mode": question.mode},
        }

        async def events():
            yield sse("passages", {"passages": used})
            first, usage, stats = None, {}, {}
            try:
                async with upstream.stream("POST", "/v1/chat/completions", json=body) as response:
                    if response.status_code != 200:
                        await response.aread()
                        yield sse("error", {"message": f"{response.status_code} {response.text[:500]}"})
                        return
                    async for line in response.aiter_lines():
                        if not line.startswith("data:") or line[5:].strip() == "[DONE]":
                            continue
                        chunk = json.loads(line[5:])
                        if error := chunk.get("error"):  # an error after the stream began
                            yield sse("error", {"message": str(error.get("message", error) if isinstance(error, dict) else error)})
                            return
                        usage, stats = chunk.get("usage") or usage, chunk.get("kvrag") or stats
                        for choice in chunk.get("choices") or []:
                            if text := (choice.get("delta") or {}).get("content"):
                                first = first or time.perf_counter()
                                yield sse("delta", {"text": text})
            except httpx.HTTPError as exc:
                yield sse("error", {"message": f"kvrag serve at {server}: {exc}"})
                return
            details = usage.get("prompt_tokens_details") or {}
            try:  # the server's shadow checks so far: how often a reused answer was full's (kvrag serve --shadow)
                health = (await upstream.get("/health")).json()
            except (httpx.HTTPError, ValueError):
                health = {}
            yield sse("done", {
                "shadow": health.get("shadow"),
                "mode": stats.get("mode", question.mode),
                "ttft_ms": round(stats["ttft"] * 1000) if stats.get("ttft") is not None else None,
                "first_token_ms": round((first - start) * 1000) if first else None,  # here: embedding + HTTP too
                "prompt_tokens": usage.get("prompt_tokens"),
                "cached_tokens": details.get("cached_tokens"),
                "completion_tokens": usage.get("completion_tokens"),
                "prefilled_tokens": stats.get("prefilled_tokens"),
                "reused_tokens": stats.get("reused_tokens"),
                "cache_hits": stats.get("cache_hits"),
            })

        return StreamingResponse(events(), media_type="text/event-stream", headers={"Cache-Control": "no-cache"})

    return app


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_server(timeout: float, shadow: float = 0.0) -> tuple[subprocess.Popen, str]:
    """`kvrag serve` from this Python's environment on a free port, once its /health answers; `shadow`: its
    --shadow share."""
    kvrag = Path(sys.executable).parent / "kvrag"
    if not kvrag.exists():
        sys.exit(f"no {kvrag}: install kvrag into this Python's environment (./run does) or give --server URL")
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    print(f"webapp: starting {kvrag} serve on port {port} (loading the model takes a few seconds)...", file=sys.stderr)
    process = subprocess.Popen([str(kvrag), "serve", "--host", "127.0.0.1", "--port", str(port), "--log-level", "warning",
                                "--shadow", str(shadow)])
    try:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if process.poll() is not None:
                sys.exit(f"webapp: kvrag serve exited with code {process.returncode} before it was ready")
            try:
                if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                    return process, url
            except httpx.HTTPError:
                pass
            time.sleep(0.5)
        sys.exit(f"webapp: kvrag serve did not answer {url}/health within {timeout:.0f} s")
    except BaseException:  # also SystemExit and Ctrl-C while waiting: never leave the server behind
        stop(process)
        raise


def stop(process: subprocess.Popen) -> None:
    process.terminate()
    try:
        process.wait(10)
    except subprocess.TimeoutExpired:
        process.kill()
        process.wait()


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--host", default="127.0.0.1", help="address of the page (default: %(default)s)")
    parser.add_argument("--port", type=int, default=8080, help="port of the page (default: %(default)s)")
    parser.add_argument("--server", help="URL of a running `kvrag serve` (default: start one)")
    parser.add_argument("--api-key", default=os.environ.get("KVRAG_API_KEY"), help="its API key (default: $KVRAG_API_KEY)")
    parser.add_argument("--shadow", type=float, default=0.0, help="the started server's --shadow: share of reused "
                                                                   "answers checked against full (default: none)")
    parser.add_argument("--startup-timeout", type=float, default=600, help="seconds to wait for `kvrag serve` (default: %(default)s)")
    args = parser.parse_args(argv)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(128 + signal.SIGTERM))  # stop the server on `kill` too
    process, server = (None, args.server.rstrip("/")) if args.server else start_server(args.startup_timeout, args.shadow)
    try:
        print(f"webapp: open http://{args.host}:{args.port} (kvrag serve at {server})", file=sys.stderr)
        uvicorn.run(create_app(server, args.api_key), host=args.host, port=args.port, log_level="warning")
    finally:
        if process is not None:
            stop(process)
    return 0


if __name__ == "__main__":
    sys.exit(main())
