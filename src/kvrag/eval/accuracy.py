"""Accuracy against time to first token: every method answers the same questions from the same passages.

Block-Attention's Table 1 set-up on the generated multi-document QA set (kvrag.eval.data): per method,
accuracy per question type and on average, token F1, median TTFT and total time, and FLOPs to
first token. All passages are indexed before timing starts, as an application indexes its
documents ahead of the questions. Methods run in a rotating order per question, so a noisy
machine slows them alike. Results go to a JSON-lines file one answer at a time, so an interrupted
run resumes where it stopped.
"""

import collections
import json
import math
import re
import statistics
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, replace
from pathlib import Path

from tqdm.auto import tqdm

from kvrag import BlendConfig, KVRagError, chains
from kvrag.modes import CAUSAL_MODES

from .data import QUESTION_TYPES, QAExample
from .layouts import LAYOUTS, OWN, check_layouts
from .metrics import answer_in_output, normalize, token_f1
from .ttft import flops_blend, flops_lookahead, flops_to_first_token, layer_flops

METHODS = ("full", "map_reduce", "map_rerank", "block", "blend", "composite")
"""What `evaluate` runs by default; `EXTRA_METHODS` can be asked for by name."""
EXTRA_METHODS = ("auto", "prefix", "blend_values", "blend_attention", "lookahead", "auto_lookahead")


@dataclass
class Record:
    """One method's answer to one question."""

    method: str
    id: str
    type: str
    question: str
    output: str
    correct: bool
    f1: float
    ttft: float
    total_time: float
    flops: float
    prompt_tokens: int
    layout: str = OWN  # the prompt layout (kvrag.eval.layouts) the question was asked in
    concurrency: int = 1  # questions in flight when it was answered: its timings are one user's only at 1
    recomputed: float | None = None  # share of the tokens before the question computed (modes only)
    first_token: int | None = None  # the first generated id (modes only; None in files written before it was kept)
    first_logprobs: list[list] | None = None  # the first token's top ids and log-probabilities: [ids, logprobs]


@dataclass
class Answer:
    text: str
    ttft: float
    total_time: float
    flops: float
    prompt_tokens: int
    recomputed: float | None = None
    first_token: int | None = None
    first_logprobs: list[list] | None = None


def flops_generation(config, prompt_tokens: int, generated: int) -> float:
    """FLOPs of a full-prefill call that then decodes `generated` tokens (each fed back but the last)."""
    decode = sum(layer_flops(config, 1, prompt_tokens + j + 1) for j in range(max(generated - 1, 0)))
    return flops_to_first_token(config, prompt_tokens, 0) + config.num_hidden_layers * decode


def _mode(mode: str, blend: BlendConfig | None = None, ratio: float | None = None, select: str | None = None) -> Callable:
    """A method answering in `mode` from one prompt; blend with `blend`'s settings, or the engine's with
    `ratio` as the share recomputed and `select` as the choice, where given. The method carries its `mode` and
    `blend_for(engine_blend)`, the blend settings it answers with (kvrag.calibrate reads both)."""
    changed = {k: v for k, v in (("recompute_ratio", ratio), ("select", select)) if v is not None}

    def blend_for(engine_blend: BlendConfig) -> BlendConfig:
        return replace(engine_blend, **changed) if changed else blend or engine_blend

    def run(engine, example: QAExample, max_new_tokens: int, layout: str = OWN) -> Answer:
        return submit(engine, example, max_new_tokens, layout)()

    def submit(engine, example: QAExample, max_new_tokens: int, layout: str = OWN) -> Callable[[], Answer]:
        """Hand the question to the engine's scheduler now; the returned call waits for its answer."""
        settings = blend_for(engine.blend)
        options = {"mode": mode, "max_new_tokens": max_new_tokens, "blend": settings}
        if layout == OWN:
            stream = engine.stream(example.question, list(example.passages), **options)
        else:  # the drop-in path: rendered text, its passages found by content
            text, _ = LAYOUTS[layout].render(engine, example.question, example.passages)
            stream = engine.stream_text(text, **options)

        def answer() -> Answer:
            r = stream.drain()
            if layout == OWN:
                question = len(engine.layout.question_ids(example.question))
            else:
                question = len(engine.prompt_from_text(text)[0].question)
            config = engine.model.config
            if mode in ("blend", "auto") and settings.select == "lookahead":
                flops = flops_lookahead(config, r.prompt_tokens - question, question, r.prefilled_tokens - 2 * question)
            elif mode in ("blend", "auto"):
                flops = flops_blend(config, r.prompt_tokens - question, question, r.prefilled_tokens - question)
            else:
                flops = flops_to_first_token(config, r.prefilled_tokens, r.prompt_tokens - r.prefilled_tokens)
            share = 1 - r.reused_tokens / max(r.prompt_tokens - question, 1)
            top = None if r.first_logprobs is None else [list(r.first_logprobs), list(r.first_logprobs.values())]
            return Answer(r.text.strip(), r.ttft, r.total_time, flops, r.prompt_tokens, share,
                          r.token_ids[0] if r.token_ids else None, top)

        answer.cancel = stream.cancel
        return answer

    run.submit, run.mode, run.blend_for = submit, mode, blend_for
    return run


def _map_reduce(engine, example: QAExample, max_new_tokens: int) -> Answer:
    r = chains.map_reduce(engine, example.question, example.passages, max_new_tokens=max_new_tokens, note_tokens=max_new_tokens)
    config = engine.model.config
    *notes, final = r.calls
    flops = sum(flops_generation(config, c.prompt_tokens, c.generated_tokens) for c in notes)
    flops += flops_to_first_token(config, final.prompt_tokens, 0)
    return Answer(r.text, r.ttft, r.total_time, flops, sum(c.prompt_tokens for c in r.calls))


def _map_rerank(engine, example: QAExample, max_new_tokens: int) -> Answer:
    r = chains.map_rerank(engine, example.question, example.passages, max_new_tokens=max_new_tokens)
    config = engine.model.config
    flops = sum(flops_generation(config, c.prompt_tokens, c.generated_tokens) for c in r.calls)
    return Answer(r.text, r.ttft, r.total_time, flops, sum(c.prompt_tokens for c in r.calls))


RUNNERS: dict[str, Callable] = {
    "full": _mode("full"),
    "map_reduce": _map_reduce,
    "map_rerank": _map_rerank,
    "block": _mode("block"),
    "blend": _mode("blend"),
    "auto": _mode("auto"),
    "composite": _mode("composite"),
    "prefix": _mode("prefix"),
    "blend_values": _mode("blend", BlendConfig(select="deviation", deviation="values")),
    "blend_attention": _mode("blend", BlendConfig(select="attention")),
    "lookahead": _mode("blend", select="lookahead"),
    "auto_lookahead": _mode("auto", select="lookahead"),
}


MODE_METHODS = ("full", "block", "blend", "auto", "composite", "prefix", "blend_values", "blend_attention", "lookahead",
                "auto_lookahead")
"""The methods that answer from one prompt, so that any prompt layout applies; the chains write their own.
Blend (or lookahead) at a share of its own, "blend@0.3", is one too (`runner`)."""
REUSING = tuple(m for m in MODE_METHODS if m not in CAUSAL_MODES)
"""The methods that read the indexed passages' KV (the rest prefill every token)."""
AT_SHARE = re.compile(r"(blend|lookahead)@(0(?:\.\d+)?|1(?:\.0*)?)")


def runner(method: str) -> Callable | None:
    """What answers as `method`: a name of RUNNERS, or "blend@R" ("lookahead@R"), blend mode recomputing a share R
    of the passages (chosen by lookahead; the engine's other blend settings), for the curve of accuracy against
    the share."""
    if method in RUNNERS:
        return RUNNERS[method]
    at = AT_SHARE.fullmatch(method)
    return _mode("blend", ratio=float(at.group(2)), select="lookahead" if at.group(1) == "lookahead" else None) \
        if at else None


def _mode_of(method: str) -> str:
    """The method a blend@R (lookahead@R) is a share of ("blend", "lookahead"); any other method is its own."""
    at = AT_SHARE.fullmatch(method)
    return at.group(1) if at else method


def check_methods(methods: Sequence[str], layouts: Sequence[str] = (OWN,)) -> None:
    unknown = [m for m in methods if runner(m) is None]
    if unknown or not methods:
        raise ValueError(f"unknown method(s) {unknown or methods}; choose from {', '.join(RUNNERS)}, or blend@R "
                         "(lookahead@R) for blend recomputing a share R between 0 and 1")
    check_layouts(layouts)
    chains = [m for m in methods if _mode_of(m) not in MODE_METHODS]
    if chains and any(layout != OWN for layout in layouts):
        raise ValueError(f"{', '.join(chains)} write their own prompts, so they answer in kvrag's layout only; "
                         f"with other prompt layouts choose from {', '.join(MODE_METHODS)}")


def _settings(engine, max_new_tokens: int, dataset: dict | None, weights: str | None = None) -> dict:
    settings = {"model": engine.fingerprint, "blend": asdict(engine.blend), "max_new_tokens": max_new_tokens,
                "dataset": dataset or {}}
    if engine.causal_fingerprint != engine.fingerprint:  # full and prefix run on other weights
        settings["causal_model"] = engine.causal_fingerprint
    if weights is not None:
        settings["weights"] = weights
    if engine.block_context != "none":  # the block modes' KV is another one
        settings["block_context"] = engine.block_context
    if isinstance(engine.storage_dtype, str):  # stored in 8 or 4 bits: the reusing modes read other numbers
        settings["storage"] = engine.storage_dtype
    return json.loads(json.dumps(settings))  # as read back from the file: tuples become lists


def _load(path: Path, settings: dict) -> dict[tuple[str, str, str], Record]:
    """Records already in `path`, written with the same settings; a half-written last line is dropped."""
    if not path.exists() or path.stat().st_size == 0:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps({"settings": settings}) + "\n")
        return {}
    lines = path.read_text(encoding="utf-8").splitlines()
    try:
        found = json.loads(lines[0])["settings"]
    except (ValueError, KeyError, TypeError) as exc:
        raise KVRagError(f"{path} is not a kvrag results file (its first line holds no settings)") from exc
    if isinstance(found.get("blend"), dict):  # written before blend mode could choose: it chose by deviation
        found["blend"].setdefault("select", "deviation")
        for name in ("coverage", "least", "most"):  # or before mode auto, which such a file never ran
            found["blend"].setdefault(name, settings["blend"][name])
    if found != settings:
        differ = sorted(k for k in settings.keys() | found.keys() if settings.get(k) != found.get(k))
        raise KVRagError(f"{path} holds results of another set-up (differs in: {', '.join(differ)}); use another results file")
    done = {}
    for n, line in enumerate(lines[1:], start=2):
        try:
            record = Record(**json.loads(line))
        except (ValueError, TypeError):
            if n < len(lines):
                raise KVRagError(f"{path}:{n} is not a result record") from None
            path.write_text("\n".join(lines[:-1]) + "\n")  # interrupted while writing: run that answer again
            break
        done[record.layout, record.method, record.id] = record
    return done


def evaluate(
    engine,
    examples: Sequence[QAExample],
    methods: Sequence[str] = METHODS,
    *,
    layouts: Sequence[str] = (OWN,),
    max_new_tokens: int = 32,
    results: str | Path | None = None,
    dataset: dict | None = None,
    progress: bool = True,
    concurrency: int = 1,
    weights: str | None = None,
) -> list[Record]:
    """Every method's answer to every example in every prompt layout, grouped by layout and method.
    `results`, a JSON-lines file, keeps them across runs: a later run with the same model, settings
    and `dataset` description (how the examples were made) only computes what is missing.
    `concurrency`: questions in flight at once, decoded together by the engine's scheduler as many
    users' are (the chains still run one at a time): the same answers up to rounding, as with another
    thread count, so one file may hold both; each record says how it was answered. `weights`: a name for
    the engine's weights (`WEIGHTS`), kept in the file's settings for `weights_table`."""
    if concurrency < 1:
        raise ValueError(f"concurrency must be >= 1, got {concurrency}")
    check_methods(methods, layouts)
    settings = _settings(engine, max_new_tokens, dataset, weights)
    path = Path(results) if results else None
    done = _load(path, settings) if path else {}
    if {_mode_of(m) for m in methods} & set(REUSING):  # the passages' KV ahead of the questions, as an app indexes them
        passages = sorted({p for e in examples for p in e.passages})
        before = {p: b for e in examples for p, b in zip(e.passages, e.preceding)}  # block context "document"
        engine.index(passages, progress=progress,
                     preceding=[before.get(p) for p in passages] if engine.block_context == "document" else None)
    if examples:  # warm-up: buffers and allocator, outside the timings
        engine.generate(examples[0].question, list(examples[0].passages), mode="block", max_new_tokens=2)
    runs = [(layout, method) for layout in layouts for method in methods]
    runners = {method: runner(method) for method in methods}
    jobs = [(example, *run) for i, example in enumerate(examples) for run in runs[i % len(runs):] + runs[: i % len(runs)]]
    answered: list[Record | None] = [None] * len(jobs)
    bar = tqdm(total=len(jobs), desc="kvrag: answering", unit="answer", disable=not progress)

    def keep(k: int, a: Answer) -> None:
        example, layout, method = jobs[k]
        correct = answer_in_output(a.text, example.answers, example.wrong)
        record = Record(method, example.id, example.type, example.question, a.text, correct, token_f1(a.text, example.answers),
                        a.ttft, a.total_time, a.flops, a.prompt_tokens, layout, concurrency, a.recomputed,
                        a.first_token, a.first_logprobs)
        if path:
            with path.open("a", encoding="utf-8") as f:
                f.write(json.dumps(asdict(record)) + "\n")
        answered[k] = record
        bar.update()

    in_flight: collections.deque = collections.deque()  # (job, its answer's wait) in the order submitted

    def keep_first() -> None:
        k, wait = in_flight[0]
        keep(k, wait())
        in_flight.popleft()

    try:
        for k, (example, layout, method) in enumerate(jobs):
            record = done.get((layout, method, example.id))
            if record is not None:
                if record.question != example.question:
                    raise KVRagError(f"{path} answers other questions under the same ids ({example.id}); use another results file")
                answered[k] = record
                bar.update()
                continue
            run = runners[method]
            args = (engine, example, max_new_tokens) + (() if layout == OWN else (layout,))
            if concurrency > 1 and hasattr(run, "submit"):
                in_flight.append((k, run.submit(*args)))
                if len(in_flight) == concurrency:
                    keep_first()
            else:
                keep(k, run(*args))
        while in_flight:
            keep_first()
    finally:
        for _, wait in in_flight:  # an error above: what is still decoding stops
            wait.cancel()
        bar.close()
    order = {run: k for k, run in enumerate(runs)}
    return sorted(answered, key=lambda r: order[r.layout, r.method])


def summarize(records: Sequence[Record]) -> list[dict]:
    """A row per layout and method (in first-seen order): accuracy per question type and on average,
    F1, median TTFT and total time, mean FLOPs to first token, the TTFT speed-up over `full` in
    the same layout where it ran, and, against full's answers there to the same questions (None for full,
    and where full did not run or the records predate what a measure reads), `AGAINST_FULL`'s measures."""
    by_run: dict[tuple[str, str], list[Record]] = {}
    for r in records:
        by_run.setdefault((r.layout, r.method), []).append(r)
    rows = []
    for (layout, method), rs in by_run.items():
        row = {"layout": layout, "method": method, "questions": len(rs)}
        for kind in QUESTION_TYPES:
            of_kind = [r.correct for r in rs if r.type == kind]
            row[kind] = sum(of_kind) / len(of_kind) if of_kind else None
        row["accuracy"] = sum(r.correct for r in rs) / len(rs)
        row["f1"] = statistics.fmean(r.f1 for r in rs)
        row["ttft"] = statistics.median(r.ttft for r in rs)
        row["total_time"] = statistics.median(r.total_time for r in rs)
        row["flops"] = statistics.fmean(r.flops for r in rs)
        rows.append(row)
    full = {row["layout"]: row["ttft"] for row in rows if row["method"] == "full"}
    for row in rows:
        row["speedup"] = full[row["layout"]] / row["ttft"] if row["layout"] in full else None
        same = _in(records, row["layout"])
        for name, measure in AGAINST_FULL.items():
            values = [] if row["method"] == "full" else _per_question(same, row["method"], measure)
            row[name] = statistics.fmean(values) if values else None
    return rows


def _in(records: Sequence[Record], layout: str) -> list[Record]:
    return [r for r in records if r.layout == layout]


def against_full(records: Sequence[Record]) -> list[tuple[str, str, int, float, float]]:
    """Each method's accuracy minus full's in the same layout on the questions both answered, with the
    half-width of its 95% interval: (layout, method, questions, difference, half-width). Paired per
    question (normal approximation), because a few hundred questions leave a gap of a few points
    inside the noise."""
    gaps = []
    for layout in dict.fromkeys(r.layout for r in records):
        same = _in(records, layout)
        for method in dict.fromkeys(r.method for r in same if r.method != "full"):
            n, diff, half = _clustered(same, method)
            if n:
                gaps.append((layout, method, n, diff, half))
    return gaps


def paired_interval(diffs: Sequence[float]) -> tuple[float, float]:
    """The mean of paired differences and the half-width of its 95% interval (normal approximation).

    One difference per question: where several layouts ask the same question, pass each question's
    mean difference over them (clustered), since its answers are not independent. A share of the same
    questions (answers that agree, 1 or 0 each) is the mean of its values, so it takes its interval here too."""
    half = 1.96 * statistics.stdev(diffs) / len(diffs) ** 0.5 if len(diffs) > 1 else math.inf
    return statistics.fmean(diffs), half


def points(diff: float, half: float) -> str:
    """A difference and its half-width in points, as the docs' tables print them: "−2.5 ± 3.5"."""
    return f"{100 * diff:+.1f} ± {100 * half:.1f}".replace("-", "−")


def percent(share: float, half: float) -> str:
    """A share and its half-width in %, as the docs' tables print them: "42.0 ± 6.1"."""
    return f"{100 * share:.1f} ± {100 * half:.1f}"


def same_answer(output: str, full: str) -> bool:
    """Whether two answers are the same words, normalised as answers are for gold ones (kvrag.eval.metrics:
    case, punctuation, articles and spacing aside)."""
    return normalize(output) == normalize(full)


def first_token_kl(full: Sequence[Sequence], other: Sequence[Sequence]) -> float:
    """KL(full ‖ other) of the first token's distribution, in nats, from the [ids, log-probabilities] of the
    likeliest tokens each record keeps (kvrag.decode.TOP_LOGPROBS). Summed over full's kept tokens; one
    missing from `other`'s is taken at `other`'s least kept log-probability, the most it can have, so its
    term is at most its true value and the sum is a lower bound of those tokens' terms. The mass outside
    full's kept tokens is left out: an estimate, 0 for the same distributions, not the exact KL."""
    theirs = dict(zip(*other))
    floor = min(theirs.values())
    return sum(math.exp(logprob) * (logprob - theirs.get(t, floor)) for t, logprob in zip(*full))


def _gap(record: Record, full: Record) -> int:
    return int(record.correct) - int(full.correct)


def _agrees(record: Record, full: Record) -> int:
    return int(same_answer(record.output, full.output))


def _same_first(record: Record, full: Record) -> int | None:
    if record.first_token is None or full.first_token is None:  # a record written before the field, or no token
        return None
    return int(record.first_token == full.first_token)


def _kl(record: Record, full: Record) -> float | None:
    if record.first_logprobs is None or full.first_logprobs is None:
        return None
    return first_token_kl(full.first_logprobs, record.first_logprobs)


AGAINST_FULL = {"agree": _agrees, "first": _same_first, "kl": _kl}
"""Measures of a method's answer against full's to the same question on the same weights, needing no gold
answer: the same answer once normalised, the same first token, the first token's KL(full ‖ method)."""


def _per_question(records: Sequence[Record], method: str, measure: Callable = _gap) -> list[float]:
    """`measure(method's record, full's)` per question, its mean over the layouts, for the questions every layout
    answered in both: the layouts ask the same questions, so a question counts once. Pairs the measure cannot
    judge (None) are left out, and a question with none."""
    by = {(r.layout, r.method, r.id): r for r in records}
    layouts = list(dict.fromkeys(r.layout for r in records))
    values = []
    for i in dict.fromkeys(r.id for r in records):
        if all((layout, m, i) in by for layout in layouts for m in (method, "full")):
            judged = [v for layout in layouts if (v := measure(by[layout, method, i], by[layout, "full", i])) is not None]
            if judged:
                values.append(statistics.fmean(judged))
    return values


def _clustered(records: Sequence[Record], method: str, measure: Callable = _gap) -> tuple[int, float, float]:
    """(questions, mean, half-width) of `measure` of `method` against full (default: its accuracy − full's)
    per question as `_per_question` pools them over the layouts; (0, nan, nan) where none."""
    values = _per_question(records, method, measure)
    return (len(values), *paired_interval(values)) if values else (0, math.nan, math.nan)


def pooled_against_full(records: Sequence[Record]) -> list[tuple[str, int, int, float, float]]:
    """Each method against full over every layout, clustered by question: (method, layouts, questions,
    difference, half-width). A question counts once, with its mean difference over the layouts, since
    the layouts ask the same questions; only questions that every layout answered in both modes."""
    layouts = len({r.layout for r in records})
    if layouts < 2:
        return []
    pooled = []
    for method in dict.fromkeys(r.method for r in records if r.method != "full"):
        n, diff, half = _clustered(records, method)
        if n:
            pooled.append((method, layouts, n, diff, half))
    return pooled


def format_against_full(records: Sequence[Record]) -> str:
    """`against_full` as lines of text, in points (the layout named where it is not kvrag's own), then
    `pooled_against_full` where there are several layouts; each with the share of answers the same as full's."""
    def same(records: Sequence[Record], method: str) -> str:
        return percent(*_clustered(records, method, _agrees)[1:])

    lines = [f"{'' if layout == OWN else f'[{layout}] '}{method} - full: {100 * diff:+.1f} ± {100 * half:.1f} "
             f"points (95% interval, {n} paired questions); the same answer as full: {same(_in(records, layout), method)}%"
             for layout, method, n, diff, half in against_full(records)]
    lines += [f"[pooled, {k} layouts] {method} - full: {100 * diff:+.1f} ± {100 * half:.1f} points (95% interval, "
              f"{n} paired questions, each counted once); the same answer as full: {same(records, method)}%"
              for method, k, n, diff, half in pooled_against_full(records)]
    return "\n".join(lines)


def format_table(rows: Sequence[dict]) -> str:
    """The summary as a Markdown table (accuracy and agreement with full in %, TTFT in ms), with a prompt-layout
    column when any row is in another layout than kvrag's own; "-" where a value is not computable."""
    pct = lambda v: "-" if v is None else f"{100 * v:.1f}"  # noqa: E731
    layouts = any(row.get("layout", OWN) != OWN for row in rows)
    head = ["method", "n", *QUESTION_TYPES, "average", "F1", "= full", "1st tok = full", "KL", "TTFT ms", "total s",
            "TTFT vs full", "GFLOPs to 1st token"]
    head = ["prompt", *head] if layouts else head
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for row in rows:
        cells = [row["method"], str(row["questions"]), *(pct(row[k]) for k in QUESTION_TYPES), pct(row["accuracy"]),
                 pct(row["f1"]), pct(row["agree"]), pct(row["first"]), "-" if row["kl"] is None else f"{row['kl']:.3f}",
                 f"{row['ttft'] * 1e3:.0f}", f"{row['total_time']:.2f}",
                 "-" if row["speedup"] is None else f"{row['speedup']:.1f}x", f"{row['flops'] / 1e9:.1f}"]
        cells = [row.get("layout", OWN), *cells] if layouts else cells
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def plot(records: Sequence[Record], path: str | Path) -> Path:
    """A PNG with accuracy against median TTFT (a point per method) and TTFT against prompt length."""
    plt = _pyplot()
    rows = summarize(records)
    fig, (left, right) = plt.subplots(1, 2, figsize=(12, 4.8))
    for k, row in enumerate(rows):
        point = (row["ttft"] * 1e3, 100 * row["accuracy"])
        label = row["method"] if row["layout"] == OWN else f"{row['method']} ({row['layout']})"
        left.scatter(*point, s=50)
        # methods often land close together: alternate the label above and below its point
        left.annotate(label, point, textcoords="offset points", xytext=(6, 5 if k % 2 else -12))
        own = [r for r in records if (r.layout, r.method) == (row["layout"], row["method"])]
        right.scatter([r.prompt_tokens for r in own], [r.ttft * 1e3 for r in own], s=8, alpha=0.6, label=label)
    left.set(xscale="log", xlabel="median time to first token (ms, log)", ylabel="accuracy (%)",
             title="Accuracy against time to first token")
    right.set(xscale="log", yscale="log", xlabel="prompt tokens the method reads (log)", ylabel="TTFT (ms, log)",
              title="Time to first token against prompt length")
    right.legend(fontsize=8)
    return _save(fig, path)


def _pyplot():
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError as exc:
        raise KVRagError("plots need matplotlib: pip install matplotlib (or pip install 'kvrag[bench]')") from exc
    return plt


def _save(fig, path: str | Path) -> Path:
    for ax in fig.axes:
        ax.grid(True, which="both", alpha=0.3)
    fig.tight_layout()
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    _pyplot().close(fig)
    return path


# ---- the same weights in every mode ---------------------------------------------------------------------

WEIGHTS = {"published": "published weights", "adapter": "shipped adapter"}
"""The weight sets `kvrag bench accuracy --weights` compares modes on, each in every mode."""
CORPORA = {"generated": "generated worlds", "squad": "SQuAD", "heldout": "examples/heldout"}
COMPARED = ("block", "blend", "auto")  # each against full, on the same weights, where the files hold it
AUTO_METHODS = ("auto", "auto_lookahead")
"""The methods whose share recomputed follows each request: the curve shows their mean share, apart from the lines."""


def read_results(path: str | Path) -> tuple[dict, list[Record]]:
    """The settings and records of a results file (plain or gzipped JSON lines)."""
    import gzip

    path = Path(path)
    opener = gzip.open if path.suffix == ".gz" else open
    with opener(path, "rt", encoding="utf-8") as f:
        lines = f.read().splitlines()
    return json.loads(lines[0])["settings"], [Record(**json.loads(line)) for line in lines[1:] if line.strip()]


def _corpus(settings: dict) -> str:
    return settings.get("dataset", {}).get("corpus", "generated")


def weights_rows(paths: Sequence[str | Path]) -> list[dict]:
    """Rows of results files (each one weight set on one corpus): accuracy of full and of each COMPARED
    method answered, their cost against full on the same weights, paired per question, and the share of
    their answers the same as full's. A file asked in several prompt layouts gives a row per layout, then one
    pooled over them (each question counted once)."""
    rows = []
    for path in paths:
        settings, records = read_results(path)
        if "causal_model" in settings:
            raise KVRagError(f"{path} answered full mode with other weights than block mode: not like for like")
        layouts = list(dict.fromkeys(r.layout for r in records))
        parts = [(layout, [r for r in records if r.layout == layout]) for layout in layouts] if len(layouts) > 1 else []
        for layout, chosen in [*parts, (None, records)]:
            row = {"weights": settings.get("weights", "model"), "corpus": _corpus(settings), "layout": layout,
                   "layouts": len(layouts), "questions": len({r.id for r in chosen})}
            for method in ("full", *COMPARED):
                answers = [r.correct for r in chosen if r.method == method]
                row[method] = sum(answers) / len(answers) if answers else math.nan
                if method != "full":
                    row[f"{method}-full"] = _clustered(chosen, method)[1:]
                    row[f"{method}=full"] = _clustered(chosen, method, _agrees)[1:]
            rows.append(row)
    return rows


def weights_table(paths: Sequence[str | Path]) -> str:
    """`weights_rows` as the Markdown table the README and docs/accuracy.md show (accuracy in %), with
    columns for each COMPARED method the files answered: its accuracy, − full's, and = full's answers in %."""
    rows = weights_rows(paths)
    compared = [m for m in COMPARED if any(not math.isnan(row[m]) for row in rows)]
    lines = ["| weights | corpus | questions | full | " + " | ".join(compared) + " | "
             + " | ".join(f"{m} − full" for m in compared) + " | " + " | ".join(f"{m} = full %" for m in compared) + " |",
             "|---|---|---:|---:|" + "---:|" * len(compared) + "---|" * 2 * len(compared)]
    for row in rows:
        where = f", `{row['layout']}`" if row["layout"] else f", {row['layouts']} layouts pooled" if row["layouts"] > 1 else ""
        lines.append(f"| {WEIGHTS.get(row['weights'], row['weights'])} | {CORPORA[row['corpus']]}{where} | "
                     f"{row['questions']} | {100 * row['full']:.1f} | "
                     + "".join(f"{100 * row[m]:.1f} | " for m in compared)
                     + "".join(f"{points(*row[f'{m}-full'])} | " for m in compared)
                     + "".join(f"{percent(*row[f'{m}=full'])} | " for m in compared).rstrip())
    return "\n".join(lines)


def adapter_effect(paths: Sequence[str | Path]) -> list[str]:
    """The adapter's own effect per corpus: full mode with it minus full mode without it, paired per question
    where the files hold both weight sets on the same questions (a question asked in several layouts counted
    once, with its mean difference over them). A cross-weights comparison, and labelled one."""
    full: dict[tuple[str, str], dict] = {}
    for path in paths:
        settings, records = read_results(path)
        full[settings.get("weights"), _corpus(settings)] = {(r.layout, r.id): int(r.correct) for r in records
                                                            if r.method == "full"}
    lines = []
    for corpus, label in CORPORA.items():
        adapter, published = full.get(("adapter", corpus)), full.get(("published", corpus))
        if adapter and published and (both := adapter.keys() & published.keys()):
            per_question = collections.defaultdict(list)
            for layout, i in both:
                per_question[i].append(adapter[layout, i] - published[layout, i])
            diff, half = paired_interval([statistics.fmean(d) for d in per_question.values()])
            lines.append(f"{label}: the adapter's full mode − the published weights' full mode {points(diff, half)} "
                         f"points ({len(per_question)} questions; across weights)")
    return lines


def curve_rows(paths: Sequence[str | Path]) -> list[dict]:
    """A row per method of each results file (one weight set each): the share of passage tokens it recomputed
    (block 0, full 1, blend@R R, auto its requests' mean), accuracy, the difference from full on the same
    weights paired per question (pooled over layouts, each question once), the share of answers the same as
    full's, pooled alike (and of the same first token, and the first token's KL, as (questions, mean, half-width)),
    and the median TTFT, which is one user's only where the file was answered one
    question at a time. `context`: the block context the reusing methods' KV was made in, where not "none"."""
    rows = []
    for path in paths:
        settings, records = read_results(path)
        for method in dict.fromkeys(r.method for r in records):
            answers = [r for r in records if r.method == method]
            at = AT_SHARE.fullmatch(method)
            shares = [r.recomputed for r in answers if r.recomputed is not None]
            ratio = settings["blend"]["recompute_ratio"]
            share = {"block": 0.0, "full": 1.0, "blend": ratio, "lookahead": ratio}.get(
                method, float(at.group(2)) if at else statistics.fmean(shares) if shares else None)
            context = settings.get("block_context") if method not in CAUSAL_MODES else None
            rows.append({"weights": settings.get("weights", "model"), "corpus": _corpus(settings), "method": method,
                         "context": context, "share": share,
                         "accuracy": statistics.fmean(r.correct for r in answers),
                         "gap": None if method == "full" else _clustered(records, method)[1:],
                         "agree": None if method == "full" else _clustered(records, method, _agrees)[1:],
                         "first": None if method == "full" else _clustered(records, method, _same_first),
                         "kl": None if method == "full" else _clustered(records, method, _kl),
                         "ttft": statistics.median(r.ttft for r in answers),
                         "flops": statistics.median(r.flops for r in answers)})
    return rows


def curve_table(paths: Sequence[str | Path]) -> str:
    """`curve_rows` as the Markdown table docs/accuracy.md shows (accuracy, answers and first tokens the same as
    full's in %, the first token's mean KL(full ‖ method)); "-" where the files predate the first tokens."""
    lines = ["| weights | corpus | method | share recomputed | accuracy | − full | = full % | 1st token = full % | KL | "
             "median TTFT ms |", "|---|---|---|---:|---:|---|---|---|---:|---:|"]
    for row in curve_rows(paths):
        share = "-" if row["share"] is None else f"{row['share']:.2f} (mean)" if row["method"] in AUTO_METHODS else f"{row['share']:g}"
        first = "" if row["first"] is None else percent(*row["first"][1:]) if row["first"][0] else "-"
        kl = "" if row["kl"] is None else f"{round(row['kl'][1], 3) + 0.0:.3f}" if row["kl"][0] else "-"  # no -0.000
        method = f"{row['method']}, {row['context']} context" if row["context"] else row["method"]
        lines.append(f"| {WEIGHTS.get(row['weights'], 'model')} | {CORPORA[row['corpus']]} | {method} | {share} | "
                     f"{100 * row['accuracy']:.1f} | {'' if row['gap'] is None else points(*row['gap'])} | "
                     f"{'' if row['agree'] is None else percent(*row['agree'])} | {first} | {kl} | "
                     f"{row['ttft'] * 1e3:.0f} |")
    return "\n".join(lines)


def _against(base: Sequence[Record], other: Sequence[Record], method: str) -> dict[str, list[float]]:
    """Per question (mean over the layouts both files answered it in), `other`'s `method` minus `base`'s: each
    against `base`'s full answer (= full, same first token, first token's KL) and gold accuracy."""
    full = {(r.layout, r.id): r for r in base if r.method == "full"}
    mine = {(r.layout, r.id): r for r in base if r.method == method}
    per: dict[str, dict] = {m: collections.defaultdict(list) for m in ("agree", "first", "kl", "accuracy")}
    for r in other:
        key = (r.layout, r.id)
        if r.method != method or key not in full or key not in mine:
            continue
        per["accuracy"][r.id].append(int(r.correct) - int(mine[key].correct))
        for name, measure in AGAINST_FULL.items():
            theirs, ours = measure(r, full[key]), measure(mine[key], full[key])
            if theirs is not None and ours is not None:
                per[name][r.id].append(theirs - ours)
    return {name: [statistics.fmean(v) for v in by_question.values()] for name, by_question in per.items()}


def paired_rows(paths: Sequence[str | Path]) -> list[dict]:
    """Results files in pairs (base, other): the same questions asked on the same weights with one setting changed
    (the stored KV's format, say). A row per reusing method the other file answered, its differences from the base
    file's same method paired per question (`_against`), and a row per setting pooling its files, each question
    once."""
    if len(paths) % 2:
        raise ValueError("paired_rows takes files in pairs: base, other, base, other, ...")
    rows, pooled = [], collections.defaultdict(lambda: collections.defaultdict(list))
    for base_path, other_path in zip(paths[::2], paths[1::2]):
        (base_settings, base), (settings, other) = read_results(base_path), read_results(other_path)
        if base_settings.get("model") != settings.get("model"):
            raise ValueError(f"{base_path} and {other_path} hold answers of other weights")
        setting = settings.get("storage", "float16")
        for method in dict.fromkeys(r.method for r in other if r.method != "full"):
            diffs = _against(base, other, method)
            rows.append({"setting": setting, "corpus": CORPORA[_corpus(settings)], "method": method, **diffs})
            for name, values in diffs.items():
                pooled[setting, method][name] += values
    for (setting, method), diffs in pooled.items():
        if sum(row["setting"] == setting and row["method"] == method for row in rows) > 1:
            rows.append({"setting": setting, "corpus": "pooled", "method": method, **diffs})
    return rows


def paired_table(paths: Sequence[str | Path]) -> str:
    """`paired_rows` as a Markdown table: differences in points (= full, same first token, accuracy) and nats (KL),
    each with its paired 95% interval."""
    lines = ["| setting | corpus | method | questions | = full (points) | 1st token = full | KL (nats) | accuracy |",
             "|---|---|---|---:|---|---|---|---|"]
    for row in paired_rows(paths):
        cells = []
        for name in ("agree", "first", "kl", "accuracy"):
            diff, half = paired_interval(row[name]) if row[name] else (math.nan, math.nan)
            cells.append(f"{diff:+.3f} ± {half:.3f}".replace("-", "−") if name == "kl" else points(diff, half))
        lines.append(f"| {row['setting']} storage | {row['corpus']} | {row['method']} | {len(row['agree'])} | "
                     + " | ".join(cells) + " |")
    return "\n".join(lines)


def curve_plot(paths: Sequence[str | Path], path: str | Path) -> Path:
    """A PNG of `curve_rows`: each weight set's accuracy against the share recomputed (blend's shares joined
    by a line from block to full, auto apart) and against the compute before the first token, which TTFT
    follows on an idle machine and which, unlike TTFT, other work on the machine does not move."""
    plt = _pyplot()
    rows = [row for row in curve_rows(paths) if row["share"] is not None]
    fig, (left, right) = plt.subplots(1, 2, figsize=(12, 4.8))
    for (weights, corpus), color in zip(dict.fromkeys((r["weights"], r["corpus"]) for r in rows), plt.cm.tab10.colors):
        mine = [r for r in rows if (r["weights"], r["corpus"]) == (weights, corpus)]
        label = f"{WEIGHTS.get(weights, weights)}, {CORPORA[corpus]}"
        for family, style in (("blend", "o-"), ("lookahead", "s--")):  # block and full end both lines
            line = sorted((r for r in mine if _mode_of(r["method"]) in (family, "block", "full")), key=lambda r: r["share"])
            if family == "blend" or any(_mode_of(r["method"]) == family for r in line):
                tag = label if family == "blend" else f"{label}, lookahead"
                left.plot([r["share"] for r in line], [100 * r["accuracy"] for r in line], style, color=color, label=tag)
                right.plot([r["flops"] / 1e9 for r in line], [100 * r["accuracy"] for r in line], style, color=color,
                           label=tag)
        for r in mine:
            if r["method"] in AUTO_METHODS:
                left.plot(r["share"], 100 * r["accuracy"], "*", ms=14, color=color, label=f"auto ({label})")
                right.plot(r["flops"] / 1e9, 100 * r["accuracy"], "*", ms=14, color=color)
            for ax, x in ((left, r["share"]), (right, r["flops"] / 1e9)):
                ax.annotate(r["method"], (x, 100 * r["accuracy"]), textcoords="offset points", xytext=(5, -11), fontsize=7)
    left.set(xlabel="share of passage tokens recomputed (block 0, full 1)", ylabel="accuracy (%)",
             title="Accuracy against the share recomputed")
    right.set(xscale="log", xlabel="median GFLOPs to the first token (log)", ylabel="accuracy (%)",
              title="Accuracy against the compute to the first token")
    left.legend(fontsize=8)
    return _save(fig, path)
