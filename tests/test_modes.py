"""What each mode reuses and computes, on a tiny random model (their exactness: test_invariants.py)."""

import pytest

TEXTS = ["Ilsa Brandt built the lighthouse of Varnholm in 1873.", "The river Olm freezes every winter."]
QUESTION = "Who built the lighthouse?"


@pytest.mark.parametrize("mode", ["block", "composite", "prefix"])
def test_reuse_bookkeeping(make_engine, mode):
    engine = make_engine()
    first = engine.generate(QUESTION, TEXTS, mode=mode, max_new_tokens=2)
    second = engine.generate(QUESTION, TEXTS, mode=mode, max_new_tokens=2)
    q = len(engine.layout.question_ids(QUESTION))
    assert second.prefilled_tokens == q and second.reused_tokens == second.prompt_tokens - q
    assert second.cache_hits == {"memory": 4}  # system prompt, two passages, the separator between them
    assert first.cache_hits.get("computed", 0) >= 2  # the passages were not indexed beforehand
    assert second.token_ids == first.token_ids


def test_prefix_mode_reuses_only_exact_prefixes(make_engine):
    engine = make_engine()
    engine.generate(QUESTION, TEXTS, mode="prefix", max_new_tokens=1)
    swapped = engine.generate(QUESTION, TEXTS[::-1], mode="prefix", max_new_tokens=1)
    assert swapped.cache_hits == {"memory": 1, "computed": 3}  # only the system prompt matches
    assert swapped.reused_tokens == len(engine.layout.prefix_ids)
