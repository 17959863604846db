"""The prompt layouts of real apps (kvrag.eval.layouts): each renders its passages where the drop-in
path finds them, and `evaluate` answers in every layout, paired per layout, resuming by layout."""

import json
from dataclasses import replace

import pytest

from kvrag import KVRagError
from kvrag.eval.accuracy import RUNNERS, against_full, check_methods, evaluate, format_against_full, format_table, summarize
from kvrag.eval.layouts import LAYOUTS, NAMES, OWN


@pytest.fixture(scope="module")
def short(examples):
    """Questions whose passages leave room in the tiny models' window for the longest layout's words."""
    return [replace(e, passages=tuple(p[:70] for p in e.passages[:4])) for e in examples]


@pytest.mark.parametrize("name", list(LAYOUTS))
def test_a_layout_renders_its_passages_where_the_drop_in_path_finds_them(engine, short, name):
    example, layout = short[0], LAYOUTS[name]
    engine.index(example.passages, progress=False)
    text, spans = layout.render(engine, example.question, example.passages)
    assert [text[a:b] for a, b in spans] == list(example.passages)
    assert engine.passages.find(text) == spans  # found by content, as the integrations send it
    prompt, _ = engine.prompt_from_text(text)
    passage_blocks = [engine.layout.passage_ids(p) for p in example.passages]
    assert [b for b in prompt.blocks if b in passage_blocks] == passage_blocks
    asked_at = text.index(example.question)
    assert (asked_at < spans[0][0]) == layout.question_first
    assert (asked_at < spans[0][0]) == (example.question in engine.tokenizer.decode(prompt.prefix))


def test_every_layout_answers_every_question_paired_with_full_in_the_same_layout(engine, short, tmp_path):
    examples = short
    path = tmp_path / "r.jsonl"
    records = evaluate(engine, examples[:2], ["full", "block"], layouts=NAMES, max_new_tokens=2, results=path, progress=False)
    assert [(r.layout, r.method, r.id) for r in records] == [
        (layout, m, e.id) for layout in NAMES for m in ("full", "block") for e in examples[:2]]
    by = {(r.layout, r.method, r.id): r for r in records}
    for layout in NAMES:
        assert by[layout, "block", examples[0].id].prompt_tokens == by[layout, "full", examples[0].id].prompt_tokens
        assert by[layout, "block", examples[0].id].flops < by[layout, "full", examples[0].id].flops
    assert len({by[layout, "full", examples[0].id].prompt_tokens for layout in NAMES}) > 1  # the layouts differ
    gaps = against_full(records)
    assert [(layout, method, n) for layout, method, n, _, _ in gaps] == [(layout, "block", 2) for layout in NAMES]
    lines = format_against_full(records).splitlines()
    assert lines[0].startswith("block - full: ") and lines[1].startswith(f"[{NAMES[1]}] block - full: ")
    rows = summarize(records)
    assert [(row["layout"], row["method"]) for row in rows] == [(layout, m) for layout in NAMES for m in ("full", "block")]
    assert all(row["speedup"] is not None for row in rows)  # against full in its own layout
    table = format_table(rows).splitlines()
    assert table[0].startswith("| prompt | method | n |") and table[2].startswith(f"| {OWN} | full | 2 |")


def test_a_rerun_resumes_by_layout_and_reads_files_written_before_layouts_select_and_auto(engine, short, tmp_path, monkeypatch):
    examples = short
    path = tmp_path / "r.jsonl"
    evaluate(engine, examples[:1], ["block"], max_new_tokens=2, results=path, progress=False)
    header, line = path.read_text().splitlines()
    old, settings = json.loads(line), json.loads(header)
    del old["layout"]  # as written before there were layouts
    for name in ("select", "coverage", "least", "most"):  # and before blend could choose (by deviation then) or auto
        del settings["settings"]["blend"][name]
    path.write_text(json.dumps(settings) + "\n" + json.dumps(old) + "\n")
    ran = []
    real = RUNNERS["block"]
    monkeypatch.setitem(RUNNERS, "block", lambda eng, ex, n, *layout: ran.append(layout) or real(eng, ex, n, *layout))
    records = evaluate(engine, examples[:1], ["block"], layouts=[OWN, "numbered"], max_new_tokens=2, results=path,
                       progress=False)
    assert ran == [("numbered",)]  # kvrag's own answer was read back
    assert [r.layout for r in records] == [OWN, "numbered"]
    settings["settings"]["blend"]["select"] = "attention"  # another blend than the engine's
    path.write_text(json.dumps(settings) + "\n" + json.dumps(old) + "\n")
    with pytest.raises(KVRagError, match="differs in: blend"):
        evaluate(engine, examples[:1], ["block"], max_new_tokens=2, results=path, progress=False)


def test_chains_answer_only_in_kvrags_layout_and_unknown_layouts_are_named():
    check_methods(["full", "map_reduce"], [OWN])
    with pytest.raises(ValueError, match="map_rerank write their own prompts"):
        check_methods(["block", "map_rerank"], [OWN, "numbered"])
    with pytest.raises(ValueError, match=r"unknown prompt layout\(s\) \['chatml'\]"):
        check_methods(["block"], ["chatml"])


@pytest.mark.e2e
def test_the_text_around_passages_is_tokenized_as_the_whole_prompt_is(default_engine):
    """What transformers or vLLM compute for a prompt's text is what kvrag prefills: a blank line before a
    passage is two newline tokens, as in the whole text, not the one token it is alone. Where a passage
    follows a space (it tokenizes otherwise in place), it keeps its indexed ids and the text stays whole."""
    from kvrag.eval import data

    engine, example = default_engine, data.generate("dev", 1, seed=3)[0]
    tokenize = lambda text: engine.tokenizer(text, add_special_tokens=False)["input_ids"]
    assert len(tokenize("\n\n")) == 1 and len(tokenize("\n\nA")) == 3  # the default tokenizer has the case
    after_newlines = 0
    for layout in LAYOUTS.values():
        text, spans = layout.render(engine, example.question, example.passages)
        prompt, _ = engine.prompt_from_text(text, spans)
        if all(text[start - 1] == "\n" for start, _ in spans):
            assert prompt.ids() == tokenize(text), layout.name
            after_newlines += 1
        else:
            assert engine.tokenizer.decode(prompt.ids()) == text
            assert [engine.layout.passage_ids(p) for p in example.passages] == prompt.blocks[::2]
    assert after_newlines >= 4
    prompt, _ = engine.build_prompt(example.question, example.passages)  # kvrag's own layout
    assert prompt.ids() == tokenize(engine.tokenizer.decode(prompt.ids()))
