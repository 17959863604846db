"""SQuAD questions for `bench accuracy --squad`: splits, distractors, determinism and errors on a
small SQuAD-format file, and the real file the set-up installs."""

import json

import pytest

from kvrag import KVRagError
from kvrag.app.cli import main
from kvrag.eval import squad


def _article(title: str, paragraphs: int) -> dict:
    return {"title": title, "paragraphs": [
        {"context": f"{title} paragraph {p} says the {title} value is {title}-{p}.",
         "qas": [{"id": f"{title}-{p}", "question": f"What is the {title} value of paragraph {p}?",
                  "answers": [{"answer_start": 0, "text": f"{title}-{p}"}, {"answer_start": 0, "text": f"{title}-{p}"}]}]}
        for p in range(paragraphs)]}


@pytest.fixture
def squad_file(tmp_path):
    path = tmp_path / "dev-v1.1.json"
    path.write_text(json.dumps({"version": "1.1", "data": [_article(t, 6) for t in ("alpha", "beta", "gamma", "delta")]}))
    return path


def test_dev_and_test_take_alternate_articles_and_every_question_once(squad_file):
    dev, test = (squad.questions(split, 100, 4, path=squad_file) for split in ("dev", "test"))
    assert sorted(e.id for e in dev) == sorted(f"squad-dev-{t}-{p}" for t in ("alpha", "gamma") for p in range(6))
    assert sorted(e.id for e in test) == sorted(f"squad-test-{t}-{p}" for t in ("beta", "delta") for p in range(6))
    assert len(squad.questions("train", 100, 4, path=squad_file)) == 24  # the train split reads the whole file


def test_a_question_comes_with_its_paragraph_and_others_of_its_article_first(squad_file):
    for e in squad.questions("test", 12, 4, path=squad_file):
        title, p = e.id.removeprefix("squad-test-").split("-")
        assert e.answers == (f"{title}-{p}",) and e.type == "single"  # repeated gold answers once
        assert e.passages[e.gold[0]] == f"{title} paragraph {p} says the {title} value is {title}-{p}."
        assert len(set(e.passages)) == 4 and all(c.startswith(f"{title} paragraph ") for c in e.passages)
    wide = squad.questions("test", 1, 9, path=squad_file)[0]  # more than its article holds: the next one's too
    assert len(set(wide.passages)) == 9 and {c.split()[0] for c in wide.passages} == {"beta", "delta"}


def test_no_distractor_names_a_gold_answer(tmp_path):
    article = _article("alpha", 5)
    article["paragraphs"][3]["context"] += " It also mentions alpha-0."
    path = tmp_path / "dev-v1.1.json"
    path.write_text(json.dumps({"data": [article]}))
    (e,) = [e for e in squad.questions("dev", 5, 5, path=path) if e.id.endswith("alpha-0")]
    assert len(e.passages) == 4 and not any("mentions" in c for c in e.passages)


def test_the_same_arguments_give_the_same_questions_and_a_seed_others(squad_file):
    def order(seed):
        return [(e.id, e.passages) for e in squad.questions("dev", 12, 4, seed=seed, path=squad_file)]
    assert order(0) == order(0) and order(0) != order(1)


@pytest.mark.parametrize("text, message", [("[1, 2]", "is not a SQuAD-format JSON file"),
                                           ('{"data": []}', "holds no questions for the dev split"),
                                           ("{not json", "is not a SQuAD-format JSON file"),
                                           ('{"data": [{"paragraphs": ["text"]}]}', "a paragraph without a context"),
                                           ('{"data": [{"paragraphs": 5}]}', "is not a SQuAD-format JSON file"),
                                           ('{"data": [{"paragraphs": [{"context": "c", "qas": [{"id": "q1"}]}]}]}',
                                            "article 0, paragraph 0, question 0 is not in SQuAD's format"),
                                           ('{"data": [{"paragraphs": [{"context": "c", "qas": [{"id": "q1", '
                                            '"question": "?", "answers": []}]}]}]}', "question q1 has no answers")])
def test_a_file_that_is_not_squad_is_a_clear_error(tmp_path, text, message):
    path = tmp_path / "x.json"
    path.write_text(text)
    with pytest.raises(KVRagError, match=message):
        squad.questions("dev", 5, path=path)


def test_bad_arguments_are_clear_errors(squad_file):
    with pytest.raises(ValueError, match="between 2 and 30"):
        squad.questions("dev", 5, 1, path=squad_file)
    with pytest.raises(ValueError, match="split must be one of"):
        squad.questions("val", 5, path=squad_file)


def test_the_set_up_installs_squad_and_the_default_file_holds_its_dev_set():
    assert squad.default_file("dev").name == "dev-v1.1.json" and squad.default_file("train").name == "train-v1.1.json"
    dev, test = (squad.questions(split, 10_000) for split in ("dev", "test"))
    assert len(dev) + len(test) == 10_570 and not {e.id[10:] for e in dev} & {e.id[11:] for e in test}
    assert all(len(e.passages) == 10 and len(set(e.passages)) == 10 for e in dev[:50])


def test_bench_accuracy_with_squad_rejects_prose_before_loading_anything(squad_file, capsys, monkeypatch):
    monkeypatch.setattr("kvrag.app.cli.common.engine", lambda args: pytest.fail("loaded a model"))
    assert main(["bench", "accuracy", "--squad", str(squad_file), "--prose", "1"]) == 2
    assert "SQuAD's paragraphs are already prose" in capsys.readouterr().err
    assert main(["bench", "accuracy", "--squad", str(squad_file.parent / "missing.json")]) == 2
    assert "cannot read the SQuAD file" in capsys.readouterr().err


def test_finetune_rejects_a_squad_share_outside_0_to_1_before_loading_anything(tmp_path, capsys, monkeypatch):
    monkeypatch.setattr("kvrag.app.cli.common.engine", lambda *args, **kwargs: pytest.fail("loaded a model"))
    assert main(["finetune", str(tmp_path / "run"), "--squad-share", "1.5"]) == 2
    assert "--squad-share must be between 0 and 1, got 1.5" in capsys.readouterr().err


def _answers_file(path, dataset, records):
    path.write_text("\n".join(json.dumps(x) for x in [{"settings": {"dataset": dataset}}, *records]) + "\n")
    return path


def test_full_mode_answers_become_the_targets_of_the_squad_questions_they_get_right(squad_file, tmp_path):
    """`finetune --squad-answers`: a SQuAD question's target becomes the first sentence of full mode's answer
    when that sentence is whole and holds a gold answer; other SQuAD questions are left out, generated ones kept."""
    from kvrag.eval import data
    from kvrag.train.finetune import with_full_mode_answers

    asked = squad.questions("train", 5, 3, path=squad_file)
    generated = data.generate("train", n=3, passages=5)
    gold = [q.answers[0] for q in asked]
    said = {asked[0].id: f"The value is {gold[0]}. It is also {gold[1]}.",  # right: its first sentence
            asked[1].id: f"The value is {gold[0]}.",  # names another question's answer
            asked[2].id: f"The value is {gold[2]} and",  # cut off before its sentence ended
            asked[3].id: f"Its value is {gold[3]}!"}  # right; asked[4] has no answer at all
    records = [{"method": "full", "id": i, "output": o} for i, o in said.items()]
    records.append({"method": "block", "id": asked[4].id, "output": f"It is {gold[4]}."})  # not full mode's
    dataset = {"corpus": "squad", "split": "train", "passages": 3, "seed": 0}
    kept = with_full_mode_answers(generated + asked, _answers_file(tmp_path / "a.jsonl", dataset, records))
    assert kept[:3] == generated
    assert [(q.id, q.target) for q in kept[3:]] == [(asked[0].id, f"The value is {gold[0]}."),
                                                    (asked[3].id, f"Its value is {gold[3]}!")]
    assert [q.passages for q in kept[3:]] == [asked[0].passages, asked[3].passages]


@pytest.mark.parametrize("dataset, lines, message", [
    ({"corpus": "squad", "split": "dev"}, [], "SQuAD's train questions are needed"),
    ({"split": "train", "passages": 10}, [], "SQuAD's train questions are needed"),
    ({"corpus": "squad", "split": "train"}, [{"method": "full", "id": "x", "output": "No."}], "holds no right full-mode answer"),
    ({"corpus": "squad", "split": "train"}, ["[1, 2]"], "is not a kvrag answers file"),
    (["squad", "train"], [], "is not a kvrag answers file"),
])
def test_a_wrong_answers_file_for_squad_targets_is_a_clear_error(squad_file, tmp_path, dataset, lines, message):
    from kvrag.train.finetune import with_full_mode_answers

    path = _answers_file(tmp_path / "a.jsonl", dataset, [])
    path.write_text(path.read_text() + "".join((x if isinstance(x, str) else json.dumps(x)) + "\n" for x in lines))
    with pytest.raises(ValueError, match=message):
        with_full_mode_answers(squad.questions("train", 3, 3, path=squad_file), path)
    with pytest.raises(ValueError, match="is not a kvrag answers file"):
        with_full_mode_answers([], tmp_path / "missing.jsonl")
