"""The `kvrag` command without a model: help texts and defaults, what it imports, the checks it makes
before any work, and the kernels commands; index and ask into a Chroma server on a tiny model. (Index,
ask and demo on the real model: test_e2e.py.)"""

import argparse
import json
import os
import subprocess
import sys
import time
import urllib.error
import urllib.request
from dataclasses import asdict
from pathlib import Path

import pytest
from servers import free_port

from kvrag import KVEngine, KVRagError
from kvrag.app.cli import ask, bench, common, finetune, serve
from kvrag.app.cli import build_parser, main
from kvrag.retrieval import chroma_collection


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
        (["ask"], ["--mode", "composite keeps encode positions (default: what `kvrag calibrate` chose for this model and home, else full", "--top-k TOP_K",
                   "passages retrieved for the question (default: 4)", "longest answer in tokens (default: 128)",
                   "--block-context {auto,none,prefix,ape,document}", "(default: auto)"]),
        (["index"], ["longest passage in tokens (default: 200)", "--block-context {auto,none,prefix,ape,document}", "(default: auto)"]),
        ([], ["--block-context {auto,none,prefix,ape,document}", "(default: auto)", "--adapter-scope {block,all}", "(default: all)"]),
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
    assert parse(["ask", "q"]).block_context == "auto"
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
    commands = ["ask", "bench", "common", "demo", "finetune", "index", "kernels", "main", "serve"]  # the parser's modules
    assert lines == ["import []", f"help {['kvrag.app', 'kvrag.app.cli', *(f'kvrag.app.cli.{m}' for m in commands)]}"]


def test_the_defaults_written_in_the_cli_are_the_harness_defaults():
    from kvrag.eval.accuracy import EXTRA_METHODS, METHODS, MODE_METHODS, RUNNERS
    from kvrag.eval.layouts import NAMES
    from kvrag.train.finetune import TEACHERS, TrainConfig

    assert bench.BENCH_METHODS == METHODS and bench.BENCH_EXTRA_METHODS == EXTRA_METHODS
    assert bench.BENCH_LAYOUTS == NAMES and set(bench.LAYOUT_METHODS) <= set(MODE_METHODS)
    assert set(RUNNERS) == set(METHODS + EXTRA_METHODS)
    trained = asdict(TrainConfig())
    assert finetune.TRAIN_DEFAULTS == {key: trained[key] for key in finetune.TRAIN_DEFAULTS}
    assert finetune.TRAIN_TEACHERS == TEACHERS
    from typing import get_args

    from kvrag import MODES, BlendConfig
    from kvrag.engine import ADAPTER_SCOPES, BLOCK_CONTEXTS, LEARN_PROMPTS

    assert (common.MODES, common.ADAPTER_SCOPES, common.BLOCK_CONTEXTS) == (MODES, ADAPTER_SCOPES, BLOCK_CONTEXTS)
    assert serve.LEARN_PROMPTS == LEARN_PROMPTS
    from kvrag import calibrate

    assert ask.CALIBRATE_SETTINGS == calibrate.SETTINGS
    calibrate_options = {a.dest: a.default for a in dict(_parsers(build_parser()))["kvrag calibrate"]._actions}
    assert (calibrate_options["target"], calibrate_options["floor"]) == (calibrate.TARGET, calibrate.FLOOR)
    assert finetune.BLEND_SELECT[0] == BlendConfig.select and set(finetune.BLEND_SELECT) == set(
        get_args(BlendConfig.__annotations__["select"])) - {"lookahead"}  # training chooses on layer 1 only


@pytest.mark.parametrize(
    "args, message",
    [(["--methods", "full,stuffing"], "unknown method"), (["--passages", "40"], "between 5 and 30"),
     (["--limit", "0"], "n must be"), (["--prompts", "kvrag,chatml"], "unknown prompt layout(s) ['chatml']"),
     (["--prompts", "all", "--methods", "block,map_reduce"], "map_reduce write their own prompts"),
     (["--prose", "2"], "prose must be between 0 and 1"), (["--concurrency", "0"], "--concurrency must be 1 or more")],
)
def test_bench_accuracy_rejects_bad_arguments_before_loading_anything(args, message, capsys, monkeypatch):
    monkeypatch.setattr(common, "engine", lambda args: pytest.fail("loaded a model"))
    assert main(["bench", "accuracy", *args]) == 2
    assert message in capsys.readouterr().err


def test_bench_accuracy_without_matplotlib_stops_before_any_work(capsys, monkeypatch):
    from kvrag.eval import data

    monkeypatch.setitem(sys.modules, "matplotlib", None)  # not installed, as far as imports go
    monkeypatch.setattr(data, "generate", lambda *a, **k: pytest.fail("generated questions"))
    monkeypatch.setattr(common, "engine", lambda args: pytest.fail("loaded a model"))
    assert main(["bench", "accuracy"]) == 2
    err = capsys.readouterr().err
    assert "pip install matplotlib" in err and "--plot ''" in err
    monkeypatch.setattr(data, "generate", lambda *a, **k: (_ for _ in ()).throw(ValueError("generating")))
    assert main(["bench", "accuracy", "--plot", ""]) == 2  # no plot wanted: the run goes on to its questions
    assert "generating" in capsys.readouterr().err


def _finetune_args(argv, monkeypatch) -> argparse.Namespace:
    """The options `kvrag finetune` would train with, read without training (or loading) anything."""
    seen = []
    monkeypatch.setattr(finetune, "cmd_finetune", seen.append)
    assert main(["finetune", *argv]) == 0
    return seen[0]


def test_finetune_config_file_sets_options_that_the_command_line_overrides(tmp_path, monkeypatch, capsys):
    config = tmp_path / "run.json"
    config.write_text(json.dumps({"out": "runs/a", "steps": 7, "lr": 0.001, "init-adapter": "runs/b/adapter",
                                  "full_attention_share": 0, "blend-select": "deviation", "seed": 5, "note": 1}))
    assert main(["finetune", "--config", str(config)]) == 2
    assert "'note' is not an option of `kvrag finetune`" in capsys.readouterr().err
    config.write_text(config.read_text().replace(', "note": 1', ""))
    args = _finetune_args(["--config", str(config)], monkeypatch)
    assert (args.out, args.steps, args.lr, args.init_adapter, args.blend_select) == ("runs/a", 7, 0.001, "runs/b/adapter",
                                                                                     "deviation")
    assert args.full_attention_share == 0.0 and isinstance(args.full_attention_share, float)
    assert (args.accumulate, args.lora_r) == (4, 8)  # what the file leaves out keeps its default
    args = _finetune_args(["elsewhere", "--config", str(config), "--steps", "9", "--seed", "0"], monkeypatch)
    assert (args.out, args.steps, args.seed, args.lr) == ("elsewhere", 9, 0, 0.001)  # given, even at the default


@pytest.mark.parametrize("options, message", [({"steps": "many"}, "steps is a whole number, got 'many'"),
                                              ({"steps": 1.5}, "steps is a whole number"),
                                              ({"full": 1}, "full is true or false"),
                                              ({"distill-from": "teacher"}, "distill-from is one of adapter, published"),
                                              ({"model": "m"}, "'model' is not an option")])
def test_finetune_config_options_are_checked_as_the_command_line_checks_them(options, message, tmp_path, capsys):
    config = tmp_path / "run.json"
    config.write_text(json.dumps(options))
    assert main(["finetune", "out", "--config", str(config)]) == 2
    assert message in capsys.readouterr().err


def test_finetune_config_runs_are_chosen_by_name(tmp_path, monkeypatch, capsys):
    config = tmp_path / "recipe.json"
    config.write_text(json.dumps({"about": "two runs", "runs": [
        {"name": "first", "out": "runs/first", "steps": 3},
        {"name": "second", "out": "runs/second", "before": ["made elsewhere"], "init-adapter": "runs/first/adapter"}]}))
    args = _finetune_args(["--config", str(config), "--run", "second"], monkeypatch)
    assert (args.out, args.init_adapter, args.steps) == ("runs/second", "runs/first/adapter", 170)
    for argv, message in [([], "holds 2 runs: name one with --run (first, second)"),
                          (["--run", "third"], "has no run 'third'; its runs: first, second")]:
        assert main(["finetune", "--config", str(config), *argv]) == 2
        assert message in capsys.readouterr().err
    config.write_text(json.dumps({"runs": [{"name": "only", "steps": 3}]}))
    assert _finetune_args(["out", "--config", str(config)], monkeypatch).steps == 3
    monkeypatch.undo()  # the command itself: it stops before loading anything
    assert main(["finetune", "--config", str(config)]) == 2  # no OUT anywhere
    assert "finetune needs OUT" in capsys.readouterr().err


def test_the_finetune_recipe_of_the_shipped_adapter_ends_in_the_run_its_training_record_describes(monkeypatch):
    from kvrag.loading import DEFAULT_ADAPTER

    recipe = DEFAULT_ADAPTER / "recipe.json"
    runs = json.loads(recipe.read_text())["runs"]
    made = []
    for run in runs:  # each run is a valid option set; each continues from what an earlier run or its 'before' made
        args = _finetune_args(["--config", str(recipe), "--run", run["name"]], monkeypatch)
        assert args.out == run["out"] and not os.path.isabs(args.out)
        if args.init_adapter:
            assert args.init_adapter in made or any(step.startswith(args.init_adapter) for step in run.get("before", []))
        if args.squad_answers:
            assert any(step.endswith(f"--results {args.squad_answers}") for step in run["before"])
        made.append(f"{args.out}/adapter")
    record = json.loads((DEFAULT_ADAPTER / "training.json").read_text())
    assert record["recipe"].startswith(f"recipe.json, run {runs[-1]['name']!r}")
    assert asdict(finetune.train_config(args)) == record["config"]
    assert args.adapter_scale == record["adapter_scale"]
    shipped = json.loads((DEFAULT_ADAPTER / "adapter_config.json").read_text())
    assert shipped["lora_alpha"] == args.adapter_scale * args.lora_r
    about = record["about"]
    assert about["dataset"] == {"split": "train", "n": args.questions - round(args.squad_share * args.questions),
                                "passages": args.passages, "noise": args.noise, "seed": args.seed, "prose": args.prose}
    assert (about["unanswerable_share"], about["squad_passages"], about["blend_select"]) == (
        args.unanswerable_share, args.squad_passages, args.blend_select)
    assert about["layouts"] == bench.prompt_layouts(args.prompts) and about["squad_answers"] == Path(args.squad_answers).name
    assert "init_adapter_training" not in about  # its own run only: the runs before it are the recipe's


def test_kernels_build_and_status_load_no_model(capsys, monkeypatch, tmp_path):
    from kvrag import kernels

    built = []
    monkeypatch.setattr(common, "engine", lambda args: pytest.fail("loaded a model"))
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


def test_index_with_document_context_encodes_each_passage_after_the_one_before_it_in_its_file(
        tmp_path, saved_model_and_adapter, capsys):
    """`kvrag --block-context document index`: a file's passages after the passage before them in the file, each
    file's first alone (their blocks start where that text ends, or at 0)."""
    from kvrag import KVEngine
    from kvrag.app.split import read_text, split_passages

    model_dir, _ = saved_model_and_adapter
    options = ["--model", str(model_dir), "--adapter", "none", "--device", "cpu", "--home", str(tmp_path / "home"),
               "--block-context", "document"]
    docs = tmp_path / "docs"
    docs.mkdir()
    (docs / "a.txt").write_text("\n\n".join(PASSAGES))
    (docs / "b.txt").write_text(PASSAGES[0] + " Again.")
    assert main([*options, "index", str(docs), "--max-tokens", "24"]) == 0
    assert "passages from 2 files" in capsys.readouterr().out
    engine = KVEngine.from_pretrained(str(model_dir), adapter=None, device="cpu", home=tmp_path / "home",
                                      block_context="document", warm_up=False)
    count = lambda text: len(engine.layout.encode(text))  # noqa: E731
    for name in ("a.txt", "b.txt"):
        ids = [engine.layout.passage_ids(p) for p in split_passages(read_text(docs / name), count, 24)]
        keys = engine.blocks.keys(engine.layout.prefix_ids, ids)
        assert len(ids) >= (2 if name == "a.txt" else 1)
        assert [engine.store.get(key, "document")[0].start for key in keys] == [0] + [len(i) for i in ids[:-1]]


def test_errors_a_user_can_cause_are_one_line_naming_the_path(tmp_path, saved_model_and_adapter, capsys):
    """An unusable KVRAG_HOME, a model path that is not there, empty files: one line each, naming it."""
    model_dir, _ = saved_model_and_adapter
    model = ["--model", str(model_dir), "--adapter", "none", "--device", "cpu"]
    docs = tmp_path / "docs"
    docs.mkdir()
    (docs / "empty.txt").write_text("\n  \n")
    assert main([*model, "--home", str(tmp_path / "home"), "index", str(docs / "empty.txt")]) == 2
    assert capsys.readouterr().err == f"kvrag: error: nothing to index: {docs / 'empty.txt'} is empty\n"
    (docs / "a.txt").write_text(PASSAGES[0])
    with pytest.warns(UserWarning) as said:
        assert main([*model, "--home", str(tmp_path / "home"), "index", str(docs)]) == 0
    assert [str(w.message) for w in said] == [f"kvrag: skipping empty file {docs / 'empty.txt'}"]
    assert "indexed 1 passages from 1 files" in capsys.readouterr().out
    occupied = tmp_path / "a-file"
    occupied.write_text("not a directory")
    for home in (occupied, occupied / "below"):
        assert main([*model, "--home", str(home), "index", str(docs / "a.txt")]) == 2
        err = capsys.readouterr().err
        assert err.startswith(f"kvrag: error: kvrag keeps its files in {home} (KVRAG_HOME or --home), which is not "
                              "a writable directory: ") and err.count("\n") == 1, err
        with pytest.raises(KVRagError, match=f"kvrag keeps its files in {home} "):
            KVEngine.from_pretrained(str(model_dir), home=home)
    for missing in (tmp_path / "nonexistent", "./models/nowhere", "~/no-such-model.gguf"):
        assert main(["--model", str(missing), "--home", str(tmp_path / "home"), "index", str(docs / "a.txt")]) == 2
        err = capsys.readouterr().err
        assert err.startswith(f"kvrag: error: no model at {Path(missing).expanduser()}: ") and err.count("\n") == 1, err


def test_ask_with_nothing_indexed_says_where_it_looked_and_what_to_do(tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("KVRAG_CHROMA", "")
    assert main(["--home", str(tmp_path), "ask", "Who built the lighthouse?"]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"kvrag: error: nothing is indexed yet in {tmp_path / 'chroma'}: run `kvrag index")
    assert "kvrag ask --server URL" in err and err.count("\n") == 1


def test_argument_and_path_errors_come_before_torch_is_imported(tmp_path):
    code = (
        "import sys\n"
        "from kvrag.app.cli import main\n"
        f"codes = [main(['--model', {str(tmp_path / 'nowhere')!r}, 'ask', 'Who?']), main(['index', {str(tmp_path)!r}])]\n"
        "try:\n"
        "    main(['ask', 'Who?', '--mode', 'fast'])\n"
        "except SystemExit as exc:\n"
        "    codes.append(exc.code)\n"
        "print(codes, 'torch' in sys.modules)\n"
    )
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert run.stdout.strip() == "[2, 2, 2] False", run.stderr[-3000:]
    assert "no model at" in run.stderr and "no text files" in run.stderr and "invalid choice: 'fast'" in run.stderr


# ---- the cost of indexing, said before it is paid, on a tiny model --------------------------------------

def _corpus(folder: Path, files: int = 3, paragraphs: int = 8, seed: int = 0) -> Path:
    """Files of paragraphs of 20-90 words, different for each seed."""
    import random

    draw = random.Random(seed)
    words = "the lighthouse river ferry winter engineer built keeper lamp bridge island harbour stone north".split()
    folder.mkdir(parents=True, exist_ok=True)
    for i in range(files):
        text = "\n\n".join(" ".join(draw.choice(words) for _ in range(draw.randint(20, 90))) + "."
                           for _ in range(paragraphs))
        (folder / f"part{seed}-{i}.md").write_text(text)
    return folder


def _block_files(home: Path) -> list[Path]:
    return sorted((home / "kv").rglob("*.safetensors"))


def _estimated_bytes(text: str) -> float:
    import re

    number, unit = re.search(r"about ([\d.]+) (B|kB|MB) of KV", text).groups()
    return float(number) * {"B": 1, "kB": 1e3, "MB": 1e6}[unit]


@pytest.fixture
def tiny_home(saved_model_and_adapter, tmp_path, monkeypatch) -> tuple[Path, list[str]]:
    """(home, the model options of a tiny model in it): an embedded passage index, no disk budget given."""
    monkeypatch.setenv("KVRAG_CHROMA", "")
    monkeypatch.delenv("KVRAG_DISK_BUDGET", raising=False)
    model_dir, _ = saved_model_and_adapter
    home = tmp_path / "home"
    return home, ["--model", str(model_dir), "--adapter", "none", "--device", "cpu", "--home", str(home)]


def test_index_says_the_kv_it_will_write_before_writing_it_and_dry_run_writes_nothing(tiny_home, tmp_path, capsys):
    """`index --dry-run` and `index` estimate the new passages' block files within a tenth of what they take; KV
    already on disk is not counted again; `status` shows what the home then holds."""
    home, options = tiny_home
    docs = _corpus(tmp_path / "docs")
    assert main([*options, "index", str(docs), "--dry-run"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("24 of 24 passages to encode, ") and "dry run: nothing encoded or written" in out, out
    assert "the disk budget is " in out and "bytes a token, float16)" in out
    assert not _block_files(home) and not (home / "chroma").exists() and not list(home.rglob("passages.sqlite"))
    assert main([*options, "index", str(docs)]) == 0
    err = capsys.readouterr().err
    said = [line for line in err.splitlines() if line.startswith("kvrag: 24 of 24 passages to encode")]
    assert len(said) == 1 and _estimated_bytes(said[0]) == _estimated_bytes(out), err
    written = sum(f.stat().st_size for f in _block_files(home))
    assert abs(_estimated_bytes(out) - written) <= 0.1 * written, (out, written)
    _corpus(docs, files=1, seed=1)  # one new file: only its passages count
    assert main([*options, "index", str(docs), "--dry-run"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("8 of 32 passages to encode, "), out
    before = written
    assert main([*options, "index", str(docs)]) == 0
    written = sum(f.stat().st_size for f in _block_files(home)) - before
    assert abs(_estimated_bytes(out) - written) <= 0.1 * written, (out, written)
    capsys.readouterr()
    assert main([*options, "status"]) == 0
    out = capsys.readouterr().out
    files = _block_files(home)
    # 256 bytes of keys and values a token in this tiny model, and its 4-byte token id
    assert "KV stored as float16: 260 bytes a token and " in out, out
    assert "32 in the passage index" in out and "32 of them with KV on disk" in out, out
    assert f"in {len(files)} block files ({files[0].parents[1]})" in out and "passages.sqlite" in out, out
    assert "memory: per process" in out


def test_index_refuses_kv_beyond_the_disk_budget_in_one_line_and_encodes_nothing(tiny_home, tmp_path, capsys,
                                                                                 monkeypatch):
    home, options = tiny_home
    docs = _corpus(tmp_path / "docs")
    assert main([*options, "--disk-budget", "20k", "index", str(docs)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("kvrag: error: not indexing about "), err
    assert "the disk budget is 20.5 kB (--disk-budget)" in err and "nothing was encoded" in err
    assert not _block_files(home)
    monkeypatch.setenv("KVRAG_DISK_BUDGET", "20k")  # the environment's budget, named as such
    assert main([*options, "index", str(docs)]) == 2
    assert "($KVRAG_DISK_BUDGET; --disk-budget overrides it)" in capsys.readouterr().err
    monkeypatch.delenv("KVRAG_DISK_BUDGET")
    assert main([*options, "index", str(docs)]) == 0 and _block_files(home)
    capsys.readouterr()
    # the KV on disk already is not counted again: within the small budget nothing new is to be written
    assert main([*options, "index", str(docs), "--disk-budget", "20k"]) == 0
    assert "0 of 24 passages to encode" in capsys.readouterr().err


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
                 "--max-new-tokens", "2", "--mode", "auto"]) == 0
    assert "[auto] TTFT" in capsys.readouterr().err
    assert not (tmp_path / "asker" / "chroma").exists()


def test_a_chroma_server_that_does_not_answer_stops_the_cli_before_the_model_loads(tmp_path, capsys):
    docs = tmp_path / "docs"
    docs.mkdir()
    (docs / "a.md").write_text(PASSAGES[0])
    url = f"http://127.0.0.1:{free_port()}"
    for argv in (["index", str(docs)], ["ask", "Who built the lighthouse?"], ["serve"]):
        assert main(["--model", str(tmp_path), "--chroma", url, *argv]) == 2  # never loaded: no model there
        err = capsys.readouterr().err
        assert f"kvrag: error: no Chroma server at {url} (" in err and "chroma run --path DIR --port" in err
    assert main(["--chroma", "localhost:8000", "ask", "Who built the lighthouse?"]) == 2
    assert "http://HOST[:PORT]" in capsys.readouterr().err


def test_export_writes_the_weights_the_engine_answers_with(saved_model_and_adapter, tmp_path, capsys):
    """`kvrag export`: the model with its adapter merged, loadable by transformers alone (as vLLM loads it),
    giving the engine's own logits; an existing directory is refused."""
    import torch
    from transformers import AutoModelForCausalLM

    from kvrag import KVEngine

    model_dir, adapter_dir = saved_model_and_adapter
    options = ["--model", str(model_dir), "--adapter", str(adapter_dir), "--device", "cpu", "--home", str(tmp_path / "home")]
    out = tmp_path / "exported"
    assert main([*options, "export", str(out)]) == 0
    exported = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
    engine = KVEngine.from_pretrained(str(model_dir), adapter=adapter_dir, device="cpu", home=tmp_path / "home",
                                      warm_up=False)
    ids = torch.tensor([[5, 9, 13, 2, 7]])
    with torch.no_grad():
        torch.testing.assert_close(exported(ids).logits, engine.model(ids).logits)
        assert not torch.allclose(exported(ids).logits, AutoModelForCausalLM.from_pretrained(model_dir)(ids).logits)
    capsys.readouterr()
    assert main([*options, "export", str(out)]) == 2
    assert capsys.readouterr().err == f"kvrag: error: {out} exists: export writes a new model directory\n"


def test_ctrl_c_while_indexing_ends_in_one_line_and_keeps_what_was_stored(saved_model_and_adapter, tmp_path):
    """SIGINT (Ctrl-C) while `kvrag index` encodes: one line, exit status 130, no traceback; the blocks stored
    before it stay, and a second run stores the rest."""
    import signal

    model_dir, _ = saved_model_and_adapter
    docs = tmp_path / "docs"
    docs.mkdir()
    (docs / "long.md").write_text("\n\n".join(f"Passage {i} says that the keeper number {i} lit lamp {i * 7}."
                                              for i in range(3000)))
    kvrag = [sys.executable, "-m", "kvrag.app.cli", "--device", "cpu", "--model", str(model_dir),
             "--home", str(tmp_path / "home"), "index", str(docs), "--max-tokens", "24"]
    # Ctrl-C's disposition as a terminal's foreground process has it (a suite started in the background of a
    # non-interactive shell ignores SIGINT, and a child would inherit that)
    run = subprocess.Popen(kvrag, stderr=subprocess.PIPE, stdout=subprocess.DEVNULL, text=True,
                           preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    seen = ""
    while "encoding passages" not in seen:  # interrupted while it encodes
        seen += run.stderr.read(1)
        assert run.poll() is None, seen
    waited = time.monotonic()
    while len(list((tmp_path / "home" / "kv").rglob("*.safetensors"))) <= 2:  # the prompt's two shared blocks, then
        assert run.poll() is None and time.monotonic() - waited < 120, seen  # a passage's (the first pack may take
        time.sleep(0.2)  # seconds on a busy machine)
    run.send_signal(signal.SIGINT)
    err = seen + run.stderr.read()
    assert run.wait(60) == 130, err
    assert "Traceback" not in err and err.strip().splitlines()[-1].startswith("kvrag: interrupted"), err
    stored = list((tmp_path / "home" / "kv").rglob("*.safetensors"))
    assert stored and not list((tmp_path / "home").rglob("*.tmp"))


def test_ask_keeps_the_model_warm_in_a_keyed_server_that_stops_once_idle(tiny_home, tmp_path, capsys):
    """`kvrag ask --keep-warm S`: the first question starts `kvrag serve` for the home (keyed; the key in a
    serve.json only this user reads) and gets the answer the in-process ask gives; the next question reaches the
    same process; S seconds without a question, it stops and its serve.json is gone."""
    home, model = tiny_home
    docs = tmp_path / "docs"
    docs.mkdir()
    (docs / "a.md").write_text("\n\n".join(PASSAGES))
    assert main([*model, "index", str(docs), "--max-tokens", "40"]) == 0
    question = [*model, "ask", "Who built the lighthouse?", "--top-k", "1", "--max-new-tokens", "4", "--mode", "block"]
    capsys.readouterr()
    assert main([*question, "--keep-warm", "0"]) == 0
    here = capsys.readouterr()
    assert "kvrag serve" not in here.err and not (home / "serve.json").exists()
    with pytest.MonkeyPatch.context() as patch:  # a server that cannot start: said in one line, answered here
        patch.setattr(sys, "executable", "/bin/false")
        with pytest.warns(UserWarning, match=r"^kvrag: the model could not be kept warm \(no output; .*serve.log\): "
                                             "answering in this process$"):
            assert main([*question, "--keep-warm", "8"]) == 0
    assert capsys.readouterr().out == here.out and not (home / "serve.json").exists()

    assert main([*question, "--keep-warm", "8"]) == 0
    first = capsys.readouterr()
    advertised = json.loads((home / "serve.json").read_text())
    assert (home / "serve.json").stat().st_mode & 0o777 == 0o600 and len(advertised["key"]) >= 24
    assert "loading the model in a process kept for 8 s" in first.err and f"pid {advertised['pid']}" in first.err
    assert first.out == here.out and f"(kvrag serve at {advertised['url']})" in first.err
    search = urllib.request.Request(f"{advertised['url']}/v1/passages/search", data=b'{"query": "x"}', method="POST")
    with pytest.raises(urllib.error.HTTPError, match="401"):
        urllib.request.urlopen(search, timeout=10)  # keyed: another user on this machine is not answered

    assert main(question) == 0  # $KVRAG_KEEP_WARM is 0 in the tests: found, not started
    second = capsys.readouterr()
    assert second.out == here.out and f"(kvrag serve at {advertised['url']})" in second.err
    assert "loading the model" not in second.err and json.loads((home / "serve.json").read_text()) == advertised
    assert main([*model, "status"]) == 0
    assert (f"server: `kvrag serve` at {advertised['url']} (pid {advertised['pid']}) answers for this home, kept warm"
            in capsys.readouterr().out)
    waited = time.monotonic()
    while (home / "serve.json").exists():  # idle for 8 s: it stops, and withdraws
        assert time.monotonic() - waited < 60, (home / "serve.log").read_text()
        time.sleep(0.5)
    while _running(advertised["pid"]):
        assert time.monotonic() - waited < 60, (home / "serve.log").read_text()
        time.sleep(0.1)

    # `kvrag index` stops a kept server and indexes here: the KV's cost said first, as without a server
    assert main([*question, "--keep-warm", "60"]) == 0
    kept = json.loads((home / "serve.json").read_text())
    (docs / "b.md").write_text("The ferry of Varnholm was painted red in 1901 by the harbour master Edda Lund.")
    capsys.readouterr()
    assert main([*model, "index", str(docs), "--max-tokens", "40"]) == 0
    indexed = capsys.readouterr()
    assert f"kvrag: stopping the model process `kvrag ask` kept warm (pid {kept['pid']}) to index here" in indexed.err
    assert "kvrag: 1 of 3 passages to encode" in indexed.err and not (home / "serve.json").exists()
    waited = time.monotonic()
    while _running(kept["pid"]):
        assert time.monotonic() - waited < 60, (home / "serve.log").read_text()
        time.sleep(0.1)


def _running(pid: int) -> bool:
    """Whether process `pid` runs: not gone, nor a zombie (exited, not yet reaped by the process that started it)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[-1].split()[0] != "Z"
    except FileNotFoundError:
        return False
