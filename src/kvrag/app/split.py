"""Reading text files and cutting them into passages of a bounded token count."""

import re
from collections.abc import Callable
from pathlib import Path

from kvrag import EmptyInputError, InputEncodingError

TEXT_SUFFIXES = (".txt", ".md", ".markdown", ".rst")
_SENTENCE_END = re.compile(r"(?<=[.!?])\s+")


def text_files(paths) -> list[Path]:
    """The text files named, and those under the directories named, in a stable order."""
    files = []
    for raw in paths:
        path = Path(raw)
        if path.is_dir():
            files += sorted(p for p in path.rglob("*") if p.is_file() and p.suffix.lower() in TEXT_SUFFIXES)
        elif path.is_file():
            files.append(path)
        else:
            raise FileNotFoundError(f"no such file or directory: {path}")
    if not files:
        raise EmptyInputError(f"no text files ({', '.join(TEXT_SUFFIXES)}) found in {', '.join(map(str, paths))}")
    return files


def read_text(path: Path) -> str:
    data = Path(path).read_bytes()
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise InputEncodingError(f"{path} is not UTF-8 text (invalid byte at offset {exc.start})") from exc


def split_passages(text: str, count_tokens: Callable[[str], int], max_tokens: int = 200, min_tokens: int = 32) -> list[str]:
    """Paragraphs, each <= max_tokens: long ones cut at sentence ends, ones under min_tokens
    (headings, one-liners) joined to the next."""
    pieces = []
    for para in re.split(r"\n\s*\n", text):
        para = para.strip()
        if not para:
            continue
        if count_tokens(para) <= max_tokens:
            pieces.append(para)
            continue
        current = ""
        for sentence in _SENTENCE_END.split(para):
            candidate = f"{current} {sentence}".strip()
            if current and count_tokens(candidate) > max_tokens:
                pieces.append(current)
                candidate = sentence
            current = candidate
        if current:
            pieces.append(current)
    passages, current = [], ""
    for piece in pieces:
        candidate = f"{current}\n\n{piece}" if current else piece
        if current and (count_tokens(current) >= min_tokens or count_tokens(candidate) > max_tokens):
            passages.append(current)
            candidate = piece
        current = candidate
    if current:
        passages.append(current)
    return passages
