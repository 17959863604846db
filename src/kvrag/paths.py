"""Where kvrag keeps what it computes: KVRAG_HOME (default ~/.cache/kvrag)."""

import errno
import hashlib
import os
import shutil
import uuid
import warnings
from pathlib import Path

from .errors import DiskFullError, KVRagError

FULL = (errno.ENOSPC, errno.EDQUOT)
"""What a write fails with when the disk (or the user's quota) has no room for it."""


def kvrag_home() -> Path:
    return Path(os.environ.get("KVRAG_HOME") or Path.home() / ".cache" / "kvrag").expanduser()


def safetensors_header_digest(path: Path) -> str:
    """SHA-256 of a safetensors file's JSON header (its tensors' names, dtypes, shapes and offsets): what
    identifies a checkpoint's weights without reading them."""
    with open(path, "rb") as f:
        size = int.from_bytes(f.read(8), "little")
        if size > 1 << 28:
            raise ValueError(f"{path}: header of {size} bytes")
        return hashlib.sha256(f.read(size)).hexdigest()


def writable_home(home: Path) -> Path:
    """`home`, made if need be, once a file could be written in it; else one line naming it (chromadb's and
    torch's own errors on an unusable directory run to tracebacks that do not)."""
    home = Path(home)
    try:
        home.mkdir(parents=True, exist_ok=True)
        probe = home / f".probe-{os.getpid()}-{uuid.uuid4().hex}"
        probe.touch()
        probe.unlink()
    except OSError as exc:
        if exc.errno in FULL:
            raise disk_full(exc, home, 0) from exc
        raise KVRagError(f"kvrag keeps its files in {home} (KVRAG_HOME or --home), which is not a writable "
                         f"directory: {exc.strerror or exc}") from exc
    for directory in (home, home / "kv"):
        name_if_open_to_all(directory)
    return home


def name_if_open_to_all(directory: Path) -> None:
    """One line (a RuntimeWarning, once per directory) where every user of the machine may write in `directory`:
    another user could plant files there that kvrag reads. Checked, not refused: what is read from it is checked
    as untrusted anyway."""
    try:
        mode = os.stat(directory).st_mode
    except OSError:
        return
    if mode & 0o002 and str(directory) not in _NAMED:
        _NAMED.add(str(directory))
        warnings.warn(f"kvrag: every user can write in {directory} (mode {oct(mode & 0o7777)}): another user could "
                      f"plant files that kvrag reads; make it yours alone (chmod o-w {directory})", RuntimeWarning,
                      stacklevel=3)


_NAMED: set[str] = set()


def check_model_path(model: str | os.PathLike | None) -> None:
    """A model named by a path (absolute, ./ ../ ~, or a .gguf file) that is not there, in one line:
    transformers would take it for a hub id and say only that it is not one."""
    if model is None:
        return
    text, path = str(model), Path(model).expanduser()
    if not path.exists() and (path.is_absolute() or text.startswith((".", "~")) or path.suffix == ".gguf"):
        raise KVRagError(f"no model at {path}: give a model directory, a .gguf file, or leave --model out for "
                         "the default model")


def size_text(n: int) -> str:
    """Bytes for a person: 512 B, 3.4 kB, 1.2 MB, 7.0 GB."""
    for unit, scale in (("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if n >= scale:
            return f"{n / scale:.1f} {unit}"
    return f"{n} B"


def disk_full(exc: Exception, directory: Path, needed: int) -> DiskFullError:
    """The one-line error for a write that found no room: which directory, and how much it needed."""
    code = getattr(exc, "errno", None) or errno.ENOSPC
    quota = "; over the disk quota" if code == errno.EDQUOT else ""
    error = DiskFullError(f"no space left in {directory} (needed {size_text(needed)}{quota})")
    error.errno = code  # str() stays the message: OSError formats errno only with a strerror
    return error


def no_room(exc: Exception, directory: Path, needed: int) -> bool:
    """Whether a failed write failed for want of space: an OSError that says so, or (libraries that write
    in native code raise their own types) less free space left in `directory` than the write needed."""
    if isinstance(exc, OSError):
        return exc.errno in FULL
    try:
        return shutil.disk_usage(directory).free < needed
    except OSError:
        return False


def fsync_dir(directory: Path) -> None:
    """Make a rename (or a new file) in `directory` durable: without it a crash can lose the entry even
    though the file's data reached the disk. File systems that cannot sync a directory are left as they are."""
    try:
        fd = os.open(directory, os.O_RDONLY | getattr(os, "O_DIRECTORY", 0))
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError as exc:
        if exc.errno not in (errno.EINVAL, errno.ENOTSUP, errno.EBADF):
            raise
    finally:
        os.close(fd)


def write_atomic(path: Path, data: bytes) -> None:
    """Write to a temporary name, fsync, rename into place and fsync the directory: readers and concurrent
    writers only ever see complete files, and after a crash the file is either the old one or the new one
    in full. A failed write leaves no temporary file behind; no room for it raises DiskFullError (any other
    OSError is raised as it is)."""
    path = Path(path)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.{uuid.uuid4().hex}.tmp")
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        with open(tmp, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
        fsync_dir(path.parent)
    except OSError as exc:
        if exc.errno in FULL:
            raise disk_full(exc, path.parent, len(data)) from exc
        raise
    finally:
        tmp.unlink(missing_ok=True)
