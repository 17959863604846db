"""What each mode reuses and computes, and which tier each block came from, on a tiny random model
(their exactness: test_invariants.py)."""

import pytest

TEXTS = ["Ilsa Brandt built the lighthouse of Varnholm in 1873.", "The river Olm freezes every winter."]
QUESTION = "Who built the lighthouse?"


def top_tier(engine) -> str:
    """Where a block used before in this process is found: on the device, where the store has a device tier."""
    return "device" if engine.store.device_tier is not None else "memory"


@pytest.mark.parametrize("mode", ["block", "composite", "prefix"])
def test_reuse_bookkeeping(make_engine, mode, device):
    engine = make_engine(device=device)
    first = engine.generate(QUESTION, TEXTS, mode=mode, max_new_tokens=2)
    second = engine.generate(QUESTION, TEXTS, mode=mode, max_new_tokens=2)
    q = len(engine.layout.question_ids(QUESTION))
    assert second.prefilled_tokens == q and second.reused_tokens == second.prompt_tokens - q
    assert second.cache_hits == {top_tier(engine): 4}  # system prompt, two passages, the separator between them
    assert first.cache_hits.get("computed", 0) >= 2  # the passages were not indexed beforehand
    assert second.token_ids == first.token_ids


def test_prefix_mode_reuses_only_exact_prefixes(make_engine):
    engine = make_engine()
    engine.generate(QUESTION, TEXTS, mode="prefix", max_new_tokens=1)
    swapped = engine.generate(QUESTION, TEXTS[::-1], mode="prefix", max_new_tokens=1)
    assert swapped.cache_hits == {"memory": 1, "computed": 3}  # only the system prompt matches
    assert swapped.reused_tokens == len(engine.layout.prefix_ids)


def test_cache_hits_name_the_tier(make_engine, device):
    """Blocks are computed on first sight, then found in memory (or on the device), and by a new
    engine over the same directory on disk."""
    engine = make_engine(device=device)
    assert engine.generate(QUESTION, TEXTS, max_new_tokens=1).cache_hits == {"computed": 4}
    assert engine.generate(QUESTION, TEXTS, max_new_tokens=1).cache_hits == {top_tier(engine): 4}
    fresh = make_engine(device=device)  # the same weights and directory: the blocks the first one wrote
    assert fresh.fingerprint == engine.fingerprint and len(fresh.store.memory) == 0
    assert fresh.generate(QUESTION, TEXTS, max_new_tokens=1).cache_hits == {"disk": 4}
    assert fresh.generate(QUESTION, TEXTS, max_new_tokens=1).cache_hits == {top_tier(fresh): 4}
