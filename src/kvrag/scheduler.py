"""The scheduler: many requests share one model, their decode steps batched (continuous batching).

Requests come from any thread or event loop, their prompts already built there (tokenizing a long
prompt here would hold up every other request's next token); one worker thread runs the model. Each
round it admits the requests that wait (their passages' KV placed in a workspace; full, prefix and
blend mode prefill there and then), then runs one model call for every active request together: each
one's next token, or a new request's question, passes through the model in one packed sequence,
appended to its own workspace and attending to it alone (`forward_packed`), so cache lengths stay
ragged and nothing is padded. Many users' questions are thus prefilled in one batch, and their decode
steps are shared. Requests join and leave at token boundaries; a cancelled one leaves at the next,
and its workspace goes back to the pool at once. The worker ends once nothing has come for a second,
so an idle engine holds no thread; the thread that submits gives its own OpenMP team up (see
threads.py).
"""

import collections
import threading
import time
import weakref

import torch

from . import threads
from .attention import forward_packed
from .decode import Generation
from .errors import QueueFullError, RequestTimeoutError


LINGER = 1.0  # seconds an idle worker waits for the next request before it ends
MAX_BACKGROUND = 4  # background requests waiting at most; more are dropped

_RUNNING: "weakref.WeakSet[Scheduler]" = weakref.WeakSet()


def _stop_all() -> None:
    """At interpreter exit, before threads are joined: cancel what is left, so the workers end at once
    (a worker killed inside torch aborts the process)."""
    for scheduler in list(_RUNNING):
        scheduler.cancel_all()


threading._register_atexit(_stop_all)  # as concurrent.futures does for its workers


class Scheduler:
    def __init__(self, max_batch: int = 16, max_queue: int = 256):
        """`max_batch`: requests decoded together (1: one at a time); `max_queue`: requests allowed to wait."""
        if max_batch < 1 or max_queue < 0:
            raise ValueError(f"max_batch must be >= 1 and max_queue >= 0, got {max_batch} and {max_queue}")
        self.max_batch, self.max_queue = max_batch, max_queue
        self._waiting: collections.deque[Generation] = collections.deque()
        self._background: collections.deque[Generation] = collections.deque()  # run only while nothing else runs
        self._active: list[Generation] = []
        self._lock = threading.Lock()
        self._arrived = threading.Condition(self._lock)
        self._running = False

    @property
    def waiting(self) -> int:
        return len(self._waiting)

    @property
    def active(self) -> int:
        return len(self._active)

    def submit(self, generation: Generation, background: bool = False) -> bool:
        """Queue a request; a `background` one (a shadow check) is admitted only when no other waits and is stepped
        only while no other is active, one at a time, and is dropped (False) when MAX_BACKGROUND already wait."""
        threads.hand_over()  # the worker's OpenMP team is then the only one (see threads.py)
        with self._lock:
            if background:
                if len(self._background) >= MAX_BACKGROUND:
                    return False
                generation.background = True
                self._background.append(generation)
            elif len(self._waiting) >= self.max_queue:
                raise QueueFullError(
                    f"{len(self._waiting)} requests are already waiting (max_queue={self.max_queue}); try again later"
                )
            else:
                self._waiting.append(generation)
            self._arrived.notify()
            if not self._running:
                self._running = True
                _RUNNING.add(self)
                threading.Thread(target=self._work, name="kvrag-scheduler").start()
        return True

    def cancel_all(self) -> None:
        with self._lock:
            for generation in [*self._waiting, *self._background, *self._active]:
                generation.stream.cancel()
            self._arrived.notify()  # a lingering worker ends now

    def _work(self) -> None:
        with torch.inference_mode():
            while True:
                with self._lock:
                    admit = self._take()
                    if not admit and not self._active:
                        self._arrived.wait(LINGER)  # a caller's next request soon finds the worker's threads warm
                        admit = self._take()
                    if not admit and not self._active:
                        self._running = False
                        _RUNNING.discard(self)
                        return
                while admit:  # those that come while these are placed join the same model call
                    for generation in admit:
                        self._admit(generation)
                    with self._lock:
                        admit = self._take()
                self._active = [g for g in self._active if self._still_running(g)]
                if self._active:
                    self._step()

    def _take(self) -> list[Generation]:
        """The waiting requests that fit in the batch now; those cancelled, or out of time with no room for
        them, leave the queue. A background request only where none waits and no other background one runs; it
        takes no place in the batch."""
        admit, running = [], sum(not g.background for g in self._active)
        for generation in list(self._waiting):
            if generation.stream.cancelled:
                self._waiting.remove(generation)
                generation.fail(None)
            elif running + len(admit) < self.max_batch:
                self._waiting.remove(generation)
                admit.append(generation)
            elif generation.expired():
                self._waiting.remove(generation)
                waited = time.perf_counter() - generation.start
                generation.fail(RequestTimeoutError(
                    f"the request waited {waited:.1f} s in the queue, over its max_time of {generation.max_time} s"))
        if self._background and not self._waiting and not admit and running == len(self._active):
            admit.append(self._background.popleft())
        return admit

    def _admit(self, generation: Generation) -> None:
        try:
            generation.prefill()
        except Exception as error:
            generation.fail(error)
            return
        if not generation.stream.done:
            self._active.append(generation)

    @staticmethod
    def _still_running(generation: Generation) -> bool:
        if generation.stream.done:
            return False
        if generation.stream.cancelled:
            generation.finish("cancelled")
            return False
        return True

    def _step(self) -> None:
        """One token for every active request; requests on the same weights share one model call."""
        groups: dict[int, list[Generation]] = {}
        foreground = [g for g in self._active if not g.background]
        for generation in foreground or self._active:  # a background request waits while another runs
            groups.setdefault(id(generation.model), []).append(generation)
        for group in groups.values():
            try:
                logits = forward_packed(group[0].model, [(g.step_ids(), g.cache, g.position) for g in group])
            except Exception as error:
                for generation in group:
                    generation.fail(error)
                continue
            for generation, row in zip(group, logits):
                try:
                    generation.advance(row)
                except Exception as error:
                    generation.fail(error)
