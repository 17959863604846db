"""Reading a corpus and cutting it into passages: which files, UTF-8 only, and passage sizes."""

import pytest

from kvrag import EmptyInputError, InputEncodingError
from kvrag.app.split import read_text, split_passages, text_files


def words(text: str) -> int:
    return len(text.split())


def test_text_files_are_the_named_ones_and_the_text_files_under_named_directories(tmp_path):
    (tmp_path / "b").mkdir()
    for name in ("b/z.md", "a.txt", "b/c.rst", "notes.markdown", "code.py", "b/data.json"):
        (tmp_path / name).write_text("x")
    named = tmp_path / "code.py"
    assert text_files([tmp_path, named]) == [tmp_path / "a.txt", tmp_path / "b/c.rst", tmp_path / "b/z.md",
                                              tmp_path / "notes.markdown", named]
    with pytest.raises(FileNotFoundError, match="no such file or directory"):
        text_files([tmp_path / "missing"])
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(EmptyInputError, match="no text files"):
        text_files([empty])


def test_read_text_refuses_what_is_not_utf8(tmp_path):
    good, bad = tmp_path / "good.txt", tmp_path / "bad.txt"
    good.write_text("café", encoding="utf-8")
    bad.write_bytes(b"caf\xe9 au lait")
    assert read_text(good) == "café"
    with pytest.raises(InputEncodingError, match=r"bad.txt is not UTF-8 text \(invalid byte at offset 3\)"):
        read_text(bad)


def test_paragraphs_that_fit_are_passages_and_short_ones_join_the_next():
    long_enough = " ".join(["word"] * 40)
    text = f"# Title\n\n{long_enough}\n\n\n{long_enough} again\n\nA last line."
    assert split_passages(text, words, max_tokens=100) == [
        f"# Title\n\n{long_enough}",  # the heading (under min_tokens) goes with the paragraph after it
        f"{long_enough} again",  # long enough on its own
        "A last line.",  # nothing after it to join
    ]
    assert split_passages("one two\n\nthree", words, max_tokens=2) == ["one two", "three"]  # joined would not fit


def test_a_long_paragraph_is_cut_at_sentence_ends_and_every_passage_fits():
    sentences = [f"Sentence {i} has exactly six words." for i in range(30)]  # 6 words each
    passages = split_passages(" ".join(sentences), words, max_tokens=40, min_tokens=0)
    assert all(words(p) <= 40 for p in passages)
    assert " ".join(passages) == " ".join(sentences)  # nothing lost, nothing reordered
    assert all(p.endswith(".") for p in passages)  # cut between sentences only
    assert len(passages) == 5  # 6 sentences (36 words) per passage
