"""Accuracy and token F1 against examples computed by hand."""

import pytest

from kvrag.eval.metrics import answer_in_output, normalize, token_f1


def test_normalize_drops_case_punctuation_and_articles():
    assert normalize("The  Lailgro Company, in 1,830!") == "lailgro company in 1830"
    assert normalize("It’s an  answer.") == "its answer"


@pytest.mark.parametrize(
    "output, answers, expected",
    [
        ("Lailgro Company is based in Dranvi.", ["Dranvi"], True),
        ("It is based in dranvi", ["Dranvi"], True),  # case
        ("The answer is 1,830.", ["1,830"], True),
        ("It is based in Dranvika.", ["Dranvi"], False),  # whole words only
        ("It is based in Gansor.", ["Dranvi", "Gansor"], True),  # any gold answer
        ("", ["Dranvi"], False),
        ("The passages do not say.", ["unanswerable", "do not say"], True),
    ],
)
def test_answer_in_output(output, answers, expected):
    assert answer_in_output(output, answers) is expected


def test_a_wrong_candidate_named_first_is_not_an_answer():
    wrong = ["Linpum Drorbro"]
    assert answer_in_output("Thaimo Vopoun was born earlier than Linpum Drorbro.", ["Thaimo Vopoun"], wrong)
    assert not answer_in_output("Linpum Drorbro was born later than Thaimo Vopoun.", ["Thaimo Vopoun"], wrong)
    assert not answer_in_output("Linpum Drorbro.", ["Thaimo Vopoun"], wrong)


@pytest.mark.parametrize(
    "output, answers, expected",
    [
        ("Dranvi", ["Dranvi"], 1.0),
        # predicted = lailgro company is based in dranvi (6), gold = dranvi (1): P = 1/6, R = 1
        ("Lailgro Company is based in Dranvi.", ["Dranvi"], 2 * (1 / 6) / (1 / 6 + 1)),
        # predicted: thaimo (1); gold: thaimo vopoun (2): P = 1, R = 1/2 -> 2/3
        ("Thaimo.", ["Thaimo Vopoun"], 2 / 3),
        ("Nothing matches here.", ["Dranvi"], 0.0),
        ("", ["Dranvi"], 0.0),
        # best over answers: "do not say" shares 3 of the 4 predicted tokens (passages do not say): P 3/4, R 1
        ("The passages do not say.", ["unanswerable", "do not say"], 2 * 0.75 / 1.75),
    ],
)
def test_token_f1(output, answers, expected):
    assert token_f1(output, answers) == pytest.approx(expected)
