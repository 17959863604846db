"""An engine's index over the store: blocks survive a restart, damaged and foreign files are recomputed,
concurrent indexers agree, the memory budget holds, and indexing twice computes nothing. Tiny
random-weight models on the CPU."""

import multiprocessing
import shutil
import traceback
import warnings

import pytest
import torch

from kvrag.store import DiskTier, KVStore
from tiny import tiny_configs, tiny_model, tiny_tokenizer
from kvfiles import (
    DAMAGES,
    MANY,
    PASSAGES,
    QUESTION,
    assert_same_block,
    damage,
    file_content,
    header_metadata,
    kv_files,
    kvrag_warnings,
    new_engine,
    prefill_logits,
    reference_run,
)


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


def test_engine_round_trip_fresh_engine(tmp_path, tok, model0):
    first = new_engine(model0, tok, tmp_path)
    ids = first.index(PASSAGES, progress=False)
    ref = first.generate(QUESTION, PASSAGES, max_new_tokens=6)  # the prefix block is stored by now
    assert "disk" not in ref.cache_hits and ref.cache_hits.get("memory", 0) >= len(PASSAGES)

    second = new_engine(model0, tok, tmp_path)
    assert second.fingerprint == first.fingerprint
    assert len(second.store.memory) == 0
    context = second.blocks.context(second.layout.prefix_ids)
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


def test_claims_left_by_killed_indexers_are_removed_by_the_next_run(tmp_path, tok, model0):
    """An indexer SIGKILLed while encoding leaves its claim files (its locks die with it); the next run removes
    those nobody holds, and leaves a live indexer's."""
    import fcntl

    engine = new_engine(model0, tok, tmp_path)
    ids = engine.index(PASSAGES, progress=False)
    claims = engine.store.disk.root / "claims"
    stale = [claims / f"{block_id.removeprefix('kv_')}.lock" for block_id in ids]
    for path in stale:
        path.write_bytes(b"")
    live = claims / f"{'e' * 32}.lock"
    held = open(live, "w")
    fcntl.flock(held, fcntl.LOCK_EX)  # another indexer, encoding now
    try:
        again = new_engine(model0, tok, tmp_path)
        assert again.index(PASSAGES, progress=False) == ids
        assert not any(path.exists() for path in stale) and live.exists()
    finally:
        held.close()


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


def test_foreign_fingerprint_is_never_served(tmp_path, tok, model0, model1):
    home = tmp_path / "shared"
    a = new_engine(model0, tok, home)
    b = new_engine(model1, tok, home)
    assert a.fingerprint != b.fingerprint
    assert a.store.disk.root != b.store.disk.root
    (id_a,) = a.index(PASSAGES[:1], progress=False)
    key_a = id_a.removeprefix("kv_")
    context = b.blocks.context(b.layout.prefix_ids)
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
    assert prefill_logits(b, PASSAGES[:1])[1] == {"memory": 2}  # the prefix's second sight writes it to disk
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
    assert_same_block(got, b.blocks.encode(b.layout.passage_ids(PASSAGES[0])))


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

    context = engine.blocks.context(engine.layout.prefix_ids)
    store = KVStore(engine.fingerprint, root)
    with warnings.catch_warnings(record=True) as records:
        warnings.simplefilter("always")
        for i, text in enumerate(MANY):
            key = ids[0][i].removeprefix("kv_")
            got, tier = store.get(key, context)
            assert tier == "disk", (i, tier)
            ids_i = engine.layout.passage_ids(text)
            assert got.token_ids.tolist() == ids_i
            expected = engine.blocks.encode(ids_i)
            torch.testing.assert_close(got.keys, expected.keys, rtol=1e-5, atol=1e-6)
            torch.testing.assert_close(got.values, expected.values, rtol=1e-5, atol=1e-6)
        if prefix_key in stored:
            got, tier = store.get(prefix_key, "none")
            assert tier == "disk" and got.token_ids.tolist() == engine.layout.prefix_ids
    assert not kvrag_warnings(records)
    assert engine.index(MANY, progress=False) == [ids[0][i] for i in range(len(MANY))]


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


def _spy_encode(monkeypatch, engine) -> list:
    """Token ids of every passage block the engine encodes (the shared prefix and separator blocks are not counted)."""
    calls = []
    real = engine.blocks.encode_many

    def spy(ids_list, *args, **kwargs):
        calls.extend(list(ids) for ids in ids_list if list(ids) not in (engine.layout.prefix_ids, engine.layout.separator_ids))
        return real(ids_list, *args, **kwargs)

    monkeypatch.setattr(engine.blocks, "encode_many", spy)
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


@pytest.mark.parametrize("block_context", ["none", "prefix"])
def test_packed_indexing_stores_the_blocks_one_at_a_time_would(tmp_path, tok, model0, monkeypatch, block_context):
    """Several passages per forward (as on a GPU, `pack_tokens`): the same KV as one at a time, to float32
    round-off, in fewer forwards."""
    alone = new_engine(model0, tok, tmp_path / "alone", block_context=block_context)
    packed = new_engine(model0, tok, tmp_path / "packed", block_context=block_context)
    forwards = []
    real = packed.blocks.encode_many
    monkeypatch.setattr(packed.blocks, "encode_many", lambda ids_list, *args, **kwargs:
                        forwards.append(len(ids_list)) or real(ids_list, *args, **kwargs))
    texts = PASSAGES + MANY[:6]
    assert alone.index(texts, progress=False, pack_tokens=0) == packed.index(texts, progress=False, pack_tokens=64)
    passages = [n for n in forwards if n > 1]
    assert passages and sum(passages) + forwards.count(1) - 2 == len(texts)  # 2: the prefix and separator blocks
    context = alone.blocks.context(alone.layout.prefix_ids)
    for key in alone.blocks.keys(alone.layout.prefix_ids, [alone.layout.passage_ids(t) for t in texts]):
        a, b = alone.store.get(key, context)[0], packed.store.get(key, context)[0]
        assert torch.equal(a.token_ids, b.token_ids) and a.start == b.start
        torch.testing.assert_close(b.keys, a.keys, atol=1e-5, rtol=1e-4)
        torch.testing.assert_close(b.values, a.values, atol=1e-5, rtol=1e-4)
    answer = lambda engine: engine.generate(QUESTION, PASSAGES, max_new_tokens=6).token_ids
    assert answer(alone) == answer(packed)


def test_document_context_encodes_each_passage_after_the_text_before_it(tmp_path, tok, model0):
    """Block context "document": a passage indexed with the text before it in its document is encoded after that
    text, and only its own KV is kept (keys as encoded, at the positions after the text); a passage without one,
    or never indexed, is encoded alone. One passage per forward and several give the same blocks."""
    texts = PASSAGES + MANY[:4]
    preceding = [None, *texts[:-1]]  # each after the one before, as one file's passages
    engines = [new_engine(model0, tok, tmp_path / name, block_context="document") for name in ("alone", "packed")]
    for engine, pack in zip(engines, (0, 64)):
        engine.index(texts, progress=False, pack_tokens=pack, preceding=preceding)
    engine = engines[0]
    for text, before in zip(texts, preceding):
        ids = engine.layout.passage_ids(text)
        lead = engine.layout.passage_ids(before) if before else []
        with torch.no_grad():
            kv = model0(torch.tensor([lead + ids]), use_cache=True).past_key_values
        key = engine.blocks.keys(engine.layout.prefix_ids, [ids])[0]
        for stored in (e.store.get(key, "document")[0] for e in engines):
            assert stored.token_ids.tolist() == ids and stored.start == len(lead)
            for got, layers in ((stored.keys, [layer.keys for layer in kv.layers]),
                                (stored.values, [layer.values for layer in kv.layers])):
                expected = torch.cat(layers)[:, :, len(lead):]  # [layers, kv_heads, n, head_dim]
                torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-4)
    none = new_engine(model0, tok, tmp_path / "none")
    assert engine.generate(QUESTION, PASSAGES[:1], max_new_tokens=4).token_ids == \
        none.generate(QUESTION, PASSAGES[:1], max_new_tokens=4).token_ids  # the first passage: alone, as 'none'
    with pytest.raises(ValueError, match="block_context='document'"):
        none.index(texts, preceding=preceding)
    with pytest.raises(ValueError, match="2 preceding texts for 7 passages"):
        engine.index(texts, preceding=preceding[:2])


def test_bench_index_times_indexing_beside_a_plain_batched_forward(saved_model_and_adapter, tmp_path, capsys):
    """`kvrag bench index`: fresh passages indexed per dtype and run (packed as by default, and one per
    forward), in memory only, and the same tokens through the model in padded batches."""
    from kvrag.app.cli import main

    model_dir, _ = saved_model_and_adapter
    argv = ["--model", str(model_dir), "--adapter", "none", "--device", "cpu", "--home", str(tmp_path)]
    assert main([*argv, "bench", "index", "--passages", "3", "--tokens", "20", "--runs", "2"]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[1].split() == ["dtype", "passages", "tokens", "passages/s", "tokens/s", "one", "at", "a", "time", "plain",
                              "tokens/s", "index/plain"]
    rows = {line.split()[0]: line.split()[1:] for line in out[2:]}
    assert set(rows) == {"float32", "bfloat16"}
    assert all(int(r[0]) >= 1 and min(map(float, r[2:])) > 0 for r in rows.values())
    assert not (tmp_path / "kv").exists()  # stored in memory only
    assert main([*argv, "bench", "index", "--dtypes", "float8"]) == 2
