#!/bin/bash
# The README's tables and the 778-question reading with the tenth stage, process K (0: the first four
# layouts of NAMES, 1: the last four), from the repository root: docs/results/tenth-stage/tables.sh K.
# Answers go to runs/tenth-tables/, committed gzipped to docs/results/tenth-stage/ (`--results` resumes
# a file there: gunzip -k the committed ones into it first).
set -e
K=$1; S=runs/tenth-tables
mkdir -p $S
LAYOUTS=$(.venv/bin/python -c "from kvrag.eval.layouts import NAMES; print(','.join(NAMES[:4] if $K == 0 else NAMES[4:]))")
export OMP_NUM_THREADS=1
ask() { ./run --home $S/home-$K --adapter docs/results/tenth-stage-pilot/adapter bench accuracy --concurrency 8 --prompts $LAYOUTS --plot "" "$@"; }
ask --seed 0 --methods block,blend --squad --split test --passages 5 --limit 400 --results $S/squad-test-$K.jsonl
ask --seed 0 --methods block,blend --split test --passages 10 --limit 200 --prose 0 --results $S/test-plain-$K.jsonl
ask --seed 0 --methods block,blend --split test --passages 10 --limit 200 --prose 1 --results $S/test-prose-$K.jsonl
ask --seed 1 --methods block --squad --split test --passages 5 --limit 400 --results $S/squad-test-seed1-$K.jsonl
