"""The accuracy benchmark: records, resuming, summary table, plot, FLOPs, and a smoke run of
`kvrag bench accuracy` on the real default model. (MapReduce / MapRerank: test_chains.py; the
command's argument checks: test_cli.py.)"""

import json
import math
import statistics
from dataclasses import asdict, replace

import pytest

from kvrag import KVRagError
from kvrag.app.cli import main
from kvrag.decode import TOP_LOGPROBS
from kvrag.eval.accuracy import (METHODS, MODE_METHODS, RUNNERS, Record, adapter_effect, against_full, check_methods,
                                 curve_plot, curve_table, evaluate, first_token_kl, flops_generation, format_against_full,
                                 format_table, paired_interval, paired_rows, paired_table, plot, points,
                                 pooled_against_full, read_results, summarize, weights_table)
from kvrag.eval.ttft import flops_to_first_token, layer_flops

PNG = b"\x89PNG\r\n\x1a\n"


def test_every_method_answers_every_question(engine, examples, tmp_path):
    records = evaluate(engine, examples, METHODS, max_new_tokens=3, results=tmp_path / "r.jsonl", progress=False)
    assert [(r.method, r.id) for r in records] == [(m, e.id) for m in METHODS for e in examples]
    for r in records:
        assert r.ttft > 0 and r.total_time >= r.ttft and r.flops > 0 and 0 <= r.f1 <= 1
    by = {(r.method, r.id): r for r in records}
    for e in examples:
        # what each method reads: the whole prompt once, or every passage in a call of its own
        assert by["block", e.id].prompt_tokens == by["full", e.id].prompt_tokens
        assert by["map_rerank", e.id].prompt_tokens > by["full", e.id].prompt_tokens
        assert by["block", e.id].flops < by["blend", e.id].flops < by["full", e.id].flops < by["map_rerank", e.id].flops
    for r in records:  # what agreement with full reads: the first token and its distribution (the modes' only)
        if r.method in MODE_METHODS:
            ids, logprobs = r.first_logprobs
            assert len(ids) == len(logprobs) == TOP_LOGPROBS and logprobs == sorted(logprobs, reverse=True)
            assert r.first_token in (None, ids[0])  # greedy: the likeliest, unless it ended the answer at once
        else:
            assert r.first_token is None and r.first_logprobs is None
    assert any(r.first_token is not None for r in records)
    _, kept = read_results(tmp_path / "r.jsonl")  # the file gives them back as they were
    assert sorted(kept, key=lambda r: (r.method, r.id)) == sorted(records, key=lambda r: (r.method, r.id))


def test_blend_at_a_share_runs_from_block_to_full(engine, examples, tmp_path):
    """The curve's methods: blend@0 recomputes nothing (block's answers), blend@1 every passage token (full's),
    shares between recompute more as they grow, and so for lookahead@R; curve_table reads the shares back."""
    methods = ["full", "block", "blend@0", "blend@0.3", "blend@1", "lookahead@0", "lookahead@0.3", "lookahead@1"]
    records = evaluate(engine, examples, methods, max_new_tokens=4, results=tmp_path / "c.jsonl", progress=False)
    by = {(r.method, r.id): r for r in records}
    for e in examples:
        assert by["blend@0", e.id].output == by["block", e.id].output
        assert by["blend@1", e.id].output == by["full", e.id].output
        assert by["block", e.id].flops <= by["blend@0", e.id].flops < by["blend@0.3", e.id].flops < by["blend@1", e.id].flops
        assert by["lookahead@0", e.id].output == by["block", e.id].output
        assert by["lookahead@1", e.id].output == by["full", e.id].output
        assert by["block", e.id].flops < by["lookahead@0.3", e.id].flops < by["lookahead@1", e.id].flops
    rows = [line.split(" | ")[2:4] for line in curve_table([tmp_path / "c.jsonl"]).splitlines()[2:]]
    assert rows == [["full", "1"], ["block", "0"], ["blend@0", "0"], ["blend@0.3", "0.3"], ["blend@1", "1"],
                    ["lookahead@0", "0"], ["lookahead@0.3", "0.3"], ["lookahead@1", "1"]]
    assert curve_plot([tmp_path / "c.jsonl"], tmp_path / "c.png").read_bytes()[:8] == PNG
    rows = {row["method"]: row for row in summarize(records)}  # blend@1 is full up to rounding: it agrees with it
    assert (rows["blend@1"]["agree"], rows["blend@1"]["first"]) == (1.0, 1.0)
    assert rows["blend@1"]["kl"] == pytest.approx(0, abs=1e-4)
    assert (rows["full"]["agree"], rows["full"]["first"], rows["full"]["kl"]) == (None, None, None)  # not against itself
    last = curve_table([tmp_path / "c.jsonl"]).splitlines()[-1].split(" | ")
    assert last[6:9] == ["100.0 ± 0.0", "100.0 ± 0.0", "0.000"]  # lookahead@1 = full: answers, first tokens, KL
    for bad in ("blend@1.5", "blend@", "blend@-0.1", "blend@x"):
        with pytest.raises(ValueError, match="blend@R"):
            check_methods([bad])


def test_passages_are_indexed_ahead_only_for_methods_that_reuse_their_kv(engine, examples, monkeypatch):
    indexed = []
    real = engine.index
    monkeypatch.setattr(engine, "index", lambda texts, **kw: indexed.append(sorted(texts)) or real(texts, **kw))
    evaluate(engine, examples[:2], ["full", "map_reduce"], max_new_tokens=2, progress=False)
    assert indexed == []  # causal prompts read no stored passage
    evaluate(engine, examples[:2], ["full", "blend"], max_new_tokens=2, progress=False)
    assert indexed == [sorted({p for e in examples[:2] for p in e.passages})]


def test_a_rerun_resumes_and_computes_only_what_is_missing(engine, examples, tmp_path, monkeypatch):
    path = tmp_path / "r.jsonl"
    first = evaluate(engine, examples[:2], ["full", "block"], max_new_tokens=2, results=path, progress=False)
    lines = path.read_text().splitlines()
    assert len(lines) == 1 + 4 and "settings" in json.loads(lines[0])
    last = json.loads(lines[-1])
    path.write_text("\n".join(lines[:-1]) + "\n" + lines[-1][:20])  # interrupted while writing the last one
    ran = []
    for name in ("full", "block"):
        real = RUNNERS[name]
        monkeypatch.setitem(RUNNERS, name, lambda eng, ex, n, name=name, real=real: ran.append((name, ex.id)) or real(eng, ex, n))
    again = evaluate(engine, examples[:3], ["full", "block"], max_new_tokens=2, results=path, progress=False)
    assert sorted(ran) == sorted([(last["method"], last["id"]), ("full", examples[2].id), ("block", examples[2].id)])
    kept = lambda records: [r for r in records if r.id != examples[2].id and (r.method, r.id) != (last["method"], last["id"])]  # noqa: E731
    assert kept(again) == kept(first) and len(kept(first)) == 3
    assert len(path.read_text().splitlines()) == 1 + 6


def test_questions_in_flight_together_get_the_answers_each_gets_alone(engine, examples, tmp_path, monkeypatch):
    from kvrag import scheduler
    from kvrag.attention import forward_packed

    sizes = []
    monkeypatch.setattr(scheduler, "forward_packed", lambda model, runs: sizes.append(len(runs)) or forward_packed(model, runs))
    methods, layouts = ["full", "block", "blend"], ["kvrag", "numbered"]
    alone = evaluate(engine, examples, methods, layouts=layouts, max_new_tokens=4, progress=False)
    assert max(sizes) == 1
    path = tmp_path / "r.jsonl"
    together = evaluate(engine, examples[:3], methods, layouts=layouts, max_new_tokens=4, results=path, progress=False,
                        concurrency=5)
    assert max(sizes) >= 4  # decoded together, not in turn
    assert {r.concurrency for r in together} == {5} and {r.concurrency for r in alone} == {1}
    # a rerun, one at a time, answers only the question that is missing; the records come back in the same order
    again = evaluate(engine, examples, methods, layouts=layouts, max_new_tokens=4, results=path, progress=False)
    assert [(r.layout, r.method, r.id, r.output) for r in again] == [(r.layout, r.method, r.id, r.output) for r in alone]
    assert [r.concurrency for r in again] == [1 if r.id == examples[3].id else 5 for r in again]
    assert len(path.read_text().splitlines()) == 1 + len(alone)
    chains = evaluate(engine, examples[:2], ["block", "map_rerank"], max_new_tokens=2, progress=False, concurrency=3)
    assert [(r.method, r.id) for r in chains] == [(m, e.id) for m in ("block", "map_rerank") for e in examples[:2]]
    with pytest.raises(ValueError, match="concurrency must be >= 1"):
        evaluate(engine, examples, methods, progress=False, concurrency=0)


def test_with_document_context_the_harness_indexes_each_passage_after_the_text_before_it(make_engine, examples, tmp_path):
    """An engine of block context "document" is handed the examples' `preceding` texts when their passages are
    indexed; its results file records the context, so another context's answers never resume it."""
    chained = [replace(e, preceding=("",) + e.passages[:-1]) for e in examples[:2]]
    engine = make_engine("llama", block_context="document", home=tmp_path / "document")
    path = tmp_path / "r.jsonl"
    evaluate(engine, chained, ["block"], max_new_tokens=2, results=path, progress=False)
    last = chained[-1]  # a passage two examples share is indexed after the later one's text
    ids = engine.layout.passage_ids(last.passages[1])
    key = engine.blocks.keys(engine.layout.prefix_ids, [ids])[0]
    assert engine.store.get(key, "document")[0].start == len(engine.layout.passage_ids(last.passages[0]))
    with pytest.raises(KVRagError, match="differs in: block_context"):
        evaluate(make_engine("llama", home=tmp_path / "none"), chained, ["block"], max_new_tokens=2, results=path,
                 progress=False)


def test_results_of_another_set_up_are_refused(engine, examples, tmp_path):
    path = tmp_path / "r.jsonl"
    evaluate(engine, examples[:1], ["block"], max_new_tokens=2, results=path, progress=False, dataset={"seed": 0})
    with pytest.raises(KVRagError, match="differs in: dataset"):
        evaluate(engine, examples[:1], ["block"], max_new_tokens=2, results=path, progress=False, dataset={"seed": 1})
    with pytest.raises(KVRagError, match="differs in: max_new_tokens"):
        evaluate(engine, examples[:1], ["block"], max_new_tokens=3, results=path, progress=False, dataset={"seed": 0})
    other = [replace(examples[0], question="Who else?")]
    with pytest.raises(KVRagError, match="other questions under the same ids"):
        evaluate(engine, other, ["block"], max_new_tokens=2, results=path, progress=False, dataset={"seed": 0})
    (tmp_path / "bad.jsonl").write_text("not json\n")
    with pytest.raises(KVRagError, match="not a kvrag results file"):
        evaluate(engine, examples[:1], ["block"], results=tmp_path / "bad.jsonl", progress=False)
    with pytest.raises(ValueError, match="unknown method"):
        evaluate(engine, examples[:1], ["stuffing"], progress=False)


def _record(method, kind, correct, ttft, f1=0.5):
    return Record(method, f"{kind}-{ttft}", kind, "q", "out", correct, f1, ttft, 2 * ttft, 1e9, 100)


def test_summary_counts_by_type_and_against_full():
    records = [
        _record("full", "single", True, 1.0), _record("full", "bridge", False, 3.0),
        _record("full", "single", True, 2.0), _record("full", "comparison", True, 2.0),
        _record("block", "single", False, 0.1, f1=0.0), _record("block", "bridge", True, 0.1, f1=1.0),
    ]
    full, block = summarize(records)
    assert full["method"] == "full" and full["questions"] == 4
    assert (full["single"], full["bridge"], full["comparison"], full["unanswerable"]) == (1.0, 0.0, 1.0, None)
    assert full["accuracy"] == 0.75 and full["ttft"] == 2.0 and full["total_time"] == 4.0
    assert block["accuracy"] == 0.5 and block["f1"] == 0.5 and block["speedup"] == pytest.approx(20.0)
    table = format_table([full, block]).splitlines()
    assert table[0].startswith("| method | n | single | bridge | comparison | unanswerable | average | F1 | = full | "
                               "1st tok = full | KL | TTFT ms")
    assert table[2] == "| full | 4 | 100.0 | 0.0 | 100.0 | - | 75.0 | 50.0 | - | - | - | 2000 | 4.00 | 1.0x | 1.0 |"
    # the block answers are to other questions than full's: no agreement to measure
    assert table[3].startswith("| block | 2 | 0.0 | 100.0 | - | - | 50.0 | 50.0 | - | - | - | 100 | 0.20 | 20.0x |")


def test_gap_to_full_is_paired_per_question_with_an_interval():
    answers = {"full": [True, True, False, False], "block": [False, False, False, False], "blend": [True, True, False, True]}
    records = [_record(m, "single", c, ttft=i) for m, cs in answers.items() for i, c in enumerate(cs)]  # id: question i
    records.append(_record("block", "single", True, ttft=9))  # no full answer: left out
    (layout, block, n, diff, half), (_, blend, _, blend_diff, _) = against_full(records)
    assert (layout, block, n, diff, blend, blend_diff) == ("kvrag", "block", 4, -0.5, "blend", 0.25)
    assert half == pytest.approx(1.96 * (1 / 3) ** 0.5 / 2)  # differences -1, -1, 0, 0: sample sd sqrt(1/3)
    assert format_against_full(records).splitlines()[0] == (
        "block - full: -50.0 ± 56.6 points (95% interval, 4 paired questions); the same answer as full: 100.0 ± 0.0%")
    assert format_against_full([r for r in records if r.method != "full"]) == ""


def test_a_clustered_interval_takes_one_difference_per_question():
    # two layouts ask the same two questions: each question's mean difference over them counts once
    per_layout = {"q1": [-1, 0], "q2": [0, 0], "q3": [-1, -1], "q4": [1, 0]}
    diff, half = paired_interval([sum(d) / len(d) for d in per_layout.values()])
    assert diff == pytest.approx(-0.25) and half == pytest.approx(1.96 * (1.25 / 3) ** 0.5 / 2)
    assert points(diff, half) == "−25.0 ± 63.3"  # the docs' minus sign
    assert paired_interval([1.0])[1] == float("inf")  # one question: no interval


def test_several_layouts_pool_against_full_counting_each_question_once():
    # the same two questions in two layouts: block loses q0 in both, q1 in one
    answers = {("kvrag", "q0"): (True, False), ("kvrag", "q1"): (True, False),
               ("numbered", "q0"): (True, False), ("numbered", "q1"): (False, False)}
    records = [replace(_record(m, "single", c, 1.0), layout=layout, id=i)
               for (layout, i), cs in answers.items() for m, c in zip(("full", "block"), cs)]
    ((method, layouts, n, diff, half),) = pooled_against_full(records)
    assert (method, layouts, n, diff) == ("block", 2, 2, -0.75)  # q0 -1, q1 -0.5
    assert half == pytest.approx(1.96 * statistics.stdev([-1, -0.5]) / 2 ** 0.5)
    assert format_against_full(records).splitlines()[-1] == (
        f"[pooled, 2 layouts] block - full: -75.0 ± {100 * half:.1f} points (95% interval, 2 paired questions, each counted "
        "once); the same answer as full: 100.0 ± 0.0%")
    assert pooled_against_full([r for r in records if r.layout == "kvrag"]) == []  # one layout: nothing to pool


def test_agreement_with_full_is_the_same_normalised_answer_each_question_counted_once_over_layouts():
    outputs = {("kvrag", "q0"): ("Paris.", "  paris "), ("kvrag", "q1"): ("Paris", "Lyon"),  # (full's, block's)
               ("numbered", "q0"): ("The Eiffel  Tower!", "eiffel tower"), ("numbered", "q1"): ("Paris", "PARIS"),
               ("numbered", "q2"): ("Paris", "Paris")}  # asked in one layout only: not pooled
    records = [replace(_record(m, "single", True, 1.0), layout=layout, id=i, output=out)
               for (layout, i), outs in outputs.items() for m, out in zip(("full", "block"), outs)]
    rows = summarize(records)
    assert [(row["layout"], row["method"], row["agree"]) for row in rows] == [
        ("kvrag", "full", None), ("kvrag", "block", 0.5), ("numbered", "full", None), ("numbered", "block", 1.0)]
    diff, half = paired_interval([1.0, 0.5])  # q0 agrees in both layouts, q1 in one
    lines = format_against_full(records).splitlines()
    assert lines[0].endswith("; the same answer as full: 50.0 ± 98.0%")
    assert lines[-1].endswith(f"(95% interval, 2 paired questions, each counted once); the same answer as full: "
                              f"75.0 ± {100 * half:.1f}%")
    assert format_table(rows).splitlines()[3].startswith("| kvrag | block | 2 | 100.0 | - | - | - | 100.0 | 50.0 | 50.0 | - | - |")


def test_the_first_token_share_counts_only_records_that_kept_it():
    records = [replace(_record(m, "single", True, 1.0), id=i, first_token=token) for m, i, token in [
        ("full", "q0", 5), ("block", "q0", 5), ("full", "q1", 5), ("block", "q1", 6),
        ("full", "q2", 5), ("block", "q2", None),  # written before the field: left out
        ("full", "q3", None), ("block", "q3", None)]]
    full, block = summarize(records)
    assert (full["first"], block["first"], block["kl"]) == (None, 0.5, None)
    old = [replace(r, first_token=None) for r in records]
    assert summarize(old)[1]["first"] is None and format_table(summarize(old)).splitlines()[3].split(" | ")[9:11] == ["-", "-"]


def test_the_first_tokens_kl_is_zero_for_the_same_distribution_and_grows_apart():
    log = math.log
    full = [[1, 2, 3], [log(0.7), log(0.2), log(0.1)]]
    assert first_token_kl(full, full) == 0
    assert first_token_kl(full, [[1, 2, 3], [log(0.4), log(0.4), log(0.2)]]) > 0
    # a token missing from the other's top is taken at its least kept log-probability: 2 at 0.3 here
    other = [[1, 3], [log(0.5), log(0.3)]]
    expected = 0.7 * log(0.7 / 0.5) + 0.2 * log(0.2 / 0.3) + 0.1 * log(0.1 / 0.3)
    assert first_token_kl(full, other) == pytest.approx(expected)
    records = [replace(_record(m, "single", True, 1.0), first_logprobs=top) for m, top in (("full", full), ("blend", other))]
    assert summarize(records)[1]["kl"] == pytest.approx(expected)
    assert format_table(summarize(records)).splitlines()[3].split(" | ")[10] == f"{expected:.3f}"


def test_plot_writes_a_png(tmp_path):
    records = [_record("full", "single", True, 1.0), _record("block", "single", False, 0.1)]
    path = plot(records, tmp_path / "sub" / "accuracy.png")
    assert path.read_bytes()[:8] == PNG


def test_flops_of_a_generation_add_one_decode_step_per_fed_back_token(engine):
    config = engine.model.config
    assert flops_generation(config, 50, 1) == flops_to_first_token(config, 50, 0)
    step = config.num_hidden_layers * layer_flops(config, 1, 51)  # the 1st generated token fed back: 50 keys + its own
    assert flops_generation(config, 50, 2) == pytest.approx(flops_to_first_token(config, 50, 0) + step)


@pytest.mark.e2e
def test_bench_accuracy_smoke_on_the_default_model(kvrag_home, tmp_path, capsys):
    results, png = tmp_path / "acc.jsonl", tmp_path / "acc.png"
    argv = ["bench", "accuracy", "--limit", "4", "--passages", "5", "--max-new-tokens", "6", "--weights", "adapter",
            "--results", str(results), "--plot", str(png)]
    assert main(argv) == 0
    out, same_weights = capsys.readouterr().out.split("The cost of block attention on the same weights")
    rows = [line for line in out.splitlines() if line.startswith("| ") and not line.startswith("| method")]
    assert [row.split(" | ")[0][2:] for row in rows] == list(METHODS)
    assert same_weights.count("| shipped adapter | generated worlds | 4 |") == 1
    for row in rows:
        cells = row.strip("| ").split(" | ")
        assert cells[1] == "4"
        for value in cells[2:10]:  # accuracy per type, average, F1, answers and first tokens the same as full's
            assert value == "-" or 0.0 <= float(value) <= 100.0
        assert (cells[8] == "-") == (row.startswith("| full |"))  # every other method answers the same questions
        assert float(cells[11]) > 0  # TTFT ms
    gaps = [line for line in out.splitlines() if " - full: " in line]
    assert [line.split(" - full: ")[0] for line in gaps] == [m for m in METHODS if m != "full"]
    assert all("(95% interval, 4 paired questions); the same answer as full: " in line for line in gaps)
    assert png.read_bytes()[:8] == PNG
    records = [json.loads(line) for line in results.read_text().splitlines()[1:]]
    assert len(records) == 4 * len(METHODS)
    assert all(r["ttft"] > 0 and 0 <= r["f1"] <= 1 for r in records)


@pytest.mark.e2e
def test_bench_accuracy_in_the_layouts_of_real_apps_on_the_default_model(kvrag_home, tmp_path, capsys):
    results = tmp_path / "layouts.jsonl"
    argv = ["bench", "accuracy", "--limit", "2", "--passages", "5", "--max-new-tokens", "6", "--prose", "1",
            "--prompts", "kvrag,langchain-rag-prompt,numbered", "--results", str(results), "--plot", "", "--weights", "adapter"]
    assert main(argv) == 0
    out, same_weights = capsys.readouterr().out.split("The cost of block attention on the same weights")
    rows = [line.strip("| ").split(" | ") for line in out.splitlines() if line.startswith("| ") and "| method |" not in line]
    assert "| shipped adapter | generated worlds, 3 layouts pooled | 2 |" in same_weights
    assert "| shipped adapter | generated worlds, `langchain-rag-prompt` | 2 |" in same_weights
    assert [row[:3] for row in rows] == [[layout, method, "2"] for layout in ("kvrag", "langchain-rag-prompt", "numbered")
                                         for method in ("full", "block", "blend")]
    assert "[langchain-rag-prompt] block - full: " in out and "100% in prose" in out
    assert "[pooled, 3 layouts] block - full: " in out and "2 paired questions, each counted once" in out
    records = [json.loads(line) for line in results.read_text().splitlines()[1:]]
    assert len(records) == 2 * 3 * 3 and {r["layout"] for r in records} == {"kvrag", "langchain-rag-prompt", "numbered"}


@pytest.mark.e2e
def test_bench_accuracy_on_squad_questions_on_the_default_model(kvrag_home, tmp_path, capsys):
    results = tmp_path / "squad.jsonl"
    argv = ["bench", "accuracy", "--squad", "--split", "dev", "--limit", "2", "--passages", "3", "--max-new-tokens", "6",
            "--prompts", "kvrag,numbered", "--methods", "full,block", "--results", str(results), "--plot", "",
            "--concurrency", "3", "--weights", "published"]
    assert main(argv) == 0
    out = capsys.readouterr().out
    assert "2 SQuAD v1.1 dev questions x 3 paragraphs (seed 0)" in out and "[pooled, 2 layouts] block - full: " in out
    assert "; 3 questions at a time, so the timings are not one user's" in out
    settings, *lines = results.read_text().splitlines()
    assert json.loads(settings)["settings"]["dataset"] == {"corpus": "squad", "split": "dev", "passages": 3, "seed": 0}
    records = [json.loads(line) for line in lines]
    assert len(records) == 2 * 2 * 2 and all(r["id"].startswith("squad-dev-") and r["type"] == "single" for r in records)
    assert {r["concurrency"] for r in records} == {3}
    assert main(argv) == 0 and results.read_text().splitlines()[1:] == lines  # a rerun resumes: nothing asked again


@pytest.mark.e2e
def test_bench_accuracy_compares_modes_on_the_same_weights_on_the_default_model(kvrag_home, tmp_path, capsys):
    """By default both weight sets answer, each in every mode: a row each, and the adapter's own effect apart;
    --blend-ratios adds blend at those shares and the weight sets' curve; auto shows the share it chose."""
    results = tmp_path / "heldout.jsonl"
    argv = ["bench", "accuracy", "--heldout", "--limit", "2", "--passages", "3", "--max-new-tokens", "6",
            "--methods", "full,block,blend,auto", "--blend-ratios", "0.5", "--results", str(results),
            "--plot", str(tmp_path / "curve.png")]
    assert main(argv) == 0
    out = capsys.readouterr().out
    assert "the published weights, in every mode, block modes in block context ape; 2 questions on examples/heldout" in out
    assert "the adapter, in every mode; 2 questions on examples/heldout" in out
    paths = [tmp_path / "heldout-published.jsonl", tmp_path / "heldout-adapter.jsonl"]
    settings = [read_results(p)[0] for p in paths]
    assert [s["weights"] for s in settings] == ["published", "adapter"] and all("causal_model" not in s for s in settings)
    assert [s.get("block_context") for s in settings] == ["ape", None]  # the published weights' block modes read as APE
    assert settings[0]["model"] != settings[1]["model"]
    assert weights_table(paths) in out and "| published weights | examples/heldout | 2 |" in out
    assert "the adapter's full mode − the published weights' full mode" in out and "across weights" in out
    assert curve_table(paths) in out and curve_table(paths).count("| examples/heldout | blend@0.5") == 2
    assert "| auto − full |" in weights_table(paths)
    for path in paths:  # auto's share is what its requests chose, within BlendConfig's bounds
        shares = [r.recomputed for r in read_results(path)[1] if r.method == "auto"]
        assert len(shares) == 2 and all(0 < share <= 0.5 + 1e-9 for share in shares)
        auto = "auto, ape context" if path == paths[0] else "auto"
        assert f"| {auto} | {sum(shares) / 2:.2f} (mean) |" in curve_table([path])
    for name in ("published", "adapter", "curve"):  # a plot per weight set, named as the results are, and the curve's
        assert (tmp_path / f"curve-{name}.png").read_bytes().startswith(PNG)


def write_results(path, weights, corpus, answers, causal=None, old=False):
    """A results file of one weight set: `answers` maps (layout, method, id) to right or wrong, the output
    "a" if right, else "b"; `old`: its records lack the fields added since (first_token, first_logprobs)."""
    settings = {"model": weights, "weights": weights, "dataset": {} if corpus == "generated" else {"corpus": corpus}}
    if causal:
        settings["causal_model"] = causal
    lines = [json.dumps({"settings": settings})]
    for (layout, method, qid), right in answers.items():
        record = asdict(Record(method, qid, "single", "q?", "a" if right else "b", right, 0.0, 0.1, 0.2, 1.0, 10, layout))
        lines.append(json.dumps({k: v for k, v in record.items() if not (old and k.startswith("first_"))}))
    path.write_text("\n".join(lines) + "\n")
    return path


def test_the_same_weights_table_pairs_each_mode_with_full_per_question(tmp_path):
    ids = [f"q{i}" for i in range(8)]
    published = {("kvrag", "full", i): k < 4 for k, i in enumerate(ids)} | \
        {("kvrag", "block", i): k < 2 for k, i in enumerate(ids)} | {("kvrag", "blend", i): k < 3 for k, i in enumerate(ids)}
    adapter = {(layout, m, i): k < 6 for layout in ("kvrag", "numbered") for m in ("full", "block", "blend")
               for k, i in enumerate(ids)}
    paths = [write_results(tmp_path / "p.jsonl", "published", "squad", published),
             write_results(tmp_path / "a.jsonl", "adapter", "squad", adapter, old=True)]  # a file from before first_token
    table = weights_table(paths).splitlines()
    assert table[0] == ("| weights | corpus | questions | full | block | blend | block − full | blend − full | "
                        "block = full % | blend = full % |")
    # block answers as full on 6 of 8 questions (right on q0-q1, wrong on q4-q7), blend on 7
    assert table[2] == ("| published weights | SQuAD | 8 | 50.0 | 25.0 | 37.5 | −25.0 ± 32.1 | −12.5 ± 24.5 | "
                        "75.0 ± 32.1 | 87.5 ± 24.5 |")
    assert table[3:] == [f"| shipped adapter | SQuAD, {where} | 8 | 75.0 | 75.0 | 75.0 | +0.0 ± 0.0 | +0.0 ± 0.0 | "
                         "100.0 ± 0.0 | 100.0 ± 0.0 |" for where in ("`kvrag`", "`numbered`", "2 layouts pooled")]
    assert all(r.first_token is None and r.first_logprobs is None for r in read_results(paths[1])[1])
    [effect] = adapter_effect(paths)
    assert effect.startswith("SQuAD: the adapter's full mode − the published weights' full mode +25.0 ± ")
    assert "(8 questions; across weights)" in effect
    both_layouts = {(layout, m, i): right for (_, m, i), right in published.items() for layout in ("kvrag", "numbered")}
    [effect] = adapter_effect([write_results(tmp_path / "p2.jsonl", "published", "squad", both_layouts), paths[1]])
    assert "+25.0 ± " in effect and "(8 questions; across weights)" in effect  # a question once, not once per layout
    across = write_results(tmp_path / "x.jsonl", "adapter", "squad", adapter, causal="published")
    with pytest.raises(KVRagError, match="not like for like"):
        weights_table([across])


def test_paired_table_compares_one_setting_against_its_base_per_question(tmp_path):
    """Two files on the same weights and questions, the second with its KV stored in 4 bits: block's agreement with
    the base file's full answer and its accuracy, each minus the base file's block, a question counted once."""
    ids = [f"q{i}" for i in range(10)]
    layouts = ("kvrag", "numbered")
    base = {(layout, m, i): k < 6 for layout in layouts for m in ("full", "block") for k, i in enumerate(ids)}
    # 4-bit block: wrong on q0 in both layouts, on q1 in one: two questions lose agreement, 1.5 answers of 20 in all
    other = {(layout, "block", i): k < 6 and not (i == "q0" or (i == "q1" and layout == "kvrag"))
             for layout in layouts for k, i in enumerate(ids)}
    for name, answers in (("base", base), ("int4", other)):
        write_results(tmp_path / f"squad-{name}.jsonl", "adapter", "squad", answers)
    other_file = tmp_path / "squad-int4.jsonl"
    lines = other_file.read_text().splitlines()
    settings = json.loads(lines[0])
    settings["settings"]["storage"] = "int4"
    other_file.write_text("\n".join([json.dumps(settings), *lines[1:]]) + "\n")
    paths = [tmp_path / "squad-base.jsonl", other_file]
    [row] = paired_rows(paths)
    assert (row["setting"], row["corpus"], row["method"]) == ("int4", "SQuAD", "block")
    assert sorted(row["agree"]) == [-1.0, -0.5] + [0.0] * 8 and row["accuracy"] == row["agree"]
    assert row["first"] == [] and row["kl"] == []  # the records hold no first tokens: nothing to judge
    table = paired_table(paths).splitlines()
    assert table[2].startswith("| int4 storage | SQuAD | block | 10 | −15.0 ± ")
    assert len(paired_rows(paths + paths)) == 3  # two pairs of one setting: their rows and the pooled one
    with pytest.raises(ValueError, match="pairs"):
        paired_rows(paths[:1])
