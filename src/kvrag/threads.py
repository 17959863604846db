"""How many CPU threads a request uses, so that a CPU shared with other processes does not stall it.

torch's OpenMP threads (which the C kernels share) split every step evenly and wait for each other
by spinning. When another process keeps one of the cores busy, the thread sharing that core makes
every step wait for the scheduler, and a request takes several times as long; a thread fewer runs
at the speed of the cores that are free. Sleeping instead of spinning (OMP_WAIT_POLICY=passive)
helps less and slows every request on an idle machine. So `adapt()`, called as each request starts,
measures the cores other processes kept busy on this process's CPUs since its last call and leaves
them out of the thread count; on an idle machine it changes nothing. It works whenever torch was
imported (nothing to set before), and it stays out of the way of a count the user chose.

Within the process, every thread that runs torch keeps a team of OpenMP threads of its own. Once the
teams together hold more threads than there are cores, GNU OpenMP stops spinning between parallel
regions in all of them, and each of a step's many regions waits for its threads to wake. The
scheduler's worker runs the model, so a thread handing it a request first gives up its own team
(`hand_over`): the worker's stays the only one, and spins as a single thread's would.
"""

import contextlib
import ctypes
import functools
import os
import threading
import time

LEAVE, RETURN = 0.4, 0.25  # other processes' busy cores above which cores are left to them, below which all are taken back
WINDOW = 0.05  # seconds: shorter spans are too coarse for /proc/stat's ticks

_lock = threading.Lock()
_state: dict = {}


def _busy_seconds(cpus: set[int]) -> float:
    """Time `cpus` spent not idle since boot, whoever ran on them (/proc/stat)."""
    total = 0
    with open("/proc/stat") as f:
        next(f)  # the line summing all CPUs
        for line in f:
            if not line.startswith("cpu"):
                break
            name, *fields = line.split()
            if int(name[3:]) in cpus:
                values = [int(x) for x in fields[:8]]
                total += sum(values) - values[3] - values[4]  # less idle and iowait
    return total / os.sysconf("SC_CLK_TCK")


def _sample() -> tuple[float, float, float]:
    return _busy_seconds(_state["cpus"]), time.process_time(), time.monotonic()


def _start(torch) -> None:
    """Adapt only where /proc/stat tells the load and the user has not chosen a count (OMP_NUM_THREADS)."""
    if "OMP_NUM_THREADS" in os.environ or not hasattr(os, "sched_getaffinity") or not os.path.exists("/proc/stat"):
        _state["off"] = True
        return
    _state.update(cpus=os.sched_getaffinity(0), most=torch.get_num_threads(), set=torch.get_num_threads())
    _state["last"] = _sample()


def watch() -> None:
    """Start measuring what other processes keep busy now (loading.load calls it as a model starts loading), so
    that the first request's `adapt` has seconds to go by. Without it the first call of a process only starts
    the measure and runs with every thread: on 2 cores with other jobs running, `kvrag ask`'s one request took
    4.1 s to prefill 240 tokens on 2 threads against 1.2 s on one (measured), the same with and without warm-up."""
    import torch

    with _lock:
        if not _state:
            _start(torch)


def adapt() -> int:
    """Set the calling thread's torch thread count for the request it starts; returns the count.

    At most the count torch had at the first call; one core fewer for each core that other processes
    kept busy on this process's CPUs since the last call, all again once they leave them. Hands off
    where OMP_NUM_THREADS is set, and while the count differs from the one it set last (the user chose)."""
    import torch

    with _lock:
        if not _state:
            _start(torch)
        if _state.get("off") or torch.get_num_threads() != _state["set"]:
            return torch.get_num_threads()
        now = _sample()
        (busy0, own0, wall0), (busy1, own1, wall1) = _state["last"], now
        if wall1 - wall0 < WINDOW:
            return _state["set"]
        _state["last"] = now
        others = max(0.0, (busy1 - busy0) - (own1 - own0)) / (wall1 - wall0)
        threads = _state["set"]
        if others > LEAVE:
            threads = max(1, min(_state["most"], len(_state["cpus"]) - round(others + 0.1)))
        elif others < RETURN:
            threads = _state["most"]
        if threads != _state["set"]:
            torch.set_num_threads(threads)
            _state["set"] = threads
        return threads


@contextlib.contextmanager
def single():
    """torch on one thread in the calling thread while inside, its count restored after: for runs of small
    operations (an adapter's merge, one question's embedding) that gain nothing from a team of threads and,
    on a CPU that other processes keep busy, wait for it at every operation (measured on 2 cores with two
    other jobs running: the default adapter's merge 4.5 s on 2 threads, 0.5 s on one; the same weights)."""
    import torch

    before = torch.get_num_threads()
    if before == 1:
        yield
        return
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(before)


def hand_over() -> None:
    """Release the calling thread's OpenMP team (its threads end; the next torch call there starts new
    ones): called by a thread about to leave the model to the scheduler's worker. Does nothing where
    torch does not use GNU OpenMP."""
    pause = _pause_resources()
    if pause is not None:
        pause(1)  # omp_pause_soft


@functools.cache
def _pause_resources():
    from . import kernels

    runtime = kernels.openmp_runtime()
    return getattr(ctypes.CDLL(str(runtime)), "omp_pause_resource_all", None) if runtime else None
