"""`kvrag ask` and `kvrag calibrate`: questions answered from the indexed passages in a mode that reuses their
KV, and the measure of which mode keeps full's answers."""

import importlib.util
import os
import secrets
import subprocess
import sys
import time
import warnings
from pathlib import Path

from kvrag.errors import KVRagError

from . import common

CALIBRATE_SETTINGS = ("prefix", "block", "auto", "blend@0.3", "lookahead@0.3")  # kvrag.calibrate.SETTINGS
KEEP_WARM = 300.0
"""Seconds the process `ask` loads the model in stays up after its last request (as Ollama keeps a model loaded
five minutes): importing torch and transformers alone takes 5.5 s on a 2-core VM, a kept process answers at once."""
STARTING = 600.0  # longest wait for that process to answer /health before answering here instead


def print_stats(result: dict, where: str = ""):
    """A request's figures (`GenerationResult.stats`: in process, or as `kvrag serve` sent them) on one line."""
    hits = ", ".join(f"{k} {v}" for k, v in sorted(result["cache_hits"].items())) or "none"
    print(
        f"[{result['mode']}] TTFT {result['ttft'] * 1e3:.0f} ms, total {result['total_time']:.2f} s, "
        f"prefilled {result['prefilled_tokens']} / reused {result['reused_tokens']} tokens, blocks: {hits}{where}",
        file=sys.stderr,
    )


def cmd_ask(args):
    chroma = common.chroma(args)
    server = common.server(args)
    nothing_indexed = isinstance(chroma, Path) and not chroma.exists()  # said below, with no model loaded
    if not server and not nothing_indexed and (seconds := keep_warm(args)):
        server = _start_warm(args, seconds)
    if server:
        return _ask_server(args, *server)
    from kvrag.retrieval import PassageIndex

    index = PassageIndex(chroma)
    if len(index) == 0:
        raise KVRagError(f"nothing is indexed yet in {chroma}: run `kvrag index PATH...` first (passages indexed "
                         "through a server that is not running for this home: `kvrag ask --server URL`)")
    passages = index.search(args.question, args.top_k)
    engine = common.engine(args, warm_up=False)  # one request: a warm-up would cost what it saves
    stream = engine.stream(args.question, passages, mode=args.mode, max_new_tokens=args.max_new_tokens)
    for delta in stream:
        print(delta, end="", flush=True)
    print()
    print_stats(stream.result.stats())


def keep_warm(args) -> float:
    """--keep-warm, else $KVRAG_KEEP_WARM, else KEEP_WARM seconds; 0: load the model in this process only."""
    given = args.keep_warm if args.keep_warm is not None else os.environ.get("KVRAG_KEEP_WARM") or KEEP_WARM
    try:
        seconds = float(given)
    except ValueError:
        raise KVRagError(f"--keep-warm / $KVRAG_KEEP_WARM is a number of seconds, got {given!r}") from None
    if not seconds >= 0:
        raise KVRagError(f"--keep-warm / $KVRAG_KEEP_WARM is a number of seconds >= 0, got {given!r}")
    return seconds


def _start_warm(args, seconds: float) -> tuple[str, str] | None:
    """Start `kvrag serve` for this home on a free local port, keyed, stopping after `seconds` without a request,
    and wait until it answers: (URL, key). None, said in one line, where it could not start: this process answers
    then."""
    from .. import client

    home, port = common.home(args), client.free_port()
    model = []
    for flag in common.MODEL_OPTIONS:
        value = getattr(args, flag[2:].replace("-", "_"), None)
        model += [] if value is None else [flag, str(value)]
    key, log = secrets.token_urlsafe(24), home / "serve.log"
    command = [sys.executable, "-m", "kvrag.app.cli", *model, "serve", "--port", str(port), "--idle-exit",
               str(seconds), "--advertise-key", "--log-level", "warning"]
    with client.private(log) as out:
        process = subprocess.Popen(command, stdin=subprocess.DEVNULL, stdout=out, stderr=out, start_new_session=True,
                                   env={**os.environ, "KVRAG_API_KEY": key})
    print(f"kvrag: loading the model in a process kept for {seconds:g} s after its last request, so that the next "
          f"question answers at once (pid {process.pid}, log {log}; --keep-warm 0: none)", file=sys.stderr)
    url, deadline = f"http://127.0.0.1:{port}", time.monotonic() + STARTING
    while process.poll() is None and time.monotonic() < deadline:
        found = client.discover(home)
        if found and found.pid == process.pid:
            return url, key
        time.sleep(0.2)
    if process.poll() is None:
        process.terminate()
    lines = log.read_text(errors="replace").strip().splitlines()
    warnings.warn(f"kvrag: the model could not be kept warm ({lines[-1] if lines else 'no output'}; {log}): "
                  "answering in this process", stacklevel=2)
    return None


def _ask_server(args, url: str, api_key: str | None):
    """`ask` through a running `kvrag serve`: its passage index searched, the answer streamed from its chat
    completions in kvrag's own layout (what `engine.stream` renders in process)."""
    from kvrag.prompt import PromptFormat

    from .. import client

    passages = client.search(url, api_key, args.question, args.top_k)
    if not passages:
        raise KVRagError(f"nothing is indexed yet on {url}: run `kvrag index PATH...` first")
    fmt = PromptFormat()
    user = fmt.separator.join([*(fmt.passage.format(text=p) for p in passages),
                               fmt.question.format(question=args.question)])
    options = {"max_tokens": args.max_new_tokens, **({"kvrag": {"mode": args.mode}} if args.mode else {})}
    for part in client.ask(url, api_key, [{"role": "system", "content": fmt.system},
                                          {"role": "user", "content": user}], options):
        if isinstance(part, str):
            print(part, end="", flush=True)
        else:
            print()
            print_stats(part, f" (kvrag serve at {url})")


def cmd_calibrate(args):
    """`kvrag calibrate`: every input checked before the model loads; the record printed as a table and plotted."""
    from kvrag import calibrate
    from kvrag.retrieval import PassageIndex

    calibrate.check_target(args.target, args.floor)
    questions = calibrate.read_questions(args.questions) if args.questions else None
    settings = [s.strip() for s in args.settings.split(",") if s.strip()]
    if args.show:
        engine = common.engine(args, warm_up=False)
        record = engine.calibration or calibrate.load(engine)
        if record is None:
            raise KVRagError(f"no calibration for this model in {calibrate.record_dir(engine.home)}: run `kvrag "
                             "calibrate` first")
    else:
        index = PassageIndex(common.chroma(args))
        if len(index) == 0:
            raise KVRagError("nothing is indexed yet: run `kvrag index PATH...` first, then calibrate on its passages")
        engine = common.engine(args)
        record = engine.calibrate(questions, index=index, n=args.count, settings=settings, target=args.target,
                                  floor=args.floor, top_k=args.top_k, max_new_tokens=args.max_new_tokens,
                                  seed=args.seed)
    try:
        print(calibrate.format_record(record))
        plot = calibrate.record_path(engine).with_suffix(".png") if args.plot is None else args.plot
        if plot and importlib.util.find_spec("matplotlib"):
            print(f"plot: {calibrate.plot_record(record, plot)}")
    except (KeyError, TypeError, AttributeError) as exc:
        raise KVRagError(f"the calibration record {calibrate.record_path(engine)} is unreadable ({exc!r}): run "
                         "`kvrag calibrate` again") from None


def register(sub) -> None:
    p = common.command(sub, "ask", "answer a question from the indexed passages")
    p.add_argument("question", help="the question to answer")
    p.add_argument("--mode", choices=common.MODES,
                   help="how passages are used: block reuses their cached KV, full prefills everything, blend "
                        "reuses it and recomputes a share of the passage tokens, those whose KV changes most in "
                        "context, auto as many as hold most of that change, prefix reuses only an exact leading "
                        "run, composite keeps encode positions (default: what `kvrag calibrate` chose for this model "
                        "and home, else full; docs/calibration.md)")
    p.add_argument("--top-k", type=int, default=4, help="passages retrieved for the question")
    p.add_argument("--max-new-tokens", type=int, default=128, help="longest answer in tokens")
    p.add_argument("--keep-warm", metavar="SECONDS",
                   help="where no server runs for this home, load the model in a `kvrag serve` that stops after this "
                        "many seconds without a question, so that the next one answers at once; 0: load it in this "
                        f"process, for this question only (default: $KVRAG_KEEP_WARM, else {KEEP_WARM:g})")
    common.server_options(p, "searches its passage index and answers, the model loaded there once for every question")
    p.set_defaults(func=cmd_ask)

    p = common.command(sub, "calibrate", "measure which reusing mode keeps full's answers on this model and the "
                                         "indexed passages, and make it the default")
    p.add_argument("--questions", metavar="FILE", help="sample questions, one a line, or JSON lines {\"question\": "
                                                       "..., \"answers\": [...]} (default: the model writes --count "
                                                       "questions about the indexed passages)")
    p.add_argument("--count", type=int, default=40, help="questions the model writes, without --questions")
    p.add_argument("--settings", default=",".join(CALIBRATE_SETTINGS),
                   help="comma-separated reusing settings compared with full: prefix, block, composite, blend, auto, "
                        "lookahead, auto_lookahead, or blend@R / lookahead@R recomputing a share R")
    p.add_argument("--target", type=float, default=0.95, help="share of answers that must be full's")
    p.add_argument("--floor", type=float, default=0.90, help="the least the lower end of that share's 95%% interval "
                                                             "may be")
    p.add_argument("--top-k", type=int, default=4, help="passages retrieved per question, as `ask` retrieves them")
    p.add_argument("--max-new-tokens", type=int, default=24, help="longest answer in tokens")
    p.add_argument("--seed", type=int, default=0, help="which passages' sentences the model writes questions about")
    p.add_argument("--show", action="store_true", help="print this model's record and write its plot; measure nothing")
    p.add_argument("--plot", metavar="PNG", help="agreement against TTFT, per setting (default: beside the record; '' "
                                                 "for none)")
    p.set_defaults(func=cmd_calibrate)
