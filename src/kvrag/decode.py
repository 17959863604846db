"""The token loop after the prefill: sampling, stop strings, incremental text, timing, the result; and
the stream through which a request's text reaches its caller. A request reaches its engine only through
a `Prefiller`: the scheduler's worker runs it, and it can call nothing else there."""

import asyncio
import collections
import threading
import time
from collections.abc import AsyncIterator, Callable, Iterator
from dataclasses import dataclass, field

import torch

TOP_LOGPROBS = 20
"""How many of the first token's log-probabilities a result keeps (`GenerationResult.first_logprobs`)."""


@dataclass
class GenerationResult:
    """What one request produced and what it cost; times are in seconds."""

    text: str
    token_ids: list[int]
    mode: str
    ttft: float
    total_time: float
    prompt_tokens: int
    prefilled_tokens: int
    reused_tokens: int
    cache_hits: dict[str, int] = field(default_factory=dict)
    finish_reason: str = "stop"
    first_logprobs: dict[int, float] | None = None
    """The first token's TOP_LOGPROBS likeliest ids and their log-probabilities, most likely first, before any
    temperature: what comparing two modes' first-token distributions needs (kvrag.eval.accuracy's KL)."""

    @property
    def generated_tokens(self) -> int:
        return len(self.token_ids)

    def stats(self) -> dict:
        """The figures server responses carry in their `kvrag` object and `kvrag ask` prints."""
        return {"mode": self.mode, "ttft": self.ttft, "total_time": self.total_time,
                "prefilled_tokens": self.prefilled_tokens, "reused_tokens": self.reused_tokens,
                "cache_hits": dict(self.cache_hits)}


class Sampler:
    """Greedy when temperature is 0, otherwise temperature / top-k / top-p sampling."""

    def __init__(self, temperature: float = 0.0, top_p: float = 1.0, top_k: int = 0, seed: int | None = None):
        if temperature < 0:
            raise ValueError(f"temperature must be >= 0, got {temperature}")
        if not 0 < top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {top_p}")
        self.temperature, self.top_p, self.top_k = temperature, top_p, top_k
        self.generator = torch.Generator().manual_seed(seed) if seed is not None else None

    def __call__(self, logits: torch.Tensor) -> int:
        if self.temperature == 0:
            return int(logits.argmax())
        logits = logits.float().cpu() / self.temperature  # the seeded generator is the CPU's, on any device
        if self.top_k and self.top_k < logits.numel():
            kth = torch.topk(logits, self.top_k).values[-1]
            logits = logits.masked_fill(logits < kth, float("-inf"))
        probs = logits.softmax(-1)
        if self.top_p < 1:
            sorted_probs, order = probs.sort(descending=True)
            outside = sorted_probs.cumsum(-1) - sorted_probs >= self.top_p
            sorted_probs[outside] = 0
            probs = torch.zeros_like(probs).scatter(0, order, sorted_probs)
        return int(torch.multinomial(probs, 1, generator=self.generator))


def top_logprobs(logits: torch.Tensor, k: int = TOP_LOGPROBS) -> dict[int, float]:
    """The `k` likeliest next ids and their log-probabilities (to 4 decimals: what a comparison of two modes reads,
    and half the size in a results file), most likely first, of logits as the sampler sees them."""
    top = torch.topk(logits.float().log_softmax(-1), min(k, logits.numel()))
    return {i: round(v, 4) for i, v in zip(top.indices.tolist(), top.values.tolist())}


class TextTracker:
    """Turns generated ids into text deltas, holding back partial characters and possible stop strings."""

    def __init__(self, tokenizer, stop: list[str] | None = None):
        self.tokenizer = tokenizer
        self.stop = [s for s in (stop or []) if s]
        self.ids: list[int] = []
        self.emitted = 0
        self.text = ""
        self.stopped = False

    def push(self, token_id: int) -> str:
        """Add a token; return the text that is now safe to show."""
        self.ids.append(token_id)
        self.text = self.tokenizer.decode(self.ids, skip_special_tokens=True)
        for s in self.stop:
            at = self.text.find(s)
            if at != -1:
                self.text, self.stopped = self.text[:at], True
        safe = len(self.text)
        if not self.stopped:
            if self.text.endswith("\ufffd"):
                safe -= 1
            for s in self.stop:
                for k in range(min(len(s) - 1, len(self.text)), 0, -1):
                    if self.text.endswith(s[:k]):
                        safe = min(safe, len(self.text) - k)
                        break
        delta = self.text[self.emitted : max(safe, self.emitted)]
        self.emitted += len(delta)
        return delta

    def flush(self) -> str:
        delta = self.text[self.emitted :]
        self.emitted = len(self.text)
        return delta


class GenerationStream:
    """A submitted request: iterate (or `async for`) for its text deltas; `result` is set once it is over.

    The scheduler's worker produces; any thread or event loop consumes. Leaving the iteration early,
    or `cancel()`, ends the request at the next token boundary and frees its workspace."""

    def __init__(self):
        self.result: GenerationResult | None = None
        self.error: BaseException | None = None
        self.cancelled = False
        self._deltas: collections.deque[str] = collections.deque()
        self._done = False
        self._cond = threading.Condition()
        self._wakers: list = []  # (event loop, asyncio.Event) of async consumers
        self._ended: list[Callable] = []  # called with the result (None on an error) once it is over

    # ---- the worker's side --------------------------------------------------------------------------

    def put(self, delta: str) -> None:
        with self._cond:
            self._deltas.append(delta)
            self._wake()

    def end(self, result: GenerationResult | None = None, error: BaseException | None = None) -> None:
        with self._cond:
            self.result, self.error, self._done = result, error, True
            self._wake()
            ended, self._ended = self._ended, []
        for call in ended:
            call(result)

    def on_end(self, call: Callable) -> None:
        """Call `call(result)` once the request is over (result None after an error); now, if it is."""
        with self._cond:
            if not self._done:
                self._ended.append(call)
                return
        call(self.result)

    def _wake(self) -> None:
        self._cond.notify_all()
        for loop, event in self._wakers:
            try:
                loop.call_soon_threadsafe(event.set)
            except RuntimeError:  # its loop closed with the iteration unfinished: nobody to wake
                pass

    # ---- the consumer's side ------------------------------------------------------------------------

    @property
    def done(self) -> bool:
        return self._done

    def cancel(self) -> None:
        """Stop generating: the request leaves the batch at the next token, `finish_reason` "cancelled"."""
        self.cancelled = True

    def _next(self):
        """A delta; None once the request is over (its error raised); `...` while the next is not there yet."""
        if self._deltas:
            return self._deltas.popleft()
        if self._done:
            if self.error is not None:
                raise self.error
            return None
        return ...

    def __iter__(self) -> Iterator[str]:
        try:
            while True:
                with self._cond:
                    item = self._next()
                    while item is ...:
                        self._cond.wait()
                        item = self._next()
                if item is None:
                    return
                yield item
        finally:
            if not self._done:
                self.cancel()

    async def __aiter__(self) -> AsyncIterator[str]:
        loop, event = asyncio.get_running_loop(), asyncio.Event()
        with self._cond:
            self._wakers.append((loop, event))
        try:
            while True:
                event.clear()
                with self._cond:
                    item = self._next()
                if item is None:
                    return
                if item is ...:
                    await event.wait()
                    continue
                yield item
        finally:
            with self._cond:
                self._wakers.remove((loop, event))
            if not self._done:
                self.cancel()

    def drain(self) -> GenerationResult:
        for _ in self:
            pass
        return self.result


@dataclass(frozen=True)
class Prefiller:
    """What a request needs of its engine: the prompt's KV put in a workspace (`prefill`, as
    `KVEngine.prefill`), the weights its mode runs on (`model_for`), what it computed stored for later
    requests (`store_pending`), its workspace handed back (`release`); and, as they were when it came,
    the tokenizer, the ids that end an answer and the context window. The engine makes one per request."""

    prefill: Callable  # (prompt, mode, *, keys, extra_capacity, blend, question) -> modes.Prefill
    model_for: Callable  # (mode) -> the model that mode runs on
    store_pending: Callable  # (prefill state, mode) -> None
    release: Callable  # (prefill state) -> None
    tokenizer: object
    eos_ids: set[int]
    context_window: int


class Generation:
    """One request's token loop, advanced a token at a time by the scheduler's worker: its prefill, then
    sampling, stop strings, incremental text and timing as each step's logits arrive."""

    def __init__(self, prefiller: Prefiller, prompt, keys, mode: str, max_new_tokens: int, sampler: Sampler,
                 stops: list[str], max_time=None, blend=None, start: float | None = None, chunk: int | None = None):
        """`prompt`, `keys`: built by the caller, on its own thread: tokenizing a long prompt on the worker
        would hold up every other request's next token. `start`: when the call came (default: now), so that
        TTFT and `max_time` count the prompt's building, as they count the KV loading of the prefill.
        The answer is at most what the context window leaves after the prompt, whatever `max_new_tokens` says.
        `chunk`: run the prompt (in full mode all of it) through the model this many tokens a step, between other
        requests' steps, instead of at once when admitted: a background request never holds the worker long."""
        self.prefiller, self.prompt, self.keys, self.mode = prefiller, prompt, keys, mode
        self.budget = min(max_new_tokens, prefiller.context_window - len(prompt))
        self.sampler, self.stops, self.max_time, self.blend = sampler, stops, max_time, blend
        self.stream = GenerationStream()
        self.start = time.perf_counter() if start is None else start
        self.state, self.released = None, False
        self.run: list[int] = []  # the ids to run through the model next, at `self.position`
        self.chunk = chunk
        self.background = False  # set by the scheduler: stepped only while no other request is

    def expired(self) -> bool:
        return self.max_time is not None and time.perf_counter() - self.start > self.max_time

    def prefill(self) -> None:
        prefiller = self.prefiller
        self.state = prefiller.prefill(self.prompt, self.mode, keys=self.keys, extra_capacity=self.budget,
                                       blend=self.blend, question=self.mode == "full" and not self.chunk)
        self.model = prefiller.model_for(self.mode)
        self.cache, self.position = self.state.cache, self.state.next_position
        self.tracker = TextTracker(prefiller.tokenizer, self.stops)
        self.ttft, self.steps, self.first_logprobs = None, 0, None
        if self.state.logits is None:  # the question (in full mode the prompt) runs with the next steps' tokens
            self.run = list(self.prompt.ids() if self.mode == "full" else self.prompt.question)
        else:
            self.push(self.state.logits[-1])

    def step_ids(self) -> list[int]:
        """The ids this step runs: `run`, or its first `chunk`."""
        return self.run[: self.chunk] if self.chunk else self.run

    def advance(self, logits: torch.Tensor) -> None:
        """After a step ran `step_ids()`: the next token from their last logits, or, with more of the run left, none."""
        ran = len(self.step_ids())
        self.position += ran
        if ran < len(self.run):
            self.run = self.run[ran:]
            return
        self.push(logits)

    def push(self, logits: torch.Tensor) -> None:
        """Sample the next token from `logits`; end the request or leave the token in `self.run`."""
        token, self.run = self.sampler(logits), []
        self.steps += 1
        if self.ttft is None:
            self.ttft = time.perf_counter() - self.start
            self.first_logprobs = top_logprobs(logits)  # after the TTFT: one top-k over the vocabulary per request
        if token in self.prefiller.eos_ids:
            return self.finish("stop")
        delta = self.tracker.push(token)
        if delta:
            self.stream.put(delta)
        if self.tracker.stopped:
            return self.finish("stop")
        if self.expired():
            return self.finish("timeout")
        if self.steps >= self.budget:
            return self.finish("length")
        self.run = [token]

    def finish(self, reason: str) -> None:
        """Hand the workspace back and end the stream with the result."""
        tail = self.tracker.flush()
        if tail:
            self.stream.put(tail)
        try:
            if reason != "cancelled":
                self.prefiller.store_pending(self.state, self.mode)
        finally:
            self.release()
        state = self.state
        self.stream.end(GenerationResult(
            text=self.tracker.text,
            token_ids=list(self.tracker.ids),
            mode=self.mode,
            ttft=self.ttft,
            total_time=time.perf_counter() - self.start,
            prompt_tokens=len(self.prompt),
            prefilled_tokens=state.prefilled_tokens,
            reused_tokens=state.reused_tokens,
            cache_hits=state.cache_hits,
            finish_reason=reason,
            first_logprobs=self.first_logprobs,
        ))

    def fail(self, error: BaseException | None) -> None:
        """End without a result: `error` raised to the caller (None: a request cancelled before it ran)."""
        self.release()
        self.stream.end(error=error)

    def release(self) -> None:
        if self.state is not None and not self.released:
            self.released = True
            self.prefiller.release(self.state)
