"""`kvrag demo`: the bundled sample corpus indexed, and its questions answered in full and block mode side by side."""

import hashlib
import json
from importlib import resources
from pathlib import Path

from . import common


def cmd_demo(args):
    from kvrag.eval.metrics import answer_in_output
    from kvrag.retrieval import PassageIndex

    sample = Path(str(resources.files("kvrag") / "sample"))
    files = sorted(sample.glob("*.md"))
    questions = json.loads(Path(args.questions or sample / "questions.json").read_text())
    chroma = common.chroma(args)
    engine = common.engine(args)
    passages, sources = common.passages(engine.layout.encode, common.read(files), args.max_tokens)
    print(f"Indexing {len(passages)} passages about a fictional island (KV computed once, then cached)...")
    engine.index(passages)
    # one collection per version of the corpus, so passages of an older sample are never retrieved
    version = hashlib.sha256("".join(sorted(passages)).encode()).hexdigest()[:12]
    index = PassageIndex(chroma, name=f"kvrag-demo-{version}")
    index.add(passages, sources)
    width = 48
    print(f"\n{'question / mode':<{width}} {'TTFT':>8}  answer")
    speedups, right = [], {"full": 0, "block": 0}
    for item in questions:
        question = item["question"]
        retrieved = index.search(question, args.top_k)
        print(f"\n{question}")
        results = {}
        for mode in ("full", "block"):
            results[mode] = r = engine.generate(question, retrieved, mode=mode, max_new_tokens=args.max_new_tokens)
            correct = answer_in_output(r.text, item["answers"])
            right[mode] += correct
            print(f"  {mode:<{width - 2}} {r.ttft * 1e3:>6.0f}ms  {r.text.strip()}  {'[ok]' if correct else '[?]'}")
        speedups.append(results["full"].ttft / results["block"].ttft)
        print(
            f"  {'block speed-up':<{width - 2}} {speedups[-1]:>7.1f}x  "
            f"({results['block'].reused_tokens} of {results['block'].prompt_tokens} prompt tokens reused)"
        )
    print(f"\nmedian TTFT speed-up of block over full: {sorted(speedups)[len(speedups) // 2]:.1f}x")
    print(f"answers with a gold answer in them: full {right['full']} of {len(questions)}, "
          f"block {right['block']} of {len(questions)}")


def register(sub) -> None:
    p = common.command(sub, "demo", "index the bundled sample corpus and compare full vs block mode")
    p.add_argument("--top-k", type=int, default=3, help="passages retrieved per question")
    p.add_argument("--max-new-tokens", type=int, default=48, help="longest answer in tokens")
    p.add_argument("--max-tokens", type=int, default=200, help="longest passage in tokens")
    p.add_argument("--questions", help='JSON list of {"question": ..., "answers": [...]} about the sample corpus '
                                       "(default: the six it ships with)")
    p.set_defaults(func=cmd_demo)
