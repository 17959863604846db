"""Answer quality: Block-Attention's accuracy (a gold answer appears in the output) and CacheBlend's
token F1, both on SQuAD-normalised text (lower case, no punctuation, no articles)."""

import collections
import re
import string
from collections.abc import Sequence

_ARTICLES = re.compile(r"\b(a|an|the)\b")
_PUNCTUATION = str.maketrans("", "", string.punctuation)


def normalize(text: str) -> str:
    text = text.lower().replace("’", "'").translate(_PUNCTUATION)
    return " ".join(_ARTICLES.sub(" ", text).split())


def _find(haystack: str, needle: str) -> int:
    """Where `needle` starts in `haystack` as whole words, or -1 (both normalised)."""
    if not needle:
        return -1
    match = re.search(rf"(?<!\w){re.escape(needle)}(?!\w)", haystack)
    return match.start() if match else -1


def answer_in_output(output: str, answers: Sequence[str], wrong: Sequence[str] = ()) -> bool:
    """Whether any gold answer appears in the output, as whole words. With `wrong` (a comparison's
    other candidate), a wrong candidate named before every gold answer makes it false: "B was born
    earlier than A" does not answer "A" just by naming it."""
    text = normalize(output)
    found = [i for i in (_find(text, normalize(a)) for a in answers) if i >= 0]
    if not found:
        return False
    misses = [i for i in (_find(text, normalize(w)) for w in wrong) if i >= 0]
    return not misses or min(found) < min(misses)


def token_f1(output: str, answers: Sequence[str]) -> float:
    """The best token F1 between the output and any gold answer."""
    predicted = normalize(output).split()
    best = 0.0
    for answer in answers:
        gold = normalize(answer).split()
        common = sum((collections.Counter(predicted) & collections.Counter(gold)).values())
        if common:
            precision, recall = common / len(predicted), common / len(gold)
            best = max(best, 2 * precision * recall / (precision + recall))
    return best
