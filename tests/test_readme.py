"""The README is a newcomer's path: its set-up commands are the two that CI runs, every Python
snippet in it and in docs/ runs as written (the README's answering its questions right, in block
mode), and its links lead somewhere.

Snippets run in this process, each in a fresh namespace, from the repository root, with the
session's KVRAG_HOME (the root conftest). Those that load the real default model are marked e2e.
A command that needs a server or a long job goes in a ```bash block, which is never run.
"""

import ast
import gc
import gzip
import json
import os
import re
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
DOCS = sorted((ROOT / "docs").glob("*.md"))
FENCE = re.compile(r"^```(\w*)\n(.*?)^```", re.MULTILINE | re.DOTALL)
LOADS_MODEL = ("KVEngine", "ChatKVRag", "KVRagVectorStore", "KVRagLLM")  # what builds an engine
# Every question the README's snippets ask, and the answer their passages hold: a newcomer's first
# answers must be right, in block mode (the snippets' default) and in the snippets' other modes alike.
ANSWERS = {
    "Who built the Glimmerhook Lighthouse?": "Maren Solvik",
    "What is the capital of Orvanne?": "Saltmere",
    "Who is the head keeper of the Hallow Archive?": "Thornbury",
}
QUESTION = re.compile(r"[A-Z][\w ']+\?")


def snippets(path: Path, language: str) -> list[tuple[int, str]]:
    """(first line number, code) of every fenced block in `language`."""
    text = path.read_text(encoding="utf-8")
    return [(text.count("\n", 0, m.start(2)) + 1, m.group(2)) for m in FENCE.finditer(text) if m.group(1) == language]


def commands(code: str) -> list[str]:
    """The shell commands of a block: comments and blank lines dropped."""
    lines = (line.split("#", 1)[0].strip() for line in code.splitlines())
    return [line for line in lines if line]


def python_cases():
    for path in [README, *DOCS]:
        for line, code in snippets(path, "python"):
            marks = [pytest.mark.e2e] if any(name in code for name in LOADS_MODEL) else []
            yield pytest.param(path, line, code, marks=marks, id=f"{path.relative_to(ROOT)}:{line}")


@pytest.mark.parametrize("path, line, code", list(python_cases()))
def test_python_snippet_runs(path, line, code, monkeypatch, capsys):
    monkeypatch.chdir(ROOT)
    namespace = {"__name__": "__main__"}
    try:
        exec(compile(code, f"{path.relative_to(ROOT)}:{line}", "exec"), namespace)  # noqa: S102 (the README's own code)
    finally:
        namespace.clear()  # the snippet's engine goes before the next snippet loads its own
        gc.collect()
    out = capsys.readouterr().out
    assert out.strip(), "the snippet printed nothing"
    if path == README:
        for question in sorted(set(QUESTION.findall(code))):
            assert question in ANSWERS, f"add the answer to {question!r} to ANSWERS"
            assert ANSWERS[question].lower() in out.lower(), (question, out)


def run_snippet(doc: str, marker: str, monkeypatch, capsys, swaps: dict[str, str] | None = None) -> str:
    """What the one Python snippet in docs/`doc` that mentions `marker` prints, run from the repository
    root; each of `swaps`' keys, found once in it, replaced by its value first."""
    (line, code), = [(n, c) for n, c in snippets(ROOT / "docs" / doc, "python") if marker in c]
    for old, new in (swaps or {}).items():
        assert code.count(old) == 1, old
        code = code.replace(old, new)
    monkeypatch.chdir(ROOT)
    exec(compile(code, f"docs/{doc}:{line}", "exec"), {"__name__": "__main__"})  # noqa: S102
    return capsys.readouterr().out


def test_the_results_file_reproduces_the_accuracy_tables(monkeypatch, capsys):
    """The recomputation snippet in docs/benchmarks.md prints the docs' table rows and finetuning.md's interval."""
    out = run_snippet("benchmarks.md", "accuracy.csv.gz", monkeypatch, capsys)
    benchmarks = (ROOT / "docs" / "benchmarks.md").read_text(encoding="utf-8")
    rows = [row for row in out.splitlines() if row.startswith("| ") and "---" not in row]
    assert len(rows) == 8  # the header and seven methods
    for row in rows:
        assert row in benchmarks, row
    assert "block - full: -0.1 ± 2.7 points" in out
    assert "**-0.1 ± 2.7**" in (ROOT / "docs" / "finetuning.md").read_text(encoding="utf-8")


def test_the_answer_files_reproduce_block_against_full_with_the_adapter(monkeypatch, capsys):
    """The snippet in docs/layouts.md prints the intervals of its table of block and blend against full
    mode with the adapter too, from the answer files in docs/results."""
    out = run_snippet("layouts.md", "answers(\"layouts-test-fulladapter\", world)", monkeypatch, capsys)
    gaps = re.findall(r"^(?:\[([\w-]+)\] )?(block|blend) - full: ([+-]\d+\.\d) ± (\d+\.\d) points", out, re.M)
    assert len(gaps) == 16  # block and blend in each of the 8 layouts
    text = (ROOT / "docs" / "layouts.md").read_text(encoding="utf-8")
    section = text[text.index("## Full mode with the adapter too"):]
    for layout, method, diff, half in gaps:
        row = next(r for r in section.splitlines() if r.startswith(f"| {layout or 'kvrag'} |"))
        assert f"{diff.replace('-', '−')} ± {half}" in row.split(" | ")[6 if method == "block" else 7], (layout, method, row)
    pooled = re.findall(r"^\[pooled, 8 layouts\] (block|blend) - full: ([+-]\d+\.\d) ± (\d+\.\d) points", out, re.M)
    row = next(r for r in section.splitlines() if r.startswith("| **pooled**")).split(" | ")
    assert [m for m, _, _ in pooled] == ["block", "blend"]  # the pooled row, clustered by question: bench prints it too
    assert all(f"{diff.replace('-', '−')} ± {half}" == row[6 if m == "block" else 7] for m, diff, half in pooled), (pooled, row)


def test_the_answer_file_reproduces_the_blend_settings_table(monkeypatch, capsys):
    """The snippet in docs/layouts.md prints each method's cells of its blend-settings table."""
    out = run_snippet("layouts.md", "def accuracy(method", monkeypatch, capsys).splitlines()
    assert len(out) == 9  # full, block and seven blend settings
    text = (ROOT / "docs" / "layouts.md").read_text(encoding="utf-8")
    section = text[text.index("## Blend settings with the adapter"):].split("\n\n")[1:4]
    rows = [" ".join(r.split()) for r in "\n".join(section).splitlines() if r.startswith("| ")]
    for line in out:
        cells = " ".join(line.split(" ", 1)[1].split())
        assert any(row.endswith(" " + cells) for row in rows), line


def test_the_answer_files_reproduce_where_blend_loses(monkeypatch, capsys):
    """The snippet in docs/layouts.md prints the rows of the attention-selection tables and the
    sweep's agreement counts that the section's text gives."""
    out = run_snippet("layouts.md", "blend-attention-dev", monkeypatch, capsys).splitlines()
    text = (ROOT / "docs" / "layouts.md").read_text(encoding="utf-8")
    section = text[text.index("## Where blend loses"):text.index("## What is left")]
    tables = [line for line in out if line.startswith("| ")]
    assert len(tables) == 11 and all(line in section for line in tables)
    block, blend = (line.split() for line in out if not line.startswith("| "))
    words = " ".join(section.split())
    assert f"{blend[1]} of {blend[3]} against {block[1]}" in words
    assert f"right {blend[6]} times of {blend[8]}, block mode {block[6]} of {block[8]}" in words


def test_the_answer_files_reproduce_the_third_stages_blend_column(monkeypatch, capsys):
    """The snippet in docs/layouts.md prints the third stage's per-layout blend table and the pooled
    intervals that its section gives."""
    out = run_snippet("layouts.md", "(\"layouts-test-fulladapter\", \"full\", \"full (adapter)\")", monkeypatch, capsys).splitlines()
    text = (ROOT / "docs" / "layouts.md").read_text(encoding="utf-8")
    section = text[text.index("### The third stage's blend column"):text.index("## The fourth stage")]
    rows = [line for line in out if line.startswith("| ")]
    assert len(rows) == 8 and all(row in section for row in rows)
    pooled = dict(line.rsplit(": ", 1) for line in out if not line.startswith("| "))
    words = " ".join(section.split())
    assert f"full mode on the same weights by {pooled['blend − full (adapter)'][1:]}" in words
    assert f"costs it {pooled['question first, blend'][1:]} points" in words
    assert f"{pooled['blend − deviation']} over deviation" in words and f"block mode by {pooled['blend − block'][1:]}" in words


def test_the_answer_file_reproduces_the_held_out_blend_table(monkeypatch, capsys):
    """The snippet in docs/layouts.md prints the rows of its held-out table (the third stage's)."""
    out = run_snippet("layouts.md", "heldout-langchain.jsonl.gz", monkeypatch, capsys).splitlines()
    text = (ROOT / "docs" / "layouts.md").read_text(encoding="utf-8")
    assert len(out) == 5 and all(line in text for line in out)


def _fourth_stage():
    text = (ROOT / "docs" / "layouts.md").read_text(encoding="utf-8")
    return " ".join(text[text.index("## The fourth stage"):text.index("## What is left")].split())


def _points(cell):
    return float(cell.split(" ± ")[0].replace("−", "-"))


def _ends(cell):
    """The lower and upper ends of a "−2.5 ± 3.5" cell, in points."""
    half = float(cell.rstrip(" |").split(" ± ")[1])
    return _points(cell) - half, _points(cell) + half


def _gains(rows):
    """Candidate minus the adapter it is judged against, from "| corpus | mode | before | after | ... |" rows."""
    return [float(row.split(" | ")[3]) - float(row.split(" | ")[2]) for row in rows]


def _squad_table(name, monkeypatch, capsys):
    """The rows the snippet reading docs/results/`name`.jsonl.gz prints, each found in the doc; the file
    answers the first n SQuAD test questions (n: the table's) in every layout and mode, and only those."""
    import gzip

    from kvrag.eval.layouts import NAMES
    from kvrag.eval.squad import questions

    out = run_snippet("layouts.md", f'gzip.open("docs/results/{name}', monkeypatch, capsys).splitlines()
    rows = [line.split(" | ") for line in out]
    assert len(rows) == 9 and all(line in _fourth_stage() for line in out)
    with gzip.open(ROOT / "docs" / "results" / f"{name}.jsonl.gz", "rt") as f:
        settings, *answered = [json.loads(line) for line in f.read().splitlines()]
    assert settings["settings"]["dataset"] == {"corpus": "squad", "split": "test", "passages": 5, "seed": 0}
    asked = {e.id: e.question for e in questions("test", int(rows[0][1]), 5, 0)}
    assert sorted((a["layout"], a["id"], a["method"]) for a in answered) == sorted(
        (layout, i, m) for layout in NAMES for i in asked for m in ("full", "block", "blend"))
    assert all(a["question"] == asked[a["id"]] for a in answered)
    return rows


def test_the_answer_files_show_the_fourth_stage_passing_the_rule(monkeypatch, capsys):
    """The dev snippet in docs/layouts.md prints its table, and the table passes the rule for adapters:
    pooled higher, no layout more than 2 points lower, kvrag's own no more than 1."""
    out = run_snippet("layouts.md", "blend-trained-attention-dev-rest", monkeypatch, capsys).splitlines()
    section = _fourth_stage()
    assert len(out) == 9 and all(row in section for row in out)
    change = {row.split(" | ")[0][2:]: _points(row.split(" | ")[4]) for row in out}
    assert change.pop("**pooled**") > 0 and min(change.values()) >= -2 and change["kvrag"] >= -1


def test_the_answer_files_reproduce_the_fourth_stages_test_tables(monkeypatch, capsys):
    """The fourth stage's test-split snippet in docs/layouts.md prints its table in the set-up users get
    (the README's until the sixth stage shipped), its table against the third and the pooled intervals
    that the section gives."""
    out = run_snippet("layouts.md", "blend-trained-attention-test-rest", monkeypatch, capsys).splitlines()
    section = _fourth_stage()
    rows = [line for line in out if line.startswith("| ")]
    assert len(rows) == 16 and all(row in section for row in rows)
    pooled = dict(line.rsplit(": ", 1) for line in out if not line.startswith("| "))
    for name in ("block, fourth − third", "blend, fourth − third", "blend − block"):
        assert f"{name}: {pooled[name]}" in section
    first = {m: pooled[f"question first, {m}"][1:] for m in ("block", "blend")}  # losses, quoted without their sign
    assert f"costs block mode {first['block']} points against the same words re-laid and blend {first['blend']}" in section


def test_the_answer_file_reproduces_the_fourth_stages_held_out_table(monkeypatch, capsys):
    """The held-out snippet in docs/layouts.md prints the rows of its table and the changes from the third
    stage that the section gives; every block and blend answer reused KV."""
    out = run_snippet("layouts.md", 'answers("heldout-fourth-stage")', monkeypatch, capsys).splitlines()
    section = _fourth_stage()
    rows = [line for line in out if line.startswith("| ")]
    assert len(rows) == 5 and all(row in section for row in rows)
    lines = dict(line.split(": ", 1) for line in out if not line.startswith("| "))
    assert lines.pop("reused KV in every block and blend answer") == "True"
    assert all(f"{name}: {change}" in section for name, change in lines.items())


def test_the_answer_file_reproduces_the_llamaindex_held_out_table(monkeypatch, capsys):
    """The LlamaIndex held-out snippet in docs/layouts.md prints the rows of its table and the
    KVBlockSynthesizer line; every block and blend answer reused KV."""
    out = run_snippet("layouts.md", "docs/results/heldout-llamaindex.jsonl.gz", monkeypatch, capsys).splitlines()
    section = _fourth_stage()
    rows = [line for line in out if line.startswith("| ")]
    assert len(rows) == 3 and all(row in section for row in rows)
    assert f"- `KVBlockSynthesizer`{out[3].removeprefix('KVBlockSynthesizer')}" in section
    assert out[4] == "reused KV in every block and blend answer: True"


def test_the_answer_files_reproduce_the_sixth_stages_held_out_table(monkeypatch, capsys):
    """The sixth stage's held-out snippet prints its table and its changes from the fourth stage as the
    section gives them; every block and blend answer reused KV."""
    out = run_snippet("layouts.md", "sixth = answers(f\"heldout-sixth-stage-", monkeypatch, capsys).splitlines()
    section = _fourth_stage().split("### The sixth stage in the set-up users get")[1]
    rows = [line for line in out if line.startswith("| ")]
    assert len(rows) == 8 and all(row in section for row in rows)
    assert all(f"- {line}" in section for line in out if "sixth − fourth" in line or line.startswith("KVBlockSynthesizer"))
    assert [line.rsplit(": ", 1)[1] for line in out if "reused KV" in line] == ["True", "True"]


def test_the_answer_files_reproduce_the_fourth_stage_in_full_mode(monkeypatch, capsys):
    """The fourth stage's full-mode snippet in docs/layouts.md prints its table and by-type figures;
    both worlds hold the same number of whole questions (every layout answered); finetuning.md quotes
    the pooled row."""
    out = run_snippet("layouts.md", "layouts-test-fulladapter-fourth", monkeypatch, capsys).splitlines()
    section = _fourth_stage()
    rows = [line for line in out if line.startswith("| ")]
    assert len(rows) == 9 and all(row in section for row in rows)
    by_type = dict(line.split(" ", 1) for line in out if not line.startswith("| "))
    assert list(by_type) == ["single", "bridge", "comparison", "unanswerable"]
    assert all(f"{kind} {figures}" in section for kind, figures in by_type.items())
    for world in ("", "-prose"):
        with gzip.open(ROOT / "docs" / "results" / f"layouts-test-fulladapter-fourth{world}.jsonl.gz", "rt") as f:
            answered = [json.loads(line) for line in f.read().splitlines()[1:]]
        questions = {a["id"] for a in answered}
        assert len(answered) == 8 * len(questions) and 2 * len(questions) == int(rows[0].split(" | ")[1])
    pooled = rows[-1].split(" | ")
    finetuning = " ".join((ROOT / "docs" / "finetuning.md").read_text(encoding="utf-8").split())
    assert f"({pooled[7]} pooled, {pooled[1]} test questions per layout)" in finetuning


def test_the_answer_file_reproduces_the_squad_table_on_the_first_questions_of_the_split(monkeypatch, capsys):
    """The SQuAD snippet in docs/layouts.md prints its table; the file answers, in every layout and
    mode, the first questions `bench accuracy --squad` asks; block − full lies below −2 on every
    layout, as the text says."""
    rows = _squad_table("squad-test-fourth", monkeypatch, capsys)
    n = int(rows[0][1])
    assert n == 150 and all(_ends(row[5])[1] < -2 for row in rows)


def test_the_answer_file_reproduces_the_squad_table_of_the_default_set_up(monkeypatch, capsys):
    """The 400-question SQuAD snippet prints its table (the published weights in full mode); block −
    full lies wholly below −2 on `numbered` alone, as the text judges."""
    rows = _squad_table("squad-test-default", monkeypatch, capsys)
    assert rows[0][1] == "400"
    below = [row[0].strip("| ") for row in rows if _ends(row[5])[1] < -2]
    assert below == ["numbered"]


def test_the_answer_files_reproduce_how_length_weighs_on_the_squad_figures(monkeypatch, capsys):
    """The snippet read after the 400-question rule prints what its paragraph says: the answers' median
    lengths, and block and blend against full by token F1 and on each answer's first sentence."""
    out = run_snippet("layouts.md", "def first_sentence", monkeypatch, capsys).splitlines()
    section = _fourth_stage()
    words = [line.split("median ")[1].removesuffix(" words") for line in out[:3]]
    assert f"(median {words[0]} words against {words[1]} in block and blend mode)" in section and words[1] == words[2]
    (block_f1, block_first), (blend_f1, blend_first) = (
        line.split("token F1 ")[1].split(", first sentence ") for line in out[3:5])
    assert f"block mode is above the published full mode: {block_f1} points pooled, blend {blend_f1}" in section
    assert f"block − full is {block_first} and blend − full {blend_first}" in section
    assert _points(block_f1) > 0 and _points(block_first) < 0
    assert f"block mode loses on F1 too ({out[5].split('token F1 ')[1]})" in section


def test_the_answer_files_reproduce_both_pilots(monkeypatch, capsys):
    """The pilots' snippet prints the second pilot's table, whose first columns are the first pilot's
    table, and each pilot's paired difference from the shipped adapter as its section quotes it."""
    out = run_snippet("layouts.md", "sixth-stage-pilot/squad-dev-pilot-*", monkeypatch, capsys).splitlines()
    first, second = _fourth_stage().split("### A pilot: the published")[1].split("### A second pilot:")
    rows, (first_gain, second_gain) = out[:-2], out[-2:]
    assert len(rows) == 9 and all(row in second for row in rows)
    assert all(row.rsplit(" | ", 1)[0] + " |" in first for row in rows)
    assert f"Pilot − shipped: {first_gain.split(': ')[1]} points" in first
    assert f"Second pilot − shipped: {second_gain.split(': ')[1]} points" in second


def test_the_answer_files_reproduce_the_sixth_stage_decision(monkeypatch, capsys):
    """The sixth stage's snippet prints its table, the intervals its text quotes, a block loss beyond
    the rule's 2 points (so the text's "criterion 1 fails" holds) and the counts read afterwards."""
    out = run_snippet("layouts.md", 'Path("docs/results/sixth-stage")', monkeypatch, capsys).splitlines()
    section = _fourth_stage().split("### The decision: the second pilot fails")[1]
    assert out[0] in section and out[1] in section
    shipped, pilot = (float(row.split(" | ")[1]) for row in out[:2])
    assert pilot - shipped < -2 and "criterion 1 fails" in section
    block, gap = out[2].removeprefix("block − shipped's ").split(", (blend − block) − shipped's ")
    assert f"Block − shipped's: {block} points; (blend − block) − shipped's: {gap}" in section
    counts = ast.literal_eval(out[3])
    assert ", ".join(f"{t} {a} → {b}" for t, (a, b) in counts.items()) in section


def _pilots(monkeypatch, capsys):
    """What the pilots' snippet prints: its table rows by adapter ("adapter" the header), and its
    intervals by (pilot, base) as (SQuAD dev, generated dev)."""
    out = run_snippet("layouts.md", "dev-pilot4-", monkeypatch, capsys).splitlines()
    rows = {line.split(" | ")[0].removeprefix("| "): line for line in out if line.startswith("| ")}
    gains = {}
    for line in out[len(rows):-1]:
        pair, cells = line.split(": ", 1)
        gains[tuple(pair.split(" − "))] = tuple(cell.split(" ", 2)[-1] for cell in cells.split(", "))
    assert list(rows) == ["adapter", "shipped", "second pilot", "third pilot", "fourth pilot", "fifth pilot"]
    assert len(gains) == 6
    words = dict(cell.rsplit(" ", 1) for cell in out[-1].removeprefix("median words of the SQuAD dev block answers: ").split(", "))
    return rows, gains, {name: int(n) for name, n in words.items()}


def _cells(row):  # a table row's cells after the adapter's name
    return [cell.rstrip(" |") for cell in row.split(" | ")[1:]]


def _keeps_refusals_and_hops(rows, pilot):
    """The pilots' rules, read beside them: at least 20 of 400 unanswerable declined, and bridge
    questions no more than 20 below the shipped adapter's."""
    mine, shipped = _cells(rows[pilot]), _cells(rows["shipped"])
    return int(mine[5]) >= 20 and int(shipped[3]) - int(mine[3]) <= 20


def test_the_answer_files_reproduce_the_third_pilot(monkeypatch, capsys):
    """The pilots' snippet prints the third pilot's table and the intervals its text quotes; its rows for
    the shipped adapter and the second pilot agree with the sixth stage's, and the counts the rule reads
    (refusals, bridge questions, both dev gains) are what its judgement says."""
    rows, gains, _ = _pilots(monkeypatch, capsys)
    section = _fourth_stage().split("### A third pilot:")[1].split("### A fourth pilot:")[0]
    assert all(rows[name] in section for name in ("adapter", "shipped", "second pilot", "third pilot"))
    assert [_cells(rows[name])[1] for name in ("shipped", "second pilot")] == ["34.8", "26.9"]  # the sixth stage's table
    unanswerable, bridge = int(_cells(rows["third pilot"])[5]), int(_cells(rows["third pilot"])[3])
    assert unanswerable < 20 and abs(bridge - int(_cells(rows["second pilot"])[3])) > 10  # neither cause, as judged
    squad, generated = gains["third pilot", "shipped"]
    assert _points(squad) <= 2 and _points(generated) < -2  # not a starting point
    assert f"SQuAD dev {squad}, generated dev {generated} points" in section
    assert "pilot: SQuAD dev {}, generated dev {}".format(*gains["third pilot", "second pilot"]) in section


def test_the_answer_files_reproduce_the_fourth_pilot(monkeypatch, capsys):
    """The pilots' snippet prints the fourth pilot's row and intervals as its section quotes them, and
    the rule's judgement follows from them: the refusals and hops kept, not a starting point."""
    rows, gains, _ = _pilots(monkeypatch, capsys)
    section = _fourth_stage().split("### A fourth pilot:")[1].split("### A fifth pilot:")[0]
    assert all(rows[name] in section for name in ("adapter", "shipped", "third pilot", "fourth pilot"))
    assert _keeps_refusals_and_hops(rows, "fourth pilot")
    squad, generated = gains["fourth pilot", "shipped"]
    assert _points(squad) <= 2 and _points(generated) < -2  # not a starting point
    assert f"Fourth pilot − shipped: SQuAD dev {squad}, generated dev {generated} points" in section
    assert "pilot: SQuAD dev {}, generated dev {} (paired".format(*gains["fourth pilot", "third pilot"]) in section


def test_the_answer_files_reproduce_the_fifth_pilot(monkeypatch, capsys):
    """The pilots' snippet prints the fifth pilot's row, intervals and answer lengths as its section quotes
    them; the rule's judgement follows from them (a starting point, refusals and hops kept); its training
    record names the SQuAD questions it kept and how it asked them."""
    rows, gains, words = _pilots(monkeypatch, capsys)
    section = _fourth_stage().split("### A fifth pilot:")[1].split("### The rule for a sixth stage, with")[0]
    assert all(rows[name] in section for name in ("adapter", "shipped", "fourth pilot", "fifth pilot"))
    assert _keeps_refusals_and_hops(rows, "fifth pilot")
    squad, generated = gains["fifth pilot", "shipped"]
    assert _points(squad) > 2 and _points(generated) >= -2  # a starting point
    assert f"Fifth pilot − shipped: SQuAD dev {squad}, generated dev {generated} points" in section
    assert "pilot: SQuAD dev {}, generated dev {} (paired".format(*gains["fifth pilot", "fourth pilot"]) in section
    assert f"(median {words['shipped']} words)" in section and words["fifth pilot"] == words["shipped"]
    assert max(words[f"{n} pilot"] for n in ("second", "third", "fourth")) <= 3
    record = json.loads((ROOT / "docs/results/sixth-stage-pilot/pilot5-training.json").read_text())
    assert record["step"] == 160 and record["about"]["squad"] == 437 and record["about"]["squad_passages"] == 3
    assert "437 of them in a whole first sentence" in " ".join(section.split())


def test_the_answer_files_reproduce_criterion_1_with_the_fifth_pilot(monkeypatch, capsys):
    """The snippet under the sixth stage's rule with the fifth pilot prints its table and interval, and
    the judgement follows: block not more than 2 below the shipped adapter's, blend − block neither."""
    out = run_snippet("layouts.md", "sixth-stage-pilot5/dev-blend-", monkeypatch, capsys).splitlines()
    section = _fourth_stage().split("### The rule for a sixth stage, with the fifth pilot")[1]
    assert len(out) == 3 and out[0] in section and out[1] in section
    shipped, pilot = (float(row.split(" | ")[1]) for row in out[:2])
    assert pilot - shipped >= -2 and "criterion 1 passes" in section
    change, blend = out[2].removeprefix("(blend − block) − shipped's ").split(", blend − shipped's ")
    assert _points(change) >= -2 and f"(Blend − block) − shipped's: {change} points" in section
    assert f"(blend itself {blend} over" in section


def test_the_answer_files_reproduce_criterion_2_with_the_fifth_pilot(monkeypatch, capsys):
    """The criterion-2 snippet prints its table as the section gives it, and the judgement follows: SQuAD
    test block above the shipped adapter's, neither block nor blend on the generated test worlds more
    than 1 point below; the shipped adapter's record (the tenth stage's, the ninth's within it) holds the
    fifth pilot's training as the sixth stage's."""
    out = run_snippet("layouts.md", "corpora = {  # corpus -> methods", monkeypatch, capsys).splitlines()
    section = _fourth_stage().split("### The rule for a sixth stage, with the fifth pilot")[1]
    assert len(out) == 3 and all(row in section for row in out)
    gains = _gains(out)
    assert gains[0] > 0 and min(gains[1:]) >= -1 and "the fifth pilot ships as the sixth stage" in section
    shipped, pilot = (json.loads((ROOT / path).read_text()) for path in (
        "src/kvrag/adapters/smollm2-135m-instruct-block/training.json", "docs/results/sixth-stage-pilot/pilot5-training.json"))
    sixth = shipped["about"]["init_adapter_training"]["sixth_stage_training"]
    assert sixth.keys() == pilot.keys() and sixth["losses"] == pilot["losses"] and sixth["about"] == pilot["about"]


def test_the_answer_files_reproduce_criterion_1_of_the_seventh_stage(monkeypatch, capsys):
    """The seventh stage's dev snippet prints its table and interval as the section gives them, and the
    judgement follows: SQuAD dev block above the sixth stage's, generated dev block and blend − block
    neither more than 2 points below."""
    out = run_snippet("layouts.md", "seventh-stage-pilot/squad-dev-", monkeypatch, capsys).splitlines()
    section = _fourth_stage().split("## The rule for a seventh stage")[1]
    assert len(out) == 4 and all(row in section for row in out[:3])
    gains = _gains(out[:3])
    gap = out[3].removeprefix("(blend − block) − the sixth stage's: ")
    assert gains[0] > 0 and gains[1] >= -2 and _points(gap) >= -2
    assert f"(Blend − block) − the sixth stage's: {gap} points" in section and "criterion 1 passes" in section


def test_the_answer_files_reproduce_criterion_2_of_the_seventh_stage(monkeypatch, capsys):
    """The seventh stage's test snippet prints its table as the section gives it; its accuracy part
    passes (SQuAD test block above the sixth stage's, generated test block and blend neither more than
    1 point below), the section records the e2e failure that kept it from shipping, and the shipped
    adapter is not the candidate."""
    out = run_snippet("layouts.md", "criterion 2 (before pytest -m e2e)", monkeypatch, capsys).splitlines()
    section = _fourth_stage().split("## The rule for a seventh stage")[1]
    assert len(out) == 4 and all(row in section for row in out[:3])
    gains = _gains(out[:3])
    assert gains[0] > 0 and min(gains[1:]) >= -1 and out[3].endswith(": passes")
    assert "`pytest -m e2e` failed" in section and "the candidate is not shipped" in section
    shipped, candidate = (ROOT / path / "adapter_model.safetensors" for path in (
        "src/kvrag/adapters/smollm2-135m-instruct-block", "docs/results/seventh-stage-pilot/adapter"))
    assert shipped.read_bytes() != candidate.read_bytes()


def test_the_answer_files_reproduce_the_seventh_stage_candidates_held_out_figures(monkeypatch, capsys):
    """The candidate's held-out snippet prints the four lines the section lists, from answers that all
    reused KV and, through LlamaIndex, the sixth stage's nodes."""
    out = run_snippet("layouts.md", "\"seventh-stage-pilot/heldout\"", monkeypatch, capsys).splitlines()
    section = _fourth_stage().split("## The rule for a seventh stage")[1]
    assert len(out) == 4 and all(f"- {line}" in section for line in out)


def test_the_answer_files_reproduce_criterion_1_of_the_candidate_at_scale_1_5(monkeypatch, capsys):
    """The scaled candidate's dev snippet prints its table and interval as the section gives them, and
    the judgement follows: its generated dev block is more than 2 points below the sixth stage's."""
    out = run_snippet("layouts.md", "seventh-stage-pilot/scale1.5/squad-dev-", monkeypatch, capsys).splitlines()
    section = _fourth_stage().split("### The rule for the seventh stage's candidate at a lower scale")[1]
    assert len(out) == 4 and all(row in section for row in out[:3])
    gains = _gains(out[:3])
    gap = out[3].removeprefix("(blend − block) − the sixth stage's at scale 1.5: ")
    assert gains[1] < -2 and f"(Blend − block) − the sixth stage's: {gap} points" in section
    assert "**criterion 1 fails**" in section


def test_the_eighth_stages_candidate_is_the_sixth_stage_plus_the_share_the_sample_check_chose(monkeypatch, capsys):
    """The rule's snippet builds the adapter (not kept in git) from the two it lies between, at the largest
    `t` tried whose 36 sample answers are all right, each answer judged against the sample's answers."""
    out = run_snippet("layouts.md", "eighth-stage-pilot/adapter", monkeypatch, capsys)
    check = _sample_check("eighth-stage-pilot")
    assert [x["t"] for x in check["tried"]] == [0.75, 0.5, 0.25]
    assert check["t"] == max(x["t"] for x in check["tried"] if x["right"] == 36)
    assert out == f"the adapter is the sixth stage plus {check['t']} of the seventh stage's change\n"


def _sample_check(folder):
    """A rule's sample-check.json, each of its 36 answers per candidate judged against the sample's answers."""
    check = json.loads((ROOT / "docs/results" / folder / "sample-check.json").read_text())
    sample = {q["question"]: q["answers"] for q in json.loads((ROOT / "src/kvrag/sample/questions.json").read_text())}
    for x in check["tried"]:
        assert len(x["answers"]) == 36 and {a["question"] for a in x["answers"]} == set(sample)
        assert {(a["place"], a["chain"]) for a in x["answers"]} == {(p, c) for p in range(3) for c in ("kv_blocks", "stuff")}
        assert all(a["correct"] == any(s in a["answer"].lower() for s in sample[a["question"]]) for a in x["answers"])
        assert x["right"] == sum(a["correct"] for a in x["answers"])
    return check


def test_the_ninth_stages_candidate_is_the_first_span_whose_sample_answers_are_all_right(monkeypatch, capsys):
    """The rule's snippet builds the spans' adapters (not kept in git; outside the span, the eighth stage's
    weights exactly) and names the first span, in the rule's order, whose 36 sample answers are all right."""
    import torch
    from safetensors.torch import load_file

    out = run_snippet("layouts.md", "SPANS = [(0, 20)", monkeypatch, capsys).splitlines()
    check = _sample_check("ninth-stage-pilot")
    spans = [x["layers"] for x in check["tried"]]
    assert spans == [[0, 19], [10, 29], [0, 14], [15, 29], [0, 9], [20, 29]][:len(spans)]
    assert [x["right"] == 36 for x in check["tried"]] == [False] * (len(spans) - 1) + [True]
    assert check["span"] == spans[-1] and out[1] == f"the candidate: layers {spans[-1][0]}–{spans[-1][1]}"
    section = _fourth_stage().split("## The rule for a ninth stage")[1]
    assert f"The sample check chose layers {spans[-1][0]}–{spans[-1][1]} " in section
    run_snippet("layouts.md", "eighth-stage-pilot/adapter", monkeypatch, capsys)  # builds it where missing
    eighth = load_file(ROOT / "docs/results/eighth-stage-pilot/adapter/adapter_model.safetensors")
    for a, b in spans:
        built = load_file(ROOT / f"docs/results/ninth-stage-pilot/adapters/layers-{a}-{b}/adapter_model.safetensors")
        inside = {k for k in eighth if a <= int(re.search(r"\.layers\.(\d+)\.", k)[1]) <= b and "lora_B" in k}
        assert built.keys() == eighth.keys() and 0 < len(inside) < len(eighth) // 2
        assert all(torch.equal(built[k], eighth[k]) != (k in inside) for k in eighth)


def test_the_tenth_stages_candidate_is_the_first_share_whose_sample_answers_are_all_right(monkeypatch, capsys):
    """The rule's snippet names the first t, in the rule's order, whose 36 sample answers are all right (none if
    no t is); below t = 1 it builds the ninth stage and the trained adapter stacked, their products unchanged."""
    import torch
    from safetensors.torch import load_file

    run_snippet("layouts.md", "SPANS = [(0, 20)", monkeypatch, capsys)  # builds the ninth stage where missing
    out = run_snippet("layouts.md", "SHARES = [1.0, 0.5, 0.25]", monkeypatch, capsys).splitlines()
    check = _sample_check("tenth-stage-pilot")
    shares, right = [x["t"] for x in check["tried"]], [x["right"] == 36 for x in check["tried"]]
    assert shares == [1.0, 0.5, 0.25][:len(shares)] and right[:-1] == [False] * (len(shares) - 1)
    assert check["t"] == (shares[-1] if right[-1] else None) and (right[-1] or len(shares) == 3)
    assert out[1] == "the candidate: " + (f"t = {check['t']}" if right[-1] else "none")
    ninth, trained = (load_file(ROOT / f"docs/results/{d}/adapter_model.safetensors")
                      for d in ("ninth-stage-pilot/adapters/layers-0-9", "tenth-stage-pilot/adapter"))
    for t in shares[1:]:
        built = load_file(ROOT / f"docs/results/tenth-stage-pilot/adapters/t-{t}/adapter_model.safetensors")
        for k in ninth:
            if "lora_B" in k:
                a = k.replace("lora_B", "lora_A")
                product = built[k].float() @ built[a].float()
                expected = (1 - t) * ninth[k].float() @ ninth[a].float() + t * trained[k].float() @ trained[a].float()
                assert (product - expected).norm() <= 1e-2 * expected.norm(), k  # float16's rounding, not a wrong t


@pytest.mark.parametrize("stage, before, heading", [("eighth", "sixth", "## The rule for an eighth stage"),
                                                    ("ninth", "eighth", "## The rule for a ninth stage"),
                                                    ("tenth", "ninth", "## The rule for a tenth stage")])
def test_the_answer_files_reproduce_criterion_1_of_the_stage(stage, before, heading, monkeypatch, capsys):
    """The stage's dev snippet prints its table and interval as the section gives them, and passes."""
    label = f"(blend − block) − the {before} stage's, {stage} stage's candidate: "
    out = run_snippet("layouts.md", label[:-2], monkeypatch, capsys).splitlines()
    section = _fourth_stage().split(heading)[1]
    assert len(out) == 5 and all(row in section for row in out[:3])
    gains = _gains(out[:3])
    gap = out[3].removeprefix(label)
    assert gains[0] > 0 and gains[1] >= -2 and f"(Blend − block) − the {before} stage's: {gap} points" in section
    assert out[4].endswith(": passes") and "**criterion 1 passes**" in section


def test_the_answer_files_reproduce_criterion_2_of_the_eighth_stage(monkeypatch, capsys):
    """The eighth stage's test snippet prints its table as the section gives it, judging only SQuAD
    questions seed 0 did not ask; the judgement follows: SQuAD test block above the sixth stage's,
    generated test block and blend neither 1 point below."""
    out = run_snippet("layouts.md", "eighth-stage-pilot/sixth-squad-test-seed1-", monkeypatch, capsys).splitlines()
    section = _fourth_stage().split("## The rule for an eighth stage")[1]
    assert len(out) == 6 and out[0] == "SQuAD test: 378 questions judged of 400" and "22 were among seed 0's" in section
    rows = [out[1], out[3], out[4]]
    assert out[2] == "generated test: 400 questions judged of 400" and all(row in section for row in rows)
    gains = _gains(rows)
    assert gains[0] > 0 and min(gains[1:]) >= -1 and out[5] == "criterion 2: passes" and "**criterion 2 passes**" in section


def _criterion_2_read_once(marker, stage, seeds, monkeypatch, capsys):
    """The stage's test snippet prints what it printed when it was read once (kept beside the answers,
    `criterion-2.txt`) and the section's table, judging only SQuAD questions earlier seeds did not ask;
    the judgement follows: SQuAD test block above the stage before, generated test block and blend
    neither 1 point below."""
    out = run_snippet("layouts.md", marker, monkeypatch, capsys).splitlines()
    assert out == (ROOT / f"docs/results/{stage}-stage-pilot/criterion-2.txt").read_text(encoding="utf-8").splitlines()
    section = _fourth_stage().split(f"## The rule for a {stage} stage")[1]
    judged = int(out[0].removeprefix("SQuAD test: ").split()[0])
    assert len(out) == 6 and out[0].endswith(" questions judged of 400") and f"{400 - judged} were among {seeds}" in section
    rows = [out[1], out[3], out[4]]
    assert out[2] == "generated test: 400 questions judged of 400" and all(row in section for row in rows)
    gains = _gains(rows)
    assert gains[0] > 0 and min(gains[1:]) >= -1 and out[5].endswith(": passes") and "**criterion 2 passes**" in section


def test_the_answer_files_reproduce_criterion_2_of_the_tenth_stage(monkeypatch, capsys):
    """Criterion 2 as read once; and the shipped adapter is the candidate its rule chose (the trained
    adapter whole, t = 1), its training.json the training's record with that t."""
    _criterion_2_read_once("criterion 2 of the tenth stage", "tenth", "seeds 0 to 2's", monkeypatch, capsys)
    check = _sample_check("tenth-stage-pilot")
    shipped, built = ROOT / "src/kvrag/adapters/smollm2-135m-instruct-block", ROOT / "docs/results/tenth-stage-pilot/adapter"
    assert check["t"] == 1 and (shipped / "adapter_model.safetensors").read_bytes() == (built / "adapter_model.safetensors").read_bytes()
    shipped_config, built_config = ({k: v for k, v in json.loads((d / "adapter_config.json").read_text()).items()
                                     if k != "base_model_name_or_path"} for d in (shipped, built))
    training, trained = (json.loads(path.read_text()) for path in (shipped / "training.json", built.parent / "training.json"))
    assert shipped_config == built_config and training["t"] == check["t"] and training["losses"] == trained["losses"]


def test_the_answer_files_reproduce_criterion_2_of_the_ninth_stage(monkeypatch, capsys):
    """Criterion 2 as read once; and the tenth stage was trained from the ninth, whose record (kept in
    the shipped training.json) names the span its rule chose."""
    _criterion_2_read_once("criterion 2 (before the README's tables)", "ninth", "seed 0's or seed 1's", monkeypatch, capsys)
    check = json.loads((ROOT / "docs/results/ninth-stage-pilot/sample-check.json").read_text())
    shipped = ROOT / "src/kvrag/adapters/smollm2-135m-instruct-block/training.json"
    training = json.loads(shipped.read_text())["about"]["init_adapter_training"]
    assert training["layers"] == check["span"] and training["t"] == 0.25


def test_the_answer_files_reproduce_the_eighth_stages_tables(monkeypatch, capsys):
    """The eighth stage's snippet in the set-up users get prints the section's tables (both corpora), and
    the costs of the question first, blend's gain over block and the change from the sixth stage that
    it quotes; the section's judgement of the targets follows from the rows: met everywhere on the
    generated worlds; on SQuAD blend met everywhere, block missed nowhere, shown met where the section
    says, below full where it says."""
    out = run_snippet("layouts.md", '"eighth-stage/squad-*"', monkeypatch, capsys).splitlines()
    section = _fourth_stage().split("### The eighth stage in the set-up users get")[1]
    assert [out[0], out[17]] == ["generated test", "SQuAD test"] and len(out) == 34
    tables = {corpus: [line.split(" | ") for line in out[start + 1:start + 10]] for corpus, start in (("generated", 0), ("squad", 17))}
    assert all(line in section for line in out if line.startswith("| "))
    assert all(_ends(row[4])[0] > 16 and _ends(row[5])[0] > 16 for row in tables["generated"])
    assert out[10:12] == ["block − full ≥ −2 shown met: everywhere", "blend − full ≥ −1 shown met: everywhere"]
    squad = tables["squad"]
    assert all(_points(row[4]) >= -2 and _ends(row[4])[1] > -2 and _ends(row[5])[0] >= -1 for row in squad)  # missed nowhere
    met = out[27].removeprefix("block − full ≥ −2 shown met: ").split(", ")
    assert len(met) == 2 and f"shown met on {met[0]} and {met[1]} (the sixth stage: nowhere)" in section
    assert all(_ends(row[4])[0] >= -2 for row in squad if f"`{row[0].strip('| `*')}`" in met)
    assert out[28] == "blend − full ≥ −1 shown met: everywhere"
    below = [row[0].strip("| `*") for row in squad if _points(row[4]) < 0]
    assert f"below the published full mode on two layouts (`{below[0]}`, `{below[1]}`), blend's on none" in section
    first = [line.split(": ")[1].lstrip("−") for line in out if line.startswith("question first")]
    assert f"loses {first[0]} points in block mode and {first[1]} in blend on the generated worlds, {first[2]} and {first[3]} on SQuAD" in section
    gain = [line.removeprefix("blend − block: ") for line in out if line.startswith("blend − block")]
    assert f"Blend − block, pooled: {gain[0]} on the generated worlds, {gain[1]} on SQuAD" in section
    change = [line.split(": ")[1] for line in out if line.startswith("eighth − sixth stage")]
    assert f"block {change[0]} and blend {change[1]} on the generated worlds, {change[2]} and {change[3]} on SQuAD" in section


def test_the_answer_files_reproduce_the_778_question_reading_of_squad(monkeypatch, capsys):
    """The 778-question snippet prints the section's table from the eighth stage's answers; each row's
    verdict follows from its two-look interval, and the section names the layouts it lists."""
    out = run_snippet("layouts.md", "eighth-stage/published-squad-seed1-*", monkeypatch, capsys).splitlines()
    section = _fourth_stage().split("### SQuAD test, seed 1 too")[1]
    assert len(out) == 15 and all(line in section for line in out[:11])
    rows = [line.split(" | ") for line in out[2:11]]
    for row in rows:
        low, high = _ends(row[4])
        verdict = row[5].rstrip(" |")  # the cells are rounded to 0.1: within 0.05 of −2 either way
        assert {"shown met": low >= -2.05, "missed": high < -1.95, "neither": low < -1.95 and high >= -2.05}[verdict]
    met = out[11].removeprefix("shown met: ").split(", ")
    assert out[13] == "missed: nowhere" and len(met) == 3 and "**pooled**" in out[12]
    assert f"**shown met on three layouts** ({', '.join(met)})" in section
    below = out[14].removeprefix("block below the published full mode: ").split(", ")
    assert all(_points(row[4]) < 0 for row in rows if row[0].strip("| ") in below) and len(below) == 4
    assert f"on four layouts ({', '.join(below)}, by 0.5 to 1.8 points)" in section


def test_the_ninth_stages_table_snippet_prints_the_eighth_stages_figures_from_its_files(monkeypatch, capsys):
    """Pointed at the eighth stage's answers in place of the ninth's, the ninth stage's snippet prints
    the eighth stage's tables and 778-question reading line for line, and no change from it."""
    swaps = {'"ninth-stage/test-p*.jsonl.gz"': '"eighth-stage/test-p*"', '"ninth-stage/squad-test-[01].jsonl.gz"': '"eighth-stage/squad-test-*"',
             '"ninth-stage/squad-test-seed1-*.jsonl.gz"': '"eighth-stage-pilot/squad-test-seed1-*"'}
    out = run_snippet("layouts.md", "ninth-stage/squad-test-seed1-", monkeypatch, capsys, swaps).splitlines()
    tables = run_snippet("layouts.md", '"eighth-stage/squad-*"', monkeypatch, capsys).splitlines()
    reading = run_snippet("layouts.md", "eighth-stage/published-squad-seed1-*", monkeypatch, capsys).splitlines()
    change = [line for line in out if line.startswith("ninth − eighth stage")]
    assert len(change) == 4 and all(line.endswith(": +0.0 ± 0.0") for line in change)
    assert [line for line in out if line not in change] == [line for line in tables if not line.startswith("eighth − sixth")] + reading


def _read_tables(stage, monkeypatch, capsys):
    """The stage's table snippet's lines, checked against what it printed when read once, and its pooled
    rows, checked against its section, which is returned whitespace-joined."""
    out = run_snippet("layouts.md", f"{stage}-stage/squad-test-seed1-", monkeypatch, capsys)
    assert out == (ROOT / f"docs/results/{stage}-stage/tables.txt").read_text(encoding="utf-8")
    lines = out.splitlines()
    section = " ".join(_fourth_stage().split(f"### The {stage} stage in the set-up users get")[1].split())
    pooled = [line.split(" | ") for line in lines if line.startswith("| **pooled**")]
    assert len(pooled) == 3 and f"block − full {pooled[1][4]} (per layout" in section
    return lines, section, pooled


def test_the_ninth_stages_tables_are_what_their_snippet_printed_when_read(monkeypatch, capsys):
    """With every answer in, the ninth stage's snippet prints what it printed when it was read once (kept
    beside the answers), and the section quotes its pooled rows and the 778 questions' verdict."""
    _, section, pooled = _read_tables("ninth", monkeypatch, capsys)
    assert f"block − full **{pooled[2][4]} pooled, {pooled[2][5].rstrip(' |')} pooled**" in section


def test_the_tenth_stages_tables_are_what_their_snippet_printed_when_read(monkeypatch, capsys):
    """With every answer in, the tenth stage's snippet prints what it printed when it was read once (kept
    beside the answers); the section quotes its pooled rows and the 778 questions' verdict, the README
    its tables (the corpora side by side), the costs of the question first and the 778 questions' pooled
    interval and per-layout range; the targets follow from the rows: block − full shown ≥ −2 on every
    layout of both corpora and of the 778 questions, block above full on each, blend − full shown ≥ −1."""
    lines, section, pooled = _read_tables("tenth", monkeypatch, capsys)
    assert f"block − full **{pooled[2][4]} pooled, shown met on every layout**" in section
    assert [lines[0], lines[17]] == ["generated test", "SQuAD test"] and len(lines) == 49
    tables = [[line.split(" | ") for line in lines[start + 1:start + 10]] for start in (0, 17)]
    assert all(_ends(row[4])[0] >= -2 and _points(row[4]) >= 0 and _ends(row[5])[0] >= -1 for table in tables for row in table)
    readme = " ".join(README.read_text(encoding="utf-8").split())
    for generated, squad in zip(*tables):
        assert " | ".join([generated[0], " / ".join(generated[1:4]), generated[4], generated[5].rstrip(" |"),
                           " / ".join(squad[1:4]), *squad[4:]]) in readme
    first = [line.split(": ")[1].lstrip("−") for line in lines if line.startswith("question first")]
    assert f"loses {first[0]} points in block mode to the same words re-laid (blend {first[1]}), {first[2]} on SQuAD (blend {first[3]})" in readme
    rows = [line.split(" | ") for line in lines[36:45]]
    assert all(row[5].rstrip(" |") == "shown met" and _points(row[4]) >= 0 for row in rows)
    assert lines[46:] == ["neither: nowhere", "missed: nowhere", "block below the published full mode: "]
    per_layout = sorted(_points(row[4]) for row in rows[:-1])
    range_ = f"{per_layout[0]:+.1f} to {per_layout[-1]:+.1f}".replace("-", "−")
    assert f"block − full {pooled[2][4]} pooled, {range_} per layout, shown ≥ −2 on every layout" in readme
    left = " ".join((ROOT / "docs" / "layouts.md").read_text(encoding="utf-8").split("## What is left")[1].split())
    assert f"{pooled[2][4]} on 778 per layout (two-look intervals, {range_} per layout): shown ≥ −2 on every layout" in left


def test_the_tenth_stages_table_snippet_prints_the_ninth_stages_figures_from_its_files(monkeypatch, capsys):
    """Pointed at the ninth stage's answers in place of the tenth's, the tenth stage's snippet prints the
    ninth stage's tables and 778-question reading line for line, and no change from it."""
    swaps = {f'"tenth-stage/{name}.jsonl.gz"': f'"ninth-stage/{name}.jsonl.gz"' for name in ("test-p*", "squad-test-[01]", "squad-test-seed1-*")}
    out = run_snippet("layouts.md", "tenth-stage/squad-test-seed1-", monkeypatch, capsys, swaps).splitlines()
    ninth = (ROOT / "docs/results/ninth-stage/tables.txt").read_text(encoding="utf-8").splitlines()
    change = [line for line in out if line.startswith("tenth − ninth stage")]
    assert len(change) == 4 and all(line.endswith(": +0.0 ± 0.0") for line in change)
    assert [line for line in out if line not in change] == [line for line in ninth if not line.startswith("ninth − eighth stage")]


@pytest.mark.parametrize("stage", ["eighth", "ninth", "tenth"])
def test_the_answer_files_reproduce_the_stages_held_out_figures(stage, monkeypatch, capsys):
    """The stage's held-out snippet prints the lines its section lists, from answers that all reused KV
    and, through LlamaIndex, the sixth stage's nodes; the README quotes the shipped stage's counts."""
    out = run_snippet("layouts.md", f'("{stage}-stage/heldout"', monkeypatch, capsys).splitlines()
    section = _fourth_stage().split(f"### The {stage} stage in the set-up users get")[1]
    assert len(out) == 7 and all(f"- {line}" in section for line in out)
    readme = " ".join(README.read_text(encoding="utf-8").split())
    for app, line in (("LangChain's stuff chain", out[0]), ("LlamaIndex's `compact`", out[3])):
        counts = line.split("block / blend / full ")[1].split(",")[0]
        assert (f"{counts} through {app}" in readme) == (stage == "tenth")


def test_the_answer_files_reproduce_the_sixth_stage_in_the_set_up_users_get(monkeypatch, capsys):
    """The sixth stage's snippet in the set-up users get prints its tables (both corpora), the costs of
    the question first and blend's gain over block that the section quotes, and the section's judgement
    of the targets follows from the rows: met everywhere on the generated worlds; on SQuAD missed
    nowhere, blend met where the section says, block shown met nowhere, block below full where it says."""
    out = run_snippet("layouts.md", 'answers("sixth-stage-pilot5/squad-*")', monkeypatch, capsys).splitlines()
    section = _fourth_stage().split("### The sixth stage in the set-up users get")[1]
    assert [out[0], out[13]] == ["generated test", "SQuAD test"] and len(out) == 26
    tables = {corpus: [line.split(" | ") for line in out[start + 1:start + 10]] for corpus, start in (("generated", 0), ("squad", 13))}
    assert all(line in section for line in out if line.startswith("| "))

    def layouts(rows, keep):
        return [row[0].strip("| `*") for row in rows if keep(row)]

    assert all(_ends(row[4])[0] > 14 and _ends(row[5])[0] > 14 for row in tables["generated"])
    squad = tables["squad"]
    assert all(_ends(row[4])[0] < -2 <= _points(row[4]) and _points(row[5]) > 0 for row in squad)  # block: none shown met
    met, below = layouts(squad, lambda row: _ends(row[5])[0] >= -1), layouts(squad, lambda row: _points(row[4]) < 0)
    assert len(met) == 3 and f"Blend − full ≥ −1 is met on `{met[0]}`, `{met[1]}` and {met[2]}," in section
    assert below[0] == "kvrag" and f"on three layouts (kvrag's own, `{below[1]}`, `{below[2]}`), blend's on none" in section
    first = [line.split(": ")[1].lstrip("−") for line in out if line.startswith("question first")]
    gain = [line.removeprefix("blend − block: ") for line in out if line.startswith("blend − block")]
    assert f"Blend − block, pooled: {gain[0]} on the generated worlds, {gain[1]} on SQuAD" in section
    assert f"loses {first[0]} points in block mode and {first[1]} in blend on the generated worlds, {first[2]} and {first[3]} on SQuAD" in section


def test_the_answer_files_reproduce_the_sixth_stage_in_full_mode(monkeypatch, capsys):
    """The sixth stage's full-mode snippet prints its table and its changes from the fourth stage as the
    section gives them; block − full lies below −2 with its whole interval on every layout, as the text
    judges, and "What is left" quotes the pooled row."""
    out = run_snippet("layouts.md", "full-adapter-squad-", monkeypatch, capsys).splitlines()
    section = _fourth_stage().split("### The sixth stage in full mode too")[1]
    rows = [line.split(" | ") for line in out if line.startswith("| ")]
    assert len(rows) == 9 and all(line in section for line in out if line.startswith("| "))
    assert all(f"- {line}" in section for line in out if not line.startswith("| "))
    assert all(_ends(row[5])[1] < -2 for row in rows)
    text = (ROOT / "docs" / "layouts.md").read_text(encoding="utf-8")
    left = " ".join(text[text.index("## What is left"):].split())
    assert f"block trails full by {rows[-1][5].lstrip('−')} points on SQuAD (150 questions per layout" in left
    assert f"({rows[-1][5]} pooled, then −16.6 ± 5.1)" in section and rows[0][1] == "150"


def test_the_answer_files_reproduce_the_partial_squad_figures_of_the_published_weights(monkeypatch, capsys):
    """The second SQuAD snippet prints what its paragraph says: the first questions answered in
    every layout with the published weights, their accuracies and paired differences."""
    out = run_snippet("layouts.md", "squad-test-published", monkeypatch, capsys).splitlines()
    section = _fourth_stage()
    counts, shares = out[0].split(" ", 1)
    shares = ast.literal_eval(shares)  # the dict the snippet prints
    assert f"the first {counts} questions in every layout" in section
    assert (f"published full {shares['published']}, full with the adapter {shares['full']}, block {shares['block']}, "
            f"blend {shares['blend']}") in section
    block, full = out[1].removeprefix("block − published ").split(" full − published ")
    assert f"block − published full {block} pooled" in section and f"published {full}" in section
    per_layout = ast.literal_eval(out[2])
    low, high = (f"{f(per_layout.values()):+d}".replace("-", "−") for f in (min, max))
    assert f"from {low} on `llamaindex-chat-qa` to {high} on `langchain-system-context`" in section


def test_the_answer_files_reproduce_the_blend_training_table(monkeypatch, capsys):
    """The snippet in docs/finetuning.md prints the rows of its attention-trained blend table, and the
    second look's reads pass the rule the text says they pass."""
    out = run_snippet("finetuning.md", "blend-trained-attention-", monkeypatch, capsys).splitlines()
    text = (ROOT / "docs" / "finetuning.md").read_text(encoding="utf-8")
    assert len(out) == 3 and all(line in text for line in out)
    for row in out[1:]:
        gain, block = (cell.replace("−", "-").split(" ± ") for cell in row.split(" | ")[6:8])
        assert float(gain[0]) > float(gain[1]) and float(block[0]) >= -2  # the whole interval above 0
    assert "The second look passes both reads" in text


def test_setup_commands_are_the_two_that_ci_runs():
    text = README.read_text(encoding="utf-8")
    section = text.split("\n## Two commands\n", 1)[1].split("\n## ", 1)[0]
    shell = [code for language, code in FENCE.findall(section) if language in ("bash", "sh")]
    assert [commands(code) for code in shell] == [["./run demo", "./run test"]]
    ci = commands((ROOT / ".ci" / "run").read_text(encoding="utf-8"))
    assert ci[-1] == "./run test"


FAKE_PYTHON = """#!/bin/sh
# Stands in for python3 and the virtualenv's python: logs each call, makes `-m venv DIR` a fake
# virtualenv whose python is this script, and takes a moment over everything else, as pip does.
echo "$*" >> "$FAKE_LOG"
if [ "$1 $2" = "-m venv" ]; then
    mkdir "$3" && mkdir "$3/bin" && cp "$0" "$3/bin/python" && printf '#!/bin/sh\\necho ran "$@"\\n' > "$3/bin/kvrag" &&
        chmod +x "$3/bin/kvrag"
else
    sleep 1
fi
"""


def test_two_runs_started_at_once_set_up_once(tmp_path):
    """`./run` twice at once on a fresh checkout: one installs, the other waits for it and then runs
    (before, both made the virtualenv and the second died on it)."""
    fake = tmp_path / "python3"
    fake.write_text(FAKE_PYTHON)
    fake.chmod(0o755)
    env = {**os.environ, "PYTHON": str(fake), "KVRAG_VENV": str(tmp_path / "venv"), "FAKE_LOG": str(tmp_path / "log")}
    runs = [subprocess.Popen([str(ROOT / "run"), "--version", str(n)], env=env, stdout=subprocess.PIPE,
                             stderr=subprocess.PIPE, text=True) for n in (1, 2)]
    results = [run.communicate(timeout=120) + (run.returncode,) for run in runs]
    assert [code for _, _, code in results] == [0, 0], results
    assert sorted(out for out, _, _ in results) == ["ran --version 1\n", "ran --version 2\n"]
    calls = (tmp_path / "log").read_text().splitlines()
    assert sum(call.startswith("-m venv ") for call in calls) == 1, calls
    assert sum("installing into" in err for _, err, _ in results) == 1


def test_readme_is_short():
    assert len(README.read_text(encoding="utf-8").splitlines()) <= 250


def slug(heading: str) -> str:
    """GitHub's anchor for a Markdown heading."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


@pytest.mark.parametrize("path", [README, *DOCS], ids=lambda p: str(p.relative_to(ROOT)))
def test_links_lead_somewhere(path):
    text = FENCE.sub("", path.read_text(encoding="utf-8"))
    for target in re.findall(r"\]\(([^)\s]+)\)", text):
        if target.startswith(("http://", "https://")):
            continue
        file, _, anchor = target.partition("#")
        linked = (path.parent / file).resolve() if file else path
        assert linked.exists(), f"{path.name} links to {target}, which does not exist"
        if anchor:
            headings = re.findall(r"^#+ (.+)$", FENCE.sub("", linked.read_text(encoding="utf-8")), re.MULTILINE)
            assert anchor in {slug(h) for h in headings}, f"{path.name} links to {target}: no such heading"
