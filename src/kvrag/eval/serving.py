"""Serving many users: concurrent clients against `kvrag serve` over localhost.

Two servers run, each in its own process: one batching up to `max_batch` requests (the scheduler) and
one serving a request at a time (`--max-batch 1`), so both are measured in the same run; the cells
(clients x mode) alternate between them. Each client streams its questions back to back, as a chat
app's users do: the sample corpus's passages retrieved by the packaged embeddings (top 4), in the
system message of LangChain's `create_retrieval_chain` prompt, the question in the user turn. TTFT
is the client's time to the first content chunk, queueing included.

The batch floor is the least time the batched server could take to answer 16 users' first tokens:
their prompts' cached blocks placed in workspaces and the 16 questions prefilled in one model call
(`forward_packed`), measured in this process on its own engine.
"""

import json
import statistics
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import torch

SYSTEM = (
    "You are an assistant for question-answering tasks. Use the following pieces of retrieved context to "
    "answer the question. If you don't know the answer, say that you don't know. Use three sentences "
    "maximum and keep the answer concise.\n\n{context}"
)


@dataclass
class Cell:
    server: str
    mode: str
    clients: int
    wall: float = 0.0
    ttfts: list[float] = field(default_factory=list)
    tokens: int = 0
    answers: dict[int, str] = field(default_factory=dict)  # workload index -> answer
    errors: list[str] = field(default_factory=list)

    @property
    def requests(self) -> int:
        return len(self.ttfts) + len(self.errors)


def percentile(values: list[float], q: float) -> float:
    """Nearest-rank percentile: with few values, the p99 is the slowest request, not an interpolation."""
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, round(q / 100 * len(ordered) + 0.5) - 1))]


def sample_retrievals(engine, top_k: int = 4) -> tuple[list[str], list[tuple[str, list[str]]]]:
    """The sample corpus's passages, and each of its questions with its top-k passages (MiniLM)."""
    from importlib.resources import files

    from kvrag.retrieval import Embedder
    from kvrag.app.split import split_passages

    sample = files("kvrag") / "sample"
    passages = [p for name in sorted(f.name for f in sample.iterdir() if f.name.endswith(".md"))
                for p in split_passages(sample.joinpath(name).read_text(), lambda t: len(engine.layout.encode(t)), 120)]
    passages = list(dict.fromkeys(passages))
    questions = [q["question"] for q in json.loads(sample.joinpath("questions.json").read_text())]
    embedder = Embedder()
    scores = torch.tensor(embedder.embed(questions)) @ torch.tensor(embedder.embed(passages)).T
    return passages, [(q, [passages[j] for j in scores[i].topk(top_k).indices.tolist()]) for i, q in enumerate(questions)]


def workload(engine, count: int, top_k: int = 4) -> tuple[list[str], list[list[dict]]]:
    """Chat messages for `count` questions of the sample corpus, each with its top-k retrieved passages."""
    passages, asked = sample_retrievals(engine, top_k)
    requests = []
    for i in range(count):
        question, top = asked[i % len(asked)]
        requests.append([{"role": "system", "content": SYSTEM.format(context="\n\n".join(top))},
                         {"role": "user", "content": question}])
    return passages, requests


def batch_floor(engine, requests: list[list[dict]], runs: int = 5) -> float:
    """Seconds to place the requests' cached blocks and prefill all their questions in one model call."""
    from kvrag.attention import forward_packed

    texts = [engine.layout.render_chat([(m["role"], [m["content"]]) for m in messages])[0] for messages in requests]
    times = []
    with torch.inference_mode():
        for _ in range(runs):
            start = time.perf_counter()
            states, runs_ = [], []
            for text in texts:
                prompt, keys = engine.prompt_from_text(text)
                state = engine.prefill(prompt, "block", keys=keys, question=False)
                states.append(state)
                runs_.append((prompt.question, state.cache, state.next_position))
            forward_packed(engine.model, runs_)
            times.append(time.perf_counter() - start)
            for state in states:
                engine.release(state)
    return statistics.median(times)


class Server:
    """`kvrag serve` in a process of its own on a free port; `extra`: global options, `mode`: its --mode, `shadow`:
    its --shadow."""

    def __init__(self, home: Path, max_batch: int, max_queue: int = 256, extra=(), mode: str | None = None,
                 shadow: float = 0.0):
        from kvrag.app.client import free_port

        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        command = [str(Path(sys.executable).parent / "kvrag"), "--home", str(home), *extra, "serve", "--port",
                   str(self.port), "--max-batch", str(max_batch), "--max-queue", str(max_queue), "--log-level", "warning",
                   *(["--mode", mode] if mode else []), *(["--shadow", str(shadow)] if shadow else [])]
        self.process = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
        deadline = time.monotonic() + 600
        while True:
            if self.process.poll() is not None:
                raise RuntimeError(f"kvrag serve exited: {self.process.stderr.read()[-2000:]}")
            try:
                if httpx.get(self.url + "/health", timeout=1).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if time.monotonic() > deadline:
                self.close()
                raise RuntimeError("kvrag serve did not come up within 600 s")
            time.sleep(0.2)

    def close(self) -> None:
        self.process.terminate()
        try:
            self.process.wait(30)
        except subprocess.TimeoutExpired:
            self.process.kill()


def ask(client: httpx.Client, url: str, messages: list[dict], mode: str, max_tokens: int) -> tuple[float, str, int]:
    """(TTFT, answer, completion tokens) of one streamed chat completion."""
    body = {"messages": messages, "stream": True, "max_tokens": max_tokens, "temperature": 0,
            "stream_options": {"include_usage": True}, "kvrag": {"mode": mode}}
    start, ttft, text, tokens, done = time.perf_counter(), None, "", None, False
    with client.stream("POST", url + "/v1/chat/completions", json=body, timeout=600) as response:
        if response.status_code != 200:
            raise RuntimeError(f"HTTP {response.status_code}: {response.read().decode()[:200]}")
        for line in response.iter_lines():
            if not line.startswith("data: "):
                continue
            if line == "data: [DONE]":
                done = True
                break
            chunk = json.loads(line[6:])
            for choice in chunk.get("choices", []):
                delta = choice.get("delta", {}).get("content")
                if delta:
                    ttft = ttft if ttft is not None else time.perf_counter() - start
                    text += delta
            if chunk.get("usage"):
                tokens = chunk["usage"]["completion_tokens"]
    if not done or tokens is None:
        raise RuntimeError("the stream ended without its usage and [DONE]")
    return (ttft if ttft is not None else time.perf_counter() - start), text, tokens


def run_cell(cell: Cell, url: str, requests: list[list[dict]], per_client: int, max_tokens: int) -> Cell:
    """`cell.clients` clients, each asking `per_client` questions back to back, all starting together."""
    barrier = threading.Barrier(cell.clients + 1)
    lock = threading.Lock()

    def client(c: int) -> None:
        with httpx.Client() as http:
            barrier.wait()
            for r in range(per_client):
                index = (c * per_client + r) % len(requests)
                try:
                    ttft, text, tokens = ask(http, url, requests[index], cell.mode, max_tokens)
                except Exception as error:  # every failure counts, whatever it is
                    with lock:
                        cell.errors.append(f"{type(error).__name__}: {error}")
                    continue
                with lock:
                    cell.ttfts.append(ttft)
                    cell.tokens += tokens
                    cell.answers[index] = text

    threads = [threading.Thread(target=client, args=(c,)) for c in range(cell.clients)]
    for t in threads:
        t.start()
    barrier.wait()
    start = time.perf_counter()
    for t in threads:
        t.join()
    cell.wall = time.perf_counter() - start
    return cell


HEADER = (f"{'server':<16} {'mode':<6} {'clients':>7} {'requests':>8} {'tokens/s':>9} {'req/s':>6} "
          f"{'TTFT p50':>9} {'p95':>7} {'p99':>7} {'errors':>6}")


def row(cell: Cell) -> str:
    if not cell.ttfts:
        return f"{cell.server:<16} {cell.mode:<6} {cell.clients:>7} {cell.requests:>8} {'-':>9} {'-':>6} {'-':>9} {'-':>7} {'-':>7} {len(cell.errors):>6}"
    ms = lambda q: f"{percentile(cell.ttfts, q) * 1e3:.0f}ms"  # noqa: E731
    return (f"{cell.server:<16} {cell.mode:<6} {cell.clients:>7} {cell.requests:>8} {cell.tokens / cell.wall:>9.1f} "
            f"{cell.requests / cell.wall:>6.2f} {ms(50):>9} {ms(95):>7} {ms(99):>7} {len(cell.errors):>6}")


def benchmark(engine, home: Path, clients=(1, 4, 16), modes=("block", "full"), per_client: int = 2,
              max_tokens: int = 32, max_batch: int = 16, soak: int = 0, extra=(), out=print,
              shadow: float = 0.0) -> list[Cell]:
    """The table: every cell on the batched server and on the one-at-a-time server, alternating; then the
    batch floor, the answers compared, and (`soak` > 0) that many requests from 16 clients at once. With
    `shadow`, the second server is a batched one with `--shadow shadow` instead, and the summary is the cost of
    its shadow checks: its output tokens/s against the plain server's over every cell, and the checks it made."""
    passages, requests = workload(engine, max(16, max(clients) * per_client))
    engine.index(passages, progress=False)
    floor = batch_floor(engine, requests[:16])
    second = (f"shadow {shadow:g}", Server(home, max_batch, extra=extra, shadow=shadow)) if shadow else \
        ("one at a time", Server(home, 1, extra=extra))
    servers = {f"batched ({max_batch})": Server(home, max_batch, extra=extra), second[0]: second[1]}
    cells = []
    try:
        for server in servers.values():
            httpx.post(server.url + "/v1/passages", json={"passages": passages}, timeout=600).raise_for_status()
            run_cell(Cell("warm-up", "block", 1), server.url, requests[: len(requests) // per_client], 1, 4)
        out(HEADER)
        for mode in modes:
            for k, n in enumerate(clients):  # comparing shadow checks, every other round the other server first
                for name, server in list(servers.items())[:: -1 if shadow and k % 2 else 1]:
                    cells.append(run_cell(Cell(name, mode, n), server.url, requests, per_client, max_tokens))
                    out(row(cells[-1]))
                    if cells[-1].errors:
                        out(f"  first error: {cells[-1].errors[0]}")
        out(f"\nbatch floor: 16 questions prefilled together over their cached blocks: {floor * 1e3:.0f} ms")
        if shadow:
            return _shadow_cost(cells, servers, out)
        for mode in modes:
            top = [c for c in cells if c.mode == mode and c.clients == max(clients)]
            batched, alone = top[0], top[1]
            same = sum(batched.answers.get(i) == a for i, a in alone.answers.items())
            out(f"{mode}, {max(clients)} clients: output tokens/s {batched.tokens / batched.wall / (alone.tokens / alone.wall):.2f}x "
                f"the one-at-a-time server's; p99 TTFT {percentile(batched.ttfts, 99) / floor:.2f}x the batch floor; "
                f"answers equal to one-at-a-time: {same}/{len(alone.answers)}")
        if soak:
            server = next(iter(servers.values()))
            cell = run_cell(Cell(next(iter(servers)), modes[0], 16), server.url, requests, -(-soak // 16), max_tokens)
            out(f"\nsoak: {cell.requests} requests from 16 clients, {len(cell.errors)} errors"
                f"{': ' + cell.errors[0] if cell.errors else ''}")
            cells.append(cell)
    finally:
        for server in servers.values():
            server.close()
    return cells


def _shadow_cost(cells: list[Cell], servers: dict, out) -> list[Cell]:
    """Per mode and number of clients, the shadow-checking server's output tokens/s over the plain one's, pooled
    over the alternating cells; and the checks it made, from its /health."""
    plain, checked = list(servers)
    for mode, n in dict.fromkeys((c.mode, c.clients) for c in cells):
        rate = {name: sum(c.tokens for c in cells if (c.server, c.mode, c.clients) == (name, mode, n)) /
                sum(c.wall for c in cells if (c.server, c.mode, c.clients) == (name, mode, n)) for name in servers}
        out(f"{mode}, {n} clients: output tokens/s with shadow checks {rate[checked] / rate[plain]:.3f}x without")
    health = httpx.get(servers[checked].url + "/health", timeout=60).json()
    out(f"shadow checks made: {json.dumps(health.get('shadow'))}")
    return cells
