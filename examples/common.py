"""What the example apps share: their command line, the questions file, and one-line answers."""

import argparse
import json
from importlib import resources
from pathlib import Path

from kvrag.eval.metrics import answer_in_output

SAMPLE = Path(str(resources.files("kvrag") / "sample"))


def load_questions(path: Path) -> list[dict]:
    """A JSON list of strings or of {"question": ..., "answers": [...]} objects (with "wrong": [...], a
    comparison's other candidates), or one question per line."""
    if path.suffix == ".json":
        items = json.loads(path.read_text())
    else:
        items = [line.strip() for line in path.read_text().splitlines() if line.strip()]
    return [{"question": item, "answers": []} if isinstance(item, str) else {"answers": [], **item} for item in items]


def parse_args(description: str, baselines: list[str], argv=None, **extra: dict) -> argparse.Namespace:
    """folder, questions (loaded), k, max_tokens, compare (checked against `baselines`), and `extra`
    options given as {"--name": add_argument keywords}."""
    parser = argparse.ArgumentParser(description=description)
    parser.add_argument("folder", nargs="?", type=Path, default=SAMPLE, help="text files (default: kvrag's sample)")
    parser.add_argument("questions", nargs="?", type=Path, help="questions file (default: FOLDER/questions.json)")
    parser.add_argument("--k", type=int, default=3, help="passages retrieved per question")
    parser.add_argument("--max-tokens", type=int, default=48, help="longest answer in tokens")
    parser.add_argument("--compare", default="", help="also run these, comma-separated: " + ",".join(baselines))
    for name, options in extra.items():
        parser.add_argument(name, **options)
    args = parser.parse_args(argv)
    args.compare = [name for name in args.compare.split(",") if name]
    if unknown := set(args.compare) - set(baselines):
        parser.error(f"unknown name(s) {sorted(unknown)} for --compare; choose from {', '.join(baselines)}")
    questions_file = args.questions or args.folder / "questions.json"
    if not questions_file.is_file():
        parser.error(f"no questions file {questions_file}: name one after the folder")
    args.questions = load_questions(questions_file)
    return args


def is_right(answer: str, item: dict) -> bool:
    """kvrag's metric: a given answer appears in the reply as whole words, before any wrong candidate."""
    return answer_in_output(answer, item["answers"], item.get("wrong", ()))


def answer_line(name: str, timing: str, answer: str, item: dict, width: int = 100) -> str:
    """One row: the name, its timing, the answer on one line, and [ok] / [?] when answers are known."""
    text = " ".join(answer.split())
    text = text if len(text) <= width else text[: width - 3] + "..."
    mark = "" if not item["answers"] else " [ok]" if is_right(answer, item) else " [?]"
    return f"  {name:<24} {timing}  {text}{mark}"
