#!/bin/bash
# Criterion 2's --seed 3 test answers, process K (0: the first four layouts of NAMES, 1: the last four),
# of the candidate and of the ninth stage, from the repository root: docs/results/tenth-stage-pilot/test.sh K.
# Answers go to runs/tenth-test/, the ninth stage's prefixed `ninth-` (`--results` resumes a file
# there: gunzip -k the committed ones into it first).
set -e
K=$1; S=runs/tenth-test
mkdir -p $S
LAYOUTS=$(.venv/bin/python -c "from kvrag.eval.layouts import NAMES; print(','.join(NAMES[:4] if $K == 0 else NAMES[4:]))")
export OMP_NUM_THREADS=1
ask() {  # WHO ADAPTER ARGS...: a --home per process and adapter
    local who=$1 adapter=$2; shift 2
    ./run --home $S/home-$K-${who:-tenth} --adapter "$adapter" bench accuracy --concurrency 8 --prompts $LAYOUTS --seed 3 --plot "" "$@"
}
adapter() { [ -z "$1" ] && echo docs/results/tenth-stage-pilot/adapter || echo docs/results/ninth-stage-pilot/adapters/layers-0-9; }
for who in "" ninth-; do
    ask "$who" $(adapter "$who") --squad --split test --passages 5 --limit 400 --methods block --results $S/${who}squad-test-seed3-$K.jsonl
done
for p in plain prose; do
    for who in "" ninth-; do
        ask "$who" $(adapter "$who") --split test --passages 10 --limit 200 --prose $([ $p = prose ] && echo 1 || echo 0) \
            --methods block,blend --results $S/${who}test-$p-seed3-$K.jsonl
    done
done
