"""KV store: disk round trip, damaged and foreign files, concurrent writers, the memory budget,
and idempotent indexing. Everything runs on tiny random-weight models on the CPU."""

import json
import multiprocessing
import os
import shutil
import struct
import traceback
import warnings
from pathlib import Path

import pytest
import safetensors.torch
import torch

from kvrag.engine import KVEngine
from kvrag.store import DiskTier, KVBlock, KVStore, MemoryTier
from tiny import tiny_configs, tiny_model, tiny_tokenizer

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


# ---- helpers / fixtures ---------------------------------------------------------------------------


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    """Tiny models are far faster on one intra-op thread (on small CPU boxes a 2-thread pool made
    each forward ~400x slower); restored afterwards so other test modules are unaffected."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="module")
def model0(tok):
    return tiny_model(tiny_configs(len(tok))["llama"], seed=0)


@pytest.fixture(scope="module")
def model1(tok):
    return tiny_model(tiny_configs(len(tok))["llama"], seed=1)


def new_engine(model, tok, home, **kwargs) -> KVEngine:
    return KVEngine(model, tok, home=home, storage_dtype=torch.float32, **kwargs)


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


# ---- 1. round trip --------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_store_round_trip_fresh_store(tmp_path, dtype):
    fp = "f" * 64
    block = make_block(7, fill=0.5, dtype=dtype, start=11)
    writer = KVStore(fp, tmp_path)
    key = writer.key("none", block.token_ids)
    writer.put(key, "none", block)
    assert writer.disk.path(key).is_file()

    reader = KVStore(fp, tmp_path)
    assert len(reader.memory) == 0 and key in reader
    got, tier = reader.get(key, "none")
    assert tier == "disk"
    assert_same_block(got, block)
    meta = header_metadata(reader.disk.path(key))
    assert meta["fingerprint"] == fp and meta["key"] == key and meta["context"] == "none"

    again, tier = reader.get(key, "none")
    assert tier == "memory"
    assert_same_block(again, block)

    # the same key asked for under another context is not served
    other = KVStore(fp, tmp_path)
    with pytest.warns(RuntimeWarning, match="context"):
        assert other.get(key, "prefix:abc") == (None, "miss")


def test_engine_round_trip_fresh_engine(tmp_path, tok, model0):
    first = new_engine(model0, tok, tmp_path)
    ids = first.index(PASSAGES, progress=False)
    ref = first.generate(QUESTION, PASSAGES, max_new_tokens=6)  # the prefix block is stored by now
    assert "disk" not in ref.cache_hits and ref.cache_hits.get("memory", 0) >= len(PASSAGES)

    second = new_engine(model0, tok, tmp_path)
    assert second.fingerprint == first.fingerprint
    assert len(second.store.memory) == 0
    context = second._context(second.layout.prefix_ids)
    for block_id in ids:
        key = block_id.removeprefix("kv_")
        got, tier = KVStore(second.fingerprint, second.store.disk.root).get(key, context)
        assert tier == "disk"
        assert_same_block(got, first.store.memory.get(key))

    with warnings.catch_warnings(record=True) as records:
        warnings.simplefilter("always")
        r1 = second.generate(QUESTION, PASSAGES, max_new_tokens=6)
        r2 = second.generate(QUESTION, ids, max_new_tokens=6)
    assert not kvrag_warnings(records)
    assert r1.cache_hits == {"disk": 2 * len(PASSAGES) - 1, "memory": 1}
    assert r2.cache_hits == {"memory": 2 * len(PASSAGES)}
    assert r1.token_ids == r2.token_ids == ref.token_ids
    assert r1.text == ref.text


# ---- 2./3. damaged files --------------------------------------------------------------------------


@pytest.mark.parametrize("how", DAMAGES)
def test_store_damaged_file_is_a_miss(tmp_path, how):
    fp = "a" * 64
    block = make_block(9, fill=1.0)
    key = KVStore(fp, tmp_path).key("none", block.token_ids)
    KVStore(fp, tmp_path).put(key, "none", block)
    path = DiskTier(tmp_path, fp).path(key)
    damage(path, how)

    store = KVStore(fp, tmp_path)
    with pytest.warns(RuntimeWarning, match="dropping unusable KV file"):
        got, tier = store.get(key, "none")
    assert (got, tier) == (None, "miss")
    assert not path.exists()
    assert key not in store
    # once deleted it is a plain miss, without a warning
    with warnings.catch_warnings(record=True) as records:
        warnings.simplefilter("always")
        assert store.get(key, "none") == (None, "miss")
    assert not kvrag_warnings(records)
    # a good put afterwards is served again
    store.put(key, "none", block)
    got, tier = KVStore(fp, tmp_path).get(key, "none")
    assert tier == "disk"
    assert_same_block(got, block)


def test_failed_write_leaves_no_file(tmp_path, monkeypatch):
    fp = "d" * 64
    block = make_block(5)
    store = KVStore(fp, tmp_path)
    key = store.key("none", block.token_ids)

    def broken_replace(src, dst):
        raise OSError("disk full")

    monkeypatch.setattr(os, "replace", broken_replace)
    with pytest.raises(OSError, match="disk full"):
        store.put(key, "none", block)
    assert kv_files(tmp_path) == []  # neither the temporary file nor a partial final file
    monkeypatch.undo()
    store.put(key, "none", block)
    assert [p.name for p in kv_files(tmp_path)] == [f"{key}.safetensors"]


def test_store_damaged_header_is_a_miss(tmp_path):
    fp = "b" * 64
    block = make_block(5)
    store = KVStore(fp, tmp_path)
    key = store.key("none", block.token_ids)
    store.put(key, "none", block)
    path = store.disk.path(key)
    raw = bytearray(path.read_bytes())
    raw[0:8] = struct.pack("<Q", 1 << 40)  # header length beyond the file
    path.write_bytes(bytes(raw))
    with pytest.warns(RuntimeWarning):
        assert KVStore(fp, tmp_path).get(key, "none") == (None, "miss")
    assert not path.exists()


@pytest.mark.parametrize("how", DAMAGES)
def test_engine_recomputes_damaged_file(tmp_path, tok, model0, how):
    ref_logits, ref = reference_run(model0, tok, tmp_path / "ref", PASSAGES)

    home = tmp_path / "damaged"
    writer = new_engine(model0, tok, home)
    ids = writer.index(PASSAGES, progress=False)
    writer.generate(QUESTION, ids, max_new_tokens=1)  # stores the prefix block too
    victim = ids[1].removeprefix("kv_")
    path = writer.store.disk.path(victim)
    good = file_content(path)

    # prefill through a fresh engine (empty memory): same logits as the undamaged store
    damage(path, how)
    engine = new_engine(model0, tok, home)
    with pytest.warns(RuntimeWarning, match="dropping unusable KV file"):
        (logits, hits) = prefill_logits(engine, PASSAGES)
    assert hits == {"computed": 1, "disk": 2 * len(PASSAGES) - 2, "memory": 1}  # only the damaged block is recomputed
    assert torch.equal(logits, ref_logits)
    # the recomputed block was written back as a valid file
    assert path.is_file() and file_content(path) == good
    with warnings.catch_warnings(record=True) as records:
        warnings.simplefilter("always")
        got, tier = KVStore(engine.fingerprint, engine.store.disk.root).get(victim, "none")
    assert not kvrag_warnings(records) and tier == "disk"
    assert_same_block(got, writer.store.memory.get(victim))

    # the same through generate() with the block ids of a fresh engine that indexed the texts
    damage(path, how)
    engine = new_engine(model0, tok, home)
    assert engine.index(PASSAGES, progress=False) == ids
    with pytest.warns(RuntimeWarning, match="dropping unusable KV file"):
        result = engine.generate(QUESTION, ids, max_new_tokens=6)
    hits = result.cache_hits
    assert hits["computed"] == 1 and hits.get("disk", 0) >= 2 and sum(hits.values()) == 2 * len(PASSAGES)
    assert result.token_ids == ref.token_ids and result.text == ref.text
    assert file_content(path) == good


# ---- 4. a file from another model -----------------------------------------------------------------


def test_foreign_fingerprint_is_never_served(tmp_path, tok, model0, model1):
    home = tmp_path / "shared"
    a = new_engine(model0, tok, home)
    b = new_engine(model1, tok, home)
    assert a.fingerprint != b.fingerprint
    assert a.store.disk.root != b.store.disk.root
    (id_a,) = a.index(PASSAGES[:1], progress=False)
    key_a = id_a.removeprefix("kv_")
    context = b._context(b.layout.prefix_ids)
    key_b = b.store.key(context, b.layout.passage_ids(PASSAGES[0]))
    assert key_a != key_b
    block_a = a.store.memory.get(key_a)

    ref_logits, ref = reference_run(model1, tok, tmp_path / "ref_b", PASSAGES[:1])

    # A's file copied verbatim to where B looks for the same passage
    path_b = b.store.disk.path(key_b)
    path_b.parent.mkdir(parents=True, exist_ok=True)
    shutil.copyfile(a.store.disk.path(key_a), path_b)
    with pytest.warns(RuntimeWarning, match="dropping unusable KV file"):
        logits, hits = prefill_logits(b, PASSAGES[:1])
    assert hits == {"computed": 2}  # B stored nothing yet: its prefix and the passage
    assert torch.equal(logits, ref_logits)
    assert header_metadata(path_b)["fingerprint"] == b.fingerprint

    # A's KV written with B's key and context, valid checksum: only the fingerprint gives it away
    DiskTier(b.store.disk.root, a.fingerprint).put(key_b, context, block_a)
    fresh = new_engine(model1, tok, home)
    with pytest.warns(RuntimeWarning, match="fingerprint"):
        result = fresh.generate(QUESTION, PASSAGES[:1], max_new_tokens=6)
    assert result.cache_hits == {"disk": 1, "computed": 1}  # prefix from disk, passage recomputed
    assert result.token_ids == ref.token_ids and result.text == ref.text
    got, tier = KVStore(b.fingerprint, b.store.disk.root).get(key_b, context)
    assert tier == "disk"
    assert not torch.equal(got.keys, block_a.keys)
    assert_same_block(got, b._encode(b.layout.passage_ids(PASSAGES[0])))


# ---- 5. concurrent writers ------------------------------------------------------------------------


def _index_worker(home, order, barrier, queue):
    try:
        torch.set_num_threads(1)
        tok = tiny_tokenizer()
        engine = new_engine(tiny_model(tiny_configs(len(tok))["llama"], seed=0), tok, home)
        barrier.wait(timeout=120)
        ids = engine.index([MANY[i] for i in order], progress=False)
        queue.put(("ok", {i: block_id for i, block_id in zip(order, ids)}))
    except BaseException:
        queue.put(("error", traceback.format_exc()))


def test_concurrent_indexing(tmp_path, tok, model0):
    ctx = multiprocessing.get_context("spawn")
    barrier, queue = ctx.Barrier(2), ctx.Queue()
    orders = [list(range(len(MANY))), list(reversed(range(len(MANY))))]
    procs = [ctx.Process(target=_index_worker, args=(str(tmp_path), order, barrier, queue)) for order in orders]
    for p in procs:
        p.start()
    try:
        results = [queue.get(timeout=120) for _ in procs]
    finally:
        for p in procs:
            p.join(timeout=30)
            if p.is_alive():
                p.kill()
    for status, payload in results:
        assert status == "ok", payload
    assert [p.exitcode for p in procs] == [0, 0]
    ids = [payload for _, payload in results]
    assert ids[0] == ids[1] and len(set(ids[0].values())) == len(MANY)

    engine = new_engine(model0, tok, tmp_path)
    root = engine.store.disk.root
    files = kv_files(tmp_path)
    assert not [f for f in files if f.suffix == ".tmp" or f.name.startswith(".")], files
    assert all(f.parent.parent == root for f in files)
    passage_keys = {block_id.removeprefix("kv_") for block_id in ids[0].values()}
    prefix_key = engine.store.key("none", engine.layout.prefix_ids)
    separator_key = engine.store.key("none", engine.layout.separator_ids)
    stored = {f.name.removesuffix(".safetensors") for f in files}
    assert stored == passage_keys | {prefix_key, separator_key}  # index() stores the prefix and separator too

    context = engine._context(engine.layout.prefix_ids)
    store = KVStore(engine.fingerprint, root)
    with warnings.catch_warnings(record=True) as records:
        warnings.simplefilter("always")
        for i, text in enumerate(MANY):
            key = ids[0][i].removeprefix("kv_")
            got, tier = store.get(key, context)
            assert tier == "disk", (i, tier)
            ids_i = engine.layout.passage_ids(text)
            assert got.token_ids.tolist() == ids_i
            expected = engine._encode(ids_i)
            torch.testing.assert_close(got.keys, expected.keys, rtol=1e-5, atol=1e-6)
            torch.testing.assert_close(got.values, expected.values, rtol=1e-5, atol=1e-6)
        if prefix_key in stored:
            got, tier = store.get(prefix_key, "none")
            assert tier == "disk" and got.token_ids.tolist() == engine.layout.prefix_ids
    assert not kvrag_warnings(records)
    assert engine.index(MANY, progress=False) == [ids[0][i] for i in range(len(MANY))]


# ---- 6. memory budget -----------------------------------------------------------------------------


def test_memory_tier_lru_under_budget():
    a, b, c, d = (make_block(6, fill=i) for i in range(4))
    size = a.nbytes
    assert all(x.nbytes == size for x in (b, c, d))
    tier = MemoryTier(3 * size + size // 2)  # room for three blocks, not four

    def check():
        assert tier.used <= tier.budget
        assert tier.used == sum(b.nbytes for b in tier._blocks.values())  # no get(): it reorders

    for key, block in (("a", a), ("b", b), ("c", c)):
        tier.put(key, block)
        check()
    assert len(tier) == 3 and tier.used == 3 * size

    assert tier.get("a") is a  # touch a: b is now least recently used
    tier.put("d", d)
    check()
    assert "b" not in tier and all(k in tier for k in "acd")
    assert tier.get("b") is None

    tier.put("c", c)  # re-put refreshes c without double counting
    check()
    assert len(tier) == 3 and tier.used == 3 * size
    tier.put("e", make_block(6, fill=9))  # a is now the oldest
    check()
    assert "a" not in tier and all(k in tier for k in "cde")

    # a double-size block evicts the two least recently used
    tier.put("big", make_block(12, fill=5))
    check()
    assert sorted(tier._blocks) == ["big", "e"]

    # a block larger than the whole budget is not kept and evicts nothing
    before = dict(tier._blocks), tier.used
    tier.put("huge", make_block(100))
    check()
    assert "huge" not in tier and (dict(tier._blocks), tier.used) == before


def test_oversized_block_served_from_disk(tmp_path):
    fp = "c" * 64
    small, huge = make_block(4), make_block(200)
    store = KVStore(fp, tmp_path, memory_budget=2 * small.nbytes)
    assert huge.nbytes > store.memory.budget
    for name, block in (("small", small), ("huge", huge)):
        store.put(store.key(name, block.token_ids), name, block)
    huge_key = store.key("huge", huge.token_ids)
    assert huge_key not in store.memory and store.memory.used == small.nbytes
    for _ in range(2):
        got, tier = store.get(huge_key, "huge")
        assert tier == "disk"
        assert_same_block(got, huge)
        assert store.memory.used <= store.memory.budget
    assert store.get(store.key("small", small.token_ids), "small")[1] == "memory"


def test_engine_with_tiny_memory_budget(tmp_path, tok, model0):
    _, ref = reference_run(model0, tok, tmp_path / "ref", PASSAGES)
    engine = new_engine(model0, tok, tmp_path / "small", memory_budget=1)
    engine.index(PASSAGES, progress=False)
    assert len(engine.store.memory) == 0 and engine.store.memory.used == 0
    first = engine.generate(QUESTION, PASSAGES, max_new_tokens=6)
    second = engine.generate(QUESTION, PASSAGES, max_new_tokens=6)
    assert "memory" not in first.cache_hits and first.cache_hits.get("disk", 0) >= len(PASSAGES)
    assert second.cache_hits == {"disk": 2 * len(PASSAGES)}
    assert first.token_ids == second.token_ids == ref.token_ids
    assert engine.store.memory.used == 0


# ---- 7. idempotent index --------------------------------------------------------------------------


def _spy_encode(monkeypatch, engine) -> list:
    """Token ids of every passage block the engine encodes (the shared prefix and separator blocks are not counted)."""
    calls = []
    real = engine._encode

    def spy(ids, after=None):
        if list(ids) not in (engine.layout.prefix_ids, engine.layout.separator_ids):
            calls.append(list(ids))
        return real(ids, after)

    monkeypatch.setattr(engine, "_encode", spy)
    return calls


def test_index_is_idempotent(tmp_path, tok, model0, monkeypatch):
    engine = new_engine(model0, tok, tmp_path)
    calls = _spy_encode(monkeypatch, engine)
    ids = engine.index(PASSAGES + [PASSAGES[0]], progress=False)  # duplicate encoded once
    assert len(calls) == len(PASSAGES)
    assert ids[0] == ids[-1] and len(set(ids)) == len(PASSAGES)
    files = kv_files(tmp_path)
    assert {f.name.removesuffix(".safetensors") for f in files} >= {i.removeprefix("kv_") for i in ids}
    stamps = {f: (f.stat().st_mtime_ns, f.stat().st_ino) for f in files}

    calls.clear()
    assert engine.index(PASSAGES, progress=False) == ids[: len(PASSAGES)]
    assert engine.index(list(reversed(PASSAGES)), progress=False) == list(reversed(ids[: len(PASSAGES)]))
    assert calls == []

    fresh = new_engine(model0, tok, tmp_path)  # empty memory: answered by the files
    fresh_calls = _spy_encode(monkeypatch, fresh)
    assert fresh.index(PASSAGES, progress=False) == ids[: len(PASSAGES)]
    assert fresh_calls == []
    assert {f: (f.stat().st_mtime_ns, f.stat().st_ino) for f in kv_files(tmp_path)} == stamps

    # a new passage is the only thing computed
    more = fresh.index(PASSAGES + ["A brand new passage about the Olm."], progress=False)
    assert more[:-1] == ids[: len(PASSAGES)] and len(fresh_calls) == 1
    assert len(kv_files(tmp_path)) == len(files) + 1
