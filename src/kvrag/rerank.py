"""Map-rerank's reply format: an answer and a 0-100 score per passage; the best-scored answer wins.

Shared by the LangChain and LlamaIndex map-rerank comparisons, so both parse replies the same way.
"""

import re
from collections.abc import Sequence
from dataclasses import dataclass

MAP_RERANK_SYSTEM = (
    "Answer the question using only the passage in the user's message, in one sentence. "
    "Then, on a new line, write 'Score:' and a number from 0 to 100 saying how well the passage "
    "answers the question (0: not at all, 100: completely)."
)
"""The instruction for one passage's call; the user message holds the passage, a blank line, the question."""


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
