"""kvrag.threads: a core left to each core other processes keep busy, all taken back once they leave."""

import subprocess
import sys

import pytest
import torch

from kvrag import threads


class Clock:
    """Stands in for /proc/stat and the clocks: `run(seconds, own=, others=)` advances them."""

    def __init__(self, monkeypatch):
        self.busy = self.own = self.wall = 0.0
        monkeypatch.setattr(threads, "_busy_seconds", lambda cpus: self.busy)
        monkeypatch.setattr(threads.time, "process_time", lambda: self.own)
        monkeypatch.setattr(threads.time, "monotonic", lambda: self.wall)

    def run(self, seconds: float, own: float, others: float) -> None:
        """`own` and `others`: busy cores of this process and of the rest."""
        self.wall += seconds
        self.own += own * seconds
        self.busy += (own + others) * seconds


@pytest.fixture
def clock(monkeypatch):
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    monkeypatch.setattr(threads.os, "sched_getaffinity", lambda pid: {0, 1, 2, 3})
    monkeypatch.setattr(threads, "_state", {})
    before = torch.get_num_threads()
    torch.set_num_threads(4)
    yield Clock(monkeypatch)
    torch.set_num_threads(before)


def test_an_idle_machine_keeps_every_thread(clock):
    assert threads.adapt() == 4
    for _ in range(3):
        clock.run(0.2, own=4, others=0.1)
        assert threads.adapt() == 4 == torch.get_num_threads()


def test_a_core_is_left_to_each_busy_one_and_taken_back(clock):
    threads.adapt()
    clock.run(0.3, own=3, others=1)  # one core busy elsewhere
    assert threads.adapt() == 3 == torch.get_num_threads()
    clock.run(0.3, own=2, others=2)
    assert threads.adapt() == 2
    clock.run(0.3, own=2, others=0.3)  # between the thresholds: no change
    assert threads.adapt() == 2
    clock.run(0.3, own=2, others=0)
    assert threads.adapt() == 4 == torch.get_num_threads()
    clock.run(0.3, own=0, others=9)
    assert threads.adapt() == 1  # never none


def test_spans_too_short_to_measure_change_nothing(clock):
    threads.adapt()
    clock.run(0.01, own=0, others=4)
    assert threads.adapt() == 4


def test_a_count_the_user_chose_is_left_alone(clock, monkeypatch):
    threads.adapt()
    torch.set_num_threads(3)
    clock.run(0.3, own=3, others=2)
    assert threads.adapt() == 3
    monkeypatch.setattr(threads, "_state", {})
    monkeypatch.setenv("OMP_NUM_THREADS", "3")
    threads.adapt()
    clock.run(0.3, own=3, others=2)
    assert threads.adapt() == 3


@pytest.mark.skipif(not threads.os.path.exists("/proc/stat"), reason="Linux's /proc/stat")
def test_the_real_machine_can_be_read():
    """/proc/stat as it is: busy time grows and never exceeds the CPUs' wall time."""
    cpus = threads.os.sched_getaffinity(0)
    start, wall = threads._busy_seconds(cpus), threads.time.monotonic()
    sum(i * i for i in range(300_000))
    busy = threads._busy_seconds(cpus) - start
    assert 0 <= busy <= len(cpus) * (threads.time.monotonic() - wall + 0.02)


HAND_OVER = """
import os, threading, time, torch
from kvrag import threads
assert threads._pause_resources() is not None  # torch's wheel uses GNU OpenMP
tasks = lambda: len(os.listdir("/proc/self/task"))
counts = []
def run():
    torch.set_num_threads(3)
    counts.append(tasks())
    torch.ones(1 << 22).exp_()  # large enough for a parallel region: the team's 2 other threads start
    counts.append(tasks())
    threads.hand_over()
    ends = time.monotonic() + 10  # the team's threads are told to exit and do so on their own: give them a moment
    while tasks() > counts[0] and time.monotonic() < ends:
        time.sleep(0.01)
    counts.append(tasks())
thread = threading.Thread(target=run)
thread.start()
thread.join()
print(counts)
"""


def test_hand_over_ends_the_calling_threads_openmp_team():
    """The worker's team must be the process's only one (see threads.py): a thread that ran torch with
    threads keeps a team of its own until it hands over. Counted in a process of its own, where no
    other thread starts or ends meanwhile."""
    done = subprocess.run([sys.executable, "-c", HAND_OVER], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    alone = int(done.stdout.strip("[]\n").split(",")[0])
    assert done.stdout.strip() == str([alone, alone + 2, alone])


def test_watch_lets_the_first_request_leave_busy_cores(clock):
    """A model loads between `watch` (loading.load) and the first request: that request already counts the cores
    other processes keep busy, as every later one does (without it, the first ran on every thread)."""
    threads.watch()
    clock.run(2.0, own=1, others=2)  # loading, while two cores are busy elsewhere
    assert threads.adapt() == 2 == torch.get_num_threads()
    threads.watch()  # once started, watching again changes nothing
    clock.run(0.3, own=2, others=0)
    assert threads.adapt() == 4


def test_without_watch_the_first_request_cannot_know(clock):
    clock.run(2.0, own=1, others=2)
    assert threads.adapt() == 4


def test_single_runs_torch_on_one_thread_and_restores_the_count():
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        with threads.single():
            assert torch.get_num_threads() == 1
        assert torch.get_num_threads() == 2
        with pytest.raises(RuntimeError, match="inside"):
            with threads.single():
                raise RuntimeError("inside")
        assert torch.get_num_threads() == 2
    finally:
        torch.set_num_threads(before)
