"""Block mode with the assembled cache changed at inference, for the experiments in
finetune-experiments.md ("Changing block mode at inference"). Block mode only; the answers go to
a results file as `kvrag bench accuracy` writes them, its header naming the change.

  --key-scale A   multiply the passage blocks' cached keys by A: the question's attention over the
                  passages at temperature 1/A (APE's sharpening), the prefix and question untouched
  --gap G         G empty positions between consecutive cached blocks; the question keeps its
                  position and earlier blocks move back, so only the relative distances change

    .venv/bin/python docs/bench/block_variants.py --key-scale 1.2 --split dev --results F
"""

import argparse

import torch

import kvrag.engine
from kvrag import KVEngine, data
from kvrag.assemble import Piece, fill
from kvrag.evaluate import evaluate, format_table, summarize


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--key-scale", type=float, default=1.0)
    p.add_argument("--gap", type=int, default=0)
    p.add_argument("--adapter", default="src/kvrag/adapters/smollm2-135m-instruct-block")
    p.add_argument("--split", default="dev")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--limit", type=int, default=200)
    p.add_argument("--results", required=True)
    args = p.parse_args()

    def gapped_fill(ws, pieces, inv_freq):
        last = len(pieces) - 1
        return fill(ws, [Piece(x.block, x.position - args.gap * (last - j)) for j, x in enumerate(pieces)], inv_freq)

    assemble = kvrag.engine.KVEngine._assemble

    def changed_assemble(self, prompt, keys, ws, reorder=True):
        kvrag.engine.fill = gapped_fill
        try:
            position, stored, hits = assemble(self, prompt, keys, ws, reorder)
        finally:
            kvrag.engine.fill = fill
        with torch.no_grad():
            ws.keys[:, :, :, len(prompt.prefix) : position] *= args.key_scale
        return position, stored, hits

    kvrag.engine.KVEngine._assemble = changed_assemble
    engine = KVEngine.from_pretrained(adapter=args.adapter, adapter_scope="all")
    dataset = {"split": args.split, "passages": 10, "noise": 0.5, "seed": args.seed}
    examples = data.generate(n=args.limit, **dataset)
    dataset |= {"key_scale": args.key_scale, "gap": args.gap}
    print(format_table(summarize(evaluate(engine, examples, ["block"], results=args.results, dataset=dataset))))


if __name__ == "__main__":
    main()
