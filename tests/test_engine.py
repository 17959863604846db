"""Generation options, streaming, modes' bookkeeping and bad input, on a tiny random model."""

import pytest
import torch

from kvrag import ContextOverflowError, EmptyInputError, InputEncodingError, UnknownBlockError
from kvrag.decode import TextTracker

TEXTS = ["Ilsa Brandt built the lighthouse of Varnholm in 1873.", "The river Olm freezes every winter."]
QUESTION = "Who built the lighthouse?"


def stored_files(engine):
    return sorted(p.name for p in engine.home.rglob("*.safetensors"))


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


def test_blocks_by_id_and_text_agree(make_engine, tmp_path):
    engine = make_engine()
    ids = engine.index(TEXTS)
    assert all(i.startswith("kv_") and len(i) == 35 for i in ids)
    by_text = engine.generate(QUESTION, TEXTS, max_new_tokens=8)
    by_id = engine.generate(QUESTION, ids, max_new_tokens=8)
    assert by_id.token_ids == by_text.token_ids
    fresh = make_engine()  # another process: ids resolve through the disk store
    assert fresh.generate(QUESTION, ids, max_new_tokens=8).token_ids == by_text.token_ids
    with pytest.raises(UnknownBlockError):
        fresh.generate(QUESTION, ["kv_" + "0" * 32])


def test_bad_input_is_refused_and_nothing_is_written(make_engine):
    engine = make_engine()
    with pytest.raises(EmptyInputError):
        engine.index([])
    with pytest.raises(EmptyInputError, match="passage 1"):
        engine.index(["fine", " \n\t "])
    with pytest.raises(EmptyInputError, match="node b7 is empty"):
        engine.index(["fine", ""], names=["node a1", "node b7"])
    with pytest.raises(InputEncodingError):
        engine.index(["fine", b"\xff\xfe broken"])
    with pytest.raises(InputEncodingError):
        engine.index(["lone surrogate \udcff"])
    with pytest.raises(EmptyInputError):
        engine.generate("   ", TEXTS)
    with pytest.raises(EmptyInputError):
        engine.generate(QUESTION, ["ok", ""])
    huge = "lighthouse " * 2000  # longer than the tiny model's 1024-token context
    with pytest.raises(ContextOverflowError, match="context window is 1024"):
        engine.index(["fine", huge])
    many = [f"Passage {i}: " + "the river Olm freezes " * 20 for i in range(12)]
    with pytest.raises(ContextOverflowError):
        engine.generate(QUESTION, many)
    assert stored_files(engine) == []
    assert len(engine.store.memory) == 0
    with pytest.raises(ValueError, match="mode"):
        engine.generate(QUESTION, TEXTS, mode="turbo")


def test_generation_stops_at_the_context_window(make_engine):
    engine = make_engine()
    engine.eos_ids = set()
    passages = ["Passage: " + "the river Olm freezes " * 20] * 8  # one cached block, eight times
    room = engine.context_window - len(engine.build_prompt(QUESTION, passages)[0])
    assert 0 < room < 100
    result = engine.generate(QUESTION, passages, max_new_tokens=500)
    assert result.generated_tokens == room and result.finish_reason == "length"


def test_storage_dtype_is_configurable(make_engine):
    engine = make_engine(storage_dtype=torch.bfloat16)
    engine.index(TEXTS)
    key = engine.build_prompt(QUESTION, TEXTS)[1][0]
    assert engine.store.get(key, "none")[0].keys.dtype == torch.bfloat16
    assert make_engine(storage_dtype=torch.float16).storage_dtype == torch.float16
