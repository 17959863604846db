"""`kvrag kernels build | status`: the optional C attention kernels, built ahead of the first request. No model loads."""

import os

from . import common


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


def register(sub) -> None:
    p = common.command(sub, "kernels", "the optional C attention kernels", model=False)
    kernels = p.add_subparsers(dest="kernels", required=True, metavar="ACTION")
    b = common.command(kernels, "build", "compile the kernels for this machine now, ahead of the first request",
                       model=False)
    b.add_argument("--force", action="store_true", help="compile even when a verified build exists")
    b.set_defaults(func=cmd_kernels_build)
    b = common.command(kernels, "status", "whether the kernels are in use, and why not", model=False)
    b.set_defaults(func=cmd_kernels_status)
