"""vLLM with and without kvrag's connector, started for real (`kvrag bench vllm`, the tests).

vLLM runs from its own virtualenv (./run builds .venv-vllm; KVRAG_VLLM_PYTHON names another interpreter)
on the weights kvrag's engine answers with, exported once (`kvrag export`), so that both engines answer
with one model.
"""

import json
import os
import statistics
import subprocess
import threading
import time
import urllib.error
import urllib.request
from contextlib import contextmanager
from pathlib import Path

from kvrag import vllm_client
from kvrag.app.client import free_port
from kvrag.eval.scaleout import stop_process

SERVED_NAME = "kvrag-default"


def vllm_python() -> Path:
    """The interpreter of vLLM's environment: $KVRAG_VLLM_PYTHON, else .venv-vllm in kvrag's checkout."""
    if os.environ.get("KVRAG_VLLM_PYTHON"):
        return Path(os.environ["KVRAG_VLLM_PYTHON"])
    return Path(__file__).resolve().parents[3] / ".venv-vllm" / "bin" / "python"


def export(directory: Path, **engine_options) -> Path:
    """The default model with its adapter, as `kvrag export` writes it, once per directory."""
    directory = Path(directory)
    if not (directory / "config.json").is_file():
        from kvrag import KVEngine, loading

        engine = KVEngine.shared(**engine_options)
        loading.export(engine.model, engine.tokenizer, directory)
    return directory


class Server(vllm_client.Server):
    """A vLLM server `vllm_server` started: the client's calls, and its `log` (a file), `home` and process."""

    def __init__(self, url: str, log: Path, home: Path | None, process: subprocess.Popen):
        super().__init__(url, SERVED_NAME)
        self.log, self.home, self.process = log, home, process

    def log_text(self) -> str:
        return self.log.read_text(errors="replace")

    def request(self, connector: bool, **fields) -> dict:
        """A request body for the served model, marked to bypass the connector unless `connector`."""
        return {"model": self.model, **fields, **({} if connector else {"kv_transfer_params": {"kvrag": "off"}})}


@contextmanager
def vllm_server(model: Path, log_dir: Path, *, connector: bool = True, home: Path | None = None,
                remote: str | None = None, dtype: str = "float32", max_model_len: int = 4096, kv_cache_gib: int = 1,
                extra: tuple[str, ...] = (), env: dict | None = None, timeout: float = 900):
    """vLLM's OpenAI-compatible server on 127.0.0.1 and a free port, eager (no compilation: ready in about a
    minute), with kvrag's connector keeping KV under `home` (and in the Redis tier at `remote`) unless
    `connector` is False; `env` adds to the environment. Stopped after."""
    python = vllm_python()
    if not python.exists():
        raise RuntimeError(f"no vLLM environment at {python.parent.parent}: `./run test` or `./run bench vllm` builds "
                           "it (or set KVRAG_VLLM_PYTHON)")
    log_dir = Path(log_dir)
    log_dir.mkdir(parents=True, exist_ok=True)
    port = free_port()
    log = log_dir / f"vllm-{port}.log"
    command = [str(python), "-m", "vllm.entrypoints.openai.api_server", "--model", str(model), "--served-model-name",
               SERVED_NAME, "--dtype", dtype, "--max-model-len", str(max_model_len), "--enforce-eager", "--host",
               "127.0.0.1", "--port", str(port), "--enable-prompt-tokens-details", "--disable-uvicorn-access-log",
               *extra]
    if connector:
        command += ["--kv-transfer-config", vllm_client.transfer_config(home=str(home) if home else None, remote=remote)]
    env = {**os.environ, "VLLM_CPU_KVCACHE_SPACE": str(kv_cache_gib), "TOKENIZERS_PARALLELISM": "false", **(env or {})}
    with open(log, "ab") as out:
        process = subprocess.Popen(command, stdin=subprocess.DEVNULL, stdout=out, stderr=subprocess.STDOUT, env=env)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + timeout
        while True:
            if process.poll() is not None:
                raise RuntimeError(f"vLLM exited ({process.returncode}); its log ends:\n{log.read_text(errors='replace')[-3000:]}")
            try:
                with urllib.request.urlopen(url + "/health", timeout=2) as response:
                    if response.status == 200:
                        break
            except (urllib.error.URLError, OSError):
                pass
            if time.monotonic() > deadline:
                raise RuntimeError(f"vLLM at {url} not ready within {timeout:.0f} s; its log: {log}")
            time.sleep(0.5)
        yield Server(url, log, Path(home) if home else None, process)
    finally:
        stop_process(process, timeout=30)


# ---- kvrag bench vllm ------------------------------------------------------------------------------------

SYSTEM = "Answer the question from the context, in one sentence."
SYSTEMS = ("vllm", "vllm+kvrag", "kvrag")
"""vLLM alone (its prefix cache on), vLLM with kvrag's connector, kvrag's own engine in block mode."""


def messages(passages: list[str], question: str) -> list[dict]:
    """A RAG app's chat request: passages joined by blank lines, as LangChain's and LlamaIndex's prompts join them."""
    context = "\n\n".join(passages)
    return [{"role": "system", "content": SYSTEM},
            {"role": "user", "content": f"Context:\n{context}\n\nQuestion: {question}"}]


def draw(passages: list[str], counts: list[int], tokens: int, rng) -> list[str]:
    """Passages adding up to about `tokens` tokens, drawn at random and in a random order: a new retrieval, so
    that no earlier request shares a prefix beyond the system prompt."""
    order = rng.sample(range(len(passages)), len(passages))
    chosen, total = [], 0
    for i in order:
        if total + counts[i] > tokens:
            continue
        chosen.append(passages[i])
        total += counts[i]
    return chosen


def _vllm_ttft(server: Server, chat: list[dict], connector: bool) -> tuple[float, int]:
    """Seconds to the first token (a one-token answer) and the prompt tokens vLLM did not compute."""
    body = server.request(connector, messages=chat, max_tokens=1, temperature=0)
    start = time.perf_counter()
    reply = server.call("POST", "/v1/chat/completions", body)
    return time.perf_counter() - start, reply["usage"]["prompt_tokens_details"]["cached_tokens"]


def _kvrag_ttft(engine, chat: list[dict]) -> tuple[float, int]:
    text = engine.tokenizer.apply_chat_template(chat, tokenize=False, add_generation_prompt=True)
    start = time.perf_counter()
    result = engine.generate_text(text, mode="block", max_new_tokens=1)
    return time.perf_counter() - start, result.prompt_tokens - result.prefilled_tokens


def ttft_rows(server: Server, engine, passages, counts, lengths, runs: int, question: str, rng, progress=print):
    """Median TTFT per system and prompt length; the three systems take turns within each run."""
    rows = []
    for length in lengths:
        times = {s: [] for s in SYSTEMS}
        reused = {s: [] for s in SYSTEMS}
        for run in range(runs):
            for system in (SYSTEMS if run % 2 == 0 else SYSTEMS[::-1]):
                chat = messages(draw(passages, counts, length, rng), question)
                seconds, cached = (_kvrag_ttft(engine, chat) if system == "kvrag"
                                   else _vllm_ttft(server, chat, connector=system == "vllm+kvrag"))
                times[system].append(seconds)
                reused[system].append(cached)
        prompt = len(engine.tokenizer.apply_chat_template(chat, tokenize=True, add_generation_prompt=True,
                                                          return_dict=False))
        row = {"length": length, "prompt_tokens": prompt,
               **{s: statistics.median(t) for s, t in times.items()},
               **{f"{s}_reused": statistics.median(r) for s, r in reused.items()}}
        rows.append(row)
        progress(format_ttft(row))
    return rows


TTFT_HEADER = (f"{'prompt':>7} {'vLLM ms':>9} {'(reused)':>9} {'+kvrag ms':>10} {'(reused)':>9} {'kvrag ms':>9} "
               f"{'vLLM/+kvrag':>12} {'+kvrag/kvrag':>13}")


def format_ttft(row) -> str:
    return (f"{row['prompt_tokens']:>7} {row['vllm'] * 1e3:>9.0f} {row['vllm_reused']:>9.0f} "
            f"{row['vllm+kvrag'] * 1e3:>10.0f} {row['vllm+kvrag_reused']:>9.0f} {row['kvrag'] * 1e3:>9.0f} "
            f"{row['vllm'] / row['vllm+kvrag']:>11.1f}x {row['vllm+kvrag'] / row['kvrag']:>12.2f}x")


def concurrent(server: Server, passages, counts, clients: int, per_client: int, length: int, question: str,
               connector: bool, rng, max_tokens: int = 16) -> dict:
    """`clients` threads each sending `per_client` streamed chat requests (new passage orders) one after another:
    requests a second, TTFT percentiles and errors."""
    import httpx

    work = [[messages(draw(passages, counts, length, rng), question) for _ in range(per_client)] for _ in range(clients)]
    ttfts, errors, lock = [], [], threading.Lock()

    def client(chats):
        with httpx.Client(timeout=600) as http:
            for chat in chats:
                body = server.request(connector, messages=chat, max_tokens=max_tokens, temperature=0, stream=True)
                start, first = time.perf_counter(), None
                try:
                    with http.stream("POST", server.url + "/v1/chat/completions", json=body) as response:
                        response.raise_for_status()
                        for line in response.iter_lines():
                            if first is None and line.startswith("data: {") and '"content":"' in line \
                                    and '"content":""' not in line:
                                first = time.perf_counter() - start
                    with lock:
                        ttfts.append(first if first is not None else time.perf_counter() - start)
                except Exception as exc:  # noqa: BLE001 - counted, and the bench goes on
                    with lock:
                        errors.append(f"{type(exc).__name__}: {exc}")

    threads = [threading.Thread(target=client, args=(chats,)) for chats in work]
    start = time.perf_counter()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    wall = time.perf_counter() - start
    from kvrag.eval.serving import percentile

    done = len(ttfts)
    return {"system": "vllm+kvrag" if connector else "vllm", "clients": clients, "requests": done + len(errors),
            "errors": len(errors), "per_second": done / wall, "p50": percentile(ttfts, 50) if ttfts else float("nan"),
            "p99": percentile(ttfts, 99) if ttfts else float("nan"), "error_examples": errors[:3]}


@contextmanager
def bench_server(directory: Path | None = None):
    """A vLLM server for the benchmarks: kvrag's weights, the connector, a 2 GiB KV cache, every core (as
    kvrag's engine has), eager; everything in a temporary directory."""
    import tempfile

    with tempfile.TemporaryDirectory(prefix="kvrag-bench-vllm-", dir=directory) as tmp:
        tmp = Path(tmp)
        weights = export(tmp / "weights")
        cores = {"VLLM_CPU_OMP_THREADS_BIND": f"0-{(os.cpu_count() or 1) - 1}", "VLLM_CPU_NUM_OF_RESERVED_CPU": "0"}
        with vllm_server(weights, tmp, home=tmp / "home", max_model_len=8192, kv_cache_gib=2,
                         env={name: os.environ.get(name, value) for name, value in cores.items()}) as server:
            yield server


def benchmark(lengths=(1024, 4096, 8000), runs: int = 3, clients: int = 16, per_client: int = 2,
              concurrent_length: int = 1024, seed: int = 0, directory: Path | None = None, progress=print) -> dict:
    """`kvrag bench vllm`: one vLLM server (its KV cache 2 GiB, both cores, eager) and kvrag's engine in this
    process, on the same weights and passages."""
    import random

    from kvrag import KVEngine
    from kvrag.eval.ttft import QUESTION, make_passages

    engine = KVEngine.shared()
    rng = random.Random(seed)
    passages = [p.strip() for p in make_passages(engine, 2 * max(lengths), block_tokens=200, tag="v")]
    counts = [len(engine.layout.passage_ids(p)) + 2 for p in passages]  # and the blank line after it
    with bench_server(directory) as server:
        started = time.perf_counter()
        vllm_client.index(server.url, passages, model=server.model)
        vllm_index = time.perf_counter() - started
        started = time.perf_counter()
        engine.index(passages, progress=False)
        kvrag_index = time.perf_counter() - started
        progress(f"{len(passages)} passages ({sum(counts)} tokens) indexed: through vLLM in {vllm_index:.1f} s, "
                 f"by kvrag's engine in {kvrag_index:.1f} s")
        warm = messages(draw(passages, counts, 512, rng), QUESTION)  # the system turn's KV, kept by each
        _vllm_ttft(server, warm, connector=True)
        _kvrag_ttft(engine, warm)
        progress(TTFT_HEADER)
        rows = ttft_rows(server, engine, passages, counts, lengths, runs, QUESTION, rng, progress)
        progress(f"{clients} clients, {per_client} requests each, ~{concurrent_length}-token prompts, 16-token "
                 f"answers, streamed")
        load = []
        for connector in (False, True, False, True):
            cell = concurrent(server, passages, counts, clients, per_client, concurrent_length, QUESTION,
                              connector, rng)
            load.append(cell)
            progress(f"  {cell['system']:<11} {cell['per_second']:6.2f} requests/s, TTFT p50 "
                     f"{cell['p50'] * 1e3:7.0f} ms, p99 {cell['p99'] * 1e3:7.0f} ms, {cell['errors']} errors")
    return {"ttft": rows, "concurrent": load, "passages": len(passages), "index_seconds": {"vllm": vllm_index,
                                                                                           "kvrag": kvrag_index}}


def plot(result: dict, path: Path) -> Path:
    from kvrag.eval.accuracy import _pyplot

    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(6.4, 4.2))
    labels = {"vllm": "vLLM alone (prefix cache on)", "vllm+kvrag": "vLLM + kvrag connector",
              "kvrag": "kvrag engine, block mode"}
    x = [row["prompt_tokens"] for row in result["ttft"]]
    for system, label in labels.items():
        ax.plot(x, [row[system] * 1e3 for row in result["ttft"]], marker="o", label=label)
    ax.set_yscale("log")
    ax.set_xlabel("prompt tokens (passages in a new order each request)")
    ax.set_ylabel("time to first token, ms (median)")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    return Path(path)


# ---- kvrag bench vllm --accuracy ---------------------------------------------------------------------------

ACCURACY_LAYOUT = "langchain-system-context"
ACCURACY_SYSTEMS = ("vllm+kvrag", "kvrag-block", "vllm-full", "kvrag-full")


def accuracy(server: Server, engine, examples, max_new_tokens: int = 48, workers: int = 4, progress=print) -> list[dict]:
    """Each question asked four ways on the same rendered prompt text and weights: through vLLM with the
    connector, by kvrag's engine in block mode (its drop-in path), through vLLM with the connector off and by
    kvrag's engine in full mode (full prefill both). Rows: id, type and each system's output and correctness."""
    from concurrent.futures import ThreadPoolExecutor

    from kvrag.eval.layouts import LAYOUTS
    from kvrag.eval.metrics import answer_in_output

    passages = sorted({p for e in examples for p in e.passages})
    vllm_client.index(server.url, passages, model=server.model)
    engine.index(passages, progress=False)

    def vllm(ids, connector: bool) -> str:
        body = server.request(connector, prompt=ids, max_tokens=max_new_tokens, temperature=0)
        return server.call("POST", "/v1/completions", body)["choices"][0]["text"]

    def ask(example) -> dict:
        text, _ = LAYOUTS[ACCURACY_LAYOUT].render(engine, example.question, example.passages)
        ids = engine.tokenizer(text, add_special_tokens=False)["input_ids"]
        outputs = {"vllm+kvrag": vllm(ids, True),
                   "kvrag-block": engine.generate_text(text, mode="block", max_new_tokens=max_new_tokens).text,
                   "vllm-full": vllm(ids, False),
                   "kvrag-full": engine.generate_text(text, mode="full", max_new_tokens=max_new_tokens).text}
        row = {"id": example.id, "type": example.type}
        for system, output in outputs.items():
            row[system] = output.strip()
            row[f"{system}_correct"] = answer_in_output(output, example.answers, example.wrong)
        return row

    ask(examples[0])  # the prompt's header: kept by the connector, so that every measured question can reuse
    with ThreadPoolExecutor(workers) as pool:
        rows = list(pool.map(ask, examples))
    progress(f"{len(rows)} questions, layout {ACCURACY_LAYOUT}")
    return rows


def accuracy_benchmark(questions: int = 200, heldout: Path | None = None, seed: int = 5, squad_questions: int = 0,
                       directory: Path | None = None, progress=print) -> list[dict]:
    """`kvrag bench vllm --accuracy`: generated test questions (SQuAD's, 5 passages each, and a held-out
    corpus's) through `accuracy`."""
    from kvrag import KVEngine
    from kvrag.eval import data, squad
    from kvrag.eval import heldout as held

    engine = KVEngine.shared()
    examples = data.generate("test", questions, seed=seed) if questions else []
    if squad_questions:
        examples += squad.questions("test", squad_questions, passages=5, seed=seed)
    if heldout is not None:
        examples += held.questions(heldout, lambda text: len(engine.layout.encode(text)))
    with bench_server(directory) as server:
        rows = accuracy(server, engine, examples, progress=progress)
    progress(accuracy_markdown(rows))
    return rows


# ---- the tables docs/vllm.md shows, computed from the files in docs/results (tests/test_readme.py) ---------

def ttft_table(paths) -> str:
    """Markdown: `benchmark`'s TTFT rows (its --json file)."""
    result = json.loads(Path(paths[0]).read_text())
    lines = ["| prompt tokens | vLLM alone | vLLM + kvrag | kvrag's engine, block | vLLM alone / + kvrag | "
             "+ kvrag / kvrag's engine |", "|---:|---:|---:|---:|---:|---:|"]
    for row in result["ttft"]:
        lines.append(f"| {row['prompt_tokens']} | {row['vllm'] * 1e3:.0f} ms | {row['vllm+kvrag'] * 1e3:.0f} ms | "
                     f"{row['kvrag'] * 1e3:.0f} ms | {row['vllm'] / row['vllm+kvrag']:.1f}× | "
                     f"{row['vllm+kvrag'] / row['kvrag']:.2f}× |")
    return "\n".join(lines)


def accuracy_table(paths) -> str:
    """Markdown: `accuracy`'s rows (its --json file, gzipped), `accuracy_markdown`."""
    import gzip

    return accuracy_markdown(json.loads(gzip.decompress(Path(paths[0]).read_bytes())))


def accuracy_markdown(rows: list[dict]) -> str:
    """`accuracy`'s rows by corpus (generated, SQuAD, held-out, all): each system's share right, the paired
    differences of the connector's answers against kvrag's block mode and against full prefill (95%), and how
    often two systems answer word for word alike."""
    from kvrag.eval.accuracy import paired_interval, points

    lines = ["| corpus | vLLM + kvrag | kvrag block | vLLM full | kvrag full | + kvrag − kvrag block | + kvrag − vLLM full "
             "| same words: + kvrag, kvrag block | same words: vLLM full, kvrag full |",
             "|---|---:|---:|---:|---:|---:|---:|---:|---:|"]
    corpora = {"squad": "SQuAD", "heldout": "held-out"}
    corpus = lambda row: next((name for prefix, name in corpora.items() if row["id"].startswith(prefix)), "generated")
    groups = [(name, [r for r in rows if corpus(r) == name]) for name in ("generated", *corpora.values())]
    for name, chosen in [(name, chosen) for name, chosen in groups if chosen] + [("all", rows)]:
        share = {s: 100 * sum(r[f"{s}_correct"] for r in chosen) / len(chosen) for s in ACCURACY_SYSTEMS}
        diffs = [points(*paired_interval([int(r["vllm+kvrag_correct"]) - int(r[f"{other}_correct"]) for r in chosen]))
                 for other in ("kvrag-block", "vllm-full")]
        same = [100 * sum(r[a] == r[b] for r in chosen) / len(chosen)
                for a, b in (("vllm+kvrag", "kvrag-block"), ("vllm-full", "kvrag-full"))]
        lines.append(f"| {name}, {len(chosen)} | {share['vllm+kvrag']:.1f}% | {share['kvrag-block']:.1f}% | "
                     f"{share['vllm-full']:.1f}% | {share['kvrag-full']:.1f}% | {diffs[0]} | {diffs[1]} | "
                     f"{same[0]:.0f}% | {same[1]:.0f}% |")
    return "\n".join(lines)
