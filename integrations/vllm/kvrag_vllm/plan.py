"""Which leading run of a prompt's tokens the connector can supply, and from which stored blocks.

vLLM hands the connector a prompt as token ids and lets it supply one contiguous run after what vLLM
already holds. kvrag finds the indexed passages in those ids (any order, any template, no markers) and
supplies header + passage + glue + passage ... up to the last passage it can, each piece from its own
stored block: the header (what precedes the first passage: system turn, instructions) holds causal KV,
every passage and every glue run between two passages (a separator, "\n\n" or a "---" rule) its KV
computed alone, as kvrag's block mode does. vLLM prefills the rest, the question at least.
"""

from collections.abc import Callable, Sequence
from dataclasses import dataclass

MIN_PASSAGE_TOKENS = 8
"""Shorter indexed runs are glue: looked up only between two passages, never searched for."""
MAX_GLUE_TOKENS = 32
"""A longer run of text between two passages ends the supplied run there (it is the prompt's own text)."""


class Passages:
    """The token ids of indexed passages, found inside a prompt's ids by their first tokens."""

    def __init__(self):
        self._by_head: dict[tuple[int, ...], list[tuple[int, ...]]] = {}

    def __len__(self) -> int:
        return sum(map(len, self._by_head.values()))

    def add(self, ids: Sequence[int]) -> bool:
        """Remember a passage; False for a run too short to search for (glue)."""
        ids = tuple(ids)
        if len(ids) < MIN_PASSAGE_TOKENS:
            return False
        same = self._by_head.setdefault(ids[:MIN_PASSAGE_TOKENS], [])
        if ids not in same:
            same.append(ids)
            same.sort(key=len, reverse=True)  # the longest passage starting here wins
        return True

    def find(self, ids: Sequence[int]) -> list[tuple[int, int]]:
        """(start, stop) of the passages in `ids`, left to right, none overlapping."""
        found, i, n = [], 0, len(ids)
        ids = list(ids)
        while i + MIN_PASSAGE_TOKENS <= n:
            for passage in self._by_head.get(tuple(ids[i : i + MIN_PASSAGE_TOKENS]), ()):
                if i + len(passage) <= n and tuple(ids[i : i + len(passage)]) == passage:
                    found.append((i, i + len(passage)))
                    i += len(passage)
                    break
            else:
                i += 1
        return found


@dataclass(frozen=True)
class Piece:
    """Tokens start..start+len(ids) of the prompt, supplied from the block stored for `ids`."""

    start: int
    ids: tuple[int, ...]
    kind: str  # "header", "passage" or "glue"

    @property
    def stop(self) -> int:
        return self.start + len(self.ids)


def leading_run(ids: Sequence[int], found: list[tuple[int, int]], stored: Callable[[tuple[int, ...]], bool]) -> list[Piece]:
    """The pieces from the prompt's start to the end of the last passage that can be supplied, each with its
    block `stored`; never the whole prompt (vLLM computes at least the question). The header is returned
    even when it is not stored, so that the caller can have it saved; the caller decides what to load."""
    if not found:
        return []
    pieces = [Piece(0, tuple(ids[: found[0][0]]), "header")] if found[0][0] else []
    last_stop = None
    for start, stop in found:
        if stop >= len(ids):
            break
        glue = tuple(ids[last_stop:start]) if last_stop is not None else ()
        if glue and (len(glue) > MAX_GLUE_TOKENS or not stored(glue)):
            break
        passage = tuple(ids[start:stop])
        if not stored(passage):
            break
        if glue:
            pieces.append(Piece(last_stop, glue, "glue"))
        pieces.append(Piece(start, passage, "passage"))
        last_stop = stop
    return pieces if last_stop is not None else []


def unknown_glue(ids: Sequence[int], found: list[tuple[int, int]], stored) -> tuple[int, ...] | None:
    """The first short run between two found passages that has no stored block, if that is what ends the
    run (for the connector to name once)."""
    for (_, stop), (start, _) in zip(found, found[1:]):
        glue = tuple(ids[stop:start])
        if glue and len(glue) <= MAX_GLUE_TOKENS and not stored(glue):
            return glue
    return None
