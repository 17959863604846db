"""Exclusive file locks (`fcntl.flock`) between processes on one machine.

What they serialize: the first use of an embedded store (Chroma creates its tables on first open, and
two processes doing it at once crash one of them) and the encoding of one block (N indexers split the
work instead of each encoding everything). A flock belongs to the open file, so a process that dies
releases its locks with it: nothing is left locked behind a crash.
"""

import fcntl
import os
import stat
from contextlib import contextmanager
from pathlib import Path


@contextmanager
def file_lock(path: str | Path, *, wait: bool = True, remove: bool = False):
    """Hold an exclusive lock on `path` (created, with its directory) inside the block, yielding True;
    with `wait` False, yield False at once, holding nothing, when someone else holds it.

    `remove`: delete the file on the way out (one lock file per block would otherwise stay for every
    block ever stored). Whoever was waiting on it then holds a lock on a file nobody else can find, so
    a lock is only taken on the file the path names when the lock is granted."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    while True:
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | (0 if wait else fcntl.LOCK_NB))
        except BlockingIOError:
            os.close(fd)
            yield False
            return
        except BaseException:
            os.close(fd)
            raise
        try:
            held = os.fstat(fd)
            named = os.stat(path)
            current = (held.st_dev, held.st_ino) == (named.st_dev, named.st_ino)
        except FileNotFoundError:
            current = False
        if current:
            break
        os.close(fd)  # removed (or replaced) by the holder before us: lock the path's file now
    try:
        yield True
    finally:
        if remove:
            path.unlink(missing_ok=True)  # still holding the lock: nobody can be granted this file now
        os.close(fd)


def sweep(directory: str | Path) -> int:
    """Remove the lock files in `directory` that nobody holds: a process killed while it held one took its lock
    with it but left the file. Each is removed while locked here, so `file_lock`'s next caller makes a new one.
    Returns how many went."""
    removed = 0
    for path in Path(directory).glob("*.lock"):
        try:
            fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
        except OSError:
            continue
        try:
            if not stat.S_ISREG(os.fstat(fd).st_mode):
                continue
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            if (os.fstat(fd).st_ino, os.fstat(fd).st_dev) == (os.stat(path).st_ino, os.stat(path).st_dev):
                path.unlink()
                removed += 1
        except OSError:  # held by a live process (BlockingIOError), or gone meanwhile
            pass
        finally:
            os.close(fd)
    return removed
