"""Block mode with and without `kvrag.kernels`, in one process (#2).

Times, interleaved, median of `--runs`: the question alone (`floor`), `full` prefill and `block`
mode, with torch's kernels (`kernels=off`) and with kvrag's C kernels (`on`: the question's attention
over the cache and the blocks' fill); full prefill runs torch's flash kernel either way, as the
kernels serve only a question after cached keys. Checks that block mode's greedy answer is the same
both ways.

    .venv/bin/python docs/bench/kernel_speed.py --lengths 4096,8000 --runs 5
"""

import argparse
import statistics

from kvrag import KVEngine, kernels
from kvrag.bench import QUESTION, make_passages


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--lengths", default="4096,8000", help="context tokens before the question")
    p.add_argument("--runs", type=int, default=5)
    args = p.parse_args()
    print("kernels:", kernels.status())
    engine = KVEngine.from_pretrained()
    settings = {"floor": ("block", False), "full": ("full", True), "block": ("block", True)}
    rows = []
    for length in map(int, args.lengths.split(",")):
        passages = make_passages(engine, length - len(engine.layout.prefix_ids))
        engine.index(passages, progress=False)

        def run(name, on, max_new_tokens=1):
            mode, with_passages = settings[name]
            kernels.enabled = on
            return engine.generate(QUESTION, passages if with_passages else [], mode=mode, max_new_tokens=max_new_tokens)

        answers = {on: run("block", on, 24).text for on in (False, True)}
        print(f"{length}: block mode's greedy 24-token answer the same with and without kernels:",
              answers[False] == answers[True], repr(answers[True]))
        times = {}
        for _ in range(args.runs):
            for on in (False, True):
                for name in settings:
                    times.setdefault((on, name), []).append(run(name, on).ttft)
        med = {key: statistics.median(values) * 1e3 for key, values in times.items()}
        rows.append((length, med))
    kernels.enabled = True
    print("\n| context | floor ms off / on | full ms off / on | block ms off / on | block off/on "
          "| full/block off / on | block/floor off / on |")
    print("|---:|---:|---:|---:|---:|---:|---:|")
    for length, m in rows:
        pair = lambda name: f"{m[False, name]:.0f} / {m[True, name]:.0f}"  # noqa: E731
        ratio = lambda a, b: f"{m[False, a] / m[False, b]:.1f}x / {m[True, a] / m[True, b]:.1f}x"  # noqa: E731
        print(f"| {length} | {pair('floor')} | {pair('full')} | {pair('block')} "
              f"| {m[False, 'block'] / m[True, 'block']:.2f}x | {ratio('full', 'block')} | {ratio('block', 'floor')} |")


if __name__ == "__main__":
    main()
