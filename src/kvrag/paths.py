"""Where kvrag keeps what it computes: KVRAG_HOME (default ~/.cache/kvrag)."""

import os
import uuid
from pathlib import Path


def kvrag_home() -> Path:
    return Path(os.environ.get("KVRAG_HOME") or Path.home() / ".cache" / "kvrag").expanduser()


def write_atomic(path: Path, data: bytes) -> None:
    """Write to a temporary name and rename into place: readers and concurrent writers only ever see
    complete files."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.{uuid.uuid4().hex}.tmp")
    try:
        with open(tmp, "wb") as f:
            f.write(data)
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)
