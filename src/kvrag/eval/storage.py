"""`kvrag bench storage`: what each KV storage format costs on this model and machine. Per format, the bytes its
block files take per token (measured on disk after indexing) and block mode's TTFT with the passages' KV in memory
and read from disk, the formats taking turns in each round so that a busy machine slows them alike."""

import statistics
import tempfile

import torch

from kvrag.engine import KVEngine

from .ttft import QUESTION, make_passages

FORMATS = ("float16", "int8", "int4")


def _passage_bytes(engine, passages: list[str]) -> int:
    """Bytes of the passages' block files (the prompt's shared prefix and separator blocks, once per home, left out)."""
    ids = [engine.layout.passage_ids(p) for p in passages]
    return sum(engine.store.disk.path(key).stat().st_size for key in engine.blocks.keys(engine.layout.prefix_ids, ids))


def storage_rows(model, tokenizer, lengths=(1024, 4096), formats=FORMATS, runs: int = 5, progress=print, **options):
    """A row per (format, length): bytes per passage token on disk (the passages' block files), block mode's median TTFT with the blocks in
    memory and from disk (the memory tier emptied first), each also as a ratio to the first format's, and
    whether block mode's first token is float16's. One engine per format over the same weights, each in a home
    of its own."""
    rows = []
    with tempfile.TemporaryDirectory(prefix="kvrag-bench-storage-") as home:
        engines = {name: KVEngine(model, tokenizer, home=f"{home}/{name}", storage_dtype=name, default_mode="block",
                                  **options) for name in formats}
        for length in lengths:
            passages = make_passages(next(iter(engines.values())), length, tag=f"{length}-")
            tokens = sum(len(next(iter(engines.values())).layout.passage_ids(p)) for p in passages)
            for engine in engines.values():
                engine.index(passages, progress=False)
                engine.generate(QUESTION, passages, max_new_tokens=1)  # warm-up: buffers and allocator
            warm, cold, first = ({name: [] for name in formats} for _ in range(3))
            for run in range(runs):
                order = formats if run % 2 == 0 else formats[::-1]
                for name in order:
                    engine = engines[name]
                    result = engine.generate(QUESTION, passages, max_new_tokens=1)
                    warm[name].append(result.ttft)
                    first[name].append(result.token_ids[:1])
                    engine.store.memory.clear()
                    cold[name].append(engine.generate(QUESTION, passages, max_new_tokens=1).ttft)
            base = formats[0]
            for name in formats:
                row = {"format": name, "context": length, "passage_tokens": tokens,
                       "bytes_per_token": _passage_bytes(engines[name], passages) / tokens,
                       "warm": statistics.median(warm[name]), "cold": statistics.median(cold[name]),
                       "same_first": first[name][0] == first[base][0]}
                row["warm_ratio"] = row["warm"] / statistics.median(warm[base])
                row["cold_ratio"] = row["cold"] / statistics.median(cold[base])
                rows.append(row)
                progress(format_row(row))
    return rows


HEADER = (f"{'format':>8} {'context':>8} {'bytes/token':>12} {'block ms (memory)':>18} {'ratio':>6} "
          f"{'block ms (disk)':>16} {'ratio':>6} {'1st token = float16':>20}")


def format_row(row) -> str:
    return (f"{row['format']:>8} {row['context']:>8} {row['bytes_per_token']:>12.0f} {row['warm'] * 1e3:>18.1f} "
            f"{row['warm_ratio']:>6.2f} {row['cold'] * 1e3:>16.1f} {row['cold_ratio']:>6.2f} "
            f"{'yes' if row['same_first'] else 'no':>20}")


def describe(model) -> str:
    return f"device {model.device}, compute {str(model.dtype).removeprefix('torch.')}, {torch.get_num_threads()} threads"
