"""Judges docs/layouts.md "The rule for a fifth stage" on the CPU's dev answers (a record, not part of kvrag).
Criteria 2 and 3 compare pooled point estimates (every layout, and both worlds for 2), as the earlier stages'
rules did; criterion 1 compares a clustered interval. Run from the repository root:
    .venv/bin/python docs/results/fifth-stage/judge.py [DIR [A,B]]   (the CPU's answer files, default dev-cpu/; the candidates)"""
import gzip, json, pathlib, statistics, sys

from kvrag.eval.accuracy import paired_interval
from kvrag.eval.layouts import NAMES as LAYOUTS

HERE = pathlib.Path(__file__).resolve().parent
DIR = pathlib.Path(sys.argv[1]) if len(sys.argv) > 1 else HERE / "dev-cpu"
GEN_IDS = [f"dev-{i}" for i in range(100)]


def read(path):
    opener = gzip.open if path.suffix == ".gz" else open
    with opener(path, "rt") as f:
        return [json.loads(line) for line in f][1:]


def squad(adapter):
    right = {}
    for lay in LAYOUTS:
        path = next(p for p in (DIR / f"squad-dev-{adapter}-{lay}.jsonl", DIR / f"squad-dev-{adapter}-{lay}.jsonl.gz") if p.exists())
        for r in read(path):
            right[r["layout"], r["method"], r["id"]] = int(r["correct"])
    return right


def generated(adapter):
    right = {}
    if adapter == "shipped":  # the CPU's answers of the blend look, the same questions
        for r in read(HERE.parent / "blend-trained-attention-dev.jsonl.gz"):
            right[r["world"], r["layout"], r["method"], r["id"]] = int(r["correct"])
        return right
    for world in ("plain", "prose"):
        for lay in LAYOUTS:
            for r in read(DIR / f"gen-dev-{world}-{adapter}-{lay}.jsonl.gz"):
                right[world, r["layout"], r["method"], r["id"]] = int(r["correct"])
    return right


def mean(xs):
    return 100 * statistics.fmean(xs)


s = squad("shipped")
IDS = sorted({i for (_, _, i) in s})  # SQuAD's own question ids
assert len(IDS) == 100 and len(s) == 1600, (len(IDS), len(s))
print(f"shipped SQuAD dev: full {mean([s[l, 'full', i] for l in LAYOUTS for i in IDS]):.1f}, "
      f"block {mean([s[l, 'block', i] for l in LAYOUTS for i in IDS]):.1f}")
passed = {}
for cand in sys.argv[2].split(",") if len(sys.argv) > 2 else ("A", "B"):
    c = squad(cand)
    gap = [statistics.fmean((c[l, "block", i] - c[l, "full", i]) - (s[l, "block", i] - s[l, "full", i]) for l in LAYOUTS)
           for i in IDS]
    d1, h1 = (100 * x for x in paired_interval(gap))
    full = mean([c[l, "full", i] - s[l, "full", i] for l in LAYOUTS for i in IDS])
    own = mean([c[l, "block", i] - c[l, "full", i] for l in LAYOUTS for i in IDS])
    ok1, ok3 = d1 > h1, full >= -2
    print(f"{cand}: SQuAD dev full {mean([c[l, 'full', i] for l in LAYOUTS for i in IDS]):.1f}, block "
          f"{mean([c[l, 'block', i] for l in LAYOUTS for i in IDS]):.1f}, block - full {own:+.1f}")
    print(f"  1. (block - full) - shipped's: {d1:+.1f} ± {h1:.1f} -> {'pass' if ok1 else 'fail'}")
    print("     per layout: " + ", ".join(f"{l} {mean([(c[l, 'block', i] - c[l, 'full', i]) - (s[l, 'block', i] - s[l, 'full', i]) for i in IDS]):+.1f}" for l in LAYOUTS))
    print(f"  3. full - shipped's full: {full:+.1f} -> {'pass' if ok3 else 'fail'}")
    if not (ok1 and ok3):
        continue
    try:
        g, sg = generated(cand), generated("shipped")
    except (StopIteration, FileNotFoundError):
        print("  2. generated dev answers not in yet")
        continue
    keys = [(w, l, i) for w in ("plain", "prose") for l in LAYOUTS for i in GEN_IDS]
    block = mean([g[w, l, "block", i] - sg[w, l, "block", i] for w, l, i in keys])
    blend = mean([(g[w, l, "blend", i] - g[w, l, "block", i]) - (sg[w, l, "blend", i] - sg[w, l, "block", i]) for w, l, i in keys])
    ok2 = block >= -2 and blend >= -2
    print(f"  2. block - shipped's {block:+.1f}, (blend - block) - shipped's {blend:+.1f} -> {'pass' if ok2 else 'fail'}")
    if ok2:
        passed[cand] = own
print("chosen:", max(passed, key=passed.get) if passed else "none passes")
