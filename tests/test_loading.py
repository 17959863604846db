"""Loading: device and dtype choices, and a fingerprint hashed once per checkpoint, not on every load."""

import os

import pytest
import torch
from tiny import tiny_configs, tiny_model

from kvrag import KVEngine, KVRagError, loading

PASSAGE = "The lighthouse of Varnholm was built in 1873 by the engineer Ilsa Brandt."


@pytest.fixture
def hashes(monkeypatch) -> list:
    """One entry per full hash of a model's weights; the tokenizer's digest is counted apart (`hashes.tokenizer`)."""

    class Calls(list):
        tokenizer = 0

    calls, digest, tokenizer_digest = Calls(), loading.weights_digest, loading.tokenizer_digest

    def count_tokenizer(tokenizer):
        calls.tokenizer += 1
        return tokenizer_digest(tokenizer)

    monkeypatch.setattr(loading, "weights_digest", lambda model: calls.append(1) or digest(model))
    monkeypatch.setattr(loading, "tokenizer_digest", count_tokenizer)
    return calls


def test_auto_device_and_dtype():
    cuda = torch.cuda.is_available()
    device = loading.resolve_device("auto")
    assert device == (torch.device("cuda", 0) if cuda else torch.device("cpu"))
    assert loading.resolve_dtype("auto", torch.device("cpu")) == torch.float32
    assert loading.resolve_dtype("bfloat16", device) == loading.resolve_dtype(torch.bfloat16, device) == torch.bfloat16
    assert loading.resolve_dtype("torch.float16", device) == torch.float16


@pytest.mark.parametrize("name", ["gpu", "cuda:x", "mps"])
def test_unknown_devices_are_refused(name):
    with pytest.raises(ValueError, match="device must be"):
        loading.resolve_device(name)


def test_cuda_without_a_gpu_says_so():
    if torch.cuda.is_available():
        assert loading.resolve_device("cuda") == torch.device("cuda", 0)
        with pytest.raises(KVRagError, match="sees"):
            loading.resolve_device(f"cuda:{torch.cuda.device_count()}")
    else:
        with pytest.raises(KVRagError, match="sees no CUDA device"):
            loading.resolve_device("cuda")


@pytest.mark.parametrize("dtype", ["float8", "int8", torch.int64, "half-ish"])
def test_unknown_dtypes_are_refused(dtype):
    with pytest.raises(ValueError, match="dtype must be"):
        loading.resolve_dtype(dtype, torch.device("cpu"))


def test_dtype_is_part_of_the_fingerprint_and_a_half_model_answers(saved_model_and_adapter, tmp_path):
    model_dir, _ = saved_model_and_adapter
    home = tmp_path / "home"
    full = KVEngine.from_pretrained(str(model_dir), device="cpu", dtype="float32", home=home)
    half = KVEngine.from_pretrained(str(model_dir), device="cpu", dtype="bfloat16", home=home)
    assert half.model.dtype == torch.bfloat16 and half.pool.dtype == torch.bfloat16
    assert half.fingerprint != full.fingerprint
    half.index([PASSAGE], progress=False)
    result = half.generate("Who built the lighthouse?", [PASSAGE], mode="block", max_new_tokens=4)
    assert result.reused_tokens > 0 and result.finish_reason in ("stop", "length")


def test_loading_warms_up_on_a_request_that_stores_nothing(saved_model_and_adapter, tmp_path, monkeypatch):
    """The first user's request should not pay for torch's first calls: from_pretrained answers one first."""
    model_dir, _ = saved_model_and_adapter
    asked = []
    generate = KVEngine.generate
    monkeypatch.setattr(KVEngine, "generate", lambda self, *a, **k: asked.append((a, k)) or generate(self, *a, **k))
    engine = KVEngine.from_pretrained(str(model_dir), device="cpu", adapter=None, home=tmp_path / "home")
    assert [k["mode"] for _, k in asked] == ["full"] and asked[0][0][1] == []
    assert not list((tmp_path / "home" / "kv").rglob("*.safetensors")) and engine.passages.find("Hello") == []
    asked.clear()
    KVEngine.from_pretrained(str(model_dir), device="cpu", adapter=None, home=tmp_path / "home", warm_up=False)
    assert asked == []


def test_second_load_does_not_hash_the_weights_again(saved_model_and_adapter, tmp_path, hashes):
    model_dir, adapter_dir = saved_model_and_adapter
    home = tmp_path / "home"
    first = KVEngine.from_pretrained(str(model_dir), home=home)
    tuned = KVEngine.from_pretrained(str(model_dir), home=home, adapter=adapter_dir)  # the merged weights: once more
    assert len(hashes) == 2 and tuned.causal_fingerprint == tuned.fingerprint != first.fingerprint
    again = KVEngine.from_pretrained(str(model_dir), home=home)
    tuned_again = KVEngine.from_pretrained(str(model_dir), home=home, adapter=adapter_dir)
    split = KVEngine.from_pretrained(str(model_dir), home=home, adapter=adapter_dir, adapter_scope="block")
    assert len(hashes) == 2 and hashes.tokenizer == 2
    assert (split.fingerprint, split.causal_fingerprint) == (tuned.fingerprint, first.fingerprint)
    assert again.fingerprint == first.fingerprint and tuned_again.fingerprint == tuned.fingerprint
    assert again.fingerprint == loading.fingerprint(again.model, again.tokenizer)  # what hashing gives
    assert tuned.fingerprint == loading.fingerprint(tuned.model, tuned.tokenizer)


def test_changed_files_are_hashed_again(saved_model_and_adapter, tmp_path, hashes, tok):
    model_dir, adapter_dir = saved_model_and_adapter
    home = tmp_path / "home"
    first = KVEngine.from_pretrained(str(model_dir), home=home).fingerprint
    weights = model_dir / "model.safetensors"
    os.utime(weights, ns=(weights.stat().st_atime_ns, weights.stat().st_mtime_ns + 10**9))  # touched: same weights
    assert KVEngine.from_pretrained(str(model_dir), home=home).fingerprint == first and len(hashes) == 2
    tiny_model(tiny_configs(len(tok))["llama"], 7).save_pretrained(model_dir)  # other weights in place
    assert KVEngine.from_pretrained(str(model_dir), home=home).fingerprint != first and len(hashes) == 3
    config = adapter_dir / "adapter_config.json"  # an adapter edited after its first merge
    config.write_text(config.read_text().replace('"lora_alpha": 8', '"lora_alpha": 16'))
    before = KVEngine.from_pretrained(str(model_dir), home=home, adapter=adapter_dir).fingerprint
    config.write_text(config.read_text().replace('"lora_alpha": 16', '"lora_alpha": 32'))
    assert KVEngine.from_pretrained(str(model_dir), home=home, adapter=adapter_dir).fingerprint != before


@pytest.mark.parametrize("planted", [b"", b"\x00\xff garbage", b"[1, 2]", b'{"weights": "../../etc"}',
                                     b'{"weights": 12}', b"{" * 100_000])
def test_damaged_or_planted_remembered_fingerprints_are_hashed_again(saved_model_and_adapter, tmp_path, hashes, planted):
    model_dir, _ = saved_model_and_adapter
    home = tmp_path / "home"
    first = KVEngine.from_pretrained(str(model_dir), home=home).fingerprint
    [remembered] = (home / "fingerprints").iterdir()
    remembered.write_bytes(planted)
    assert KVEngine.from_pretrained(str(model_dir), home=home).fingerprint == first and len(hashes) == 2
    assert KVEngine.from_pretrained(str(model_dir), home=home).fingerprint == first and len(hashes) == 2  # rewritten


def test_a_model_larger_than_its_gpu_keeps_what_does_not_fit_on_the_host(tok):
    gpu, gib = torch.device("cuda", 1), 2**30
    free = {0: 80 * gib, 1: 20 * gib, "cpu": 100 * gib}
    assert loading.placement(16 * gib, free, gpu) == {"device_map": {"": gpu}}
    spill = {"device_map": "auto", "max_memory": {1: int(18 * gib), "cpu": 100 * gib}}
    assert loading.placement(19 * gib, free, gpu) == spill
    assert loading.placement(19 * gib, free, torch.device("cpu")) == {}
    config = tiny_configs(len(tok))["llama"]
    assert loading.param_count(config) == sum(p.numel() for p in tiny_model(config).parameters())


def test_load_benchmark_times_both_loads_and_hashes_once(saved_model_and_adapter, tmp_path, hashes):
    from kvrag.eval.loadtime import load_times

    model_dir, _ = saved_model_and_adapter
    times = load_times(model_dir, torch.device("cpu"), torch.float32, tmp_path / "home", runs=2)
    assert set(times) == {"first", "plain", "plain_tokenizer", "kvrag"} and all(t > 0 for t in times.values())
    assert len(hashes) == 1


def test_a_gguf_digest_is_remembered_until_the_file_changes(tmp_path, monkeypatch):
    gguf = tmp_path / "model.gguf"
    gguf.write_bytes(b"GGUF" + bytes(range(256)) * 1000)
    calls = []
    digest = loading.file_sha256
    monkeypatch.setattr(loading, "file_sha256", lambda path: calls.append(path) or digest(path))
    home = tmp_path / "home"
    first = loading.gguf_sha256(gguf, home)
    assert first == digest(gguf) and loading.gguf_sha256(gguf, home) == first and len(calls) == 1
    [remembered] = (home / "fingerprints").iterdir()
    remembered.write_text("{not json")  # damaged: hashed again
    assert loading.gguf_sha256(gguf, home) == first and len(calls) == 2
    remembered.write_text('{"sha256": "planted"}')
    assert loading.gguf_sha256(gguf, home) == first and len(calls) == 3
    gguf.write_bytes(b"GGUF other weights")  # changed: another identity, hashed again
    assert loading.gguf_sha256(gguf, home) == digest(gguf) != first and len(calls) == 4
