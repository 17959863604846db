"""The shared tier: a Redis server (or any server that speaks its protocol) that replicas on several
machines use for KV blocks and for the passage registry.

Blocks are plain values under `kvrag:kv:<key>`, a request's read a few per round trip; the
passages the drop-in matcher looks for are a list, `kvrag:passages`, with a set of their digests
beside it so that each text is added once. Redis evicts on its own (`maxmemory` with an LRU
policy); a write it refuses (full, or a value over its limit) is skipped, never an error.

Whoever can write to the server could otherwise decide every replica's answers, so values carry a
keyed MAC (store.py) with a secret every replica shares (`shared_secret`), and a value without a valid
one is refused. The server's own access control goes in the URL: a password or an ACL user
(`redis://USER:PASSWORD@host:6379/0`) and TLS (`rediss://`, with `?ssl_ca_certs=PATH`); the password
never appears in a message.

The server may be missing, restarting or slow. Every call is bounded by the socket timeouts, and a
failed call reads as a miss (or skips the write): the request goes on from the local tiers or by
computing. The first failure of an outage warns once; further calls are not tried until a backoff
has passed (doubling up to a limit), after which the next call tries again, and a success ends the
outage.
"""

import contextlib
import hashlib
import logging
import os
import queue
import socket
import threading
import time
import uuid
import warnings
from pathlib import Path
from urllib.parse import parse_qs, urlsplit

from .errors import KVRagError

PREFIX = "kvrag:"
TIMEOUT = 2.0  # seconds: connecting, and each read or write of a call (a long transfer keeps reading)
GROUP = 4  # blocks per round trip when a request's blocks are fetched (`iter_many`)
BACKOFF, MAX_BACKOFF = 0.5, 30.0  # seconds before the first retry after a failure, and the most

CLAIM_SECONDS = 60.0
"""How long a claim on a block to encode holds unless released: a worker that dies holding one delays that
block by as much, then another encodes it."""
_RELEASE = "if redis.call('get', KEYS[1]) == ARGV[1] then return redis.call('del', KEYS[1]) end return 0"

SECRET_ENV, SECRET_FILE_ENV, INSECURE_ENV = "KVRAG_SECRET", "KVRAG_SECRET_FILE", "KVRAG_REMOTE_INSECURE"
MIN_SECRET = 16  # bytes

log = logging.getLogger(__name__)


def shared_secret(secret: str | bytes | None = None, *, remote: str | None = None) -> bytes | None:
    """The key of the MAC on stored KV values: `secret`, else the file $KVRAG_SECRET_FILE names, else
    $KVRAG_SECRET; None where none is set. With a remote tier one is required (every replica must share
    it), unless $KVRAG_REMOTE_INSECURE=1 says that whoever can write to the server is trusted."""
    if secret is None and os.environ.get(SECRET_FILE_ENV):
        path = Path(os.environ[SECRET_FILE_ENV]).expanduser()
        try:
            secret = path.read_bytes().strip()
        except OSError as exc:
            raise KVRagError(f"cannot read the shared secret {path} (${SECRET_FILE_ENV}): {exc.strerror}") from None
    if secret is None:
        secret = os.environ.get(SECRET_ENV) or None
    if isinstance(secret, str):
        secret = secret.encode()
    if secret is not None and len(secret) < MIN_SECRET:
        raise KVRagError(f"the shared secret has {len(secret)} bytes; use at least {MIN_SECRET} random ones "
                         "(e.g. `openssl rand -hex 32`)")
    if secret is None and remote is not None and os.environ.get(INSECURE_ENV) != "1":
        raise KVRagError(
            f"the remote tier {redacted(remote)} needs a shared secret, so that a value planted by another client is "
            f"refused: set ${SECRET_FILE_ENV} (a file only kvrag's user can read) or ${SECRET_ENV} to the same "
            f"random string on every replica, or ${INSECURE_ENV}=1 to trust whoever can write to that server")
    return secret


def redacted(url: str) -> str:
    """`url` without its password."""
    parts = urlsplit(url)
    if parts.password is None:
        return url
    netloc = f"{parts.username or ''}:***@{parts.hostname}" + (f":{parts.port}" if parts.port else "")
    return parts._replace(netloc=netloc).geturl()

_ADD = """
if redis.call('SADD', KEYS[1], ARGV[1]) == 1 then redis.call('RPUSH', KEYS[2], ARGV[2]) end
"""


class Remote:
    """A connection to the shared tier at `url` (`redis://host:port/db`, `rediss://...`, `unix:///path`).

    Timeouts given in the URL (`?socket_timeout=0.5&socket_connect_timeout=0.5`) replace the default."""

    def __init__(self, url: str):
        import redis
        from redis.backoff import NoBackoff
        from redis.retry import Retry

        if urlsplit(url).scheme not in ("redis", "rediss", "unix"):
            raise ValueError(f"the remote tier takes a redis://, rediss:// or unix:// URL, got {redacted(url)!r}")
        given = parse_qs(urlsplit(url).query)
        options = {name: TIMEOUT for name in ("socket_timeout", "socket_connect_timeout") if name not in given}
        # kvrag retries on its own schedule (below), so a dead server costs one timeout, not several
        self.client = redis.Redis.from_url(url, retry=Retry(NoBackoff(), 0), **options)
        self.url = redacted(url)
        self._down = (redis.ConnectionError, redis.TimeoutError, redis.BusyLoadingError, OSError)
        self._refused = redis.RedisError
        self._add = self.client.register_script(_ADD)
        self._release = self.client.register_script(_RELEASE)
        self._lock = threading.Lock()
        self._down_until = 0.0
        self._backoff = 0.0

    def __repr__(self) -> str:
        return f"Remote({self.url!r})"

    @property
    def available(self) -> bool:
        """False while an outage's backoff lasts: calls then return their default at once."""
        return time.monotonic() >= self._down_until

    def _call(self, what: str, fn, default):
        if not self.available:
            return default
        try:
            result = fn()
        except self._down as exc:
            self._failed(what, exc)
            return default
        except self._refused as exc:  # the server answered with an error (full, value too large): skip the call
            log.info("kvrag: remote tier at %s refused %s: %s", self.url, what, exc)
            return default
        if self._backoff:
            with self._lock:
                self._backoff = 0.0
            log.info("kvrag: the remote tier at %s is back", self.url)
        return result

    def _failed(self, what: str, exc: BaseException) -> None:
        with self._lock:
            first = not self._backoff
            self._backoff = min(MAX_BACKOFF, self._backoff * 2 or BACKOFF)
            self._down_until = time.monotonic() + self._backoff
        if first:
            warnings.warn(
                f"kvrag: the remote tier at {self.url} failed ({what}: {exc}); answering from the local tiers "
                f"and by computing until it is back (retried after {BACKOFF:g} s, backing off to {MAX_BACKOFF:g} s)",
                RuntimeWarning, stacklevel=4,
            )

    # ---- KV blocks ----------------------------------------------------------------------------------

    def get_many(self, keys: list[str]) -> list[bytes | None]:
        return self._call("get", lambda: self.client.mget([PREFIX + "kv:" + k for k in keys]), [None] * len(keys))

    def iter_many(self, keys: list[str], group: int = GROUP):
        """The values of `keys` in order, fetched `group` at a time by a helper thread, so that the
        caller checks the first ones while the next are on their way (no thread for a single group)."""
        if len(keys) <= group:
            yield from self.get_many(keys)
            return
        arrived = queue.Queue()

        def fetch():
            for i in range(0, len(keys), group):
                arrived.put(self.get_many(keys[i : i + group]))

        threading.Thread(target=fetch, name="kvrag-remote-fetch", daemon=True).start()
        for _ in range(0, len(keys), group):
            yield from arrived.get()

    def put(self, key: str, value: bytes) -> None:
        self._call("set", lambda: self.client.set(PREFIX + "kv:" + key, value), None)

    def exists(self, key: str) -> bool:
        return bool(self._call("exists", lambda: self.client.exists(PREFIX + "kv:" + key), 0))

    def delete(self, key: str) -> None:
        self._call("delete", lambda: self.client.delete(PREFIX + "kv:" + key), None)

    # ---- claims: indexers on several machines encode each block once -----------------------------------

    def claim(self, key: str, owner: str, seconds: float | None = None) -> bool | None:
        """Claim block `key` for `owner` (SET NX, expiring): True; False where another holds it; None where the
        server cannot say (down), so that nobody waits on it."""
        ms = int(1000 * (CLAIM_SECONDS if seconds is None else seconds))
        return self._call("claim", lambda: bool(self.client.set(PREFIX + "claim:" + key, owner, nx=True, px=ms)), None)

    def release(self, key: str, owner: str) -> None:
        """Drop `owner`'s claim on `key` (not one that expired and was taken by another since)."""
        self._call("release", lambda: self._release(keys=[PREFIX + "claim:" + key], args=[owner]), None)

    @contextlib.contextmanager
    def claimed(self, key: str, wait: bool, poll: float = 0.05):
        """As `locks.file_lock` for one machine: yields whether this process may encode block `key` now, the
        other workers on this server told no until it releases; `wait`: until then, or the claim expires."""
        owner = f"{socket.gethostname()}:{os.getpid()}:{uuid.uuid4().hex[:8]}"
        while (got := self.claim(key, owner)) is False and wait:
            time.sleep(poll)
        if not got:
            yield got is None  # a server that cannot say: encode here rather than wait on nobody
            return
        try:
            yield True
        finally:
            self.release(key, owner)

    # ---- the passage registry -----------------------------------------------------------------------

    def add_passages(self, texts: list[str], registry: str = "passages") -> None:
        """Add `texts` to a registry, each once: "passages" is the engines' (text), other names other users'
        (kvrag's vLLM connector keeps token ids per model there)."""
        keys = [PREFIX + ("passage-digests" if registry == "passages" else f"{registry}-digests"), PREFIX + registry]

        def add():
            pipe = self.client.pipeline(transaction=False)
            for text in texts:
                digest = hashlib.sha256(text.encode("utf-8", "surrogatepass")).hexdigest()
                self._add(keys=keys, args=[digest, text], client=pipe)
            pipe.execute()

        if texts:
            self._call("add passages", add, None)

    def passages(self, start: int, registry: str = "passages") -> tuple[list[str | None], int]:
        """The registry's passages from the `start`-th on (None for an entry that is not text), and where
        the next read starts. A registry shorter than `start` was emptied (a restarted server): read
        from its first. Nothing, and `start` again, when the server cannot say."""
        key = PREFIX + registry

        def read():
            pipe = self.client.pipeline(transaction=True)
            length, values = pipe.llen(key).lrange(key, start, -1).execute()
            if length < start:
                values = self.client.lrange(key, 0, -1)
                return values, len(values)
            return values, start + len(values)

        values, after = self._call("read passages", read, ([], start))
        return [_text(v) for v in values], after


def _text(value: bytes) -> str | None:
    try:
        return value.decode("utf-8", "surrogatepass")
    except UnicodeDecodeError:
        return None
