"""Questions on a folder of hand-written documents (`examples/heldout`: a delta's towns, bridges,
manuals, minutes, a letter), asked as a RAG app asks them: the files split into passages as `kvrag
index` splits them, and each question given its `k` nearest passages by the packaged all-MiniLM-L6-v2
(cosine), most similar first. Nobody tuned kvrag or its adapter on this text.

The folder holds the documents (.md, .txt) and `questions.json`: [{"question": ..., "answers": [...]}].
"""

import hashlib
import json
from pathlib import Path

from ..errors import KVRagError
from .data import QAExample

DEFAULT = Path("examples/heldout")


def questions(directory: str | Path, count_tokens, k: int = 4, max_tokens: int = 200, embedder=None) -> list[QAExample]:
    """Every question of `directory` with its `k` retrieved passages; `count_tokens(text)` is the model's
    (passages are cut to `max_tokens` of it)."""
    from kvrag.retrieval import Embedder
    from kvrag.app.split import read_text, split_passages, text_files

    directory = Path(directory)
    path = directory / "questions.json"
    if not path.is_file():
        raise KVRagError(f"{directory} holds no questions.json: a held-out corpus is its documents and their questions")
    asked = json.loads(path.read_text(encoding="utf-8"))
    files = [f for f in text_files([directory]) if f.name != path.name]
    cut = [split_passages(read_text(f), count_tokens, max_tokens) for f in files]
    passages = [p for parts in cut for p in parts]
    before = {b: a for parts in cut for a, b in zip(parts, parts[1:])}  # the passage before, in its file
    embedder = embedder or Embedder()
    vectors = embedder.embed(passages)
    found = []
    for i, item in enumerate(asked):
        query = embedder.embed([item["question"]])[0]
        scores = [sum(a * b for a, b in zip(query, v)) for v in vectors]
        nearest = sorted(range(len(passages)), key=lambda j: -scores[j])[:k]
        found.append(QAExample(id=f"heldout-{i}", split="heldout", type="heldout", question=item["question"],
                               answers=tuple(item["answers"]), target=item["answers"][0],
                               passages=tuple(passages[j] for j in nearest), gold=(),
                               preceding=tuple(before.get(passages[j], "") for j in nearest)))
    return found


def digest(directory: str | Path) -> str:
    """What the corpus is, for a results file's settings: its files' names and contents."""
    h = hashlib.sha256()
    for path in sorted(Path(directory).iterdir()):
        if path.is_file():
            h.update(path.name.encode() + b"\0" + path.read_bytes())
    return h.hexdigest()[:16]
