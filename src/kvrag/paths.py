"""Where kvrag keeps what it computes: KVRAG_HOME (default ~/.cache/kvrag)."""

import os
from pathlib import Path


def kvrag_home() -> Path:
    return Path(os.environ.get("KVRAG_HOME") or Path.home() / ".cache" / "kvrag").expanduser()
