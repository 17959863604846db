"""How a question and its passages become token ids: prefix block, passage blocks, question block.

The chat template is rendered once around a placeholder user message; what precedes the
placeholder is the shared prefix (system turn and the opening of the user turn), what follows it
closes the user turn and opens the assistant's. A passage is tokenized on its own, so its ids never
depend on its neighbours and `full` mode prefills exactly the same ids. The text around passages is
tokenized as tokenizing the whole prompt has it, so that where passages tokenize alone as they do in
place, a prompt's ids are those a server tokenizing it whole (transformers, vLLM) computes.

A passage block is the passage's own text; the separator between two passages is a small block
of its own and the one after the last passage opens the question. So a passage's block is the
same wherever a prompt puts it: first, in the middle, or last before a chat template's end-of-turn.
"""

import functools
import itertools
from collections.abc import Sequence
from dataclasses import dataclass, field

from .errors import EmptyInputError, InputEncodingError

_PLACEHOLDER = "\x00kvrag-user-message\x00"
_PASSAGE_MARKER = "\x00kvrag-passage-{}\x00"
_CONTEXT_CHARS = 16  # tokenizers' pre-splitting looks a character or two past a piece
_CACHED_CHARS = 1024  # pieces around passages up to this long are tokenized once


def check_text(text, what: str = "passage") -> str:
    """A usable passage or question: a str (or UTF-8 bytes) with something besides whitespace."""
    if isinstance(text, (bytes, bytearray)):
        try:
            text = bytes(text).decode("utf-8")
        except UnicodeDecodeError as exc:
            raise InputEncodingError(f"{what} is not valid UTF-8: {exc}") from exc
    if not isinstance(text, str):
        raise TypeError(f"{what} must be str, got {type(text).__name__}")
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as exc:
        raise InputEncodingError(f"{what} contains characters that are not valid UTF-8: {exc}") from exc
    if not text.strip():
        raise EmptyInputError(f"{what} is empty or whitespace only")
    return text


@dataclass(frozen=True)
class PromptFormat:
    """What the model sees around the passages; every field may be changed."""

    system: str = (
        "You are a helpful assistant. Answer the question using only the passages in the user's message. "
        "Answer briefly, in one sentence."
    )
    passage: str = "{text}"
    separator: str = "\n\n"  # between passages, and between the last passage and the question
    question: str = "Question: {question}"


@dataclass(frozen=True)
class Passage:
    """A passage inside a chat message (see `PromptLayout.render_chat`): it becomes a block of its own."""

    text: str


@dataclass
class Prompt:
    """Token ids of one request, by part."""

    prefix: list[int]
    blocks: list[list[int]] = field(default_factory=list)
    question: list[int] = field(default_factory=list)

    def ids(self) -> list[int]:
        return self.prefix + [t for b in self.blocks for t in b] + self.question

    def block_starts(self) -> list[int]:
        """Where each block begins in `ids()`."""
        return list(itertools.accumulate(map(len, self.blocks[:-1]), initial=len(self.prefix)))[: len(self.blocks)]

    def __len__(self) -> int:
        return len(self.prefix) + sum(map(len, self.blocks)) + len(self.question)


class PromptLayout:
    """Splits the tokenizer's chat template into the prefix and question parts of a `PromptFormat`."""

    def __init__(self, tokenizer, fmt: PromptFormat | None = None):
        self.tokenizer = tokenizer
        self.format = fmt or PromptFormat()
        self.head, self.tail = self._template_parts()
        self.prefix_ids = self.before_a_passage(self.head)
        self.separator_ids = self.before_a_passage(self.format.separator)

    def _template_parts(self) -> tuple[str, str]:
        system = self.format.system
        if not getattr(self.tokenizer, "chat_template", None):
            return (f"{system}\n\n" if system else ""), "\nAnswer:"
        messages = [{"role": "user", "content": _PLACEHOLDER}]
        if system:
            messages.insert(0, {"role": "system", "content": system})
        try:
            text = self.tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        except Exception:  # templates without a system role: put the instructions in the user turn
            text = self.tokenizer.apply_chat_template(
                [{"role": "user", "content": _PLACEHOLDER}], tokenize=False, add_generation_prompt=True
            )
            head, tail = text.split(_PLACEHOLDER)
            return head + (f"{system}\n\n" if system else ""), tail
        head, tail = text.split(_PLACEHOLDER)
        return head, tail

    def encode(self, text: str) -> list[int]:
        return self.tokenizer(text, add_special_tokens=False)["input_ids"]

    def passage_ids(self, text: str) -> list[int]:
        return self.block_ids(self.format.passage.format(text=text))

    def block_ids(self, text: str) -> list[int]:
        """Ids of a block's text tokenized alone."""
        return list(self._block_ids(text))

    @functools.lru_cache(maxsize=16384)
    def _block_ids(self, text: str) -> tuple[int, ...]:
        # retrieved passages recur across questions; tokenizing thousands of tokens each time shows in TTFT
        return tuple(self.encode(text))

    def question_ids(self, question: str, after_passages: bool = True) -> list[int]:
        lead = self.format.separator if after_passages else ""
        return self.encode(lead + self.format.question.format(question=question) + self.tail)

    def cut(self, text: str, spans: Sequence[tuple[int, int]]) -> Prompt:
        """The prompt of an already rendered text whose passages, at character `spans`, become blocks.

        With a passage format that adds text around the passage (say "[doc] {text}"), a span widens
        to it where the text has it, so that the block is exactly the one `passage_ids` makes. Text
        before the first passage is the prefix, text between passages forms small blocks of its own,
        text after the last passage is the question."""
        before, after = self.format.passage.split("{text}")
        cuts, end = [], 0
        for start, stop in sorted(spans):
            if not end <= start < stop <= len(text):
                raise ValueError(f"passage span {(start, stop)} is empty, overlaps another or lies outside the prompt")
            if not text[start:stop].strip():
                raise EmptyInputError(f"the passage at {(start, stop)} is whitespace only")
            if text.startswith(after, stop) and text[start - len(before) : start] == before and start - len(before) >= end:
                start, stop = start - len(before), stop + len(after)
            cuts.append((start, stop))
            end = stop
        if not cuts:
            return Prompt([], [], self.encode(text))
        if not text[end:].strip():
            raise EmptyInputError("the prompt ends with a passage: a question must follow the passages")
        blocks = []
        for (start, stop), next_start in zip(cuts, [c[0] for c in cuts[1:]] + [None]):
            blocks.append(self.block_ids(text[start:stop]))
            if next_start is not None and next_start > stop:
                blocks.append(self.in_context(text, stop, next_start))
        return Prompt(self.in_context(text, 0, cuts[0][0]), blocks, self.in_context(text, end, len(text)))

    def before_a_passage(self, text: str) -> list[int]:
        """Ids of `text` where a passage (a word) follows it: a blank line there is two newlines."""
        return self.in_context(text + "A", 0, len(text))

    def in_context(self, text: str, start: int, stop: int) -> list[int]:
        """Ids of `text[start:stop]` as tokenizing the whole text gives them (a blank line before a word is
        two newline tokens, not one), when the whole text's tokens break at `start` and `stop`; else the
        piece tokenized alone. Servers that tokenize the prompt whole (vLLM, transformers) then compute the
        same tokens as kvrag around passages."""
        lo, hi = max(0, start - _CONTEXT_CHARS), min(len(text), stop + _CONTEXT_CHARS)
        # glue and a system prompt's header recur in every request; a long chat history is not worth keeping
        split = self._in_context_cached if hi - lo <= _CACHED_CHARS else self._in_context
        return list(split(text[lo:hi], start - lo, stop - lo))

    def _in_context(self, window: str, start: int, stop: int) -> tuple[int, ...]:
        whole, left, right = (self.encode(t) for t in (window, window[:start], window[stop:]))
        inside = len(whole) - len(left) - len(right)
        if inside > 0 and whole[: len(left)] == left and whole[len(whole) - len(right) :] == right:
            return tuple(whole[len(left) : len(left) + inside])
        return tuple(self.encode(window[start:stop]))

    _in_context_cached = functools.lru_cache(maxsize=16384)(_in_context)

    def render_chat(self, turns: Sequence[tuple[str, Sequence[str | Passage]]]) -> tuple[str, list[tuple[int, int]] | None]:
        """The chat-template text of `turns`, (role, parts) pairs, and the character spans of their
        `Passage` parts in it (None when there are none: the engine then finds indexed passages in
        the text by content). Integrations turn their message types into turns with this.

        A turn's parts are joined with the format's separator, as the engine joins passages, so
        explicit passages and the same text sent as one string render alike and reuse the same
        separator blocks.
        """
        if not turns:
            raise ValueError("no messages to render")
        role, parts = turns[-1]
        if role == "user" and not any(isinstance(p, str) and p.strip() for p in parts):
            raise ValueError("the last message holds no question: add text after the passages")
        messages, passages = [], []
        for role, parts in turns:
            content = []
            for part in parts:
                if isinstance(part, Passage):
                    content.append(_PASSAGE_MARKER.format(len(passages)))
                    passages.append(part.text)
                elif part:
                    content.append(part)
            messages.append({"role": role, "content": self.format.separator.join(content)})
        if getattr(self.tokenizer, "chat_template", None):
            rendered = self.tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        else:  # as `_template_parts` lays out a prompt without a template
            rendered = "\n\n".join(m["content"] for m in messages) + self.tail
        if not passages:
            return rendered, None
        pieces, spans, position, length = [], [], 0, 0
        for i, passage in enumerate(passages):
            marker = _PASSAGE_MARKER.format(i)
            at = rendered.find(marker, position)
            if at < 0:
                raise ValueError("the chat template dropped a passage from the prompt")
            pieces += [rendered[position:at], passage]
            length += at - position
            spans.append((length, length + len(passage)))
            length += len(passage)
            position = at + len(marker)
        pieces.append(rendered[position:])
        return "".join(pieces), spans
