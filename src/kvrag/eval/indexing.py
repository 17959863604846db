"""How fast `KVEngine.index` encodes passages, beside the limit of the hardware: a plain batched forward of
the base model over the same tokens, in the same dtype.

`KVEngine.index` packs several passages into each forward (1024 tokens on a CPU, up to 65536 on a GPU),
each attending to itself alone; "one at a time" shows what that gains. On a CPU it is compute-bound, so a
cheaper dtype or more machines go further. Each run indexes passages no run has
stored before (distinct texts, the same lengths; the engines store in memory only); the dtypes take turns
and the order of the three ways rotates, so a busy machine affects them alike. index/plain is the median of
each run's own ratio: this machine's speed drifts by ±15% from one run to the next, more than the gap.
"""

import statistics
import time
import uuid

import torch

from kvrag import KVEngine

from .ttft import make_passages


@torch.inference_mode()
def plain_forward(model, ids_list: list[list[int]], batch: int = 8) -> float:
    """Seconds for the base model's decoder over every passage, `batch` at a time (padded, sorted by length).

    The decoder alone: encoding KV needs no logits. (transformers' head over a padded batch's last
    positions copies its weight once per row in bfloat16: half the forward's time on this CPU.)"""
    decoder = model.get_decoder()
    ordered = sorted(ids_list, key=len)
    start = time.perf_counter()
    for i in range(0, len(ordered), batch):
        chunk = ordered[i : i + batch]
        width = max(map(len, chunk))
        ids = torch.zeros(len(chunk), width, dtype=torch.long, device=model.device)
        mask = torch.zeros(len(chunk), width, dtype=torch.long, device=model.device)
        for row, passage in enumerate(chunk):
            ids[row, : len(passage)] = torch.tensor(passage)
            mask[row, : len(passage)] = 1
        decoder(input_ids=ids, attention_mask=mask, use_cache=False)
    return time.perf_counter() - start


def index_table(model: str | None, dtypes=("float32", "bfloat16"), passages: int = 32, tokens: int = 160,
                runs: int = 2, device: str = "cpu", adapter="auto", home=None, progress=print) -> list[dict]:
    """Per dtype: passages/s and tokens/s of `KVEngine.index` (passages packed per forward as it does by default:
    on a GPU), its tokens/s one passage per forward, and tokens/s of `plain_forward`: medians of `runs`
    alternating runs over `passages` fresh passages of about `tokens` tokens each, and the median of the
    runs' index/plain ratios."""
    engines = {d: KVEngine.from_pretrained(model, dtype=d, device=device, adapter=adapter, home=home, persist=False,
                                           warm_up=False) for d in dtypes}  # stored in memory only
    times = {d: {"index": [], "alone": [], "plain": []} for d in dtypes}
    counts = {}
    ways = ["index", "alone", "plain"]
    for run in range(runs):
        for dtype, engine in engines.items():
            for way in ways[run % 3:] + ways[: run % 3]:
                texts = make_passages(engine, passages * tokens, block_tokens=tokens, tag=f"{uuid.uuid4().hex[:8]}-")
                ids = [engine.layout.passage_ids(t) for t in texts]
                counts[dtype] = (len(ids), sum(map(len, ids)))
                if way == "plain":
                    times[dtype][way].append(plain_forward(engine.model, ids))
                    continue
                start = time.perf_counter()
                engine.index(texts, progress=False, pack_tokens=None if way == "index" else 0)
                times[dtype][way].append(time.perf_counter() - start)
    rows = []
    for dtype in dtypes:
        n, total = counts[dtype]
        index, alone, plain = (statistics.median(times[dtype][k]) for k in ("index", "alone", "plain"))
        rows.append({"dtype": dtype, "passages": n, "tokens": total, "passages_per_s": n / index,
                     "tokens_per_s": total / index, "alone_tokens_per_s": total / alone,
                     "plain_tokens_per_s": total / plain,
                     "index_per_plain": statistics.median(p / i for i, p in zip(times[dtype]["index"],
                                                                                  times[dtype]["plain"]))})
        progress(format_row(rows[-1]))
    return rows


HEADER = (f"{'dtype':>9} {'passages':>8} {'tokens':>7} {'passages/s':>10} {'tokens/s':>9} {'one at a time':>13} "
          f"{'plain tokens/s':>14} {'index/plain':>11}")


def format_row(row) -> str:
    return (f"{row['dtype']:>9} {row['passages']:>8} {row['tokens']:>7} {row['passages_per_s']:>10.2f} "
            f"{row['tokens_per_s']:>9.0f} {row['alone_tokens_per_s']:>13.0f} {row['plain_tokens_per_s']:>14.0f} "
            f"{row['index_per_plain']:>11.2f}")
