"""MapReduce and MapRerank on kvrag's engine: one full-prefill call per passage, then an answer.

These are the classic baselines that CacheBlend compares against. langchain_kvrag's
``map_reduce`` / ``map_rerank`` chains send the same messages (they take the instructions and the
note filter from here), so on ``ChatKVRag(mode="full")`` they give the same answers; the
evaluation runs these to compare them without LangChain in the loop.

Time to first token: MapReduce's first answer token comes after every note is written; MapRerank
knows its answer only when every passage's reply is in, so its TTFT is its total time.
"""

import re
import time
from collections.abc import Sequence
from dataclasses import dataclass, field

from .generate import GenerationResult
from .rerank import MAP_RERANK_SYSTEM, ScoredAnswer, best_answer, parse_scored_answer

MAP_NOTES_SYSTEM = (
    "You take notes for a question. Copy the facts from the passage in the user's message that help "
    "answer the question, in one or two short sentences. If nothing in it helps, write: nothing relevant."
)
"""The instruction for one passage's call in MapReduce; the user message holds the passage, a blank
line, the question."""

_NOTHING = re.compile(r"^\W*(?:nothing relevant|none|n/a)\W*$", re.IGNORECASE)


def join_notes(notes: Sequence[str]) -> str:
    """The map step's notes as the reduce step reads them: empty and "nothing relevant" notes dropped,
    the rest joined with blank lines."""
    return "\n\n".join(n.strip() for n in notes if n.strip() and not _NOTHING.match(n))


@dataclass
class ChainResult:
    """A chain's answer, its timings (seconds) and every model call it made, in order."""

    text: str
    ttft: float
    total_time: float
    calls: list[GenerationResult] = field(default_factory=list)
    candidates: list[ScoredAnswer] = field(default_factory=list)


def _call(engine, system: str, parts: list, max_new_tokens: int) -> GenerationResult:
    """One chat call in full mode: a system message, then a user message of `parts`."""
    text, spans = engine.layout.render_chat([("system", [system]), ("user", parts)])
    return engine.generate_text(text, spans, mode="full", max_new_tokens=max_new_tokens)


def map_reduce(engine, question: str, passages: Sequence[str], *, max_new_tokens: int = 48, note_tokens: int = 48) -> ChainResult:
    """Notes on the question from every passage, then an answer from the notes."""
    start = time.perf_counter()
    calls = [_call(engine, MAP_NOTES_SYSTEM, [f"{p}\n\n{question}"], note_tokens) for p in passages]
    reduce_at = time.perf_counter() - start
    notes = join_notes([c.text for c in calls])
    final = _call(engine, engine.layout.format.system, [f"{notes}\n\n{question}"], max_new_tokens)
    calls.append(final)
    return ChainResult(final.text.strip(), reduce_at + final.ttft, time.perf_counter() - start, calls)


def map_rerank(engine, question: str, passages: Sequence[str], *, max_new_tokens: int = 48) -> ChainResult:
    """An answer and a 0-100 score from every passage; the best-scored answer wins."""
    start = time.perf_counter()
    calls = [_call(engine, MAP_RERANK_SYSTEM, [f"{p}\n\n{question}"], max_new_tokens) for p in passages]
    candidates = [parse_scored_answer(c.text) for c in calls]
    total = time.perf_counter() - start
    return ChainResult(best_answer(candidates).answer, total, total, calls, candidates)

