"""MapReduce and MapRerank: the classic baselines CacheBlend compares against, one implementation.

Both read every passage in a call of its own. This module holds their prompts, the note filter of
map-reduce and the reply parsing and selection of map-rerank; `map_reduce` / `map_rerank` run them on
kvrag's engine in full mode (what `kvrag bench accuracy` compares), and langchain_kvrag's chains and
LlamaIndex's `MapRerankSynthesizer` build the same messages from the same constants and pick answers
with the same functions, so on `ChatKVRag(mode="full")` they give the same answers.

Time to first token: MapReduce's first answer token comes after every note is written; MapRerank
knows its answer only when every passage's reply is in, so its TTFT is its total time.
"""

import re
import time
from collections.abc import Sequence
from dataclasses import dataclass, field

from .decode import GenerationResult

MAP_NOTES_SYSTEM = (
    "You take notes for a question. Copy the facts from the passage in the user's message that help "
    "answer the question, in one or two short sentences. If nothing in it helps, write: nothing relevant."
)
"""The instruction of one passage's call in MapReduce (the user message: `MAP_USER`)."""

MAP_RERANK_SYSTEM = (
    "Answer the question using only the passage in the user's message, in one sentence. "
    "Then, on a new line, write 'Score:' and a number from 0 to 100 saying how well the passage "
    "answers the question (0: not at all, 100: completely)."
)
"""The instruction of one passage's call in MapRerank (the user message: `MAP_USER`)."""

MAP_USER = "{passage}\n\n{question}"
"""The user message of one passage's call, in both chains: the passage, a blank line, the question."""

REDUCE_USER = "{notes}\n\n{question}"
"""The user message of MapReduce's last call (after the engine's own system instruction)."""

_NOTHING = re.compile(r"^\W*(?:nothing relevant|none|n/a)\W*$", re.IGNORECASE)


def map_message(passage: str, question: str) -> str:
    return MAP_USER.format(passage=passage, question=question)


def join_notes(notes: Sequence[str]) -> str:
    """The map step's notes as the reduce step reads them: empty and "nothing relevant" notes dropped,
    the rest joined with blank lines."""
    return "\n\n".join(n.strip() for n in notes if n.strip() and not _NOTHING.match(n))


# ---- map-rerank's replies: an answer and a 0-100 score, however loosely the model follows the format


@dataclass(frozen=True)
class ScoredAnswer:
    """One passage's answer. ``score`` is 0-100, or None when the reply had none."""

    answer: str
    score: float | None
    raw: str = ""


_NUMBER = r"(\d+(?:\.\d+)?|\.\d+)"
_SCALE = r"(?:[ \t]*(%)|[ \t]*(?:/|out[ \t]+of)[ \t]*(\d+(?:\.\d+)?))?"
# "Score: 80", "score=80/100", "**Confidence:** 0.8", "(relevance score 7/10)", "my confidence is 80%",
# "The score is 90."
_KEYED = re.compile(
    r"[(\[]?[ \t]*[*_]*\b(?:(?:the|my|its|final|relevance|confidence)[ \t]+){0,2}"
    r"(?:scores?|confidence|relevance|certainty|rating)\b[*_]*"
    r"(?:[ \t]*\([ \t]*0[ \t]*(?:-|–|to)[ \t]*100[ \t]*\))?"
    r"(?:[ \t]*(?:[:=\-–]|\bis\b|\bof\b))*[ \t]*[*_]*[ \t]*" + _NUMBER + _SCALE + r"[*_]*[ \t]*[)\]]?",
    re.IGNORECASE,
)
# a line holding only "80%", "(80/100)", "80" ...
_BARE_LINE = re.compile(r"^[ \t]*[(\[]?[ \t]*" + _NUMBER + _SCALE + r"[ \t]*[)\]]?[ \t]*\.?[ \t]*$", re.MULTILINE)
# "... 80%" / "... (80/100)" at the very end of the reply
_TRAILING = re.compile(r"[(\[]?[ \t]*" + _NUMBER + r"[ \t]*(?:(%)|/[ \t]*(100|10))[ \t]*[)\]]?[ \t]*\.?\s*$")
# "Answer:", "**Final answer:**", "The answer is:"
_ANSWER_LABEL = re.compile(
    r"^[*_]*(?:the[ \t]+)?(?:final[ \t]+)?answer(?:[ \t]+is)?[*_]*[ \t]*[:\-–][*_]*[ \t]*", re.IGNORECASE
)
_EDGE_PUNCT = " \t,;:|-–—"


def _scaled(number: str, percent: str | None, denominator: str | None) -> float:
    value = float(number)
    if denominator:
        value = value / float(denominator) * 100 if float(denominator) else 0.0
    elif not percent and "." in number and value <= 1:
        value *= 100  # "confidence 0.8"
    return min(max(value, 0.0), 100.0)


def _strip_span(text: str, start: int, end: int) -> str:
    """The text without [start, end): a line left empty goes, separators left dangling go too."""
    line_start = text.rfind("\n", 0, start) + 1
    line_end = text.find("\n", end)
    line_end = len(text) if line_end < 0 else line_end
    line = (text[line_start:start].rstrip(_EDGE_PUNCT) + " " + text[end:line_end].lstrip(_EDGE_PUNCT + ".")).strip()
    return text[:line_start] + line + text[line_end:]


def parse_scored_answer(text: str) -> ScoredAnswer:
    """The answer and its 0-100 score from a map_rerank reply, for models that follow the format loosely.

    Recognized, the last match counting: a keyword (score, confidence, relevance, certainty, rating)
    followed by a number, as in ``Score: 80``, ``score=80/100``, ``**Confidence:** 0.8``,
    ``(confidence 0.8)``, ``The score is 90.``, ``relevance score of 7/10`` (every one of them is
    stripped from the answer); else a line holding only a number (``80``, ``80%``, ``(80/100)``)
    after some answer text; else ``80%`` / ``80/100`` ending the reply. A number inside the text (a
    year, "50% of the islanders") is never taken for a score. ``N/D`` and ``N out of D`` scale to 100, a
    fraction without ``%`` (``0.8``) counts as 80, values are clamped to 0-100. No score: ``None``
    (ranked below every score). The answer is the reply without the score and without a leading
    ``Answer:`` / ``The answer is:`` label. Small models often leave the score out (the default
    SmolLM2-135M nearly always does); then the earliest passage, i.e. the retriever's best, wins.
    """
    raw = text or ""
    matches = list(_KEYED.finditer(raw))
    match = matches[-1] if matches else None
    if match is None:
        bare = [m for m in _BARE_LINE.finditer(raw) if raw[: m.start()].strip()]  # not the whole reply
        if bare and (bare[-1].group(2) or bare[-1].group(3) or float(bare[-1].group(1)) <= 100):
            match = bare[-1]
    if match is None:
        match = _TRAILING.search(raw)
        if match is not None and not raw[: match.start()].strip():
            match = None
    if match is None:
        return ScoredAnswer(answer=_clean_answer(raw), score=None, raw=raw)
    score = _scaled(*match.group(1, 2, 3))
    answer = raw
    for span in reversed(matches or [match]):  # every score line goes, the last one counts
        answer = _strip_span(answer, span.start(), span.end())
    return ScoredAnswer(answer=_clean_answer(answer), score=score, raw=raw)


def _clean_answer(text: str) -> str:
    lines = [line.strip() for line in text.strip().splitlines()]
    lines = [line for line in lines if line.strip(_EDGE_PUNCT + ".*_")]
    if lines:
        lines[0] = _ANSWER_LABEL.sub("", lines[0].lstrip(_EDGE_PUNCT + "."), count=1).strip()
    return "\n".join(line for line in lines if line)


def best_answer(candidates: Sequence[ScoredAnswer]) -> ScoredAnswer:
    """The highest score; a missing score ranks lowest, an empty answer below any answer; ties: the first."""
    if not candidates:
        raise ValueError("no candidates to choose from")
    order = range(len(candidates))
    best = max(
        order,
        key=lambda i: (bool(candidates[i].answer), -1.0 if candidates[i].score is None else candidates[i].score, -i),
    )
    return candidates[best]


def rerank(replies: Sequence[str]) -> tuple[ScoredAnswer, list[ScoredAnswer]]:
    """The winning answer of MapRerank's replies (one per passage, in retrieval order) and every parsed one."""
    candidates = [parse_scored_answer(reply) for reply in replies]
    return best_answer(candidates), candidates


@dataclass
class ChainResult:
    """A chain's answer, its timings (seconds) and every model call it made, in order."""

    text: str
    ttft: float
    total_time: float
    calls: list[GenerationResult] = field(default_factory=list)
    candidates: list[ScoredAnswer] = field(default_factory=list)


def _call(engine, system: str, user: str, max_new_tokens: int) -> GenerationResult:
    """One chat call in full mode: a system message, then a user message."""
    text, spans = engine.layout.render_chat([("system", [system]), ("user", [user])])
    return engine.generate_text(text, spans, mode="full", max_new_tokens=max_new_tokens)


def map_reduce(engine, question: str, passages: Sequence[str], *, max_new_tokens: int = 48, note_tokens: int = 48) -> ChainResult:
    """Notes on the question from every passage, then an answer from the notes."""
    start = time.perf_counter()
    calls = [_call(engine, MAP_NOTES_SYSTEM, map_message(p, question), note_tokens) for p in passages]
    reduce_at = time.perf_counter() - start
    notes = join_notes([c.text for c in calls])
    final = _call(engine, engine.layout.format.system, REDUCE_USER.format(notes=notes, question=question), max_new_tokens)
    calls.append(final)
    return ChainResult(final.text.strip(), reduce_at + final.ttft, time.perf_counter() - start, calls)


def map_rerank(engine, question: str, passages: Sequence[str], *, max_new_tokens: int = 48) -> ChainResult:
    """An answer and a 0-100 score from every passage; the best-scored answer wins."""
    start = time.perf_counter()
    calls = [_call(engine, MAP_RERANK_SYSTEM, map_message(p, question), max_new_tokens) for p in passages]
    best, candidates = rerank([c.text for c in calls])
    total = time.perf_counter() - start
    return ChainResult(best.answer, total, total, calls, candidates)
