"""Calibration: whether reuse keeps full prefill's answers on this model and this corpus, measured, recorded, and
read back as the default mode.

`calibrate` answers sample questions over the passages a home has indexed, retrieved as `kvrag ask` retrieves them,
in full mode and in each reusing setting (SETTINGS), and measures every setting against full on the same weights
(kvrag.eval.accuracy's agreement: the same answer once normalised, the same first token, its KL; gold accuracy where
the questions carry answers) and its median TTFT. The fastest setting whose agreement meets the target, with the
lower end of its 95% interval at or above the floor, and faster than full, is recorded under the home for these
weights, this prompt layout and block context and this kvrag version. `KVEngine(default_mode="calibrated")`, the
default, reads the record back (`load`); one made for anything else is named in one line and requests that name
no mode get full.
"""

import hashlib
import importlib.metadata
import json
import math
import os
import random
import re
import statistics
import time
import warnings
from dataclasses import asdict
from pathlib import Path

from tqdm.auto import tqdm

from .blend import BlendConfig
from .errors import EmptyInputError, KVRagError

SETTINGS = ("prefix", "block", "auto", "blend@0.3", "lookahead@0.3")
"""What `calibrate` compares with full by default: exact prefix reuse, block mode, blend choosing its share per
request, and blend recomputing 30% chosen by deviation or by the question (docs/closer-to-full.md's best)."""
TARGET, FLOOR = 0.95, 0.90
"""A setting is chosen when its answers are full's on at least TARGET of the questions and the lower end of that
share's 95% interval is at least FLOOR."""
SAFER = {"block": "auto", "composite": "auto", "blend": "full", "auto": "full", "prefix": "full"}
"""The mode an engine steps down to when shadow checks find the default one under the target (`shadow.py`): block mode
to auto, which recomputes what the request's passages need, anything else to full."""
QUESTION_PROMPT = ("{passage}\n\nWrite one question that a reader of this text could ask and that this sentence "
                   "answers: \"{sentence}\"\nReply with the question only.")
MAX_RECORD_BYTES = 1 << 20
"""A calibration record is a few KB; a larger file under the home is not read."""
_SENTENCE = re.compile(r"(?<=[.!?])\s+")
_NAME = re.compile(r"\b[A-Z][a-z]+(?: (?:of |the )?[A-Z][a-z]+)*")


def version() -> str:
    try:
        return importlib.metadata.version("kvrag")
    except importlib.metadata.PackageNotFoundError:
        return "unknown"


def setting_mode(setting: str, blend: BlendConfig) -> tuple[str, BlendConfig]:
    """The mode and blend settings a setting's requests run with: those of `kvrag bench accuracy`'s method of that
    name (kvrag.eval.accuracy.runner; "blend@R" recomputes a share R, "lookahead@R" a share R chosen by the
    question), over `blend` (the engine's). Full and the chains are not reusing settings."""
    from kvrag.eval.accuracy import MODE_METHODS, runner

    run = runner(setting)
    if run is None or getattr(run, "mode", "full") == "full":
        raise ValueError(f"unknown setting {setting!r}: choose from {', '.join(MODE_METHODS[1:])}, or blend@R "
                         "(lookahead@R) recomputing a share R between 0 and 1")
    return run.mode, run.blend_for(blend)


def check_target(target: float, floor: float) -> None:
    if not (isinstance(target, (int, float)) and 0 < target <= 1):
        raise ValueError(f"the target is a share of questions in (0, 1], got {target!r}")
    if not (isinstance(floor, (int, float)) and 0 <= floor <= target):
        raise ValueError(f"the floor is a share of questions in [0, target={target}], got {floor!r}")


# ---- questions --------------------------------------------------------------------------------------------------


def read_questions(path: str | Path) -> list[tuple[str, tuple[str, ...]]]:
    """(question, gold answers) from a file: one question a line, or JSON lines {"question": ..., "answers": [...]}
    (answers optional). Anything else is refused in one line naming the file and line."""
    path = Path(path)
    try:
        data = path.read_bytes()
    except OSError as exc:
        raise KVRagError(f"cannot read the questions file {path}: {exc.strerror or exc}") from exc
    if b"\0" in data[:8192]:
        raise KVRagError(f"{path} is not a text file of questions (it holds binary data)")
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise KVRagError(f"{path} is not UTF-8 text (byte {exc.start}): a questions file is text") from exc
    questions = []
    for n, line in enumerate(text.splitlines(), start=1):
        line = line.strip()
        if not line:
            continue
        if line.startswith("{"):
            try:
                item = json.loads(line)
                question, answers = item["question"], item.get("answers", [])
                if isinstance(answers, str):
                    answers = [answers]
                if not isinstance(question, str) or not all(isinstance(a, str) for a in answers):
                    raise TypeError
            except (ValueError, KeyError, TypeError, AttributeError):
                raise KVRagError(f"{path}:{n} is not a question: a JSON line needs \"question\" (text) and may have "
                                 "\"answers\" (a list of texts)") from None
            questions.append((question.strip(), tuple(answers)))
        else:
            questions.append((line, ()))
    questions = [(q, a) for q, a in questions if q]
    if not questions:
        raise EmptyInputError(f"{path} holds no questions: write one a line, or JSON lines with \"question\"")
    return questions


def make_questions(engine, passages: list[str], n: int, seed: int = 0, progress: bool = True) -> list[str]:
    """`n` questions about the passages, for a user who has none at hand. First the model's own: sentences drawn at
    random (seeded) from the passages, each given to the model with its passage, which writes a question that
    sentence answers (replies that are not one question are left out). So they ask what the corpus says, in a
    reader's words, and retrieval then finds their passages among all the others, as it does for a user's. Where the
    corpus has too few sentences for `n`, then "What do the passages say about NAME?" for the names (capitalised
    words inside a sentence), those no question asks about yet first: the broad question a user asks about a topic."""
    sentences = [(p, s) for p in passages for s in _SENTENCE.split(p) if len(s.split()) >= 5]
    random.Random(seed).shuffle(sentences)
    template = engine.tokenizer.apply_chat_template
    streams = []
    for passage, sentence in sentences[: 2 * n]:
        text = template([{"role": "user", "content": QUESTION_PROMPT.format(passage=passage, sentence=sentence)}],
                        tokenize=False, add_generation_prompt=True)
        streams.append(engine.stream_text(text, [], mode="full", max_new_tokens=40, stop=["\n"]))
    found: dict[str, str] = {}
    for stream in tqdm(streams, desc="kvrag: writing questions", unit="question", disable=not progress):
        # all submitted at once: their decode steps are batched
        question = stream.drain().text.strip().strip('"').removeprefix("Question:").strip()
        key = " ".join(question.lower().split())
        if len(found) < n and question.endswith("?") and 4 <= len(question.split()) <= 30 and '"' not in question \
                and key not in found:  # a quote: the sentence copied, not asked about
            found[key] = question
    names = list(dict.fromkeys(name for _, s in sentences for name in _NAME.findall(s.split(" ", 1)[-1])))
    asked = " ".join(found.values())
    for name in sorted(names, key=lambda name: name in asked)[: n - len(found)]:  # those not asked about first
        found[name] = f"What do the passages say about {name}?"
    return list(found.values())


# ---- the measurement ------------------------------------------------------------------------------------------


def layout_digest(engine) -> str:
    """What the prompt of a request looks like around its passages: the prompt format and the chat template."""
    fmt = asdict(engine.layout.format)
    template = getattr(engine.tokenizer, "chat_template", None) or ""
    return hashlib.sha256(json.dumps([fmt, template], sort_keys=True).encode()).hexdigest()[:16]


def identity(engine) -> dict:
    """What a record holds for: the weights (and adapter), the causal weights, the block context, the stored KV's
    format, the prompt layout and kvrag's version. A record is used only by an engine whose identity is the same."""
    return {"model": engine.fingerprint, "causal_model": engine.causal_fingerprint, "adapter": engine.adapter,
            "block_context": engine.block_context, "storage": str(engine.storage_dtype).removeprefix("torch."),
            "layout": layout_digest(engine), "kvrag": version()}


def record_dir(home: str | Path) -> Path:
    return Path(home) / "calibration"


def record_path(engine) -> Path:
    return record_dir(engine.home) / f"{engine.fingerprint[:16]}.json"


def calibrate(engine, index, questions=None, *, n: int = 40, settings=SETTINGS, target: float = TARGET,
              floor: float = FLOOR, top_k: int = 4, max_new_tokens: int = 24, seed: int = 0,
              progress: bool = True) -> dict:
    """Measure each setting against full on `questions` (a list of texts or (text, answers) pairs; None: `n` made by
    `make_questions` from the indexed passages), each with its `top_k` passages from `index` (a `PassageIndex`), and
    write the record (`record_path`); return it. The answers go to a results file beside it, one at a time, so an
    interrupted run resumes; nothing else is written until the record, which replaces the last one whole."""
    from kvrag.eval.accuracy import _settings, curve_rows, evaluate
    from kvrag.eval.data import QAExample

    check_target(target, floor)
    settings = list(dict.fromkeys(settings))
    if not settings:
        raise ValueError("calibrate needs at least one reusing setting to compare with full")
    for setting in settings:
        setting_mode(setting, engine.blend)
    if len(index) == 0:
        raise KVRagError("nothing is indexed yet: run `kvrag index PATH...` (or index passages) before calibrating")
    folder = record_dir(engine.home)
    source = "given"
    if questions is None:
        if n < 2:
            raise ValueError(f"calibrate needs at least 2 questions, got {n}")
        passages = index.texts()
        questions = make_questions(engine, passages, n, seed, progress)
        source = f"made by the model from {len(passages)} passages (seed {seed})"
        if len(questions) < 2:
            raise KVRagError(f"the model wrote {len(questions)} usable questions about the indexed passages; give "
                             "your own with --questions FILE")
    questions = [(q, ()) if isinstance(q, str) else (q[0], tuple(q[1])) for q in questions]
    examples = []
    for question, answers in questions:
        passages = index.search(question, top_k)
        digest = hashlib.sha256(json.dumps([question, passages]).encode()).hexdigest()[:12]
        examples.append(QAExample(f"q{digest}", "calibration", "single", question, answers, "", tuple(passages), ()))
    dataset = {"corpus": "calibration", "questions": hashlib.sha256(
        json.dumps([[e.question, e.passages] for e in examples]).encode()).hexdigest()[:16], "top_k": top_k}
    folder.mkdir(parents=True, exist_ok=True)
    results = folder / f"{engine.fingerprint[:16]}.answers.jsonl"
    _start_afresh_unless_resumable(results, _settings(engine, max_new_tokens, dataset))
    answered = evaluate(engine, examples, ["full", *settings], max_new_tokens=max_new_tokens, results=results,
                        dataset=dataset, progress=progress)
    rows = {row["method"]: row for row in curve_rows([results])}
    gold = any(answers for _, answers in questions)
    measured = [_row(setting, rows[setting], engine.blend, gold) for setting in settings]
    full = rows["full"]
    chosen = decide(measured, full["ttft"], target, floor)
    record = {**identity(engine), "created": time.strftime("%Y-%m-%dT%H:%M:%S%z"), "questions": len(examples),
              "source": source, "top_k": top_k, "max_new_tokens": max_new_tokens, "target": target, "floor": floor,
              "full": {"ttft": full["ttft"], "accuracy": full["accuracy"] if gold else None,
                       "prompt_tokens": int(statistics.median(r.prompt_tokens for r in answered
                                                               if r.method == "full"))},
              "settings": measured, "chosen": chosen}
    _write_atomic(record_path(engine), json.dumps(record, indent=1) + "\n")
    return record


def _start_afresh_unless_resumable(results: Path, settings: dict) -> None:
    """The answers file resumes a run on the same questions and settings; one of others (or unreadable) belongs to a
    calibration this one replaces."""
    try:
        with results.open(encoding="utf-8") as f:
            found = json.loads(f.readline())["settings"]
    except (OSError, ValueError, KeyError, TypeError):
        found = None
    if found != settings and results.exists():
        results.unlink()


def _row(setting: str, row: dict, blend: BlendConfig, gold: bool) -> dict:
    mode, config = setting_mode(setting, blend)
    first, kl = row["first"], row["kl"]
    return {"setting": setting, "mode": mode, "blend": asdict(config) if mode in ("blend", "auto") else None,
            "agree": row["agree"][0], "agree_half": row["agree"][1],
            "first": first[1] if first[0] else None, "kl": kl[1] if kl[0] else None,
            "accuracy": row["accuracy"] if gold else None,
            "accuracy_gap": list(row["gap"]) if gold else None, "ttft": row["ttft"]}


def decide(rows: list[dict], full_ttft: float, target: float, floor: float) -> str | None:
    """The fastest setting whose agreement with full is at least `target`, with its interval's lower end at least
    `floor`, and that answers sooner than full; None (full) where none does."""
    good = [r for r in rows if r["agree"] >= target and r["agree"] - _finite(r["agree_half"]) >= floor
            and r["ttft"] < full_ttft]
    return min(good, key=lambda r: r["ttft"])["setting"] if good else None


def _finite(half: float) -> float:
    return half if math.isfinite(half) else 1.0


def _write_atomic(path: Path, text: str) -> None:
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    try:
        tmp.write_text(text, encoding="utf-8")
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)


# ---- reading it back ------------------------------------------------------------------------------------------


def load(engine) -> dict | None:
    """The record made for this engine under its home; None where there is none. One made for anything else (or
    unreadable) is named in one line (a RuntimeWarning) and not used."""
    path = record_path(engine)
    found = [path] if path.is_file() else sorted((p for p in record_dir(engine.home).glob("*.json") if p.is_file()),
                                                 key=_mtime, reverse=True)
    if not found:
        return None
    try:
        if found[0].stat().st_size > MAX_RECORD_BYTES:
            raise ValueError(f"over {MAX_RECORD_BYTES} bytes")
        record = json.loads(found[0].read_text(encoding="utf-8"))
        if not isinstance(record, dict):
            raise ValueError("not a JSON object")
        check_target(record.get("target", TARGET), 0)
        chosen = record.get("chosen")
        mine = {row.get("setting"): row for row in record.get("settings", [])}
        if chosen is not None:
            row = mine[chosen]
            if row["mode"] not in SAFER:
                raise ValueError(f"unknown mode {row['mode']!r}")
            if row["blend"] is not None:
                engine._check_blend(BlendConfig(**row["blend"]))  # its layers this model's
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as exc:
        warnings.warn(f"kvrag: the calibration record {found[0]} is unreadable ({exc}); requests that name no mode "
                      "get full: run `kvrag calibrate` again", RuntimeWarning, stacklevel=3)
        return None
    differ = [k for k, v in identity(engine).items() if record.get(k) != v]
    if differ:
        warnings.warn(f"kvrag: the calibration record {found[0]} was made for another set-up (differs in: "
                      f"{', '.join(differ)}); requests that name no mode get full: run `kvrag calibrate` for this one",
                      RuntimeWarning, stacklevel=3)
        return None
    return record


def _mtime(path: Path) -> float:
    try:
        return path.stat().st_mtime
    except OSError:
        return 0.0


def chosen(record: dict | None, blend: BlendConfig) -> tuple[str, BlendConfig]:
    """(mode, blend settings) a record chose; full and `blend` where none was chosen or there is no record."""
    if not record or record.get("chosen") is None:
        return "full", blend
    row = next(r for r in record["settings"] if r["setting"] == record["chosen"])
    return row["mode"], BlendConfig(**row["blend"]) if row["blend"] else blend


# ---- showing it -----------------------------------------------------------------------------------------------


def format_record(record: dict) -> str:
    """The record as a table: each setting's agreement with full, first tokens, gold accuracy, TTFT, and the choice."""
    from kvrag.eval.accuracy import percent

    gold = record["full"]["accuracy"] is not None
    lines = [f"calibrated {record['created']} on {record['questions']} questions ({record['source']}), "
             f"{record['top_k']} passages each, median prompt {record['full']['prompt_tokens']} tokens; "
             f"target {100 * record['target']:g}% agreement, floor {100 * record['floor']:g}%",
             f"{'setting':<16} {'= full %':>14} {'1st token %':>12} {'KL':>7} "
             + (f"{'accuracy %':>11} " if gold else "") + f"{'TTFT ms':>8}",
             f"{'full':<16} {'':>14} {'':>12} {'':>7} "
             + (f"{100 * record['full']['accuracy']:>11.1f} " if gold else "") + f"{1e3 * record['full']['ttft']:>8.0f}"]
    for row in record["settings"]:
        first = "-" if row["first"] is None else f"{100 * row['first']:.1f}"
        kl = "-" if row["kl"] is None else f"{round(row['kl'], 3) + 0.0:.3f}"  # no -0.000
        lines.append(f"{row['setting']:<16} {percent(row['agree'], _finite(row['agree_half'])):>14} {first:>12} "
                     f"{kl:>7} " + (f"{100 * row['accuracy']:>11.1f} " if gold else "") + f"{1e3 * row['ttft']:>8.0f}")
    choice = record["chosen"]
    lines.append(f"chosen: {choice} (requests that name no mode)" if choice else
                 "chosen: full: no reusing setting kept full's answers to the target, faster than full")
    return "\n".join(lines)


def plot_record(record: dict, path: str | Path) -> Path:
    """A PNG of the record: each setting's agreement with full against its median TTFT, full at 100%."""
    from kvrag.eval.accuracy import _pyplot, _save

    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(6.4, 4.8))
    points = [("full", record["full"]["ttft"], 1.0, 0.0)] + \
        [(r["setting"], r["ttft"], r["agree"], _finite(r["agree_half"])) for r in record["settings"]]
    for name, ttft, agree, half in points:
        ax.errorbar(1e3 * ttft, 100 * agree, yerr=100 * half, fmt="o", capsize=3,
                    color="tab:green" if name == record["chosen"] else "tab:blue")
        ax.annotate(name, (1e3 * ttft, 100 * agree), textcoords="offset points", xytext=(6, -12), fontsize=8)
    ax.axhline(100 * record["target"], ls="--", color="gray", label=f"target {100 * record['target']:g}%")
    ax.set(xscale="log", xlabel="median time to first token (ms, log)", ylabel="answers the same as full's (%)",
           title="Agreement with full against TTFT")
    ax.legend(fontsize=8)
    return _save(fig, path)
