"""What every command group shares: the model options and their parser helpers, and the engine, home, passage
index and corpus every command that answers or indexes reads. Nothing heavy is imported at module level:
torch and transformers load inside `engine`, when a command runs."""

import argparse
import os
import warnings
from pathlib import Path

MODES = ("full", "block", "composite", "prefix", "blend", "auto")
"""kvrag.MODES, and below the engine's choices the options take, written here so that neither `kvrag --help`
nor a bad argument waits for torch to be imported (tests/test_cli.py checks them against the engine's)."""
ADAPTER_SCOPES = ("block", "all")
BLOCK_CONTEXTS = ("none", "prefix", "ape", "document")
STORAGE = ("float16", "bfloat16", "float32", "int8", "int4")  # kvrag.store.STORAGE, without importing torch here


def engine(args, **options):
    """The KVEngine the model options describe (`options`: further KVEngine arguments)."""
    from kvrag import KVEngine

    adapter = None if args.adapter == "none" else args.adapter
    return KVEngine.from_pretrained(args.model, home=args.home, block_context=args.block_context, adapter=adapter,
                                    adapter_scope=args.adapter_scope, device=args.device, dtype=args.dtype,
                                    remote=args.remote, disk_budget=args.disk_budget, storage_dtype=args.storage,
                                    **options)


def home(args) -> Path:
    from kvrag.paths import kvrag_home, writable_home

    return writable_home(Path(args.home) if args.home else kvrag_home())


def chroma(args) -> str | Path:
    """Where the passage index lives: --chroma, else $KVRAG_CHROMA (a Chroma server's URL), else the
    embedded Chroma under the cache directory."""
    from kvrag.retrieval import chroma_url, parse_chroma_url

    url = args.chroma or chroma_url()
    if url:
        parse_chroma_url(url)  # a URL, or refused before anything is loaded
        return url
    return home(args) / "chroma"


def read(files) -> dict:
    """Every file's text, read (and checked for UTF-8) before anything is loaded or written; empty ones
    left out, named in one line (an error if every one is)."""
    from kvrag.errors import EmptyInputError

    from ..split import read_text

    texts = {f: read_text(f) for f in files}
    empty = [str(f) for f, text in texts.items() if not text.strip()]
    if empty and len(empty) == len(texts):
        raise EmptyInputError(f"nothing to index: {', '.join(empty)} {'is' if len(empty) == 1 else 'are'} empty")
    if empty:
        warnings.warn(f"kvrag: skipping empty file{'s' if len(empty) > 1 else ''} {', '.join(empty)}", stacklevel=2)
    return {f: text for f, text in texts.items() if text.strip()}


def passages(encode, texts: dict, max_tokens: int):
    """Every file's passages and their sources; `encode` is the model's tokenizer (text -> ids)."""
    from ..split import split_passages

    count = lambda text: len(encode(text))  # noqa: E731
    found, sources = [], []
    for f, text in texts.items():
        for p in split_passages(text, count, max_tokens):
            found.append(p)
            sources.append(str(f))
    return found, sources


def tokenizer(source):
    from kvrag import loading

    return loading.load_tokenizer(source)  # a file it cannot read: one line naming it


def api_key(args) -> str | None:
    return args.api_key or os.environ.get("KVRAG_API_KEY") or None


def answering_options(args) -> dict:
    """The options that decide the answers: a running server is used for another command only where they
    agree."""
    names = ("model", "adapter", "adapter_scope", "dtype", "block_context", "storage")
    return {name: None if getattr(args, name) is None else str(getattr(args, name)) for name in names}


def server(args) -> tuple[str, str | None] | None:
    """(URL, API key) of `--server`, else of the `kvrag serve` running for this home with the same model options
    (the key it advertised, else --api-key's), else None."""
    from .. import client

    if getattr(args, "server", None):
        return args.server, api_key(args)
    found = client.discover(home(args))
    if found and found.model == answering_options(args):
        return found.url, found.key or api_key(args)
    return None


# ---- the parser ------------------------------------------------------------------------------------------

class Help(argparse.ArgumentDefaultsHelpFormatter):
    """Every option's help ends with its default, unless the help already says it in words."""

    def _get_help_string(self, action):
        if action.default is None or "(default" in (action.help or ""):
            return action.help
        return super()._get_help_string(action)


MODEL_OPTIONS = {
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
    "--storage": dict(choices=STORAGE, help="how stored KV is kept: float16, bfloat16, float32, or 8- and 4-bit "
                                            "codes with scales ('int8', 'int4': a half and about a quarter of "
                                            "float16's bytes) (default: $KVRAG_STORAGE, else int4 for the default "
                                            "model, the model's half dtype or float16 for others)"),
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


def server_options(p: argparse.ArgumentParser, does: str) -> None:
    p.add_argument("--server", metavar="URL", help=f"a running `kvrag serve` that {does} (default: the one "
                                                   "`kvrag serve` runs for this home with the same model options, if "
                                                   "any; else this process)")
    p.add_argument("--api-key", help="the server's API key (default: $KVRAG_API_KEY, else none)")


def model_options(parser: argparse.ArgumentParser, after_command: bool = False) -> None:
    """The options of the model every command but `kernels` loads. They are accepted before the command
    and after it; after it they take no default, so that they never undo one given before."""
    for flag, options in MODEL_OPTIONS.items():
        if after_command:
            default = options.get("default")
            help = options["help"] if default is None else f"{options['help']} (default: {default})"
            options = {**options, "default": argparse.SUPPRESS, "help": help}
        parser.add_argument(flag, **options)


def command(sub, name: str, help: str, model: bool = True) -> argparse.ArgumentParser:
    """A subcommand's parser, taking the model options after it too (unless `model` is False)."""
    parser = sub.add_parser(name, help=help, description=help, formatter_class=Help)
    if model:
        model_options(parser, after_command=True)
    return parser
