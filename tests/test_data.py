"""The generated multi-document QA set: deterministic, split-disjoint, and answerable exactly as labelled."""

import re
from collections import Counter

import pytest

from kvrag.eval import data

N = 120


@pytest.fixture(scope="module")
def test_split():
    return data.generate("test", N, passages=10)


@pytest.fixture(scope="module")
def worlds():
    return {split: data._build_world(split, seed=0) for split in data.SPLITS}


def _contains(text: str, value: str) -> bool:
    return value.lower() in text.lower()


def test_same_seed_same_questions_other_seed_others(test_split):
    assert data.generate("test", N, passages=10) == test_split
    other = data.generate("test", N, passages=10, seed=1)
    assert {e.question for e in other}.isdisjoint({e.question for e in test_split})


def test_a_shorter_run_is_a_prefix_of_a_longer_one(test_split):
    """So `--limit` picks the first questions of the full benchmark."""
    assert data.generate("test", 20, passages=10) == test_split[:20]


def test_shape_types_and_passage_counts(test_split):
    assert Counter(e.type for e in test_split) == {t: N // 4 for t in data.QUESTION_TYPES}
    assert len({e.id for e in test_split}) == N
    for e in test_split:
        assert len(e.passages) == 10 and len(set(e.passages)) == 10
        assert len(e.gold) == (2 if e.type in ("bridge", "comparison") else 1)
        assert e.question.endswith("?") and e.target
    for k in (5, 30):
        assert all(len(e.passages) == k for e in data.generate("dev", 8, passages=k))


@pytest.mark.e2e  # counted with the default model's tokenizer
def test_passages_are_60_to_200_tokens(test_split, prose_split, default_engine):
    lengths = [len(default_engine.layout.passage_ids(p)) for e in test_split + prose_split for p in e.passages]
    assert 60 <= min(lengths) and max(lengths) <= 200


def test_splits_share_no_entity(worlds):
    words = {split: {w for e in world for w in re.findall(r"[A-Z][a-z]+", e.name)} - {"The", "Company", "Works",
             "Brothers", "Industries", "River", *data.WORK_NOUNS} for split, world in worlds.items()}
    facts = {split: {v for e in world for v in e.facts.values() if v[0].isupper()} for split, world in worlds.items()}
    for a, b in [("train", "dev"), ("train", "test"), ("dev", "test")]:
        assert words[a].isdisjoint(words[b])
        assert facts[a].isdisjoint(facts[b])  # countries and rivers too
    train = data.generate("train", 40)
    test_text = " ".join(p for e in data.generate("test", 40) for p in e.passages)
    assert not any(name in test_text for name in words["train"])
    assert all(e.split == "train" for e in train)


@pytest.fixture(scope="module")
def prose_split():
    return data.generate("train", N, passages=10, prose=0.5)


def test_every_answer_is_in_a_gold_passage_and_in_no_distractor(test_split, prose_split):
    for e in test_split + prose_split:
        if e.type == "unanswerable":
            continue
        gold = [e.passages[i] for i in e.gold]
        distractors = [p for i, p in enumerate(e.passages) if i not in e.gold]
        for answer in e.answers:
            assert any(_contains(p, answer) for p in gold), (e.id, answer)
            assert not any(_contains(p, answer) for p in distractors), (e.id, answer)


def test_bridge_needs_both_passages(test_split, worlds):
    """The first passage names the second hop's entity; only the second holds the answer."""
    by_passage = {x.passage: x for x in worlds["test"]}
    for e in (e for e in test_split if e.type == "bridge"):
        first, second = sorted((e.passages[i] for i in e.gold), key=lambda p: _contains(p, e.answers[0]))
        assert not _contains(first, e.answers[0])
        assert by_passage[first].name in e.question
        assert by_passage[second].name in first


def test_comparison_names_both_candidates_and_the_facts_decide(test_split, worlds):
    by_name = {x.name: x for x in worlds["test"]}
    attribute = {"person": "born", "company": "founded", "city": "population", "work": "year"}
    for e in (e for e in test_split if e.type == "comparison"):
        (win,), (lose,) = e.answers, e.wrong
        assert win in e.question and lose in e.question
        a, b = by_name[win], by_name[lose]
        value = lambda x: int(x.facts[attribute[x.kind]].replace(",", ""))  # noqa: E731
        assert (value(a) > value(b)) == ("more" in e.question)
        for x in (a, b):
            assert x.passage in [e.passages[i] for i in e.gold]
            assert _contains(x.passage, x.facts[attribute[x.kind]])


def test_unanswerable_questions_are_truly_unanswerable(test_split, worlds):
    """The subject's passage is there but leaves the fact out, and no passage states its value."""
    by_name = {x.name: x for x in worlds["test"]}
    for e in (e for e in test_split if e.type == "unanswerable"):
        assert e.answers == data.REFUSALS and e.target == data.UNANSWERABLE_TARGET
        subject = next(x for name, x in by_name.items() if name in e.question)
        hidden = subject.facts[subject.withheld]
        assert e.passages[e.gold[0]] == subject.passage
        assert not any(_contains(p, hidden) for p in e.passages), (e.id, hidden)


def test_noise_decides_how_many_distractors_are_hard(worlds):
    by_passage = {x.passage: x for x in worlds["test"]}

    def hard_share(noise):
        shares = []
        for e in data.generate("test", 40, passages=10, noise=noise):
            if e.type not in ("single", "unanswerable"):  # one gold passage: its entity is the subject
                continue
            kind = by_passage[e.passages[e.gold[0]]].kind
            distractors = [p for i, p in enumerate(e.passages) if i not in e.gold]
            shares.append(sum(by_passage[p].kind == kind for p in distractors) / len(distractors))
        return sum(shares) / len(shares)

    assert hard_share(0.0) == 1.0
    assert hard_share(0.0) > hard_share(0.5) > hard_share(1.0)


def test_prose_rewrites_passages_and_keeps_the_facts(worlds):
    """Prose changes how a share of the entities is written, not what the world is."""
    world = data._build_world("train", seed=0, prose=0.5)
    assert 0.4 < sum(e.prose for e in world) / len(world) < 0.6
    for plain, e in zip(worlds["train"], world):
        assert (e.name, e.withheld) == (plain.name, plain.withheld)
        assert {a: v for a, v in e.facts.items() if a in plain.facts} == plain.facts
        if not e.prose:
            assert e.passage == plain.passage and e.facts == plain.facts
            continue
        assert e.passage != plain.passage and len(e.facts) == len(plain.facts) + 1  # one fact more
        assert all(_contains(e.passage, v) for a, v in e.facts.items() if a != e.withheld), e.passage
        assert e.withheld is None or not _contains(e.passage, e.facts[e.withheld])


def test_prose_entities_are_asked_in_other_words_and_of_their_extra_fact(prose_split):
    def asked_as(templates):
        patterns = [re.escape(t).replace(re.escape("{name}"), ".+") for t in templates]
        return [q for q in single if any(re.fullmatch(p, q) for p in patterns)]

    single = [e.question for e in prose_split if e.type == "single"]
    plain = set(asked_as(q for q, _ in data._SINGLE.values()))
    assert set(asked_as(q for qs in data._REPHRASED.values() for q in qs)) - plain
    assert asked_as(extra[2] for kind in data._EXTRAS.values() for extra in kind.values())


@pytest.mark.parametrize(
    "kwargs, message",
    [({"split": "val"}, "split must be"), ({"passages": 4}, "between 5 and 30"), ({"passages": 31}, "between 5 and 30"),
     ({"noise": 1.5}, "noise"), ({"prose": -0.1}, "prose"), ({"n": 0}, "n must be")],
)
def test_bad_arguments(kwargs, message):
    with pytest.raises(ValueError, match=message):
        data.generate(**kwargs)
