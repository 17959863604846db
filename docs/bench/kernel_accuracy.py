"""Block mode's answers with the attention kernel's float32 and bfloat16 products, in one process (#2).

Answers the accuracy benchmark's test questions (10 passages each, greedy, 32 new tokens) in
block mode under `KVRAG_KERNELS=fp32` and `bf16`, and prints how many answers are identical,
how many are correct under each, and every answer that changed.

    .venv/bin/python docs/bench/kernel_accuracy.py --limit 200 --adapter none
"""

import argparse

from kvrag import KVEngine, data, kernels
from kvrag.evaluate import evaluate


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--limit", type=int, default=200, help="test questions")
    p.add_argument("--adapter", default="auto", help="auto (the shipped block-tuned adapter) or none")
    args = p.parse_args()
    engine = KVEngine.from_pretrained(adapter=None if args.adapter == "none" else args.adapter)
    examples = data.generate("test", n=args.limit, passages=10)
    records = {}
    for setting in ("fp32", "bf16"):
        kernels.use(setting)
        print(f"KVRAG_KERNELS={setting}:", kernels.status())
        records[setting] = evaluate(engine, examples, ["block"], progress=False)
    pairs = list(zip(records["fp32"], records["bf16"]))
    same = sum(a.output == b.output for a, b in pairs)
    correct = {setting: sum(r.correct for r in rs) for setting, rs in records.items()}
    print(f"adapter {args.adapter}, {len(pairs)} questions: {same} identical answers; "
          f"correct with fp32 {correct['fp32']}, with bf16 {correct['bf16']}")
    for a, b in pairs:
        if a.output != b.output:
            print(f"  fp32 ({'right' if a.correct else 'wrong'}): {a.output!r}\n  bf16 ({'right' if b.correct else 'wrong'}): {b.output!r}")


if __name__ == "__main__":
    main()
