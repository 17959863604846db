"""Block mode with torch's kernels, kvrag's C kernels in float32, and with bfloat16 products, in one process (#2).

Times, interleaved, median of `--runs`: the question alone (`floor`) and `block` mode under each
`KVRAG_KERNELS` setting (`0`: torch's kernels; `fp32`: kvrag's C kernels for the question's attention
over the cache and the blocks' fill; `bf16`: the same with the attention's products in bfloat16, where
the CPU has AVX512-BF16), and `full` prefill once per run, as the kernels serve only a question after
cached keys. Checks that block mode's greedy answer is the same under each setting.

    .venv/bin/python docs/bench/kernel_speed.py --lengths 4096,8000 --runs 5
"""

import argparse
import statistics

from kvrag import KVEngine, kernels
from kvrag.bench import QUESTION, make_passages

SETTINGS = ("0", "fp32", "bf16")


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--lengths", default="4096,8000", help="context tokens before the question")
    p.add_argument("--runs", type=int, default=5)
    args = p.parse_args()
    for setting in SETTINGS:
        kernels.use(setting)
        print(f"KVRAG_KERNELS={setting}:", kernels.status())
    engine = KVEngine.from_pretrained()
    rows = []
    for length in map(int, args.lengths.split(",")):
        passages = make_passages(engine, length - len(engine.layout.prefix_ids))
        engine.index(passages, progress=False)

        def run(name, max_new_tokens=1):
            with_passages = passages if name != "floor" else []
            mode = "full" if name == "full" else "block"
            return engine.generate(QUESTION, with_passages, mode=mode, max_new_tokens=max_new_tokens)

        answers = {}
        for setting in SETTINGS:
            kernels.use(setting)
            answers[setting] = run("block", 24).text
        print(f"{length}: block mode's greedy 24-token answers:", answers)
        times = {}
        for _ in range(args.runs):
            times.setdefault("full", []).append(run("full").ttft)
            for setting in SETTINGS:
                kernels.use(setting)
                for name in ("floor", "block"):
                    times.setdefault((setting, name), []).append(run(name).ttft)
        rows.append((length, {key: statistics.median(values) * 1e3 for key, values in times.items()}))
    print(f"\n| context | full ms | floor ms {' / '.join(SETTINGS)} | block ms {' / '.join(SETTINGS)} "
          f"| full/block {' / '.join(SETTINGS)} | block/floor {' / '.join(SETTINGS)} |")
    print("|---:|---:|---:|---:|---:|---:|")
    for length, m in rows:
        each = lambda value: " / ".join(value(setting) for setting in SETTINGS)  # noqa: E731
        floor = each(lambda s: f"{m[s, 'floor']:.0f}")
        block = each(lambda s: f"{m[s, 'block']:.0f}")
        speedup = each(lambda s: f"{m['full'] / m[s, 'block']:.1f}x")
        over_floor = each(lambda s: f"{m[s, 'block'] / m[s, 'floor']:.2f}x")
        print(f"| {length} | {m['full']:.0f} | {floor} | {block} | {speedup} | {over_floor} |")


if __name__ == "__main__":
    main()
