"""The token loop: streaming, generation options, stop strings and the context window's end, on a tiny random model."""

import math

from kvrag.decode import TOP_LOGPROBS, TextTracker

TEXTS = ["Ilsa Brandt built the lighthouse of Varnholm in 1873.", "The river Olm freezes every winter."]
QUESTION = "Who built the lighthouse?"


def test_stream_deltas_join_to_the_result(make_engine):
    engine = make_engine()
    stream = engine.stream(QUESTION, TEXTS, max_new_tokens=20)
    deltas = list(stream)
    assert "".join(deltas) == stream.result.text
    assert stream.result.token_ids == engine.generate(QUESTION, TEXTS, max_new_tokens=20).token_ids


def test_max_new_tokens_and_timings(make_engine):
    engine = make_engine()
    engine.eos_ids = set()  # a random model may emit EOS at any point; here we want exactly 7 tokens
    result = engine.generate(QUESTION, TEXTS, max_new_tokens=7)
    assert result.generated_tokens == 7 and result.finish_reason == "length"
    assert 0 < result.ttft <= result.total_time
    assert result.prompt_tokens == result.prefilled_tokens + result.reused_tokens


def test_sampling_is_seeded(make_engine):
    engine = make_engine()
    engine.eos_ids = set()
    a = engine.generate(QUESTION, TEXTS, max_new_tokens=12, temperature=1.5, seed=3)
    b = engine.generate(QUESTION, TEXTS, max_new_tokens=12, temperature=1.5, seed=3)
    greedy = engine.generate(QUESTION, TEXTS, max_new_tokens=12)
    others = {tuple(engine.generate(QUESTION, TEXTS, max_new_tokens=12, temperature=1.5, seed=s).token_ids) for s in range(4, 8)}
    assert a.token_ids == b.token_ids
    assert len(others | {tuple(greedy.token_ids)}) > 1
    top1 = engine.generate(QUESTION, TEXTS, max_new_tokens=12, temperature=1.5, top_k=1, seed=9)
    assert top1.token_ids == greedy.token_ids  # top-k 1 is greedy whatever the temperature


def test_the_first_tokens_distribution_is_kept_before_temperature(make_engine):
    """Its top log-probabilities, for comparing modes (kvrag.eval.accuracy): the greedy token first, the same
    whatever the temperature, whether the first token comes from the prefill (full) or the scheduler's step (block)."""
    engine = make_engine()
    engine.eos_ids = set()
    for mode in ("full", "block"):
        greedy = engine.generate(QUESTION, TEXTS, mode=mode, max_new_tokens=3)
        ids, logprobs = list(greedy.first_logprobs), list(greedy.first_logprobs.values())
        assert len(ids) == TOP_LOGPROBS and ids[0] == greedy.token_ids[0] and logprobs == sorted(logprobs, reverse=True)
        assert math.log(1 / len(engine.tokenizer)) - 1e-6 <= logprobs[0] <= 0  # the likeliest: at least uniform's
        hot = engine.generate(QUESTION, TEXTS, mode=mode, max_new_tokens=3, temperature=1.5, seed=3)
        assert hot.first_logprobs == greedy.first_logprobs


def test_stop_strings_are_never_streamed(tok):
    tracker = TextTracker(tok, stop=["lighthouse"])
    shown = ""
    for token in tok("The old lighthouse stands.", add_special_tokens=False)["input_ids"]:
        shown += tracker.push(token)
        if tracker.stopped:
            break
    shown += tracker.flush()
    assert shown == tracker.text == "The old "


def test_stop_string_ends_generation(make_engine, tok):
    engine = make_engine()
    engine.eos_ids = set()
    free = engine.generate(QUESTION, TEXTS, max_new_tokens=30).text
    stop = free[len(free) // 2 : len(free) // 2 + 2]
    assume_text = free[: free.find(stop)]
    result = engine.generate(QUESTION, TEXTS, max_new_tokens=30, stop=[stop])
    assert result.text == assume_text and result.finish_reason == "stop"


def test_generation_stops_at_the_context_window(make_engine):
    engine = make_engine()
    engine.eos_ids = set()
    passages = ["Passage: " + "the river Olm freezes " * 20] * 8  # one cached block, eight times
    room = engine.context_window - len(engine.build_prompt(QUESTION, passages)[0])
    assert 0 < room < 100
    result = engine.generate(QUESTION, passages, max_new_tokens=500)
    assert result.generated_tokens == room and result.finish_reason == "length"


def test_a_results_stats_are_its_figures():
    from kvrag.decode import GenerationResult

    result = GenerationResult(text="x", token_ids=[1, 2], mode="block", ttft=0.25, total_time=1.5, prompt_tokens=40,
                              prefilled_tokens=8, reused_tokens=32, cache_hits={"memory": 2, "disk": 1})
    assert result.stats() == {"mode": "block", "ttft": 0.25, "total_time": 1.5, "prefilled_tokens": 8,
                                               "reused_tokens": 32, "cache_hits": {"memory": 2, "disk": 1}}
    assert result.stats()["cache_hits"] is not result.cache_hits
