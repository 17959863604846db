"""The `kvrag` command without a model: help texts and defaults, what it imports, the checks it makes
before any work, and the kernels commands; index and ask into a Chroma server on a tiny model. (Index,
ask and demo on the real model: test_e2e.py.)"""

import argparse
import os
import subprocess
import sys
from dataclasses import asdict

import pytest
from servers import free_port

from kvrag.app import cli
from kvrag.app.cli import build_parser, main
from kvrag.app.retrieval import chroma_collection


def _parsers(parser: argparse.ArgumentParser, name: str = "kvrag"):
    """Every parser of the command line, with its command path."""
    yield name, parser
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for sub, child in action.choices.items():
                yield from _parsers(child, f"{name} {sub}")


def _help(argv) -> str:
    with pytest.raises(SystemExit) as exit_:
        main([*argv, "--help"])
    assert exit_.value.code == 0
    return ""


def test_every_option_has_help_text_and_shows_its_default():
    for name, parser in _parsers(build_parser()):
        formatter = parser._get_formatter()
        for action in parser._actions:
            if not action.option_strings or isinstance(action, argparse._HelpAction):
                continue
            flag = action.option_strings[-1]
            assert action.help, f"`{name}` {flag}: no help text"
            assert "(default" in formatter._get_help_string(action), f"`{name}` {flag}: no default shown"


@pytest.mark.parametrize(
    "argv, expected",
    [
        (["ask"], ["--mode", "composite keeps encode positions (default: block)", "--top-k TOP_K",
                   "passages retrieved for the question (default: 4)", "longest answer in tokens (default: 128)",
                   "--block-context {none,prefix}", "(default: none)"]),
        (["index"], ["longest passage in tokens (default: 200)", "--block-context {none,prefix}", "(default: none)"]),
        ([], ["--block-context {none,prefix}", "(default: none)", "--adapter-scope {block,all}", "(default: block)"]),
        (["bench", "accuracy"], ["(default: full,map_reduce,map_rerank,block,blend,composite; in other prompt layouts "
                                  "full,block,blend)", "needs matplotlib", "or 'all': kvrag, langchain-rag-prompt"]),
        (["finetune"], ["optimizer steps (default: 170)", "peak learning rate (default: 0.0005)"]),
        (["kernels"], ["build", "status"]),
    ],
)
def test_help_texts(argv, expected, capsys):
    _help(argv)
    text = " ".join(capsys.readouterr().out.split())
    for piece in expected:
        assert " ".join(piece.split()) in text, piece


def test_model_options_are_taken_before_or_after_the_command():
    parse = build_parser().parse_args
    assert parse(["ask", "q"]).block_context == "none"
    assert parse(["ask", "q", "--block-context", "prefix"]).block_context == "prefix"
    assert parse(["--block-context", "prefix", "ask", "q"]).block_context == "prefix"  # not undone by the command's
    assert parse(["--adapter", "none", "index", "docs", "--home", "h"]).adapter == "none"
    with pytest.raises(SystemExit):
        parse(["kernels", "status", "--model", "m"])  # loads no model


def test_neither_import_kvrag_nor_help_loads_the_harness_or_matplotlib():
    code = (
        "import sys\n"
        "import kvrag\n"
        "def loaded(): return sorted(m for m in sys.modules if m.split('.')[0] == 'matplotlib' "
        "or m.startswith(('kvrag.eval', 'kvrag.train', 'kvrag.app')))\n"
        "print('import', loaded())\n"
        "from kvrag.app.cli import main\n"
        "for argv in (['--help'], ['ask', '--help'], ['bench', 'accuracy', '--help'], ['finetune', '--help']):\n"
        "    try:\n"
        "        main(argv)\n"
        "    except SystemExit:\n"
        "        pass\n"
        "print('help', loaded())\n"
    )
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-3000:]
    lines = [line for line in run.stdout.splitlines() if line.startswith(("import ", "help "))]
    assert lines == ["import []", "help ['kvrag.app', 'kvrag.app.cli']"]


def test_the_defaults_written_in_the_cli_are_the_harness_defaults():
    from kvrag.eval.accuracy import EXTRA_METHODS, METHODS, MODE_METHODS, RUNNERS
    from kvrag.eval.layouts import NAMES
    from kvrag.train.finetune import TEACHERS, TrainConfig

    assert cli.BENCH_METHODS == METHODS and cli.BENCH_EXTRA_METHODS == EXTRA_METHODS
    assert cli.BENCH_LAYOUTS == NAMES and set(cli.LAYOUT_METHODS) <= set(MODE_METHODS)
    assert set(RUNNERS) == set(METHODS + EXTRA_METHODS)
    trained = asdict(TrainConfig())
    assert cli.TRAIN_DEFAULTS == {key: trained[key] for key in cli.TRAIN_DEFAULTS}
    assert cli.TRAIN_TEACHERS == TEACHERS


@pytest.mark.parametrize(
    "args, message",
    [(["--methods", "full,stuffing"], "unknown method"), (["--passages", "40"], "between 5 and 30"),
     (["--limit", "0"], "n must be"), (["--prompts", "kvrag,chatml"], "unknown prompt layout(s) ['chatml']"),
     (["--prompts", "all", "--methods", "block,map_reduce"], "map_reduce write their own prompts"),
     (["--prose", "2"], "prose must be between 0 and 1"), (["--concurrency", "0"], "--concurrency must be 1 or more")],
)
def test_bench_accuracy_rejects_bad_arguments_before_loading_anything(args, message, capsys, monkeypatch):
    monkeypatch.setattr("kvrag.app.cli._engine", lambda args: pytest.fail("loaded a model"))
    assert main(["bench", "accuracy", *args]) == 2
    assert message in capsys.readouterr().err


def test_bench_accuracy_without_matplotlib_stops_before_any_work(capsys, monkeypatch):
    from kvrag.eval import data

    monkeypatch.setitem(sys.modules, "matplotlib", None)  # not installed, as far as imports go
    monkeypatch.setattr(data, "generate", lambda *a, **k: pytest.fail("generated questions"))
    monkeypatch.setattr("kvrag.app.cli._engine", lambda args: pytest.fail("loaded a model"))
    assert main(["bench", "accuracy"]) == 2
    err = capsys.readouterr().err
    assert "pip install matplotlib" in err and "--plot ''" in err
    monkeypatch.setattr(data, "generate", lambda *a, **k: (_ for _ in ()).throw(ValueError("generating")))
    assert main(["bench", "accuracy", "--plot", ""]) == 2  # no plot wanted: the run goes on to its questions
    assert "generating" in capsys.readouterr().err


def test_kernels_build_and_status_load_no_model(capsys, monkeypatch, tmp_path):
    from kvrag import kernels

    built = []
    monkeypatch.setattr("kvrag.app.cli._engine", lambda args: pytest.fail("loaded a model"))
    monkeypatch.setattr(kernels, "build", lambda force=False: built.append((force, os.environ["KVRAG_HOME"])) or "on (test)")
    monkeypatch.setattr(kernels, "library", lambda: None)
    monkeypatch.setattr(kernels, "status", lambda: "off (test)")
    monkeypatch.setenv("KVRAG_HOME", str(tmp_path / "default"))
    assert main(["kernels", "build"]) == 0
    assert capsys.readouterr().out == "kernels: on (test)\n"
    assert main(["--home", str(tmp_path / "other"), "kernels", "build", "--force"]) == 0  # built under --home
    assert built == [(False, str(tmp_path / "default")), (True, str(tmp_path / "other"))]
    assert main(["kernels", "status"]) == 0
    assert capsys.readouterr().out.splitlines()[-1] == "kernels: off (test)"


def test_cli_refuses_a_non_utf8_file_and_indexes_nothing(tmp_path, capsys):
    home = tmp_path / "home"
    docs = tmp_path / "docs"
    docs.mkdir()
    (docs / "good.txt").write_text("The Varnholm lighthouse was built in 1873 by the engineer Ilsa Brandt.")
    (docs / "bad.txt").write_bytes(b"caf\xe9 au lait")
    assert main(["--home", str(home), "index", str(docs)]) == 2
    assert "bad.txt is not UTF-8" in capsys.readouterr().err
    assert not home.exists()  # checked before the model was even loaded: no KV, no Chroma collection


# ---- the passage index in a Chroma server (`chroma run`), on a tiny model ------------------------------

PASSAGES = ["The lighthouse of Varnholm was built in 1873 by the engineer Ilsa Brandt.",
            "The river Olm freezes every winter, and the ferry stops until spring."]


def test_index_and_ask_keep_the_passages_in_a_chroma_server(saved_model_and_adapter, tmp_path, chroma, monkeypatch,
                                                            capsys):
    model_dir, _ = saved_model_and_adapter
    docs = tmp_path / "docs"
    docs.mkdir()
    (docs / "a.md").write_text("\n\n".join(PASSAGES))
    model = ["--model", str(model_dir), "--adapter", "none", "--device", "cpu"]
    assert main([*model, "--home", str(tmp_path / "indexer"), "--chroma", chroma, "index", str(docs),
                 "--max-tokens", "40"]) == 0
    assert f"into Chroma at {chroma}" in capsys.readouterr().out
    assert not (tmp_path / "indexer" / "chroma").exists()  # nothing embedded
    stored = chroma_collection(chroma, "kvrag-passages").get()
    assert sorted(stored["documents"]) == sorted(PASSAGES)
    assert {m["source"] for m in stored["metadatas"]} == {str(docs / "a.md")}
    # another machine's home, the server named by $KVRAG_CHROMA: the passages are found there
    monkeypatch.setenv("KVRAG_CHROMA", chroma)
    assert main([*model, "--home", str(tmp_path / "asker"), "ask", "Who built the lighthouse?", "--top-k", "1",
                 "--max-new-tokens", "2"]) == 0
    assert "[block] TTFT" in capsys.readouterr().err
    assert not (tmp_path / "asker" / "chroma").exists()


def test_a_chroma_server_that_does_not_answer_stops_the_cli_before_the_model_loads(tmp_path, capsys):
    docs = tmp_path / "docs"
    docs.mkdir()
    (docs / "a.md").write_text(PASSAGES[0])
    url = f"http://127.0.0.1:{free_port()}"
    for argv in (["index", str(docs)], ["ask", "Who built the lighthouse?"], ["serve"]):
        assert main(["--model", str(tmp_path / "no-model"), "--chroma", url, *argv]) == 2  # never loaded
        err = capsys.readouterr().err
        assert f"kvrag: error: no Chroma server at {url} (" in err and "chroma run --path DIR --port" in err
    assert main(["--chroma", "localhost:8000", "ask", "Who built the lighthouse?"]) == 2
    assert "http://HOST[:PORT]" in capsys.readouterr().err
