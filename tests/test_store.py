"""KV store: the disk round trip, damaged files, interrupted writes, the memory tier's budget.
Store objects alone, on made-up blocks: no model."""

import os
import struct
import warnings

import pytest
import torch

from kvrag.store import DiskTier, KVStore, MemoryTier
from kvfiles import DAMAGES, assert_same_block, damage, header_metadata, kv_files, kvrag_warnings, make_block


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
