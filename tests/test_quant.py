"""8- and 4-bit KV storage (kvrag.quant): the round trip's error bound, the files and remote values that hold it
(checked like every stored value: a bad scale is refused), the C kernel against torch, and engines that store
their blocks so and answer as with float16 storage, up to the rounding."""

import warnings
import zlib

import pytest
import safetensors.torch
import torch
from kvfiles import PASSAGES, QUESTION, kv_files, kvrag_warnings
from test_kernels import needs_kernels
from tiny import tiny_configs, tiny_model

from kvrag import KVEngine, kernels, quant
from kvrag.assemble import Piece, fill
from kvrag.rope import delta_cos_sin, shift_keys
from kvrag.store import (BadBlock, BlockShape, DiskTier, KVBlock, KVStore, _checksum, _bytes, block_key, pack,
                         STORAGE, storage_format, unpack)
from kvrag.workspace import Workspace

SHAPES = {bits: BlockShape(layers=2, kv_heads=3, head_dim=64, dtype=f"int{bits}", max_tokens=1024) for bits in (8, 4)}


def real_looking(n: int = 40, seed: int = 0) -> torch.Tensor:
    """[2, 3, n, 64] with outlier channels, as attention keys have."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(2, 3, n, 64, generator=g)
    x[:, :, :, 5] *= 20
    x[:, :, :, 40] += 7
    return x


def quantized_block(bits: int, n: int = 40, start: int = 3) -> tuple[KVBlock, torch.Tensor, torch.Tensor]:
    keys, values = real_looking(n, 1), real_looking(n, 2)
    block = KVBlock(torch.arange(n) + 7, quant.quantize(keys, bits, quant.KEYS), quant.quantize(values, bits, quant.VALUES),
                    start)
    return block, keys, values


@pytest.mark.parametrize("bits", [8, 4])
@pytest.mark.parametrize("per", [quant.KEYS, quant.VALUES])
def test_round_trip_is_within_half_a_step(bits, per):
    x = real_looking()
    q = quant.quantize(x, bits, per)
    assert q.shape == x.shape and q.codes.dtype == torch.uint8 and q.codes.shape[-1] == 64 * bits // 8
    assert q.scale.shape == quant.group_shape(x.shape, per) and q.scale.dtype == q.low.dtype == torch.float16
    error = (quant.dequantize(q) - x).abs()
    assert bool((error <= q.scale.float() / 2 + 1e-3 * x.abs().amax()).all())
    assert float(error.max()) > 0  # lossy: the test could fail
    # the bound is relative to each group's own range: an outlier channel does not coarsen the others' keys
    if per == quant.KEYS:
        assert float(q.scale[..., 5].float().min()) > 5 * float(q.scale[..., 6].float().max())


def test_a_group_narrower_than_float16_rounding_keeps_a_valid_scale():
    """Two tokens a hair below 20.734375, the float16 number their low end rounds up to: the scale is 0, not negative."""
    x = torch.tensor([20.734375 - 0.005, 20.734375 - 0.004]).reshape(1, 1, 2, 1).repeat(1, 1, 1, 64)
    for bits in (8, 4):
        q = quant.quantize(x, bits, quant.KEYS)
        assert float(q.scale.float().min()) >= 0
        assert float((quant.dequantize(q) - x).abs().max()) <= 0.01  # float16's own step there is 0.0156
        block = KVBlock(torch.arange(2), q, quant.quantize(x, bits, quant.VALUES), 0)
        key = block_key("fp", "none", block.token_ids)
        assert unpack(pack("fp", key, "none", block), "fp", key, "none") is not None


def test_constant_groups_and_packing_are_exact():
    x = torch.full((1, 1, 4, 64), 2.5)
    for bits in (8, 4):
        for per in (quant.KEYS, quant.VALUES):
            assert torch.equal(quant.dequantize(quant.quantize(x, bits, per)), x)
    codes = torch.arange(16).repeat(4)[None, None, None, :].float()  # channel i holds i % 16: every 4-bit code
    q = quant.quantize(codes, 4, quant.VALUES)
    assert q.codes.shape[-1] == 32 and torch.equal(q.codes[0, 0, 0, :16] & 0x0F, torch.arange(16, dtype=torch.uint8))
    assert torch.equal(quant.dequantize(q), codes)


@pytest.mark.parametrize("bits", [8, 4])
def test_dequantizing_into_a_workspace_is_dequantizing_then_rotating(bits):
    """The fill's torch path (scales folded into the rotation, written into a strided workspace view) against the
    plain definition: dequantize, then rope.shift_keys."""
    inv_freq = 1.0 / 10000 ** (torch.arange(0, 64, 2) / 64)
    cos, sin = delta_cos_sin(345, inv_freq, torch.float32)
    keys, values = real_looking(40, 1), real_looking(40, 2)
    qk, qv = quant.quantize(keys, bits, quant.KEYS), quant.quantize(values, bits, quant.VALUES)
    ws = Workspace(2, 3, 64, 100, torch.float32, "cpu")
    ws.keys.zero_()
    out_keys, out_values = ws.keys[:, 0, :, 7:47], ws.values[:, 0, :, 7:47]
    quant.dequantize_into(qk, out_keys, cos, sin)
    quant.dequantize_into(qv, out_values)
    expected = torch.empty_like(keys)
    shift_keys(quant.dequantize(qk), cos, sin, out=expected)
    torch.testing.assert_close(out_keys, expected, rtol=1e-5, atol=1e-4)
    assert torch.equal(out_values, quant.dequantize(qv))
    quant.dequantize_into(qk, out_keys)  # no rotation: the block stays where it was encoded
    assert torch.equal(out_keys, quant.dequantize(qk))
    assert float(ws.keys[:, 0, :, :7].abs().max()) == 0 == float(ws.keys[:, 0, :, 47:].abs().max())  # nothing else


@pytest.mark.parametrize("bits", [8, 4])
def test_blocks_round_trip_through_disk_beside_float_ones(tmp_path, bits):
    block, keys, values = quantized_block(bits)
    key = block_key("fp", "none", block.token_ids)
    float_tier = DiskTier(tmp_path, "fp", shape=BlockShape(2, 3, 64, torch.float16, 1024))
    tier = DiskTier(tmp_path, "fp", shape=SHAPES[bits])
    tier.put(key, "none", block)
    assert key in tier and key not in float_tier  # side by side under one key: another file
    float_tier.put(key, "none", KVBlock(block.token_ids, keys.half(), values.half(), block.start))
    assert tier.path(key) != float_tier.path(key) and tier.path(key).name == f"{key}.int{bits}.safetensors"
    again = tier.read(key, "none")
    assert isinstance(again.keys, quant.Quantized) and again.start == block.start
    for got, want in ((again.keys, block.keys), (again.values, block.values)):
        assert all(torch.equal(a, b) for a, b in zip(got.parts(), want.parts()))
    # what a file of this format takes: the store's estimate, less what 4-bit codes deflate to
    store = KVStore("fp", tmp_path, shape=SHAPES[bits])
    stored = safetensors.torch.load(tier.path(key).read_bytes())
    deflated = sum(stored[name].numel() for name in ("keys", "values"))
    if bits == 4:
        assert stored["keys"].dim() == 1 and deflated < 2 * block.keys.codes.numel()  # smaller, so kept deflated
    else:
        assert stored["keys"].shape == block.keys.codes.shape  # 8-bit codes are kept as they are
    assert abs(store.file_bytes(len(block)) - tier.path(key).stat().st_size
               - (2 * block.keys.codes.numel() - deflated)) < 64  # a header's digits apart
    assert float_tier.path(key).stat().st_size > (2.5 if bits == 4 else 1.5) * tier.path(key).stat().st_size


def test_codes_that_do_not_deflate_smaller_are_kept_as_they_are():
    """4-bit codes of random bytes: deflating cannot make them smaller, so the file keeps them raw (the estimate stays
    an upper bound) and reads back the same."""
    bits = 4
    block, _, _ = quantized_block(bits)
    for q in (block.keys, block.values):
        q.codes = torch.randint(0, 256, q.codes.shape, dtype=torch.uint8, generator=torch.Generator().manual_seed(3))
    key = block_key("fp", "none", block.token_ids)
    data = pack("fp", key, "none", block)
    assert safetensors.torch.load(data)["keys"].shape == block.keys.codes.shape
    again = unpack(data, "fp", key, "none", SHAPES[bits])
    assert torch.equal(again.keys.codes, block.keys.codes) and torch.equal(again.values.codes, block.values.codes)


def _forged(block: KVBlock, key: str, how: str) -> bytes:
    """`pack`'s bytes for `block` with one tensor changed and the checksum made to match: only the checks of
    what the tensors mean can refuse it."""
    data = pack("fp", key, "none", block)
    tensors = safetensors.torch.load(data)
    size = int.from_bytes(data[:8], "little")
    import json

    metadata = json.loads(data[8 : 8 + size])["__metadata__"]
    if how == "nan-scale":
        tensors["keys_scale"][0, 0, 0, 3] = float("nan")
    elif how == "negative-scale":
        tensors["values_scale"][1, 2, 5, 0] = -0.5
    elif how == "huge-range":
        tensors["values_scale"][0, 0, 0, 0] = 60000.0
    elif how == "scale-shape":
        tensors["keys_scale"] = tensors["keys_scale"][..., :32].contiguous()
        tensors["keys_low"] = tensors["keys_low"][..., :32].contiguous()
    elif how == "no-scales":
        del tensors["values_scale"]
    elif how == "float-scales":
        tensors["keys_scale"] = tensors["keys_scale"].float()
    elif how == "inflates-past-its-codes":  # a deflate bomb: far more bytes than the block's codes take
        coder = zlib.compressobj(9, zlib.DEFLATED, -15)
        tensors["keys"] = torch.frombuffer(bytearray(coder.compress(bytes(1 << 24)) + coder.flush()), dtype=torch.uint8)
    elif how == "inflates-short":
        coder = zlib.compressobj(9, zlib.DEFLATED, -15)
        tensors["keys"] = torch.frombuffer(bytearray(coder.compress(bytes(100)) + coder.flush()), dtype=torch.uint8)
    elif how == "damaged-deflate":
        tensors["values"] = tensors["values"].clone()
        tensors["values"][:8] = 0xFF
    elif how == "other-bits":
        metadata["storage"] = "int8" if metadata["storage"] == "int4" else "int4"
    elif how == "float-claimed":
        del metadata["storage"]
    else:
        raise AssertionError(how)
    metadata["checksum"] = _checksum({name: _bytes(t) for name, t in tensors.items()})
    return safetensors.torch.save(tensors, metadata=metadata)


FORGERIES = ["nan-scale", "negative-scale", "huge-range", "scale-shape", "no-scales", "float-scales", "other-bits",
             "float-claimed", "inflates-past-its-codes", "inflates-short"]  # 8 bits: deflated codes at all


@pytest.mark.parametrize(("bits", "how"), [(8, how) for how in FORGERIES] + [(4, how) for how in FORGERIES]
                         + [(4, "damaged-deflate")])
def test_bad_scales_and_formats_are_refused(bits, how):
    block, _, _ = quantized_block(bits)
    key = block_key("fp", "none", block.token_ids)
    assert unpack(pack("fp", key, "none", block), "fp", key, "none", SHAPES[bits]) is not None
    with pytest.raises(BadBlock):
        unpack(_forged(block, key, how), "fp", key, "none", SHAPES[bits])
    if how not in ("other-bits", "float-claimed"):  # inconsistent in itself: refused without the model's shape too
        with pytest.raises(BadBlock):
            unpack(_forged(block, key, how), "fp", key, "none")


def test_a_planted_bad_file_is_dropped_and_the_block_recomputed(tmp_path):
    block, _, _ = quantized_block(4)
    key = block_key("fp", "none", block.token_ids)
    tier = DiskTier(tmp_path, "fp", shape=SHAPES[4])
    tier.path(key).parent.mkdir(parents=True)
    tier.path(key).write_bytes(_forged(block, key, "nan-scale"))
    with warnings.catch_warnings(record=True) as said:
        warnings.simplefilter("always")
        assert tier.read(key, "none") is None
    assert len(kvrag_warnings(said)) == 1 and "scales" in str(said[0].message) and not tier.path(key).exists()


def test_storage_names():
    from kvrag.app.cli import common

    assert common.STORAGE == STORAGE  # the CLI's choices, kept without importing torch
    assert storage_format(None, torch.float32) == torch.float16 and storage_format("int4", torch.float32) == "int4"
    assert storage_format("bfloat16", torch.float32) == torch.bfloat16
    with pytest.raises(ValueError, match="int8, int4"):
        storage_format("int3", torch.float32)


@needs_kernels
@pytest.mark.parametrize("bits", [8, 4])
def test_dequantize_kernel_matches_torch(bits, monkeypatch):
    assert kernels.library() is not None, kernels.status()
    inv_freq = 1.0 / 10000 ** (torch.arange(0, 64, 2) / 64)
    pieces = []
    for seed, (n, start, position) in enumerate(((34, 0, 0), (300, 0, 34), (250, 34, 334), (5, 900, 7))):
        x = real_looking(n, seed)[:, :1].repeat(2, 1, 1, 1)[:4].reshape(4, 1, n, 64).repeat(1, 3, 1, 1)
        pieces.append(Piece(KVBlock(torch.zeros(n), quant.quantize(x, bits, quant.KEYS),
                                    quant.quantize(x * 0.5, bits, quant.VALUES), start), position))
    assert kernels.fill_quantized_applies(pieces[0].block.keys, pieces[0].block.values,
                                          *(Workspace(4, 3, 64, 64, torch.float32, "cpu").keys[:, 0, :, :34],) * 2)
    with_kernel, without = (Workspace(4, 3, 64, 1024, torch.float32, "cpu") for _ in range(2))
    assert fill(with_kernel, pieces, inv_freq) == 589
    monkeypatch.setattr(kernels, "enabled", False)
    assert fill(without, pieces, inv_freq) == 589
    torch.testing.assert_close(with_kernel.keys[..., :589, :], without.keys[..., :589, :], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(with_kernel.values[..., :589, :], without.values[..., :589, :], rtol=1e-6, atol=1e-6)
    assert float(with_kernel.values[..., :589, :].abs().max()) > 1  # the values were written, not left at zero


@pytest.mark.parametrize("storage", ["int8", "int4"])
def test_an_engine_stores_compact_blocks_and_answers_as_with_float16(tok, tmp_path, monkeypatch, storage):
    monkeypatch.setattr(kernels, "bf16", False)
    model = tiny_model(tiny_configs(len(tok))["llama"])
    monkeypatch.setenv("KVRAG_STORAGE", storage)  # the environment's word, as `kvrag` commands take it
    compact = KVEngine(model, tok, home=tmp_path / "compact", default_mode="block")
    plain = KVEngine(model, tok, home=tmp_path / "plain", storage_dtype=torch.float16, default_mode="block")
    assert compact.storage_dtype == storage and plain.storage_dtype == torch.float16
    for engine in (compact, plain):
        engine.index(PASSAGES, progress=False)
    files = [[p for p in kv_files(e.store.disk.root) if p.suffix == ".safetensors"] for e in (compact, plain)]
    assert len(files[0]) == len(files[1]) and all(p.name.endswith(f".{storage}.safetensors") for p in files[0])
    assert sum(p.stat().st_size for p in files[0]) < 0.9 * sum(p.stat().st_size for p in files[1])  # tiny: headers weigh
    fresh = KVEngine(model, tok, home=tmp_path / "compact", default_mode="block")  # reads them back from disk
    got, want = (e.generate(QUESTION, PASSAGES, max_new_tokens=6) for e in (fresh, plain))
    assert got.cache_hits.get("disk", 0) >= len(PASSAGES) and got.reused_tokens == want.reused_tokens > 0
    top = next(iter(want.first_logprobs))
    assert top in got.first_logprobs
    assert abs(got.first_logprobs[top] - want.first_logprobs[top]) < (0.02 if storage == "int8" else 0.2)
    assert got.first_logprobs != want.first_logprobs  # other numbers: the test could fail


def test_a_shared_redis_tier_holds_the_compact_form_and_drops_a_bad_scale(tok, tmp_path, monkeypatch):
    """Two replicas on one real redis-server, storing 4-bit KV: the second reads every passage from Redis (values
    named by format), and a value changed in place (claiming another format) fails its MAC: dropped, recomputed
    and said once."""
    import redis
    from servers import RedisServer

    monkeypatch.setattr(kernels, "bf16", False)
    model = tiny_model(tiny_configs(len(tok))["llama-head64"])
    with RedisServer(tmp_path / "redis") as server:
        monkeypatch.setenv("KVRAG_SECRET", "a secret shared by the replicas, forty-two")
        a, b = (KVEngine(model, tok, home=tmp_path / name, remote=server.url, storage_dtype="int4",
                         default_mode="block") for name in "ab")
        a.index(PASSAGES, progress=False)
        client = redis.Redis.from_url(server.url)
        names = sorted(k.decode() for k in client.keys("*kv:*"))
        assert names and all(name.endswith(".int4") for name in names)
        result = b.generate(QUESTION, PASSAGES, max_new_tokens=4)
        assert result.cache_hits.get("remote", 0) >= len(PASSAGES) and "computed" not in result.cache_hits
        c = KVEngine(model, tok, home=tmp_path / "c", remote=server.url, storage_dtype="int4", default_mode="block")
        key = c.blocks.keys(c.layout.prefix_ids, [c.layout.passage_ids(PASSAGES[0])])[0]
        value = client.get(f"kvrag:kv:{key}.int4")
        client.set(f"kvrag:kv:{key}.int4", value.replace(b"int4", b"int8", 1))  # another format claimed: no valid MAC
        with warnings.catch_warnings(record=True) as said:
            warnings.simplefilter("always")
            again = c.generate(QUESTION, PASSAGES, max_new_tokens=4)
        assert again.text == result.text and again.cache_hits.get("computed", 0) == 1
        assert len([w for w in kvrag_warnings(said) if key in str(w.message)]) == 1


@pytest.mark.e2e
def test_the_default_model_stores_its_kv_in_4_bits(default_engine):
    """The default model's engine (from_pretrained, as `kvrag` commands and the integrations load it) stores 4-bit
    KV, chosen by measurement (engine.DEFAULT_MODEL_STORAGE); its blocks are files of that format."""
    from kvrag.engine import DEFAULT_MODEL_STORAGE

    assert default_engine.storage_dtype == DEFAULT_MODEL_STORAGE == "int4"
    [key] = default_engine.index(["The Varnholm lighthouse keeper logs the fog in 4-bit ink."], progress=False)
    path = default_engine.store.disk.path(key.removeprefix("kv_"))
    assert path.name.endswith(".int4.safetensors") and path.is_file()
    tokens = len(default_engine.layout.passage_ids("The Varnholm lighthouse keeper logs the fog in 4-bit ink."))
    assert 0.9 * default_engine.store.file_bytes(tokens) < path.stat().st_size <= default_engine.store.file_bytes(tokens)
    assert default_engine.store.file_bytes(200) / 200 < 6400  # at most, a 200-token passage: 6.1 KB a token


def test_bench_storage_measures_each_format_on_disk_and_in_time(saved_model_and_adapter, tmp_path, capsys):
    """`kvrag bench storage`: per format, the passages' block files' bytes per token as written, and block mode's
    TTFT from memory and from disk, in homes of its own (the given home keeps nothing)."""
    from kvrag.app.cli import main

    model_dir, _ = saved_model_and_adapter
    argv = ["--model", str(model_dir), "--adapter", "none", "--device", "cpu", "--home", str(tmp_path)]
    assert main([*argv, "bench", "storage", "--lengths", "300", "--runs", "1"]) == 0
    out = capsys.readouterr().out.splitlines()
    rows = {line.split()[0]: line.split()[1:] for line in out[2:]}
    assert list(rows) == ["float16", "int8", "int4"]
    per_token = {name: float(row[1]) for name, row in rows.items()}
    assert per_token["float16"] > 1.5 * per_token["int8"] > 1.5 * 1.2 * per_token["int4"] > 0
    assert all(float(row[2]) > 0 and float(row[4]) > 0 for row in rows.values()) and rows["float16"][3] == "1.00"
    assert not (tmp_path / "kv").exists()
    assert main([*argv, "bench", "storage", "--formats", "int3"]) == 2
