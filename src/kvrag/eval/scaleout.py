"""Replicas on one Redis: what the remote tier costs and saves (`kvrag bench remote`).

Starts a `redis-server` of its own on a free localhost port (it restarts it, so never a user's) and
measures, with the default model in block mode:
- TTFT with every block in memory, on the local disk (memory cold), in the remote tier (memory and
  disk cold) and computed (nothing cached), runs of the four interleaved;
- two replicas (engines loaded apart, homes apart, one Redis): the sample corpus indexed through A,
  its questions asked through A and B alike, and how many times each passage was encoded;
- requests from four clients to both replicas while Redis is stopped and started again: errors, and
  answers against those before the restart.
"""

import os
import shutil
import statistics
import subprocess
import tempfile
import threading
import time
from pathlib import Path

from kvrag.app.client import free_port
from kvrag.eval.serving import sample_retrievals
from kvrag.eval.ttft import FILLER


def stop_process(process: subprocess.Popen, timeout: float = 15) -> None:
    """SIGTERM, then SIGKILL if it lingers past `timeout` seconds."""
    if process.poll() is None:
        process.terminate()
        try:
            process.wait(timeout)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()


class RedisServer:
    """`redis-server` on 127.0.0.1 and a free port, no persistence, evicting least-recently-used keys past
    `maxmemory`. `stop()` then `start()` restarts it on the same port, empty, as a restarted cache is.
    `password`: clients must AUTH with it; `tls`: the port speaks TLS only, with a self-signed certificate
    for 127.0.0.1 made by `openssl` (the URL names it as the CA to trust)."""

    def __init__(self, directory: Path, maxmemory: str = "1gb", policy: str = "allkeys-lru", *,
                 password: str | None = None, tls: bool = False):
        self.directory, self.maxmemory, self.policy = Path(directory), maxmemory, policy
        self.directory.mkdir(parents=True, exist_ok=True)
        self.port = free_port()
        self.options = ["--port", str(self.port)]
        auth = f":{password}@" if password else ""
        self.url, self.process = f"redis://{auth}127.0.0.1:{self.port}/0", None
        if password:
            self.options += ["--requirepass", password]
        if tls:
            cert, key = self.directory / "cert.pem", self.directory / "key.pem"
            subprocess.run(["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "1", "-subj",
                            "/CN=127.0.0.1", "-addext", "subjectAltName=IP:127.0.0.1", "-keyout", str(key), "-out",
                            str(cert)], check=True, capture_output=True)
            self.options = ["--port", "0", "--tls-port", str(self.port), "--tls-cert-file", str(cert), "--tls-key-file",
                            str(key), "--tls-ca-cert-file", str(cert), "--tls-auth-clients", "no"] + self.options[2:]
            self.url = f"rediss://{auth}127.0.0.1:{self.port}/0?ssl_ca_certs={cert}"

    def start(self, timeout: float = 30.0) -> "RedisServer":
        import redis

        program = shutil.which("redis-server")
        if program is None:
            raise RuntimeError("redis-server is not installed (Debian: apt-get install redis-server; ./run's set-up does)")
        with open(self.directory / "redis.log", "ab") as out:
            self.process = subprocess.Popen(
                [program, *self.options, "--bind", "127.0.0.1", "--save", "", "--appendonly", "no",
                 "--dir", str(self.directory), "--maxmemory", self.maxmemory, "--maxmemory-policy", self.policy],
                stdin=subprocess.DEVNULL, stdout=out, stderr=subprocess.STDOUT,
            )
        deadline = time.monotonic() + timeout
        client = redis.Redis.from_url(self.url, socket_timeout=1.0, socket_connect_timeout=1.0)
        while True:
            try:
                if client.ping():
                    client.close()
                    return self
            except (redis.RedisError, OSError):
                pass
            if self.process.poll() is not None or time.monotonic() > deadline:
                log = (self.directory / "redis.log").read_text(errors="replace")[-2000:]
                self.stop()
                raise RuntimeError(f"redis-server did not start on port {self.port}; its log:\n{log}")
            time.sleep(0.02)

    def kill(self) -> None:
        """SIGKILL: the server gone at once, its connections cut mid-reply."""
        if self.process is not None:
            self.process.kill()
            self.process.wait()
            self.process = None

    def stop(self) -> None:
        if self.process is not None:
            stop_process(self.process)
        self.process = None

    def __enter__(self) -> "RedisServer":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()


def _cold(engine) -> None:
    """Forget what the engine holds in memory (its disk, and Redis, stay as they are)."""
    engine.store.memory.clear()


def ttft_rows(engine, url: str, home: Path, lengths, runs: int, out=print) -> dict:
    """Median TTFT (block mode, one new token) with the blocks in each tier, per context length. Each tier
    is an engine of its own, so their scheduler workers must not linger into each other's runs: two
    OpenMP teams at once would slow both (see threads.py)."""
    from kvrag import KVEngine, scheduler

    same = dict(fingerprint=engine.fingerprint, storage_dtype=engine.storage_dtype)
    tiers = {
        "memory": engine,
        "disk": KVEngine(engine.model, engine.tokenizer, home=home / "disk", **same),
        "remote": KVEngine(engine.model, engine.tokenizer, persist=False, remote=url, **same),
        "computed": KVEngine(engine.model, engine.tokenizer, persist=False, **same),
    }
    question = "Which pilot guided the ship?"
    per_passage = len(engine.layout.passage_ids(FILLER * 2 + " Record 0."))
    out(f"{'context':>8} {'tier':<9} {'TTFT':>8} {'x memory':>9}")
    medians, linger, scheduler.LINGER = {}, scheduler.LINGER, 0.0
    try:
        for length in lengths:
            passages = [FILLER * 2 + f" Record {length}-{i}." for i in range(max(1, round(length / per_passage)))]
            tokens = sum(len(engine.layout.passage_ids(p)) for p in passages)
            for name in ("memory", "disk", "remote"):
                tiers[name].index(passages, progress=False)  # memory, disk: the local store; remote: Redis too
            times = {name: [] for name in tiers}
            for _ in range(runs + 1):  # the first round warms up and is dropped
                for name, tier in tiers.items():
                    if name != "memory":
                        _cold(tier)
                    result = tier.generate(question, passages, mode="block", max_new_tokens=1)
                    if result.cache_hits.get(name, 0) < len(passages):  # the tier's name is the hits' name
                        raise RuntimeError(f"the {name} run was not served from there: {result.cache_hits}")
                    times[name].append(result.ttft)
            for name in tiers:
                medians[length, name] = statistics.median(times[name][1:])
                out(f"{tokens:>8} {name:<9} {medians[length, name] * 1e3:>6.0f}ms "
                    f"{medians[length, name] / medians[length, 'memory']:>8.2f}x")
    finally:
        scheduler.LINGER = linger
    return medians


def count_passage_encodings(engine, passages: list[str]) -> dict:
    """Wrap the engine's encoder to count, per corpus passage, how often its KV is computed."""
    by_ids = {tuple(engine.layout.passage_ids(p)): p for p in passages}
    counts = dict.fromkeys(passages, 0)
    encode_many = engine.blocks.encode_many

    def counting(ids_list, *args, **kwargs):
        for ids in ids_list:
            if tuple(ids) in by_ids:
                counts[by_ids[tuple(ids)]] += 1
        return encode_many(ids_list, *args, **kwargs)

    engine.blocks.encode_many = counting
    return counts


def replicas(load, url: str, home: Path, out=print) -> tuple:
    """Two engines on one Redis; the corpus indexed through A, every question asked through both."""
    a, b = load(home / "a", url), load(home / "b", url)
    passages, requests = sample_retrievals(a)
    counts = [count_passage_encodings(engine, passages) for engine in (a, b)]
    a.index(passages, progress=False)
    for question, top in requests:
        for engine in (a, b):
            engine.generate(question, top, mode="block", max_new_tokens=8)
    encoded = [sum(c.values()) for c in counts]
    twice = sum(counts[0][p] + counts[1][p] > 1 for p in passages)
    out(f"corpus {len(passages)} passages, indexed through A, {len(requests)} questions asked through A and B: "
        f"passage encodings A {encoded[0]}, B {encoded[1]}, total {sum(encoded)}; passages encoded twice: {twice}")
    return a, b, requests, encoded


def restart(a, b, server: RedisServer, requests, total: int = 200, clients: int = 4, out=print) -> dict:
    """`total` requests from `clients` threads to A and B in turn; Redis stopped at a third of them and
    started again at two thirds."""
    expected = {q: a.generate(q, top, mode="block", max_new_tokens=8).token_ids for q, top in requests}
    done, errors, wrong, lock = [0], [], [0], threading.Lock()
    events = {total // 3: server.stop, 2 * total // 3: server.start}
    ran = {n: threading.Event() for n in events}  # in order: a start never overtakes the stop still under way

    def client(c):
        while True:
            with lock:
                n = done[0]
                if n >= total:
                    return
                done[0] += 1
            if n in events:
                for m in events:
                    if m < n:
                        ran[m].wait()
                try:
                    events[n]()
                finally:
                    ran[n].set()
            question, top = requests[n % len(requests)]
            try:
                if (a, b)[n % 2].generate(question, top, mode="block", max_new_tokens=8).token_ids != expected[question]:
                    with lock:
                        wrong[0] += 1
            except Exception as exc:  # noqa: BLE001 - counted, that is what is measured
                with lock:
                    errors.append(repr(exc))

    threads = [threading.Thread(target=client, args=(c,)) for c in range(clients)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    out(f"Redis stopped after {total // 3} and started again after {2 * total // 3} of {total} requests "
        f"({clients} clients, A and B in turn): {len(errors)} failed, {wrong[0]} answers unlike before the restart"
        f"{': ' + errors[0] if errors else ''}")
    return {"failed": len(errors), "wrong": wrong[0]}


def benchmark(load, lengths=(1024, 4096), runs: int = 5, requests: int = 200, out=print) -> None:
    """`load(home, remote_url)` makes an engine; the three parts above, in order. The replicas share a
    secret, as a deployment's do (`remote.shared_secret`): a random one unless $KVRAG_SECRET is set."""
    import secrets
    import warnings

    os.environ.setdefault("KVRAG_SECRET", secrets.token_hex(32))

    with tempfile.TemporaryDirectory(prefix="kvrag-bench-remote-") as tmp, RedisServer(Path(tmp) / "redis") as server:
        home = Path(tmp)
        engine = load(home / "memory", None)
        out(f"redis-server {server.url} (localhost TCP); block mode, 1 new token, median of {runs}\n")
        ttft_rows(engine, server.url, home, lengths, runs, out)
        out("")
        a, b, asked, _ = replicas(load, server.url, home, out)
        with warnings.catch_warnings():  # the outage's one warning per replica is expected here
            warnings.simplefilter("ignore")
            restart(a, b, server, asked, requests, out=out)
