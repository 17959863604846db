"""KV store: the disk round trip, damaged files, interrupted writes, the memory and device tiers'
budgets, pinned host copies for a GPU, the storage dtype. Store objects alone, on made-up blocks: no model."""

import os
import struct
import time
import warnings

import pytest
import torch
from safetensors import safe_open

from kvrag.store import DiskTier, KVBlock, KVStore, MemoryTier, default_storage_dtype, pack
from kvfiles import DAMAGES, assert_same_block, damage, header_metadata, kv_files, kvrag_warnings, make_block


SAFETENSORS_DTYPES = {torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16"}


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_store_round_trip_fresh_store(tmp_path, dtype, device):
    fp = "f" * 64
    block = make_block(7, fill=0.5, dtype=dtype, start=11)
    writer = KVStore(fp, tmp_path, device=device)
    key = writer.key("none", block.token_ids)
    writer.put(key, "none", block)
    assert writer.disk.path(key).is_file()
    with safe_open(writer.disk.path(key), framework="pt") as f:  # the file records the storage dtype
        assert {f.get_slice(name).get_dtype() for name in ("keys", "values")} == {SAFETENSORS_DTYPES[dtype]}

    reader = KVStore(fp, tmp_path, device=device)
    assert len(reader.memory) == 0 and key in reader
    got, tier = reader.get(key, "none")
    assert tier == "disk"
    assert_same_block(got, block)
    assert got.keys.is_pinned() == got.values.is_pinned() == (device == "cuda")  # read into pinned memory for a GPU
    meta = header_metadata(reader.disk.path(key))
    assert meta["fingerprint"] == fp and meta["key"] == key and meta["context"] == "none"

    again, tier = reader.get(key, "none")
    assert tier == "memory"
    assert_same_block(again, block)

    # the same key asked for under another context is not served
    other = KVStore(fp, tmp_path, device=device)
    with pytest.warns(RuntimeWarning, match="context"):
        assert other.get(key, "prefix:abc") == (None, "miss")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("how", DAMAGES)
def test_store_damaged_file_is_a_miss(tmp_path, how, dtype):
    fp = "a" * 64
    block = make_block(9, fill=1.0, dtype=dtype)
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
        tier.put(key, None, block)
        check()
    assert len(tier) == 3 and tier.used == 3 * size

    assert tier.get("a") is a  # touch a: b is now least recently used
    tier.put("d", None, d)
    check()
    assert "b" not in tier and all(k in tier for k in "acd")
    assert tier.get("b") is None

    tier.put("c", None, c)  # re-put refreshes c without double counting
    check()
    assert len(tier) == 3 and tier.used == 3 * size
    tier.put("e", None, make_block(6, fill=9))  # a is now the oldest
    check()
    assert "a" not in tier and all(k in tier for k in "cde")

    # a double-size block evicts the two least recently used
    tier.put("big", None, make_block(12, fill=5))
    check()
    assert sorted(tier._blocks) == ["big", "e"]

    # a block larger than the whole budget is not kept and evicts nothing
    before = dict(tier._blocks), tier.used
    tier.put("huge", None, make_block(100))
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


def test_default_storage_dtype_follows_a_half_precision_model():
    assert default_storage_dtype(torch.bfloat16) == torch.bfloat16
    assert default_storage_dtype(torch.float16) == torch.float16
    assert default_storage_dtype(torch.float32) == torch.float16
    assert default_storage_dtype(torch.float64) == torch.float16


def test_memory_tier_keeps_host_copies_pinned_for_a_gpu(tmp_path, device):
    """Whatever `put` is given (a host block, or one on the device), the memory tier keeps it on the
    host, pinned where the store serves a GPU; `host_copy` makes such copies in the storage dtype."""
    fp = "9" * 64
    store = KVStore(fp, tmp_path, device=device)
    block = make_block(5, fill=2.0)
    on_device = KVBlock(block.token_ids, block.keys.to(device), block.values.to(device), block.start)
    for context, given in (("host", block), ("device", on_device)):
        key = store.key(context, block.token_ids)
        store.put(key, context, given)
        kept = store.memory.get(key)
        assert kept.keys.device.type == kept.values.device.type == "cpu"
        assert kept.keys.is_pinned() == kept.values.is_pinned() == (device == "cuda")
        assert_same_block(kept, block)
        assert_same_block(KVStore(fp, tmp_path).get(key, context)[0], block)  # and so is the file
    copy = store.host_copy(on_device.keys[:, :, 1:4], torch.bfloat16)
    assert copy.device.type == "cpu" and copy.dtype == torch.bfloat16 and copy.is_pinned() == (device == "cuda")
    assert torch.equal(copy, block.keys[:, :, 1:4].to(torch.bfloat16))
    same_dtype = store.host_copy(block.keys, block.keys.dtype)  # a copy even where no conversion is needed
    assert torch.equal(same_dtype, block.keys) and same_dtype.data_ptr() != block.keys.data_ptr()


# Devices apart from the host, for the device tier: "meta" is in every build of torch; its tensors hold no
# data, which the tier's bookkeeping does not need.
ACCELERATORS = ["meta", *(["cuda"] if torch.cuda.is_available() else [])]


@pytest.mark.parametrize("accelerator", ACCELERATORS)
def test_device_tier_keeps_the_most_recent_blocks_within_its_budget(tmp_path, accelerator):
    fp = "e" * 64
    blocks = {name: make_block(6, fill=i) for i, name in enumerate("abc")}
    size = blocks["a"].nbytes
    store = KVStore(fp, tmp_path, device=accelerator, device_budget=2 * size + size // 2)  # two blocks, not three
    keys = {name: store.key(name, block.token_ids) for name, block in blocks.items()}

    def on_device():
        tier = store.device_tier
        assert tier.used <= tier.budget and tier.used == sum(b.nbytes for b in tier._blocks.values())
        return sorted(name for name, key in keys.items() if key in tier)

    def get(name, expected_tier):
        block, tier = store.get(keys[name], name)
        assert tier == expected_tier
        assert block.keys.device.type == block.values.device.type == accelerator  # the copy nearest the device
        assert block.token_ids.device.type == "cpu"  # read as lists: never moved
        if accelerator != "meta":
            assert torch.equal(block.keys.cpu(), blocks[name].keys)
            assert torch.equal(block.values.cpu(), blocks[name].values)
        return block

    for name, block in blocks.items():
        store.put(keys[name], name, block)
    assert len(store.memory) == 3 and on_device() == ["b", "c"]  # a, the least recently put, left the device
    assert store.memory.get(keys["a"]).keys.device.type == "cpu"
    get("c", "device")
    get("a", "memory")  # from memory, and onto the device: b, least recently used there, leaves
    assert on_device() == ["a", "c"]
    get("a", "device")
    get("b", "memory")
    assert on_device() == ["a", "b"] and all(key in store for key in keys.values())

    fresh = KVStore(fp, tmp_path, device=accelerator, device_budget=store.device_tier.budget)
    store = fresh
    get("c", "disk")  # from disk into memory and onto the device
    assert keys["c"] in store.memory and on_device() == ["c"]
    get("c", "device")

    # a block larger than the device budget is served from memory and leaves the device tier as it was
    huge = make_block(40)
    keys["huge"], blocks["huge"] = store.key("huge", huge.token_ids), huge
    store.put(keys["huge"], "huge", huge)
    assert huge.nbytes > store.device_tier.budget and on_device() == ["c"]
    get("huge", "memory")
    assert on_device() == ["c"]


def test_no_device_tier_on_the_host(tmp_path):
    """On the CPU host memory is the device's: a device budget adds no second copy."""
    store = KVStore("8" * 64, tmp_path, device="cpu", device_budget=1 << 20)
    block = make_block(4)
    key = store.key("none", block.token_ids)
    store.put(key, "none", block)
    assert store.device_tier is None and not store.pinned
    got, tier = store.get(key, "none")
    assert got is block and tier == "memory"


def test_disk_tier_keeps_its_budget_evicting_the_least_recently_used(tmp_path):
    """Past the budget the files least recently written or read go, down to 90% of it; a read keeps a file
    (its access time), and one budget covers the block files of every model under the same root."""
    blocks = {name: make_block(8, fill=i) for i, name in enumerate("abcde")}
    keys = {name: KVStore("1" * 64).key(name, block.token_ids) for name, block in blocks.items()}
    size = len(pack("1" * 64, keys["a"], "a", blocks["a"]))
    one, two = (KVStore(fp, tmp_path / fp[:16], disk_budget=int(3.5 * size), budget_root=tmp_path)  # three files
                for fp in ("1" * 64, "2" * 64))

    def on_disk():
        return sorted(name for name, key in keys.items() if key in one.disk or key in two.disk)

    for name, store in (("a", one), ("b", two), ("c", one)):
        store.put(keys[name], name, blocks[name])
        time.sleep(0.05)  # the file system's clock is coarser than a put
    assert one.disk.read(keys["a"], "a") is not None  # read: now more recent than b and c
    time.sleep(0.05)
    one.put(keys["d"], "d", blocks["d"])
    assert on_disk() == ["a", "c", "d"]  # b, another model's, was the least recently used
    assert sum(p.stat().st_size for p in tmp_path.rglob("*.safetensors")) <= 3.5 * size
    two.put(keys["e"], "e", blocks["e"])
    assert on_disk() == ["a", "d", "e"]



def _planted(tmp_path, plant):
    """A store whose block's file was replaced by `plant(path)`; then the block read back."""
    from kvrag.store import BlockShape

    fp, block = "c" * 64, make_block(5, fill=0.3)
    shape = BlockShape(2, 1, 4, torch.float32, 64)
    key = KVStore(fp, tmp_path, shape=shape).key("none", block.token_ids)
    KVStore(fp, tmp_path, shape=shape).put(key, "none", block)
    path = DiskTier(tmp_path, fp).path(key)
    path.unlink()
    plant(path)
    store = KVStore(fp, tmp_path, shape=shape)
    with pytest.warns(RuntimeWarning, match="dropping unusable KV file") as said:
        assert store.disk.read(key, "none") is None
    assert not path.exists() and len(said) == 1 and "\n" not in str(said[0].message)
    store.put(key, "none", block)  # computed again, it is stored as a file of its own
    assert_same_block(KVStore(fp, tmp_path, shape=shape).get(key, "none")[0], block)
    return str(said[0].message)


def test_a_fifo_at_a_blocks_path_is_dropped_not_waited_on(tmp_path):
    assert "not a regular file" in _planted(tmp_path, os.mkfifo)


def test_a_file_larger_than_any_block_is_dropped_unread(tmp_path):
    def sparse(path):
        with open(path, "wb") as f:
            f.truncate(3 << 30)  # 3 GB that take no disk: read whole, they would take 3 GB of memory

    assert "more than a block of this model can hold" in _planted(tmp_path, sparse)


def test_a_link_at_a_blocks_path_is_dropped_and_its_target_left_alone(tmp_path):
    outside = tmp_path / "outside.txt"
    outside.write_text("someone else's file")
    _planted(tmp_path / "kv", lambda path: path.symlink_to(outside))
    assert outside.read_text() == "someone else's file"


def test_a_home_every_user_can_write_in_is_named_in_one_line(tmp_path, tok):
    from tiny import tiny_configs, tiny_model

    from kvrag import KVEngine

    home = tmp_path / "shared-home"
    home.mkdir()
    home.chmod(0o777)
    with pytest.warns(RuntimeWarning, match=f"every user can write in {home} \\(mode 0o777\\)") as said:
        KVEngine(tiny_model(tiny_configs(len(tok))["llama"], 0), tok, home=home, default_mode="full")
    assert len([w for w in said if "every user can write" in str(w.message)]) == 1
    home.chmod(0o755)
    private = tmp_path / "private-home"
    with warnings.catch_warnings():
        warnings.simplefilter("error", RuntimeWarning)
        KVEngine(tiny_model(tiny_configs(len(tok))["llama"], 0), tok, home=private, default_mode="full")
