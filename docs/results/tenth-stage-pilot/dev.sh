#!/bin/bash
# Criterion 1's dev answers, process K (0: the first four layouts of NAMES, 1: the last four), from the
# repository root: docs/results/tenth-stage-pilot/dev.sh K ADAPTER. Answers go to runs/tenth-dev/
# (`--results` resumes a file there: gunzip -k the committed ones into it first).
set -e
K=$1; ADAPTER=$2; S=runs/tenth-dev
mkdir -p $S
LAYOUTS=$(.venv/bin/python -c "from kvrag.eval.layouts import NAMES; print(','.join(NAMES[:4] if $K == 0 else NAMES[4:]))")
export OMP_NUM_THREADS=1
ask() { ./run --home $S/home-$K --adapter "$ADAPTER" bench accuracy --concurrency 8 --prompts $LAYOUTS --plot "" "$@"; }
ask --squad --split dev --passages 5 --limit 100 --methods block --results $S/squad-dev-$K.jsonl
ask --split dev --passages 10 --limit 100 --prose 0 --methods block,blend --results $S/dev-plain-$K.jsonl
ask --split dev --passages 10 --limit 100 --prose 1 --methods block,blend --results $S/dev-prose-$K.jsonl
