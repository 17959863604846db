"""Stored KV is untrusted input: blocks whose header, checksum and ids all pass but whose tensors do not
fit the model (more or fewer layers, other heads, head dim or dtype, NaN or huge values), values written
without the shared secret, and blocks planted past the store's checks are refused before they touch a
workspace, deleted from their tier, recomputed, and said once; the answer is the clean one. Through the
disk tier and a real redis-server, by real `kvrag` processes."""

import os
import shutil
import subprocess
import sys
import warnings
from pathlib import Path

import pytest
import redis
import torch
from kvfiles import header_metadata, kvrag_warnings
from servers import RedisServer
from tiny import tiny_configs, tiny_model

from kvrag import KVRagError, kernels
from kvrag.prompt import PromptLayout
from kvrag.store import BadBlock, BlockShape, KVBlock, block_key, ids_digest, pack, unpack

SECRET = "correct horse battery staple, forty-two"
KVRAG = [sys.executable, "-m", "kvrag.app.cli"]
PASSAGES = [
    "The lighthouse of Varnholm was built in 1873 by the engineer Ilsa Brandt.",
    "The river Olm freezes every winter, and the ferry stops until spring.",
    "Ilsa Brandt also designed two bridges over the Olm, both of grey granite.",
    "The harbour school of Varnholm opened in 1901 with nine pupils and one teacher.",
    "Passages describe places, people and dates; the archive keeps the island's charters.",
    "The island's bakery sells rye bread every morning except on the first of May.",
    "The ferry captain, Oskar Lind, has crossed the Olm more than four thousand times.",
    "A storm in 1922 tore the roof off the lighthouse keeper's cottage at midnight.",
]
QUESTION = "Who built the lighthouse?"


def forge(block: KVBlock, how: str) -> KVBlock:
    """`block` made unfit for the model in one way; `pack` then gives it a valid header and checksum."""
    keys, values = block.keys, block.values
    if how == "extra-layers":
        keys, values = torch.cat([keys, keys]), torch.cat([values, values])
    elif how == "fewer-layers":
        keys, values = keys[:1], values[:1]
    elif how == "wrong-heads":
        keys, values = torch.cat([keys, keys], 1), torch.cat([values, values], 1)
    elif how == "wrong-head-dim":
        keys, values = keys[..., :32], values[..., :32]
    elif how == "wrong-dtype":
        keys, values = keys.float(), values.float()
    elif how == "nan":
        keys = keys.clone()
        keys[-1, 0, 1, 5] = float("nan")
    elif how == "huge":
        values = values.clone()
        values[0, 0, 0, 0] = 60000.0  # finite in float16
    else:
        raise AssertionError(how)
    return KVBlock(block.token_ids, keys.contiguous(), values.contiguous(), block.start)


FORGERIES = ["extra-layers", "fewer-layers", "wrong-heads", "wrong-head-dim", "wrong-dtype", "nan", "huge"]
SHAPE = BlockShape(layers=2, kv_heads=1, head_dim=64, dtype=torch.float16, max_tokens=1024)


def real_looking_block(n: int = 9) -> KVBlock:
    g = torch.Generator().manual_seed(n)
    keys, values = (torch.randn(2, 1, n, 64, generator=g).half() for _ in range(2))
    return KVBlock(torch.arange(n) + 7, keys, values, 3)


@pytest.mark.parametrize("how", FORGERIES)
def test_a_block_that_does_not_fit_the_model_is_refused_before_any_tensor_is_used(how):
    block, fp = real_looking_block(), "f" * 64
    key = block_key(fp, "none", block.token_ids)
    assert torch.equal(unpack(pack(fp, key, "none", block), fp, key, "none", SHAPE).keys, block.keys)
    with pytest.raises(BadBlock):
        unpack(pack(fp, key, "none", forge(block, how)), fp, key, "none", SHAPE)


def test_a_block_whose_ids_are_not_its_keys_is_refused():
    block, fp = real_looking_block(), "f" * 64
    other = KVBlock(block.token_ids + 1, block.keys, block.values, block.start)
    key = block_key(fp, "none", block.token_ids)
    with pytest.raises(BadBlock, match="token ids"):
        unpack(pack(fp, key, "none", other), fp, key, "none", SHAPE)  # its header's ids hash is its own, and valid


def test_a_position_beyond_the_context_window_is_refused():
    block, fp = real_looking_block(), "f" * 64
    key = block_key(fp, "none", block.token_ids)
    far = KVBlock(block.token_ids, block.keys, block.values, 5000)
    with pytest.raises(BadBlock, match="position"):
        unpack(pack(fp, key, "none", far), fp, key, "none", SHAPE)


def test_with_a_secret_only_values_written_with_it_are_read():
    block, fp = real_looking_block(), "f" * 64
    key = block_key(fp, "none", block.token_ids)
    ours, theirs = SECRET.encode(), b"another secret of the same length!!!!!!"
    assert torch.equal(unpack(pack(fp, key, "none", block, ours), fp, key, "none", SHAPE, ours).values, block.values)
    for data in (pack(fp, key, "none", block, theirs), pack(fp, key, "none", block)):  # another key, or none
        with pytest.raises(BadBlock, match="MAC"):
            unpack(data, fp, key, "none", SHAPE, ours)
    # the header's fields are covered too: a start moved by hand, checksum recomputed, is refused
    data = bytearray(pack(fp, key, "none", block, ours))
    at = data.index(b'"start":"3"')
    data[at : at + 11] = b'"start":"4"'
    with pytest.raises(BadBlock, match="MAC"):
        unpack(bytes(data), fp, key, "none", SHAPE, ours)


@pytest.mark.skipif(not kernels.machine_supported(), reason="kvrag.kernels are built on Linux x86-64")
def test_the_fill_kernel_refuses_what_would_write_past_the_workspace():
    lib = kernels.library()
    assert lib is not None, kernels.status()
    buffer = torch.full((2, 1, 1, 40, 64), -7.0)  # keys and values: [layers, 1, heads, capacity, head_dim]
    keys, values = buffer[0, :, :, 30:40], buffer[1, :, :, 30:40]  # the one layer's last ten slots
    block = torch.zeros(4, 1, 10, 64, dtype=torch.float16)  # four layers where the views hold one
    cos, sin = torch.ones(1, 32), torch.zeros(1, 32)
    with pytest.raises(ValueError, match="does not fit"):
        kernels.fill_block(lib, block, block, keys, values, cos, sin)
    # the kernel itself, given four layers 40 slots apart from slot 30 of a 40-slot buffer, writes nothing
    assert lib.fill_block(block.data_ptr(), block.data_ptr(), keys.data_ptr(), values.data_ptr(), 4, 10,
                          40 * 64, cos.data_ptr(), sin.data_ptr(), 1, kernels._room(keys)) == -1
    assert (buffer == -7.0).all()
    assert lib.fill_block(block.data_ptr(), block.data_ptr(), keys.data_ptr(), values.data_ptr(), 1, 10,
                          40 * 64, cos.data_ptr(), sin.data_ptr(), 1, kernels._room(keys)) == 0
    assert (buffer[:, :, :, 30:] == 0).all() and (buffer[:, :, :, :30] == -7.0).all()


@pytest.mark.parametrize("storage", [torch.float16, torch.float32])  # the C fill kernel's path, and torch's
def test_a_planted_block_in_memory_is_refused_at_the_workspace(make_engine, storage):
    engine = make_engine("llama-head64", storage_dtype=storage, persist=False)
    engine.index(PASSAGES[:3], progress=False)
    clean = engine.generate(QUESTION, PASSAGES[:3], max_new_tokens=8)
    key = engine.blocks.keys(engine.layout.prefix_ids, [engine.layout.passage_ids(PASSAGES[1])])[0]
    good = engine.store.memory.get(key)
    engine.store.memory.put(key, None, forge(good, "fewer-layers"))  # past unpack's checks, as a bug would put it
    with warnings.catch_warnings(record=True) as records:
        warnings.simplefilter("always")
        result = engine.generate(QUESTION, PASSAGES[:3], max_new_tokens=8)
    dropped = [str(w.message) for w in kvrag_warnings(records)]
    assert len(dropped) == 1 and key in dropped[0] and "shape" in dropped[0]
    assert result.token_ids == clean.token_ids and result.cache_hits.get("computed") == 1
    # recomputed in its place, alone (`index` had packed it with others: the same KV to round-off)
    torch.testing.assert_close(engine.store.memory.get(key).keys, good.keys, atol=2e-3, rtol=2e-3)


def test_a_remote_tier_needs_a_shared_secret(make_engine, monkeypatch):
    for name in ("KVRAG_SECRET", "KVRAG_SECRET_FILE", "KVRAG_REMOTE_INSECURE"):
        monkeypatch.delenv(name, raising=False)
    url = "redis://:hunter2hunter2@127.0.0.1:1/0"
    with pytest.raises(KVRagError, match="needs a shared secret") as refused:
        make_engine(remote=url)
    assert "hunter2" not in str(refused.value)  # the password is never shown
    with pytest.raises(KVRagError, match="at least 16"):
        make_engine(remote=url, secret="short")
    monkeypatch.setenv("KVRAG_REMOTE_INSECURE", "1")
    assert make_engine(remote=url).store.remote.secret is None  # an explicit choice


# ---- real processes ---------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory, tok):
    """A tiny checkpoint with SmolLM2's head shape (head dim 64: the C fill kernel's path), as a user's."""
    path = tmp_path_factory.mktemp("model")
    tiny_model(tiny_configs(len(tok))["llama-head64"], 0).save_pretrained(path)
    tok.save_pretrained(path)
    return path


def kvrag(home: Path, *args, env=None) -> subprocess.CompletedProcess:
    env = {**os.environ, "KVRAG_HOME": str(home), "HF_HUB_OFFLINE": "1", **(env or {})}
    return subprocess.run([*KVRAG, *args], capture_output=True, text=True, env=env, timeout=600)


def ask(home: Path, model_dir: Path, env=None) -> subprocess.CompletedProcess:
    done = kvrag(home, "ask", QUESTION, "--model", str(model_dir), "--top-k", str(len(PASSAGES)),
                 "--max-new-tokens", "8", "--mode", "block", env=env)
    assert done.returncode == 0, done.stderr
    assert "Traceback" not in done.stderr
    return done


def stored_blocks(home: Path, tok) -> dict[Path, dict]:
    """The passages' KV files (not the prompt's prefix or the separator), with their header fields."""
    digests = {ids_digest(PromptLayout(tok).passage_ids(text)) for text in PASSAGES}
    files = {p: header_metadata(p) for p in (home / "kv").rglob("*.safetensors")}
    return {p: meta for p, meta in files.items() if meta["ids_sha256"] in digests}


def read(path_or_bytes, meta) -> KVBlock:
    data = path_or_bytes.read_bytes() if isinstance(path_or_bytes, Path) else path_or_bytes
    return unpack(data, meta["fingerprint"], meta["key"], meta["context"])


@pytest.fixture(scope="module")
def indexed(tmp_path_factory, model_dir):
    """A home with the passages indexed by `kvrag index`, and the clean answer of `kvrag ask` there."""
    home = tmp_path_factory.mktemp("home")
    docs = home / "docs"
    docs.mkdir()
    for i, text in enumerate(PASSAGES):
        (docs / f"{i}.txt").write_text(text)
    done = kvrag(home, "index", str(docs), "--model", str(model_dir))
    assert done.returncode == 0, done.stderr
    return home, ask(home, model_dir).stdout


def test_forged_kv_files_are_dropped_recomputed_and_named_by_kvrag_ask(indexed, model_dir, tok):
    home, clean = indexed
    blocks = stored_blocks(home, tok)
    assert len(blocks) == len(PASSAGES)
    forged = dict(zip(blocks, FORGERIES))
    for path, how in forged.items():
        meta = blocks[path]
        path.write_bytes(pack(meta["fingerprint"], meta["key"], meta["context"], forge(read(path, meta), how)))
    done = ask(home, model_dir)
    assert done.stdout == clean
    dropped = [line for line in done.stderr.splitlines() if "dropping unusable KV file" in line]
    assert sorted(Path(line.split("file ")[1].split(":")[0]) for line in dropped) == sorted(forged)
    for path in forged:  # recomputed and written back intact
        assert read(path, blocks[path]).keys.shape[0] == 2 and torch.isfinite(read(path, blocks[path]).keys).all()


def test_forged_remote_values_are_refused_deleted_and_recomputed(indexed, model_dir, tok, tmp_path):
    """Replica A indexes into Redis; replicas B and C (homes of their own, no KV files) answer from it. Values
    forged with the secret but unfit for the model, and a plausible one written without the secret, are refused."""
    home, clean = indexed
    with RedisServer(tmp_path / "redis", password="a redis password") as server:
        env = {"KVRAG_SECRET": SECRET, "KVRAG_REMOTE": server.url}
        homes = {name: tmp_path / name for name in "abc"}
        done = kvrag(homes["a"], "index", str(home / "docs"), "--model", str(model_dir), env=env)
        assert done.returncode == 0, done.stderr
        for name in "bc":  # the passage index only: the KV comes from Redis
            shutil.copytree(homes["a"] / "chroma", homes[name] / "chroma")
        assert ask(homes["b"], model_dir, env).stdout == clean
        client = redis.Redis.from_url(server.url)
        kinds = FORGERIES + ["without the secret"]
        forged = {}
        for meta, how in zip(stored_blocks(homes["a"], tok).values(), kinds, strict=True):
            key, context = meta["key"], meta["context"]
            block = read(client.get(f"kvrag:kv:{key}"), meta)
            if how == "without the secret":  # well formed, but its values are another text's
                fake = KVBlock(block.token_ids, block.keys.flip(2), block.values.flip(2), block.start)
                client.set(f"kvrag:kv:{key}", pack(meta["fingerprint"], key, context, fake))
            else:
                client.set(f"kvrag:kv:{key}", pack(meta["fingerprint"], key, context, forge(block, how), SECRET.encode()))
            forged[key] = meta, block
        done = ask(homes["c"], model_dir, env)
        assert done.stdout == clean
        dropped = [line for line in done.stderr.splitlines() if "dropping unusable remote KV value" in line]
        assert sorted(line.split("value ")[1].split()[0] for line in dropped) == sorted(forged)
        assert "a redis password" not in done.stderr and sum("MAC" in line for line in dropped) == 1
        for key, (meta, block) in forged.items():  # recomputed and written back, with the secret
            again = unpack(client.get(f"kvrag:kv:{key}"), meta["fingerprint"], key, meta["context"], None,
                           SECRET.encode())
            assert torch.allclose(again.keys.float(), block.keys.float(), atol=1e-2)


def test_the_remote_tier_over_tls_with_a_password(make_engine, tmp_path, monkeypatch):
    monkeypatch.setenv("KVRAG_SECRET", SECRET)
    with RedisServer(tmp_path / "redis", password="tls and a password", tls=True) as server:
        assert server.url.startswith("rediss://")
        a = make_engine("llama-head64", home=tmp_path / "a", remote=server.url)
        b = make_engine("llama-head64", home=tmp_path / "b", remote=server.url)
        a.index(PASSAGES[:3], progress=False)
        result = b.generate(QUESTION, PASSAGES[:3], max_new_tokens=4)
        assert result.cache_hits.get("remote", 0) > 3 and "computed" not in result.cache_hits  # passages, prefix, separator
        wrong = server.url.replace("tls and a password", "not the password")
        with warnings.catch_warnings(record=True) as records:
            warnings.simplefilter("always")
            c = make_engine("llama-head64", home=tmp_path / "c", remote=wrong)
            again = c.generate(QUESTION, PASSAGES[:3], max_new_tokens=4)
        said = [str(w.message) for w in kvrag_warnings(records)]
        assert again.token_ids == result.token_ids and len(said) == 1 and "failed" in said[0]
        assert "not the password" not in said[0] and "***" in said[0]
