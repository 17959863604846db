"""Map-rerank replies: the answer and the 0-100 score, however loosely a model follows the format."""

import pytest
from kvrag.rerank import ScoredAnswer, best_answer, parse_scored_answer


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
