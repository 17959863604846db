"""What the store's tests and the index tests share: passages, tiny models, and ways to read and damage KV files."""

import json
import struct
from pathlib import Path

import torch

from kvrag.engine import KVEngine
from kvrag.store import KVBlock

QUESTION = "Who built the lighthouse?"
# a request over PASSAGES reads 2 * len(PASSAGES) blocks: the prefix, each passage, and the
# separator between two passages (the same block each time: a fresh engine reads it once from disk)
PASSAGES = [
    "The lighthouse of Varnholm was built in 1873 by the engineer Ilsa Brandt.",
    "The river Olm freezes every winter, and the ferry stops until spring.",
    "Ilsa Brandt also designed two bridges over the Olm.",
]
# ~20 distinct passages for the concurrent-indexing test
MANY = [
    f"Passage {i}: the {w} of Varnholm was described in {1800 + 7 * i} by {name}."
    for i, (w, name) in enumerate(
        (w, name)
        for w in ("lighthouse", "river", "bridge", "harbour", "school")
        for name in ("Ilsa Brandt", "the engineer", "a helpful assistant", "the passages")
    )
]
assert len(MANY) == 20 and len(set(MANY)) == 20


def new_engine(model, tok, home, **kwargs) -> KVEngine:
    """An engine whose requests run in block mode unless they name another: the stored KV these tests read."""
    return KVEngine(model, tok, home=home, storage_dtype=torch.float32, **{"default_mode": "block", **kwargs})


def kv_files(root: Path) -> list[Path]:
    """Files of the KV store (not the list of indexed passage texts kept beside it)."""
    return sorted(p for p in Path(root).rglob("*") if p.is_file() and not p.name.startswith("passages.sqlite"))


def kvrag_warnings(records) -> list:
    return [w for w in records if issubclass(w.category, RuntimeWarning) and "kvrag" in str(w.message)]


def make_block(n_tokens: int, fill: float = 0.0, dtype=torch.float32, layers=2, heads=1, dim=4, start=0) -> KVBlock:
    g = torch.Generator().manual_seed(n_tokens * 1000 + int(fill * 10))
    keys = (torch.randn(layers, heads, n_tokens, dim, generator=g) + fill).to(dtype)
    values = (torch.randn(layers, heads, n_tokens, dim, generator=g) - fill).to(dtype)
    return KVBlock(torch.arange(n_tokens, dtype=torch.long) + 3, keys, values, start)


def assert_same_block(a: KVBlock, b: KVBlock) -> None:
    assert torch.equal(a.token_ids, b.token_ids)
    assert a.token_ids.dtype == b.token_ids.dtype == torch.long
    assert a.keys.dtype == b.keys.dtype and a.values.dtype == b.values.dtype
    assert torch.equal(a.keys, b.keys)
    assert torch.equal(a.values, b.values)
    assert a.start == b.start


def data_offset(path: Path) -> int:
    raw = path.read_bytes()
    (n,) = struct.unpack("<Q", raw[:8])
    return 8 + n


def header_metadata(path: Path) -> dict:
    raw = path.read_bytes()
    (n,) = struct.unpack("<Q", raw[:8])
    return json.loads(raw[8 : 8 + n])["__metadata__"]


def file_content(path: Path) -> tuple[dict, bytes]:
    """Header metadata and data section (safetensors writes metadata keys in no fixed order)."""
    return header_metadata(path), path.read_bytes()[data_offset(path) :]


def damage(path: Path, how: str) -> None:
    raw = bytearray(path.read_bytes())
    start = data_offset(path)
    assert start < len(raw)
    if how.startswith("flip"):
        pos = {"flip-first": start, "flip-middle": (start + len(raw)) // 2, "flip-last": len(raw) - 1}[how]
        raw[pos] ^= 0xFF
        raw[pos - 1 if pos > start else pos + 1] ^= 0x5A
    elif how == "truncate-half":
        raw = raw[: len(raw) // 2]
    elif how == "truncate-5":
        raw = raw[:5]
    elif how == "empty":
        raw = bytearray()
    else:
        raise AssertionError(how)
    path.write_bytes(bytes(raw))


DAMAGES = ["flip-first", "flip-middle", "flip-last", "truncate-half", "truncate-5", "empty"]


def reference_run(model, tok, home, texts, max_new_tokens=6):
    """Logits and answer of an engine whose store was never damaged."""
    engine = new_engine(model, tok, home)
    engine.index(texts, progress=False)
    logits, _ = prefill_logits(engine, texts)
    result = engine.generate(QUESTION, texts, max_new_tokens=max_new_tokens)
    return logits, result


def prefill_logits(engine, texts):
    prompt, keys = engine.build_prompt(QUESTION, texts)
    state = engine.prefill(prompt, "block", keys=keys, all_logits=True)
    try:
        return state.logits.clone(), dict(state.cache_hits)
    finally:
        engine.release(state)


