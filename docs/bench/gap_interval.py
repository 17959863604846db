"""How far each method is from full attention on the same questions, with a 95% interval.

Pools several answer files of `kvrag bench accuracy` (one per generated world, e.g. seeds 0 and 1)
and pairs every method's answer with full's to the same question. Usage:
.venv/bin/python docs/bench/gap_interval.py docs/bench/accuracy-shipped.jsonl docs/bench/accuracy-seed1-shipped.jsonl
"""

import json
import sys
from dataclasses import replace

from kvrag.evaluate import Record, format_against_full

records = []
for world, path in enumerate(sys.argv[1:]):
    with open(path, encoding="utf-8") as f:
        rows = [json.loads(line) for line in f]
    records += [replace(Record(**row), id=f"{world}:{row['id']}") for row in rows if "method" in row]  # ids repeat across worlds
print(format_against_full(records))
