"""`kvrag calibrate`: each reusing setting measured against full on the home's passages, the record written, read
back as the default mode by the engines made for the same set-up and refused, in one line, by any other; bad input
refused in one line with nothing written. Tiny random models, and the real default model through the CLI (e2e)."""

import json
import warnings
from dataclasses import replace

import pytest

from kvrag import BlendConfig, calibrate
from kvrag.app.cli import main
from kvrag.errors import KVRagError

PASSAGES = ["The lighthouse was built in 1873 by Ilsa Brandt.", "Orvanne's capital is Saltmere, a harbour town.",
            "The river Olm freezes every winter near Kettering.", "Maren Solvik painted the Tin Harvest mural."]
QUESTIONS = [("Who built the lighthouse?", ("Brandt",)), ("What is the capital of Orvanne?", ("Saltmere",)),
             ("Which river freezes in winter?", ("Olm",)), ("Who painted the mural?", ())]


class Retriever:
    """A user's own retriever (calibrate takes anything with `search`, `texts` and `len`): the passages that share
    the most words with the question first."""

    def __init__(self, passages):
        self.passages = list(passages)

    def __len__(self):
        return len(self.passages)

    def texts(self, limit=None):
        return list(self.passages)

    def search(self, question, k=4):
        words = set(question.lower().split())
        return sorted(self.passages, key=lambda p: -len(words & set(p.lower().split())))[:k]


def _calibrated(make_engine, **options):
    engine = make_engine(default_mode="calibrated")
    engine.index(PASSAGES, progress=False)
    options = {"settings": ["prefix", "block"], "top_k": 2, "max_new_tokens": 6, "progress": False, **options}
    return engine, engine.calibrate(QUESTIONS, index=Retriever(PASSAGES), **options)


def test_the_record_measures_each_setting_against_full_and_is_read_back(make_engine):
    engine, record = _calibrated(make_engine)
    path = calibrate.record_path(engine)
    assert json.loads(path.read_text()) == record
    assert record["questions"] == 4 and [r["setting"] for r in record["settings"]] == ["prefix", "block"]
    assert record["model"] == engine.fingerprint and record["full"]["accuracy"] is not None  # some gold answers
    prefix = record["settings"][0]
    assert prefix["agree"] == 1.0 and prefix["first"] == 1.0  # exact prefix reuse is full's computation
    assert record["chosen"] == calibrate.decide(record["settings"], record["full"]["ttft"], 0.95, 0.9)
    assert engine.default_mode == calibrate.chosen(record, engine.blend)[0]
    # the record chose for a later engine on the same weights, layout and home; forced to a reusing choice here
    record["chosen"] = "block"
    path.write_text(json.dumps(record))
    again = make_engine(default_mode="calibrated")
    assert again.default_mode == "block" and again.calibration["chosen"] == "block"
    assert make_engine(default_mode="full").default_mode == "full"  # a mode given is the mode


def test_an_interrupted_calibration_resumes_and_new_questions_start_afresh(make_engine):
    engine, _ = _calibrated(make_engine)
    answers = calibrate.record_dir(engine.home) / f"{engine.fingerprint[:16]}.answers.jsonl"
    lines = answers.read_text().splitlines()
    assert len(lines) == 1 + 3 * len(QUESTIONS)
    answers.write_text("\n".join(lines[:-2]) + "\n" + lines[-2][:20])  # killed while writing an answer
    engine.calibrate(QUESTIONS, index=Retriever(PASSAGES), settings=["prefix", "block"], top_k=2, max_new_tokens=6,
                     progress=False)
    resumed = answers.read_text().splitlines()
    assert len(resumed) == len(lines) and resumed[:-2] == lines[:-2]  # only what was missing was answered
    engine.calibrate(QUESTIONS[:2], index=Retriever(PASSAGES), settings=["block"], top_k=2, max_new_tokens=6,
                     progress=False)
    assert len(answers.read_text().splitlines()) == 1 + 2 * 2
    engine.blend = replace(engine.blend, recompute_ratio=0.5)  # as a chosen blend setting brings its own
    engine.calibrate(QUESTIONS[:2], index=Retriever(PASSAGES), settings=["block"], top_k=2, max_new_tokens=6,
                     progress=False)  # the same questions under other settings: answered afresh
    assert json.loads(answers.read_text().splitlines()[0])["settings"]["blend"]["recompute_ratio"] == 0.5


@pytest.mark.parametrize("field", ["model", "adapter", "layout", "kvrag", "block_context"])
def test_a_record_for_another_set_up_is_refused_in_one_line_and_requests_get_full(make_engine, field):
    engine, record = _calibrated(make_engine)
    record.update(chosen="block", **{field: "something else"})
    calibrate.record_path(engine).write_text(json.dumps(record))
    with pytest.warns(RuntimeWarning, match=f"differs in: {field}\\); requests that name no mode get full") as said:
        again = make_engine(default_mode="calibrated")
    assert again.default_mode == "full" and again.calibration is None
    assert len(said) == 1 and "\n" not in str(said[0].message)


def test_the_record_of_other_weights_in_the_home_is_named_and_not_used(make_engine):
    engine, record = _calibrated(make_engine)
    record["chosen"] = "block"
    calibrate.record_path(engine).write_text(json.dumps(record))
    with pytest.warns(RuntimeWarning, match="differs in: model, causal_model"):
        other = make_engine(seed=1, default_mode="calibrated")
    assert other.default_mode == "full"


@pytest.mark.parametrize("content", [b"not json", b"[1, 2]", b'{"chosen": "block", "settings": []}',
                                     b'{"chosen": "x", "settings": [{"setting": "x", "mode": "rm -rf", "blend": null}]}',
                                     b'{"chosen": "x", "settings": [{"setting": "x", "mode": "blend", '
                                     b'"blend": {"check_layers": [99]}}]}', b'{"target": "high"}', b" " * (2 << 20)])
def test_an_unreadable_record_is_named_and_not_used(make_engine, content):
    engine = make_engine(default_mode="calibrated")
    path = calibrate.record_path(engine)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(content)
    with pytest.warns(RuntimeWarning, match="unreadable"):
        again = make_engine(default_mode="calibrated")
    assert again.default_mode == "full"


def test_the_choice_is_the_fastest_setting_that_meets_the_target_and_the_floor():
    rows = [{"setting": "block", "agree": 0.97, "agree_half": 0.09, "ttft": 0.1},  # interval too wide: 0.88
            {"setting": "auto", "agree": 0.96, "agree_half": 0.04, "ttft": 0.3},
            {"setting": "prefix", "agree": 1.0, "agree_half": 0.0, "ttft": 0.9},
            {"setting": "blend@0.3", "agree": 0.94, "agree_half": 0.01, "ttft": 0.2}]
    assert calibrate.decide(rows, 1.0, 0.95, 0.9) == "auto"
    assert calibrate.decide(rows, 1.0, 0.95, 0.85) == "block"
    assert calibrate.decide(rows, 0.25, 0.95, 0.9) is None  # nothing that meets it is faster than full
    assert calibrate.decide(rows, 1.0, 1.0, 1.0) == "prefix"


def test_settings_run_as_the_bench_runs_them(engine):
    mode, config = calibrate.setting_mode("lookahead@0.3", engine.blend)
    assert (mode, config.select, config.recompute_ratio) == ("blend", "lookahead", 0.3)
    assert calibrate.setting_mode("auto", engine.blend) == ("auto", engine.blend)
    with pytest.raises(ValueError, match="unknown setting 'fast'"):
        calibrate.setting_mode("fast", engine.blend)


def test_bad_input_is_one_line_and_writes_nothing(make_engine, tmp_path):
    engine = make_engine(default_mode="calibrated")
    for target, floor in ((0, 0), (1.5, 0.9), (0.9, 0.95)):
        with pytest.raises(ValueError, match="target|floor"):
            engine.calibrate(QUESTIONS, index=Retriever(PASSAGES), target=target, floor=floor)
    with pytest.raises(KVRagError, match="nothing is indexed yet"):
        engine.calibrate(QUESTIONS, index=Retriever([]))
    with pytest.raises(ValueError, match="unknown setting"):
        engine.calibrate(QUESTIONS, index=Retriever(PASSAGES), settings=["block", "fastest"])
    assert not calibrate.record_dir(engine.home).exists()
    empty, binary, broken = tmp_path / "empty.txt", tmp_path / "binary.txt", tmp_path / "broken.jsonl"
    empty.write_text("\n  \n")
    binary.write_bytes(b"\x7fELF\x00\x01\x02")
    broken.write_text('{"question": "Who?"}\n{"answers": ["x"]}\n')
    for path, message in ((empty, "holds no questions"), (binary, "binary data"), (broken, "broken.jsonl:2 is not a")):
        with pytest.raises(KVRagError, match=message) as raised:
            calibrate.read_questions(path)
        assert "\n" not in str(raised.value)
    good = tmp_path / "good.jsonl"
    good.write_text('Who built it?\n{"question": "Where?", "answers": ["Saltmere"]}\n')
    assert calibrate.read_questions(good) == [("Who built it?", ()), ("Where?", ("Saltmere",))]


def test_cli_calibrate_refuses_bad_input_in_one_line_before_the_model_loads(tmp_path, capsys):
    questions = tmp_path / "q.txt"
    questions.write_bytes(b"\x00\x01")
    home = tmp_path / "home"
    for argv, message in ((["--target", "1.5"], "target is a share"), (["--questions", str(questions)], "binary"),
                          ([], "nothing is indexed yet")):
        assert main(["--home", str(home), "calibrate", *argv]) == 2  # the default model never loaded
        err = capsys.readouterr().err
        assert message in err and err.count("\n") == 1
    assert not (home / "calibration").exists()
    unwritable = tmp_path / "file"
    unwritable.write_text("")
    assert main(["--home", str(unwritable), "calibrate"]) == 2
    assert "not a writable directory" in capsys.readouterr().err


@pytest.mark.e2e
def test_calibrate_on_the_sample_corpus_then_ask_uses_the_choice(tmp_path, capsys):
    """The README's path on the real default model: index the sample corpus, calibrate on questions the model
    writes, show the record; `ask` then answers in the chosen mode."""
    from importlib import resources

    sample = str(resources.files("kvrag") / "sample")
    home = ["--home", str(tmp_path)]
    assert main([*home, "index", sample]) == 0
    capsys.readouterr()
    assert main([*home, "calibrate", "--count", "4", "--settings", "prefix,block", "--plot", ""]) == 0
    out = capsys.readouterr().out
    assert "prefix" in out and "block" in out and "chosen:" in out
    records = list((tmp_path / "calibration").glob("*.json"))
    record = json.loads(records[0].read_text())
    assert record["questions"] >= 2 and record["source"].startswith("made by the model")
    assert record["settings"][0]["agree"] >= 0.75  # prefix reuse is full's computation, up to rounding
    assert main([*home, "calibrate", "--show", "--plot", str(tmp_path / "record.png")]) == 0
    assert (tmp_path / "record.png").stat().st_size > 0 and "chosen:" in capsys.readouterr().out
    with warnings.catch_warnings():
        warnings.simplefilter("error", RuntimeWarning)  # the record is this engine's: nothing said
        assert main([*home, "ask", "Who built the Glimmerhook Lighthouse?", "--max-new-tokens", "8"]) == 0
    assert f"[{calibrate.chosen(record, BlendConfig())[0]}]" in capsys.readouterr().err


def test_the_integrations_answer_in_the_calibrated_mode(make_engine):
    """ChatKVRag and KVRagLLM name no mode by default: they get the calibrated engine's choice."""
    from langchain_kvrag import ChatKVRag
    from llama_index.llms.kvrag import KVRagLLM

    engine, record = _calibrated(make_engine)
    record["chosen"] = "block"
    calibrate.record_path(engine).write_text(json.dumps(record))
    calibrated = make_engine(default_mode="calibrated")
    prompt = f"{PASSAGES[0]}\n\n{PASSAGES[1]}\n\nQuestion: {QUESTIONS[0][0]}"
    reply = ChatKVRag(engine=calibrated, max_tokens=4).invoke(prompt)
    assert reply.response_metadata["mode"] == "block"
    completion = KVRagLLM(engine=calibrated, max_new_tokens=4).complete(prompt)
    assert completion.additional_kwargs["mode"] == "block", completion.additional_kwargs
