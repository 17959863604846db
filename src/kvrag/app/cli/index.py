"""`kvrag index` and `kvrag status`: files cut into passages, their KV computed once and kept, the passages put in
the passage index; and what that costs. Before encoding, `index` says how many bytes of KV the new passages will
take (`KVStore.file_bytes` per block) and refuses to start when that exceeds the disk budget; `--dry-run` stops
there, and `status` shows what the home holds."""

import os
import sys
from pathlib import Path

from kvrag.errors import KVRagError

from . import common


def disk_limit(args) -> tuple[int | None, str]:
    """(bytes, where they were given) of --disk-budget, else $KVRAG_DISK_BUDGET, as the engine reads them; (None,
    what the budget is then) where neither is given."""
    from kvrag.store import parse_size

    if args.disk_budget is not None:
        return parse_size(args.disk_budget), "--disk-budget"
    if os.environ.get("KVRAG_DISK_BUDGET") is not None:
        return parse_size(os.environ["KVRAG_DISK_BUDGET"]), "$KVRAG_DISK_BUDGET; --disk-budget overrides it"
    return None, "what leaves a tenth of the disk free; --disk-budget sets one"


def budget(kv: Path, limit: int | None):
    """The disk budget of the block files under `kv` (the home's kv/: every model's), as the engine keeps it."""
    from kvrag.store import DiskBudget

    return DiskBudget(kv, limit)


def cost_text(engine, passages: list[str], args) -> tuple[str, str | None]:
    """(what indexing `passages` will write, beside the disk budget; why it is refused, or None). Refused when the
    new blocks alone exceed the budget: the KV there already makes room for them, least recently used first."""
    from kvrag.paths import size_text

    cost = engine.index_cost(passages)
    kv, (limit, given) = engine.home / "kv", disk_limit(args)  # the budget's directory: every model's block files
    allowance = budget(kv, limit).allowance()
    said = (f"{cost.new} of {cost.passages} passages to encode, {cost.tokens:,} tokens: {bound(engine)} "
            f"{size_text(cost.bytes)} of KV on disk ({cost.bytes / max(1, cost.tokens):,.0f} bytes a token, "
            f"{storage_name(engine)}); the disk budget is {size_text(allowance)} ({given})")
    if cost.bytes <= allowance:
        return said, None
    where = f"no space left in {kv} for" if limit is None else "not indexing"
    return said, (f"{where} {bound(engine)} {size_text(cost.bytes)} of KV for {cost.new} new passages: the disk budget is "
                  f"{size_text(allowance)} ({given}); nothing was encoded")


def cmd_index(args):
    from ..split import text_files

    if args.dry_run and args.server:
        raise KVRagError("--dry-run estimates the KV this home would keep: leave out --server")
    files = text_files(args.paths)
    texts = common.read(files)
    if not args.dry_run and not args.server:
        _stop_kept_warm(args)
    server = None if args.dry_run else common.server(args)
    if server:  # the server computes and keeps the KV; here only the tokenizer, to cut the passages
        from kvrag import loading

        from .. import client

        tokenizer = common.tokenizer(loading.resolve_model_dir(args.model, Path(args.home) if args.home else None))
        encode = lambda text: tokenizer(text, add_special_tokens=False)["input_ids"]  # noqa: E731
        passages, _ = common.passages(encode, texts, args.max_tokens)
        client.send_passages(*server, passages)
        print(f"indexed {len(passages)} passages from {len(texts)} files on {server[0]}")
        return
    from kvrag import preceding_in_documents
    from kvrag.retrieval import PassageIndex

    if args.dry_run:  # no passage index opened, and an engine that keeps nothing on disk
        engine = common.engine(args, warm_up=False, persist=False)
    else:
        chroma = common.chroma(args)
        index = PassageIndex(chroma)  # a Chroma server that does not answer: refused before any work
        engine = common.engine(args)
    passages, sources = common.passages(engine.layout.encode, texts, args.max_tokens)
    said, refused = cost_text(engine, passages, args)
    if args.dry_run:
        print(f"{said}; dry run: nothing encoded or written")
    if refused:
        raise KVRagError(refused)
    if args.dry_run:
        return
    print(f"kvrag: {said}", file=sys.stderr)  # the line above the encoding bar and its ETA
    # block context "document": each passage encoded after the one before it in its file
    preceding = preceding_in_documents(passages, sources) if engine.block_context == "document" else None
    engine.index(passages, preceding=preceding)  # its progress bar shows how many were newly encoded
    index.add(passages, sources)
    print(f"indexed {len(passages)} passages from {len(texts)} files"
          f"{f' into Chroma at {chroma}' if isinstance(chroma, str) else ''}")


def per_token(engine) -> tuple[float, int]:
    """(bytes of a block file per token, bytes of it whatever its length: header, 8- and 4-bit keys' scales) for this
    model and storage format."""
    one, more = engine.store.file_bytes(1), engine.store.file_bytes(1025)
    each = (more - one) / 1024
    return each, round(one - each)


def storage_name(engine) -> str:
    return str(engine.storage_dtype).removeprefix("torch.")


def bound(engine, exact: str = "about") -> str:
    """How a format's files compare to `KVStore.file_bytes`: 4-bit codes are kept deflated where that is smaller
    (about 7% of the default model's KV), so for them it is an upper bound."""
    return "at most" if engine.store.shape.deflated else exact


def _size(path: Path) -> int:
    """Bytes of the files at `path` (a file, or every file under a directory); 0 where there is none."""
    if path.is_file():
        return path.stat().st_size
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file()) if path.is_dir() else 0


def _stop_kept_warm(args) -> None:
    """Stop the server `kvrag ask` keeps warm for this home, if it runs: this process then indexes, saying first
    what the KV will cost and refusing what exceeds the disk budget (a server started with `kvrag serve` indexes
    what it is sent)."""
    from .. import client

    home = common.home(args)
    found = client.discover(home)
    if found and found.idle_exit:
        print(f"kvrag: stopping the model process `kvrag ask` kept warm (pid {found.pid}) to index here",
              file=sys.stderr)
        client.stop(home, found)


def cmd_status(args):
    """What the home holds for this model, tier by tier; nothing is encoded, and the engine keeps nothing on disk."""
    from kvrag.paths import kvrag_home, size_text
    from kvrag.retrieval import PassageIndex, chroma_url, parse_chroma_url

    home = Path(args.home) if args.home else kvrag_home()
    chroma = args.chroma or chroma_url() or home / "chroma"
    texts = None
    if isinstance(chroma, str):
        parse_chroma_url(chroma)  # a URL, or refused before anything is loaded
    if isinstance(chroma, str) or chroma.is_dir():  # an embedded index not made yet is not made here
        index = PassageIndex(chroma)
        texts = index.texts(limit=max(1, len(index)))
    engine = common.engine(args, warm_up=False, persist=False)
    own, (limit, given) = engine.kv_dir, disk_limit(args)
    files = budget(own, limit).files()
    every_model = budget(home / "kv", limit)
    each, fixed = per_token(engine)
    each_text = f"{bound(engine, '')} {each:,.0f}".lstrip()
    print(f"model: {args.model or 'the default model'}, KV stored as {storage_name(engine)}: {each_text} bytes a "
          f"token and {size_text(fixed)} a block")
    if texts is None:
        print(f"passages: none indexed yet in {chroma}")
    else:
        cost = engine.index_cost(texts)
        print(f"passages: {len(texts)} in the passage index, {cost.passage_tokens:,} tokens; "
              f"{cost.passages - cost.new} of them with KV on disk for this model")
    registry = own / "passages.sqlite"
    where = f"on the server at {chroma}" if isinstance(chroma, str) else f"{size_text(_size(chroma))} ({chroma})"
    print(f"disk: KV {size_text(sum(size for _, size, _ in files))} in {len(files)} block files ({own}); passage registry "
          f"{size_text(_size(registry))} ({registry}); passage index (Chroma) {where}")
    print(f"disk budget: {size_text(every_model.allowance())} ({given}) for the KV of every model in {home / 'kv'}, "
          f"which holds {size_text(sum(size for _, size, _ in every_model.files()))}")
    if engine.remote is not None:
        print(f"remote: KV and passages in the Redis server at {engine.remote.url} (not measured here)")
    print("memory: per process (each kvrag process keeps the KV it uses in memory, within its budget); none is kept "
          "between processes")
    from .. import client

    server = client.discover(home)
    if server:
        kept = f", kept warm by `kvrag ask` until {server.idle_exit:g} s pass without a request" \
            if server.idle_exit else ""
        print(f"server: `kvrag serve` at {server.url} (pid {server.pid}) answers for this home{kept}")


def register(sub) -> None:
    p = common.command(sub, "index", "split text/markdown files into passages and precompute their KV")
    p.add_argument("paths", nargs="+", help="text files, or directories searched for .txt/.md/.markdown/.rst files")
    p.add_argument("--max-tokens", type=int, default=200, help="longest passage in tokens")
    p.add_argument("--dry-run", action="store_true",
                   help="cut and tokenize the passages and print the KV they would take against the disk budget; "
                        "encode nothing, write nothing")
    common.server_options(p, "computes and keeps the passages' KV and stores them in its passage index instead of "
                             "this process")
    p.set_defaults(func=cmd_index)

    p = common.command(sub, "status", "what the home holds for this model: passages, tokens, bytes of KV a token, "
                                      "bytes on disk per tier, the disk budget")
    p.set_defaults(func=cmd_status)
