"""Finding indexed passages inside rendered prompts (drop-in reuse) and cutting prompts at them."""

import copy
import multiprocessing
import sqlite3
import threading
import time
import warnings

import numpy as np
import pytest

from kvrag import EmptyInputError, Passage, match
from kvrag.match import PassageMatcher, registered_passages, window_hashes
from kvrag.prompt import PromptLayout

P1 = "The Varnholm lighthouse was built in 1873 by the engineer Ilsa Brandt on the northern cliff."
P2 = "Orrin Vale painted The Tin Harvest, a mural on the old grain store of Selby Cross, in 1921."
P3 = "Short but long enough: thirty-two+"  # exactly 34 characters, below the 64-character window


def test_window_hash_depends_on_content_not_position():
    text = "xyz" + P1 + "abc" + P1[:64]
    hashes = window_hashes(text, 64)
    assert hashes[3] == hashes[3 + len(P1) + 3] == window_hashes(P1[:64], 64)[0]
    assert len(set(hashes.tolist())) == len(hashes) - 1  # every other window differs
    assert window_hashes("short", 64).size == 0


def test_find_returns_exact_non_overlapping_spans_and_verifies_content():
    matcher = PassageMatcher(min_chars=32)
    matcher.add([P1, P2, P3, "tiny passage"])
    text = f"Context:\n{P2}\n\n{P1}\n\n{P3} and {P1[:-1]}? Question: ..."
    spans = matcher.find(text)
    assert [text[a:b] for a, b in spans] == [P2, P1, P3]
    assert matcher.find("tiny passage " * 5) == []  # too short to match by chance


def test_same_head_different_tail_is_not_a_match():
    matcher = PassageMatcher()
    matcher.add([P1])
    near_miss = P1[:80] + "X" + P1[81:]
    assert matcher.find(f"a {near_miss} b") == []


def test_longest_passage_wins_at_the_same_start():
    longer = P1 + " It was painted red in 1901 and again in 1950."
    matcher = PassageMatcher()
    matcher.add([P1, longer])
    text = f"see {longer} end"
    assert [text[a:b] for a, b in matcher.find(text)] == [longer]


def _add_in_process(path, texts):
    PassageMatcher(path).add(texts)


def test_passages_persist_and_are_shared_between_processes(tmp_path):
    path = tmp_path / "passages.sqlite"
    reader = PassageMatcher(path)
    assert reader.find(f"x {P1} y") == []
    ctx = multiprocessing.get_context("spawn")
    writers = [ctx.Process(target=_add_in_process, args=(path, [P1, P2])) for _ in range(2)]
    for w in writers:
        w.start()
    for w in writers:
        w.join(60)
        assert w.exitcode == 0
    assert len(reader) == 2  # the same reader sees what other processes added
    assert len(PassageMatcher(path).find(f"{P2} and {P1} ")) == 2


def test_openers_that_find_a_damaged_registry_together_set_it_aside_once(tmp_path, monkeypatch):
    """One opener at a time (a lock file beside the registry; threads here, processes alike): the first
    moves the damaged file aside and creates a new one, the others open that one, and no passage goes
    to a file moved aside. Each open is slowed, as on a busy disk, so that the openers overlap."""
    path = tmp_path / "passages.sqlite"
    path.write_bytes(b"SQLite format 3\x00" + bytes(range(256)) * 8)
    real_open = match._open

    def slow_open(p):
        try:
            return real_open(p)
        finally:
            time.sleep(0.2)

    monkeypatch.setattr(match, "_open", slow_open)
    texts = [f"{P1} ({i})" for i in range(4)]
    barrier, errors = threading.Barrier(len(texts)), []

    def open_and_add(text):
        try:
            barrier.wait(timeout=10)
            PassageMatcher(path).add([text])
        except Exception as exc:
            errors.append(exc)

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        threads = [threading.Thread(target=open_and_add, args=(text,)) for text in texts]
        for t in threads:
            t.start()
        for t in threads:
            t.join(30)
    assert errors == []
    assert len(list(tmp_path.glob("passages.sqlite.damaged-*"))) == 1
    assert sorted(registered_passages([path])) == sorted(texts)


# ---- prompts cut at passages ----------------------------------------------------------------------


def rendered(engine, question, passages):
    """The engine's own prompt for (question, passages), as one string."""
    layout = engine.layout
    return (
        layout.head
        + layout.format.separator.join(layout.format.passage.format(text=p) for p in passages)
        + layout.format.separator
        + layout.format.question.format(question=question)
        + layout.tail
    )


def test_found_passages_give_exactly_the_prompt_of_explicit_blocks(make_engine):
    engine = make_engine("qwen2")
    engine.index([P1, P2])
    question = "Who built the lighthouse?"
    found, found_keys = engine.prompt_from_text(rendered(engine, question, [P2, P1]))
    explicit, explicit_keys = engine.build_prompt(question, [P2, P1])
    assert (found.prefix, found.blocks, found.question) == (explicit.prefix, explicit.blocks, explicit.question)
    assert found_keys == explicit_keys
    result = engine.generate_text(rendered(engine, question, [P2, P1]), max_new_tokens=5)
    reference = engine.generate(question, [P2, P1], max_new_tokens=5)
    assert result.token_ids == reference.token_ids
    assert result.reused_tokens == reference.reused_tokens > 0
    assert result.prefilled_tokens == len(explicit.question)


def test_text_between_and_around_passages_keeps_its_place(make_engine):
    engine = make_engine()
    engine.index([P1, P2])
    text = f"Read these.\n{P1} --- {P2}\n\nQuestion: who?"
    prompt, keys = engine.prompt_from_text(text)
    layout = engine.layout
    assert prompt.prefix == layout.encode("Read these.\n")
    assert prompt.blocks == [layout.block_ids(P1), layout.block_ids(" --- "), layout.passage_ids(P2)]
    assert prompt.question == layout.encode("\n\nQuestion: who?")
    assert len(keys) == 3
    full = engine.generate_text(text, mode="full", max_new_tokens=1)
    assert full.prefilled_tokens == len(prompt) and full.reused_tokens == 0


def test_unindexed_text_is_all_question(make_engine):
    engine = make_engine()
    text = f"Context: {P1}\n\nQuestion: who?"
    prompt, keys = engine.prompt_from_text(text)
    assert (prompt.prefix, prompt.blocks, keys) == ([], [], [])
    result = engine.generate_text(text, max_new_tokens=2)
    assert result.reused_tokens == 0 and result.prefilled_tokens == len(prompt)


def test_explicit_spans_and_bad_spans(make_engine):
    engine = make_engine()
    text = f"A: {P3}\n\nQ?"
    start = text.index(P3)
    prompt, _ = engine.prompt_from_text(text, [(start, start + len(P3))])  # not indexed: computed
    assert prompt.blocks == [engine.layout.passage_ids(P3)]
    with pytest.raises(ValueError, match="overlaps"):
        engine.prompt_from_text(text, [(0, 10), (5, 12)])
    with pytest.raises(ValueError, match="outside"):
        engine.prompt_from_text(text, [(0, len(text) + 1)])
    with pytest.raises(EmptyInputError, match="question must follow"):
        engine.prompt_from_text(f"A: {P3}", [(3, 3 + len(P3))])
    with pytest.raises(EmptyInputError, match="whitespace only"):
        engine.prompt_from_text("A:    \n\nQ?", [(2, 6)])


# ---- chat turns rendered with passage spans -------------------------------------------------------


def test_chat_turns_render_like_the_engines_prompt_with_their_passages_marked(make_engine):
    engine = make_engine()
    layout = engine.layout
    question = layout.format.question.format(question="Who built the lighthouse?")
    turns = [("system", [layout.format.system]), ("user", [Passage(P1), Passage(P2), question])]
    text, spans = layout.render_chat(turns)
    assert text == rendered(engine, "Who built the lighthouse?", [P1, P2])
    assert [text[a:b] for a, b in spans] == [P1, P2]
    as_string = layout.render_chat([("system", [layout.format.system]), ("user", [f"{P1}\n\n{P2}\n\n{question}"])])
    assert as_string == (text, None)  # the engine finds indexed passages itself
    assert engine.prompt_from_text(text, spans) == engine.build_prompt("Who built the lighthouse?", [P1, P2])


def test_chat_turns_without_a_question_or_a_template(make_engine, tok):
    layout = make_engine().layout
    with pytest.raises(ValueError, match="no question"):
        layout.render_chat([("user", [Passage(P1), "  "])])
    with pytest.raises(ValueError, match="no messages"):
        layout.render_chat([])
    bare = copy.copy(tok)
    bare.chat_template = None
    plain = PromptLayout(bare)
    text, spans = plain.render_chat([("system", [plain.format.system]), ("user", [Passage(P1), "Question: who?"])])
    assert text == f"{plain.format.system}\n\n{P1}\n\nQuestion: who?\nAnswer:" and text[slice(*spans[0])] == P1


def test_window_hashes_of_non_bmp_text():
    text = "🙂" * 10 + "é" * 10
    assert np.array_equal(window_hashes(text, 5)[:1], window_hashes("🙂" * 5, 5))


@pytest.mark.parametrize("damage", ["garbage", "another table", "not text"])
def test_a_damaged_or_planted_passage_registry_is_set_aside(tmp_path, damage):
    """passages.sqlite only remembers texts that indexing adds again: unusable, it is moved aside with a
    warning, never a crash; rows that are not text are never matched."""
    path = tmp_path / "passages.sqlite"
    if damage == "garbage":
        path.write_bytes(b"SQLite format 3\x00" + bytes(range(256)) * 8)
    else:
        db = sqlite3.connect(path)
        if damage == "another table":
            db.execute("CREATE TABLE passages (digest TEXT PRIMARY KEY, body BLOB)")
        else:
            db.execute("CREATE TABLE passages (digest TEXT PRIMARY KEY, text TEXT NOT NULL)")
            db.execute("INSERT INTO passages VALUES ('x', x'00ff00ff00ff00ff00ff00ff00ff00ff00ff00ff00ff00ff00ff00ff00ff00ff')")
            db.execute("INSERT INTO passages VALUES ('y', 123456789012345678)")
        db.commit()
        db.close()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        matcher = PassageMatcher(path)
    moved = sorted(p.name for p in tmp_path.iterdir() if ".damaged-" in p.name)
    assert (len(moved), len(caught)) == ((0, 0) if damage == "not text" else (1, 1))
    passage = "The lighthouse of Varnholm was built in 1873 by the engineer Ilsa Brandt."
    matcher.add([passage])
    assert PassageMatcher(path).find(f"Context: {passage}\nQuestion: who?") == [(9, 9 + len(passage))]


def test_learned_passages_are_encoded_once_then_reused(make_engine):
    """A passage the engine was only told about (a retrieval, say) becomes a block of a rendered prompt:
    computed the first time, reused after."""
    engine = make_engine()
    engine.learn([P1, "  "])
    text, _ = engine.layout.render_chat([("user", [P1, "Who built the lighthouse?"])])
    first = engine.generate_text(text, max_new_tokens=2)
    again = engine.generate_text(text, max_new_tokens=2)
    assert first.cache_hits.get("computed", 0) >= 1 and again.cache_hits.get("computed", 0) == 0
    assert again.reused_tokens >= len(engine.layout.passage_ids(P1)) and again.token_ids == first.token_ids


CHATML_SPECIALS = ["<|im_start|>", "<|im_end|>"]


def chatml(user: str, system: str = "You are a helpful assistant.") -> str:
    return f"<|im_start|>system\n{system}<|im_end|>\n<|im_start|>user\n{user}<|im_end|>\n<|im_start|>assistant\n"


@pytest.mark.parametrize(
    "text, expected",
    [  # the ecosystems' habits: a label line, a template's special tokens, the question last or first
        (chatml(f"Answer from the context.\n\nContext:\n{P1}\n\n{P2}\n\nQuestion: who painted The Tin Harvest, and when?"),
         [P1, P2]),
        (chatml("Who painted it?", system=f"Use the following context.\n\n{P1}\n\n{P2}\n\n{P3}"), [P1, P2]),
        (chatml(f"Question: who? \nContext: {P3}\n\n{P1}\n\n{P2} \nAnswer:"), [P1]),
        (f"<|begin_of_text|><|start_header_id|>user<|end_header_id|>\n\nAnswer briefly from the passages below.\n\n"
         f"{P1}\n\n{P2}\n\nWho built the lighthouse, and in which year?<|eot_id|>", [P1, P2]),
        (f"Context:\n\n{P1}\n\n{P2}\n\nQuestion: who?\nAnswer:", [P1]),
        (chatml(f"Context information is below.\n-----\n{P1}\n\n{P2}\n-----\nGiven the context information, answer "
                "the query.\nQuery: who?\nAnswer: "), [P1, P2]),
        (chatml(f"{P1} {P2}\nWho painted it?"), []),
    ],
)
def test_unmarked_passages_are_the_runs_between_blank_lines(text, expected):
    specials = CHATML_SPECIALS + ["<|begin_of_text|>", "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>"]
    assert match.unmarked_passages(text, specials) == expected


def test_a_pasted_context_is_learned_and_reused_by_the_next_prompt(make_engine):
    """Nobody indexed or retrieved these passages: the first prompt learns them (blocks computed and stored),
    the second, another question over the same passages, reuses them."""
    engine = make_engine()
    ask = lambda q: engine.generate_text(chatml(f"Context:\n\n{P1}\n\n{P2}\n\n{q}"), max_new_tokens=2)
    first, second = ask("Who built the lighthouse in 1873?"), ask("Who painted the mural of Selby Cross?")
    assert first.cache_hits.get("computed", 0) >= 2 and first.reused_tokens == 0
    assert second.cache_hits.get("computed", 0) == 0
    assert second.reused_tokens >= len(engine.layout.passage_ids(P1)) + len(engine.layout.passage_ids(P2))
    assert P1 in engine.passages and P2 in engine.passages and "Who built" not in str(list(engine.passages._seen))


def test_the_paragraphs_of_a_known_passage_are_not_learned_apart(make_engine):
    engine = make_engine()
    engine.learn([f"{P1}\n\n{P2}"])
    engine.generate_text(chatml(f"Context:\n\n{P3} and the rest of it.\n\n{P1}\n\n{P2}\n\nWho built it, and when?"),
                         max_new_tokens=1)
    assert len(engine.passages) == 2 and P1 not in engine.passages and P2 not in engine.passages


def test_full_mode_and_a_spent_budget_learn_nothing(make_engine):
    engine = make_engine(learn_prompts=1)
    text = chatml(f"Context:\n\n{P1}\n\n{P2}\n\nWho built the lighthouse in 1873?")
    engine.generate_text(text, mode="full", max_new_tokens=1)
    assert len(engine.passages) == 0
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        engine.generate_text(text, max_new_tokens=1)
        engine.generate_text(chatml(f"Context:\n\n{P2}\n\n{P3} and more, unknown.\n\nWho?"), max_new_tokens=1)
    assert P1 in engine.passages and len(engine.passages) == 1
    said = [str(w.message) for w in caught]
    assert len(said) == 2 and "learn_prompts budget" in said[0] and "reused no KV" in said[1]


def test_a_long_prompt_that_reuses_nothing_says_so_once(make_engine):
    engine = make_engine(learn_prompts=0)
    text = chatml(f"Context:\n\n{P1}\n\n{P2}\n\nWho built the lighthouse in 1873?")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        engine.generate_text(text, mode="full", max_new_tokens=1)  # full mode reuses by design
        engine.generate_text("Who?", max_new_tokens=1)  # too short to have held passages
        engine.generate_text(text, max_new_tokens=1)
        engine.generate_text(text, max_new_tokens=1)
    said = [str(w.message) for w in caught if "reused no KV" in str(w.message)]
    assert len(said) == 1 and "blank line" in said[0] and "KVEngine.index" in said[0]


def test_a_known_passage_that_ends_the_prompt_is_prefilled_as_the_question(make_engine):
    engine = make_engine()
    engine.learn([P1])
    result = engine.generate_text(f"Who built it? {P1}", max_new_tokens=1)
    assert result.reused_tokens == 0 and not result.cache_hits
