"""The token loop after the prefill: sampling, stop strings, incremental text, timing, the result."""

import time
from collections.abc import Iterator
from dataclasses import dataclass, field

import torch

from .attention import forward


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

    @property
    def generated_tokens(self) -> int:
        return len(self.token_ids)


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
    """Iterate for text deltas; `result` is set once the iteration is over."""

    def __init__(self, run: Iterator[str]):
        self._run = run
        self.result: GenerationResult | None = None

    def __iter__(self) -> Iterator[str]:
        self.result = yield from self._run

    def drain(self) -> GenerationResult:
        for _ in self:
            pass
        return self.result


@torch.inference_mode()
def run(engine, build, mode: str, max_new_tokens: int, sampler: Sampler, stops: list[str], max_time=None, blend=None):
    """Yield text deltas; return the GenerationResult. `build` makes (prompt, keys): inside the timing,
    as is the KV loading of `engine.prefill`."""
    start = time.perf_counter()
    prompt, keys = build()
    budget = min(max_new_tokens, engine.context_window - len(prompt))
    state = engine.prefill(prompt, mode, keys=keys, extra_capacity=budget, blend=blend)
    model = engine.model_for(mode)
    tracker = TextTracker(engine.tokenizer, stops)
    ttft, finish = None, "length"
    try:
        logits, position = state.logits[-1], state.next_position
        for step in range(budget):
            token = sampler(logits)
            if ttft is None:
                ttft = time.perf_counter() - start
            if token in engine.eos_ids:
                finish = "stop"
                break
            delta = tracker.push(token)
            if delta:
                yield delta
            if tracker.stopped:
                finish = "stop"
                break
            if max_time is not None and time.perf_counter() - start > max_time:
                finish = "timeout"
                break
            if step + 1 < budget:
                logits = forward(model, [token], state.cache, position)[-1]
                position += 1
        tail = tracker.flush()
        if tail:
            yield tail
        engine.store_pending(state, mode)
    finally:
        engine.release(state)
    return GenerationResult(
        text=tracker.text,
        token_ids=list(tracker.ids),
        mode=mode,
        ttft=ttft,
        total_time=time.perf_counter() - start,
        prompt_tokens=len(prompt),
        prefilled_tokens=state.prefilled_tokens,
        reused_tokens=state.reused_tokens,
        cache_hits=state.cache_hits,
        finish_reason=finish,
    )
