"""How a question and its passages become token ids: prefix block, passage blocks, question block.

The chat template is rendered once around a placeholder user message; what precedes the
placeholder is the shared prefix (system turn and the opening of the user turn), what follows it
closes the user turn and opens the assistant's. Each part is tokenized on its own, so the ids of
a passage never depend on its neighbours and `full` mode prefills exactly the same ids.

A passage block is the passage's own text; the separator between two passages is a small block
of its own and the one after the last passage opens the question. So a passage's block is the
same wherever a prompt puts it: first, in the middle, or last before a chat template's end-of-turn.
"""

import functools
from dataclasses import dataclass, field

_PLACEHOLDER = "\x00kvrag-user-message\x00"


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


@dataclass
class Prompt:
    """Token ids of one request, by part."""

    prefix: list[int]
    blocks: list[list[int]] = field(default_factory=list)
    question: list[int] = field(default_factory=list)

    def ids(self) -> list[int]:
        return self.prefix + [t for b in self.blocks for t in b] + self.question

    def __len__(self) -> int:
        return len(self.prefix) + sum(map(len, self.blocks)) + len(self.question)


class PromptLayout:
    """Splits the tokenizer's chat template into the prefix and question parts of a `PromptFormat`."""

    def __init__(self, tokenizer, fmt: PromptFormat | None = None):
        self.tokenizer = tokenizer
        self.format = fmt or PromptFormat()
        self.head, self.tail = self._template_parts()
        self.prefix_ids = self.encode(self.head)
        self.separator_ids = self.encode(self.format.separator)

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
