"""The example apps' question files: every gold answer is in the corpus it is asked of, and a
comparison that names its other candidate first is not counted right."""

import importlib.util
import json
from pathlib import Path

import pytest
from kvrag.app.split import read_text, text_files
from kvrag.eval.metrics import answer_in_output

EXAMPLES = Path(__file__).resolve().parents[1] / "examples"
_spec = importlib.util.spec_from_file_location("examples_common", EXAMPLES / "common.py")
common = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(common)


@pytest.mark.parametrize("folder", [common.SAMPLE, EXAMPLES / "heldout"], ids=["sample", "heldout"])
def test_every_answer_is_in_the_corpus(folder):
    corpus = "\n\n".join(read_text(path) for path in text_files([folder]))
    questions = common.load_questions(folder / "questions.json")
    assert len({item["question"] for item in questions}) == len(questions)
    for item in questions:  # findable by the metric that scores the replies
        assert answer_in_output(corpus, item["answers"]), item
        for other in item.get("wrong", []):
            assert answer_in_output(corpus, [other]), item


def test_the_heldout_set_is_what_the_docs_say():
    questions = json.loads((EXAMPLES / "heldout" / "questions.json").read_text())
    assert len(questions) == 60 and sum("wrong" in item for item in questions) == 10
    assert len(text_files([EXAMPLES / "heldout"])) == 12


def test_a_comparison_naming_the_other_candidate_first_is_wrong():
    item = {"question": "Which club is older, the Herons or the Gulls?", "answers": ["Gulls"], "wrong": ["Herons"]}
    assert common.is_right("The Gulls, founded in 1903, are older than the Herons.", item)
    assert not common.is_right("The Herons are older than the Gulls.", item)
    assert not common.is_right("Neither.", item)
    assert common.is_right("The Herons are older than the Gulls.", {**item, "wrong": []})
