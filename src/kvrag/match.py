"""Find indexed passages inside an arbitrary prompt by content, so unmodified RAG chains reuse their KV.

A chain that stuffs retrieved passages into a prompt leaves no markers, and separators tokenize
differently inside text (the LMCache trap), so passages are found by what they are: a polynomial
rolling hash over the prompt's characters proposes positions where a known passage's first
characters occur, and an exact string comparison confirms the whole passage.

Known passages persist in a small SQLite file next to their KV, so a chat model in one process
finds passages that a vector store indexed in another; with a remote tier (remote.py) they are
also registered there, so a replica on another machine finds them too.

A prompt whose passages nobody indexed or retrieved (text pasted into a template) teaches the matcher
its own: `unmarked_passages` proposes the runs of text between blank lines, which the engine learns
before answering, so the next prompt holding them reuses their KV.
"""

import hashlib
import os
import re
import sqlite3
import threading
import uuid
import warnings
from pathlib import Path

import numpy as np

from .locks import file_lock
from .paths import disk_full

_BASE = np.uint64(0x100000001B3)  # odd, hence invertible modulo 2**64
_BASE_INV = np.uint64(pow(int(_BASE), -1, 1 << 64))


def _codes(text: str) -> np.ndarray:
    return np.frombuffer(text.encode("utf-32-le", "surrogatepass"), dtype=np.uint32).astype(np.uint64)


def _powers(base: np.uint64, n: int) -> np.ndarray:
    """base**0 .. base**(n-1) modulo 2**64 (numpy's unsigned arithmetic wraps)."""
    out = np.full(n, base, dtype=np.uint64)
    out[0] = 1
    return np.cumprod(out, dtype=np.uint64)


def window_hashes(text: str, width: int) -> np.ndarray:
    """Hash of every `width`-character window of `text`, the same value wherever the window occurs."""
    codes = _codes(text)
    n = len(codes)
    if n < width:
        return np.empty(0, dtype=np.uint64)
    with np.errstate(over="ignore"):
        sums = np.concatenate(([np.uint64(0)], np.cumsum(codes * _powers(_BASE, n), dtype=np.uint64)))
        # sums[i + w] - sums[i] = base**i * hash(window at i); multiply the base**i away
        return (sums[width:] - sums[: n - width + 1]) * _powers(_BASE_INV, n - width + 1)


_BLANK = r"\n[ \t]*(?:[-=*_~]{3,}[ \t]*)?\n\s*"
"""A blank line, or a rule ("---", "===") on a line of its own, as LlamaIndex's prompts frame their context."""
_LABEL = re.compile(r"[^\n]{1,40}:[ \t]*\n")
"""A short first line ending in a colon ("Context:", "Sources:"): a template's label, not the passage's."""


def unmarked_passages(text: str, special_tokens=(), min_chars: int = 32) -> list[str]:
    """The texts a rendered prompt probably holds as passages, found without being told: each run of text
    that a blank line (or a rule) opens and a blank line or a special token (the chat template's) closes, less a
    label line, at least `min_chars` long. The last such long run of the prompt is left out (the question,
    or the passage the question is glued to), and so is the first of each message (opened by the
    template: an instruction, or the passage glued to it), so that neither becomes a block."""
    boundary = "|".join([_BLANK, *map(re.escape, sorted(special_tokens, key=len, reverse=True))])
    runs, start, opened = [], 0, False
    for m in re.finditer(boundary, text):
        run = text[start : m.start()]
        runs.append((run, opened))
        blank = m.group().startswith("\n")
        opened = blank and (bool(run.strip()) or opened)  # a blank line right after a special token opens nothing
        start = m.end()
    runs.append((text[start:], opened))
    runs = [((run[label.end() :] if (label := _LABEL.match(run)) else run).strip(), opened) for run, opened in runs]
    long = [i for i, (run, _) in enumerate(runs) if len(run) >= min_chars]
    keep = set(long[:-1])
    return [run for i, (run, opened) in enumerate(runs) if opened and i in keep]


def _open(path) -> sqlite3.Connection:
    db = sqlite3.connect(str(path), timeout=60, check_same_thread=False, isolation_level=None)
    try:
        db.execute("CREATE TABLE IF NOT EXISTS passages (digest TEXT PRIMARY KEY, text TEXT NOT NULL)")
        db.execute("SELECT rowid, text FROM passages LIMIT 1").fetchall()  # a table of another shape fails here
    except sqlite3.DatabaseError:
        db.close()
        raise
    return db


_IN_USE = ("SQLITE_BUSY", "SQLITE_LOCKED")
"""SQLite's errors for a registry that another connection holds past the timeout: in use, not damaged,
so it is never moved aside for them."""
PAGE = 4096
"""SQLite's default page: the least a write to the registry needs, said where a full disk refuses one."""


def _full(exc: sqlite3.Error) -> bool:
    """Whether SQLite's error says the disk (or the quota) has no room: not damage, so nothing is moved aside."""
    return getattr(exc, "sqlite_errorcode", None) == sqlite3.SQLITE_FULL


def _open_room(path: Path) -> sqlite3.Connection:
    """`_open`, a full disk said in one line naming the directory (DiskFullError, as for the KV files beside it):
    no room is no damage, so the registry is not moved aside for it."""
    try:
        return _open(path)
    except sqlite3.OperationalError as exc:
        if _full(exc):
            raise disk_full(exc, path.parent, PAGE) from exc
        raise


def registered_passages(paths) -> list[str]:
    """The texts of passage registries (passages.sqlite files), each once, read without writing to them.
    A registry that cannot be read is skipped with a one-line warning: the engine that owns it moves it
    aside when it next opens it."""
    texts: dict[str, None] = {}
    for path in paths:
        path = Path(path)
        try:
            with file_lock(path.with_name(f"{path.name}.lock")):  # not while it is being created
                db = sqlite3.connect(f"{path.resolve().as_uri()}?mode=ro", uri=True, timeout=60)
                try:
                    rows = db.execute("SELECT text FROM passages WHERE typeof(text) = 'text' ORDER BY rowid").fetchall()
                finally:
                    db.close()
        except sqlite3.DatabaseError as exc:
            warnings.warn(f"kvrag: skipping unreadable passage registry {path}: {exc}", RuntimeWarning, stacklevel=2)
            continue
        texts.update(dict.fromkeys(text for (text,) in rows))
    return list(texts)


class PassageMatcher:
    """The texts of indexed passages, and where they occur in a prompt.

    Passages shorter than `min_chars` are never matched: they could occur by chance inside other
    text, and prefilling them costs little anyway.
    """

    def __init__(self, path: str | Path | None = None, *, remote=None, window: int = 64, min_chars: int = 32):
        self.window, self.min_chars = window, min_chars
        self.remote, self._remote_seen = remote, 0
        self._buckets: dict[int, dict[int, list[str]]] = {}  # window width -> head hash -> passages
        self._seen: set[str] = set()
        self._lock = threading.Lock()
        self._db = self._version = None
        self._last_row = 0
        self.path = Path(path) if path is not None else None
        if path is not None:
            path = Path(path)
            with file_lock(path.with_name(f"{path.name}.lock")):  # created, or moved aside, by one process at a time
                try:
                    self._db = _open_room(path)
                except sqlite3.DatabaseError as exc:  # damaged: it only remembers texts, which indexing adds again
                    if getattr(exc, "sqlite_errorname", None) in _IN_USE:
                        raise
                    aside = path.with_name(f"{path.name}.damaged-{uuid.uuid4().hex[:8]}")
                    warnings.warn(f"kvrag: {path} is unusable ({exc}); moved to {aside.name}, starting afresh",
                                  RuntimeWarning, stacklevel=2)
                    os.replace(path, aside)
                    self._db = _open_room(path)

    def __len__(self) -> int:
        self._refresh()
        return len(self._seen)

    def __contains__(self, text: str) -> bool:
        self._refresh()
        return text in self._seen

    def add(self, texts) -> None:
        texts = [t for t in dict.fromkeys(texts) if len(t) >= self.min_chars]
        with self._lock:
            if self._db is not None:
                rows = [(hashlib.sha256(t.encode("utf-8", "surrogatepass")).hexdigest(), t) for t in texts]
                try:
                    with self._db:  # one transaction: concurrent writers wait on SQLite's lock
                        self._db.execute("BEGIN IMMEDIATE")
                        self._db.executemany("INSERT OR IGNORE INTO passages VALUES (?, ?)", rows)
                except sqlite3.OperationalError as exc:
                    if _full(exc):
                        raise disk_full(exc, self.path.parent, sum(len(t) for t in texts)) from exc
                    raise
            for text in texts:
                self._remember(text)
        if self.remote is not None:
            self.remote.add_passages(texts)

    def _remember(self, text: str) -> None:
        if text in self._seen:
            return
        self._seen.add(text)
        width = min(self.window, len(text))
        head = int(window_hashes(text[:width], width)[0])
        self._buckets.setdefault(width, {}).setdefault(head, []).append(text)

    def _refresh(self) -> None:
        """Load passages that other processes (or other engines, or other replicas) have added since the
        last look."""
        if self.remote is not None:
            with self._lock:
                texts, self._remote_seen = self.remote.passages(self._remote_seen)
                for text in texts:
                    if text is not None and len(text) >= self.min_chars:
                        self._remember(text)
        if self._db is None:
            return
        with self._lock:
            version = self._db.execute("PRAGMA data_version").fetchone()[0]
            if version == self._version and self._last_row:
                return
            rows = "SELECT rowid, text FROM passages WHERE rowid > ? AND typeof(text) = 'text' ORDER BY rowid"
            for row, text in self._db.execute(rows, (self._last_row,)):
                self._remember(text)
                self._last_row = row
            self._version = version

    def find(self, text: str) -> list[tuple[int, int]]:
        """(start, end) character spans of known passages in `text`: leftmost first, longest at
        each start, never overlapping."""
        self._refresh()
        found = []
        for width, bucket in self._buckets.items():
            hashes = window_hashes(text, width)
            if not len(hashes):
                continue
            heads = np.fromiter(bucket.keys(), dtype=np.uint64, count=len(bucket))
            for start in np.flatnonzero(np.isin(hashes, heads)).tolist():
                for passage in bucket[int(hashes[start])]:
                    if text.startswith(passage, start):
                        found.append((start, start + len(passage)))
        spans, end = [], 0
        for start, stop in sorted(found, key=lambda s: (s[0], -s[1])):
            if start >= end:
                spans.append((start, stop))
                end = stop
        return spans
