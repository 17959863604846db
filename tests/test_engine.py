"""The engine's face: block ids, input checks, storage dtype, on a tiny random model."""

import pytest
import torch

from kvrag import ContextOverflowError, EmptyInputError, InputEncodingError, UnknownBlockError

TEXTS = ["Ilsa Brandt built the lighthouse of Varnholm in 1873.", "The river Olm freezes every winter."]
QUESTION = "Who built the lighthouse?"


def stored_files(engine):
    return sorted(p.name for p in engine.home.rglob("*.safetensors"))


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


def test_storage_dtype_is_configurable(make_engine):
    engine = make_engine(storage_dtype=torch.bfloat16)
    engine.index(TEXTS)
    key = engine.build_prompt(QUESTION, TEXTS)[1][0]
    assert engine.store.get(key, "none")[0].keys.dtype == torch.bfloat16
    assert make_engine(storage_dtype=torch.float16).storage_dtype == torch.float16


def test_a_prefix_reaches_the_disk_from_its_second_sight(make_engine):
    """A rendered prompt with the question before its passages has a prefix of its own per question:
    kept in memory at once, written to disk only once it recurs, so one-off prefixes never fill it."""
    engine = make_engine()
    engine.index(TEXTS)
    before = stored_files(engine)

    def ask(question):
        text = f"Question: {question}\nContext: {TEXTS[0]}\n\n{TEXTS[1]}\nAnswer:"
        return engine.generate_text(text, max_new_tokens=2).cache_hits

    assert ask("Who built it?") == {"computed": 1, "memory": 3}  # the prefix; the passages and separator reused
    assert ask("When did it freeze?") == {"computed": 1, "memory": 3}
    assert stored_files(engine) == before  # neither one-off prefix was written
    assert ask("Who built it?") == {"memory": 4}  # seen again: from memory, and now on disk too
    assert len(stored_files(engine)) == len(before) + 1
    assert make_engine().generate_text(f"Question: Who built it?\nContext: {TEXTS[0]}\n\n{TEXTS[1]}\nAnswer:",
                                       max_new_tokens=2).cache_hits == {"disk": 4}  # another process
