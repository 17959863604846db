"""Command line: kvrag index | status | ask | calibrate | serve | export | demo | finetune | bench ttft | bench load |
bench accuracy | bench serve | bench vllm | kernels build | kernels status.

The parser is built here from the command groups, each a module of this package that registers its
subcommands and holds their cmd_* functions (as vLLM's entrypoints/cli/ does). The research harness
(kvrag.eval, kvrag.train), torch and matplotlib are imported inside the commands that use them, so
`kvrag --help` and a bad argument never wait for them.
"""

import argparse
import sys
import warnings

from kvrag.errors import KVRagError

from . import ask, bench, common, demo, finetune, index, kernels, serve


def build_parser(finetune_config: dict | None = None) -> argparse.ArgumentParser:
    """The command line; `finetune_config`: options of `finetune --config`, which become that command's defaults."""
    parser = argparse.ArgumentParser(prog="kvrag", description=__doc__.split("\n\n")[0], formatter_class=common.Help)
    common.model_options(parser)
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    index.register(sub)
    ask.register(sub)
    serve.register(sub)
    demo.register(sub)
    finetune.register(sub, finetune_config)
    bench.register(sub)
    kernels.register(sub)
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
            args = build_parser(finetune.read_config(args.config, args.run)).parse_args(argv)
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
