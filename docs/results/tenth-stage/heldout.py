"""The tenth stage's block and blend answers to examples/heldout: eighth-stage/heldout.py with it shipped.

    KVRAG_HOME=DIR python docs/results/tenth-stage/heldout.py langchain|llamaindex OUT.jsonl
"""

import sys

sys.path.insert(0, "docs/results/eighth-stage")

import heldout  # noqa: E402

heldout.ENGINE = "KVEngine.shared() (the tenth stage, adapter_scope='block', CPU)"

if __name__ == "__main__":
    heldout.main(*sys.argv[1:])
