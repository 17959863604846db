"""The MapReduce / MapRerank baselines: one call per passage on a tiny model, the note filter, and
map-rerank's replies (the answer and the 0-100 score, however loosely a model follows the format)."""


import pytest

from kvrag import chains
from kvrag.chains import ScoredAnswer, best_answer, parse_scored_answer, rerank


def test_map_reduce_and_map_rerank_call_once_per_passage(engine, examples):
    e = examples[0]
    mr = chains.map_reduce(engine, e.question, e.passages, max_new_tokens=3, note_tokens=2)
    assert len(mr.calls) == len(e.passages) + 1 and all(c.mode == "full" for c in mr.calls)
    assert all(c.generated_tokens <= 2 for c in mr.calls[:-1])
    assert sum(c.total_time for c in mr.calls[:-1]) < mr.ttft < mr.total_time
    rr = chains.map_rerank(engine, e.question, e.passages, max_new_tokens=3)
    assert len(rr.calls) == len(rr.candidates) == len(e.passages) and rr.ttft == rr.total_time


def test_each_call_is_the_instruction_then_the_passage_and_the_question(engine, examples, monkeypatch):
    """What the integrations' chains send too: they build their messages from the same constants."""
    e = examples[0]
    sent = []
    render = engine.layout.render_chat
    monkeypatch.setattr(engine.layout, "render_chat", lambda turns: sent.append(turns) or render(turns))
    chains.map_rerank(engine, e.question, e.passages[:2], max_new_tokens=1)
    assert sent == [[("system", [chains.MAP_RERANK_SYSTEM]), ("user", [f"{p}\n\n{e.question}"])] for p in e.passages[:2]]
    sent.clear()
    result = chains.map_reduce(engine, e.question, e.passages[:2], max_new_tokens=1, note_tokens=1)
    notes = chains.join_notes([c.text for c in result.calls[:-1]])
    assert sent[:2] == [[("system", [chains.MAP_NOTES_SYSTEM]), ("user", [f"{p}\n\n{e.question}"])] for p in e.passages[:2]]
    assert sent[2] == [("system", [engine.layout.format.system]), ("user", [f"{notes}\n\n{e.question}"])]


def test_join_notes_drops_empty_and_nothing_relevant_notes():
    notes = ["Ravel was born in 1901.", "nothing relevant", " ", "Nothing relevant.", "N/A", "It is in Osk. "]
    assert chains.join_notes(notes) == "Ravel was born in 1901.\n\nIt is in Osk."


def test_rerank_parses_every_reply_and_picks_the_best():
    best, candidates = rerank(["1742.\nScore: 20", "Kellan stew.\nScore: 95", "no score"])
    assert [c.score for c in candidates] == [20.0, 95.0, None]
    assert best is candidates[1] and best.answer == "Kellan stew."


def test_best_answer_ranks_an_empty_answer_below_any_answer():
    assert best_answer([ScoredAnswer("", 100.0), ScoredAnswer("x", None)]).answer == "x"
    with pytest.raises(ValueError):
        best_answer([])


@pytest.mark.parametrize(
    "reply, answer, score",
    [
        ("Score: 80", "", 80.0),
        ("Answer: It was founded in 1742.\nScore: 90", "It was founded in 1742.", 90.0),
        ("It was founded in 1742.\n\nScore: 90", "It was founded in 1742.", 90.0),
        ("Score: 75\nAnswer: Kellan stew.", "Kellan stew.", 75.0),
        ("Score: 80. Answer: Kellan stew", "Kellan stew", 80.0),
        ("The answer is: Kellan stew.\nThe score is 90.", "Kellan stew.", 90.0),
        ("The answer is kellan stew. Score: 90", "The answer is kellan stew.", 90.0),  # no colon: a sentence
        ("score=80/100", "", 80.0),
        ("Kellan stew, score=80/100", "Kellan stew", 80.0),
        ("Kellan stew. 80%", "Kellan stew.", 80.0),
        ("Kellan stew.\n80%", "Kellan stew.", 80.0),
        ("Kellan stew (confidence 0.8)", "Kellan stew", 80.0),
        ("Kellan stew [Confidence: 0.35]", "Kellan stew", 35.0),
        ("**Score:** 7/10\n**Answer:** Kellan stew", "Kellan stew", 70.0),
        ("Kellan stew.\nRelevance score of 9 out of 10", "Kellan stew.", 90.0),
        ("Kellan stew.\nScore (0-100): 60", "Kellan stew.", 60.0),
        ("Kellan stew.\nMy confidence is 85%.", "Kellan stew.", 85.0),
        ("It was founded in 1742 and is famous for seaweed. The score is 0.", "It was founded in 1742 and is famous for seaweed.", 0.0),
        ("Kellan stew.\nSCORE = 100", "Kellan stew.", 100.0),
        ("Kellan stew.\nScore: 1", "Kellan stew.", 1.0),  # an integer is on the 0-100 scale
        ("Kellan stew.\nScore: 1.0", "Kellan stew.", 100.0),  # a fraction is not
        ("Kellan stew.\nScore: 150", "Kellan stew.", 100.0),  # clamped
        ("Kellan stew.\n\n85", "Kellan stew.", 85.0),  # a bare number on its own line
        ("Kellan stew.\n(85/100)", "Kellan stew.", 85.0),
        ("Score: 10\nKellan stew.\nScore: 90", "Kellan stew.", 90.0),  # the last score counts
        ("Kellan stew.", "Kellan stew.", None),  # missing
        ("Kellan stew.\nScore: high", "Kellan stew.\nScore: high", None),  # no number: no score
        ("", "", None),
        ("It was founded in 1742.", "It was founded in 1742.", None),  # a year is not a score
        ("The island is 12 km wide and 1742 m high.\n1742", "The island is 12 km wide and 1742 m high.\n1742", None),
        ("About 50% of the islanders live in Saltmere, mostly fishers.", "About 50% of the islanders live in Saltmere, mostly fishers.", None),
        ("85", "85", None),  # a reply that is only a number is the answer, not a score
    ],
)
def test_parse_scored_answer(reply, answer, score):
    parsed = parse_scored_answer(reply)
    assert (parsed.answer, parsed.score) == (answer, score)
    assert parsed.raw == reply
