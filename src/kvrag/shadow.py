"""Shadow checks: a share of the requests answered in a reusing mode is answered again in full mode, in the
background, and the two answers compared, so that agreement with full is measured on the requests an engine really
gets, not only on a calibration's questions.

The full answer runs at the scheduler's lowest priority (admitted when no request waits, stepped only while none runs,
its prompt prefilled SHADOW_CHUNK tokens a step: a request that arrives waits one chunk at most) and is never sent
anywhere; the answer already sent is never changed. Only greedy requests are checked (a sampled answer has no single
full answer to agree with). When the default mode's agreement over the last `window` checks falls under the target,
the engine steps to the next safer mode (`calibrate.SAFER`: block to auto to full), says so in one log line, and
steps back once `kvrag calibrate` writes a new record that chooses a mode.
"""

import collections
import logging
import threading

from . import calibrate
from .decode import Generation, Sampler
from .eval.accuracy import same_answer
from .prompt import Prompt

SHADOW_CHUNK = 64
"""Prompt tokens a shadow check prefills per scheduler step."""
WINDOW, LEAST = 50, 20
"""Agreement is judged over the last WINDOW checks of a mode, once there are LEAST."""

log = logging.getLogger("kvrag")


class Shadow:
    def __init__(self, engine, share: float, *, target: float | None = None, window: int = WINDOW, least: int = LEAST):
        """`share`: of the greedy requests answered in a reusing mode, how many are checked (every 1/share-th);
        `target`: the agreement under which the default mode steps down (default: the calibration record's, else
        calibrate.TARGET)."""
        if not 0 < share <= 1:
            raise ValueError(f"the shadow share is a share of requests in (0, 1], got {share!r}")
        if target is not None:
            calibrate.check_target(target, 0)
        self.engine, self.share, self.window, self.least = engine, share, window, least
        self.target = target or (engine.calibration or {}).get("target", calibrate.TARGET)
        self.checks: dict[str, collections.deque] = {}  # mode -> the last `window` checks, 1 agreed / 0 not
        self.totals: dict[str, list[int]] = {}  # mode -> [checks, agreed] since start
        self.dropped = 0  # checks not made: the background queue was full
        self.stepped: list[tuple[str, str]] = []  # (from, to) while stepped down
        self._due = 0.0
        self._record = self._stamp()
        self._lock = threading.Lock()

    def _stamp(self):
        try:
            return calibrate.record_path(self.engine).stat().st_mtime_ns
        except OSError:
            return None

    def consider(self, generation: Generation) -> None:
        """After `generation` was submitted: check it against full if it is due, reusing and greedy."""
        if generation.mode == "full" or generation.sampler.temperature != 0:
            return
        with self._lock:
            self._due += self.share
            if self._due < 1:
                return
            self._due -= 1
        prompt = generation.prompt
        full = Generation(generation.prefiller, Prompt([], [], prompt.ids()), [], "full", generation.budget,
                          Sampler(), generation.stops, chunk=SHADOW_CHUNK)
        pair = _Pair(self, generation)
        generation.stream.on_end(pair.reused)
        full.stream.on_end(pair.full)
        if not self.engine.scheduler.submit(full, background=True):
            with self._lock:
                self.dropped += 1

    def record(self, mode: str, agreed: bool) -> None:
        with self._lock:
            window = self.checks.setdefault(mode, collections.deque(maxlen=self.window))
            window.append(int(agreed))
            totals = self.totals.setdefault(mode, [0, 0])
            totals[0] += 1
            totals[1] += int(agreed)
            engine = self.engine
            if mode == engine.default_mode and len(window) >= self.least and sum(window) / len(window) < self.target:
                safer = calibrate.SAFER.get(mode, "full")
                log.warning("kvrag: shadow checks: %s agreed with full on %d of the last %d requests, under the "
                            "target of %g%%; requests that name no mode now get %s until `kvrag calibrate` records "
                            "a new choice", mode, sum(window), len(window), 100 * self.target, safer)
                self.stepped.append((mode, safer))
                engine.default_mode = safer
            self._recalibrated()

    def _recalibrated(self) -> None:
        """Stepped down and a new calibration record written since: its choice, the windows afresh."""
        stamp = self._stamp()
        if not self.stepped or stamp == self._record:
            return
        self._record = stamp
        record = calibrate.load(self.engine)
        if record is None or record.get("chosen") is None:
            return
        self.engine.use_calibration(record)
        self.target = record.get("target", self.target)
        self.checks.clear()
        self.stepped.clear()
        log.warning("kvrag: recalibrated: requests that name no mode get %s again", self.engine.default_mode)

    def agreement(self) -> dict[str, dict]:
        """Per mode: checks and agreements since start, and the share that agreed in the current window."""
        with self._lock:
            return {mode: {"checks": checks, "agreed": agreed,
                           "window": sum(self.checks[mode]) / len(self.checks[mode]) if self.checks.get(mode) else None}
                    for mode, (checks, agreed) in self.totals.items()}


class _Pair:
    """A request and its full-mode shadow: compared once both are over, if both ran to their end."""

    def __init__(self, shadow: Shadow, generation: Generation):
        self.shadow, self.mode, self.results = shadow, generation.mode, {}
        self._lock = threading.Lock()

    def reused(self, result) -> None:
        self._done("reused", result)

    def full(self, result) -> None:
        self._done("full", result)

    def _done(self, which: str, result) -> None:
        with self._lock:
            self.results[which] = result
            if len(self.results) < 2:
                return
        reused, full = self.results["reused"], self.results["full"]
        if reused is None or full is None or {reused.finish_reason, full.finish_reason} & {"cancelled", "timeout"}:
            return
        self.shadow.record(self.mode, same_answer(reused.text, full.text))
