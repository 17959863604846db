"""kvrag.kernels: the C kernels against torch, their use in the engine, and the fallback without them."""

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from tiny import tiny_configs, tiny_model

from kvrag import KVEngine, kernels
from kvrag.assemble import Piece, fill
from kvrag.attention import causal_mask
from kvrag.cache import Workspace
from kvrag.store import KVBlock

needs_avx512 = pytest.mark.skipif(not kernels.cpu_supported(), reason="kvrag.kernels need an x86-64 CPU with AVX-512F")
needs_bf16 = pytest.mark.skipif(not kernels.cpu_supported("avx512_bf16"), reason="bfloat16 products need AVX512-BF16")
PRINT_STATUS = "from kvrag import kernels; print(kernels.status())"  # in a fresh process, which reads KVRAG_KERNELS at import


@pytest.fixture
def lib():
    library = kernels.library()
    assert library is not None, f"kernels: {kernels.status()}"
    return library


SHAPES = [(9, 3, 55, 4119), (3, 1, 2, 0), (8, 2, 64, 1000), (6, 6, 13, 127)]


def random_attention(heads, kv_heads, n, past):
    g = torch.Generator().manual_seed(n)
    query = torch.randn(1, n, heads, 64, generator=g).transpose(1, 2)  # as the model hands it over
    workspace = torch.randn(2, 1, kv_heads, past + n + 100, 64, generator=g)  # larger than the request
    workspace[..., past + n :, :] = float("nan")  # beyond the request: must not leak in
    return query, workspace[0][:, :, : past + n], workspace[1][:, :, : past + n]


def sdpa(query, key, value, dtype=torch.float32):
    n, past = query.shape[2], key.shape[2] - query.shape[2]
    query, key, value = (x.to(dtype) for x in (query, key, value))
    gqa = query.shape[1] != key.shape[1]
    return F.scaled_dot_product_attention(query, key, value, attn_mask=causal_mask(n, past, dtype), enable_gqa=gqa)


@needs_avx512
@pytest.mark.parametrize("heads,kv_heads,n,past", SHAPES)
def test_attention_kernel_matches_sdpa(lib, heads, kv_heads, n, past):
    query, key, value = random_attention(heads, kv_heads, n, past)
    assert kernels.attention_applies(query, key, value)
    expected = sdpa(query, key, value)
    torch.testing.assert_close(kernels.attend(lib, query, key, value, 64**-0.5, in_bf16=False), expected, rtol=1e-5, atol=1e-5)


@needs_bf16
@pytest.mark.parametrize("heads,kv_heads,n,past", SHAPES)
def test_bf16_attention_kernel_is_exact_attention_over_bf16_inputs(lib, heads, kv_heads, n, past):
    """Its only rounding is the inputs' (and the probabilities') to bfloat16: sums stay float32."""
    assert lib.has_bf16
    query, key, value = random_attention(heads, kv_heads, n, past)
    rounded = [x.bfloat16().double() for x in (query, key, value)]
    expected = sdpa(*rounded, dtype=torch.float64).float()
    got = kernels.attend(lib, query, key, value, 64**-0.5, in_bf16=True)
    torch.testing.assert_close(got, expected, rtol=0, atol=1e-2)
    assert not torch.allclose(got, sdpa(query, key, value), rtol=0, atol=1e-6)  # it did run in bfloat16


def test_attention_kernel_declines_what_it_does_not_do():
    query, key = torch.randn(1, 3, 5, 64), torch.randn(1, 1, 20, 64)
    assert kernels.attention_applies(query, key, key)
    assert not kernels.attention_applies(query[..., :32], key[..., :32], key[..., :32])  # head_dim 32
    assert not kernels.attention_applies(query.double(), key.double(), key.double())
    assert not kernels.attention_applies(torch.randn(1, 3, 65, 64), torch.randn(1, 1, 80, 64), torch.randn(1, 1, 80, 64))
    assert not kernels.attention_applies(query[..., :1, :], key, key)  # one query: torch's decode path
    assert not kernels.attention_applies(query.requires_grad_(), key, key)  # no backward


@needs_avx512
def test_fill_kernel_matches_torch(lib, monkeypatch):
    g = torch.Generator().manual_seed(0)
    inv_freq = 1.0 / 10000 ** (torch.arange(0, 64, 2) / 64)
    pieces = [
        Piece(KVBlock(torch.zeros(n), *torch.randn(2, 4, 3, n, 64, generator=g).half(), start), position)
        for n, start, position in ((34, 0, 0), (300, 0, 34), (250, 34, 334), (5, 900, 7))
    ]
    with_kernel, without = (Workspace(4, 3, 64, 1024, torch.float32, "cpu") for _ in range(2))
    assert fill(with_kernel, pieces, inv_freq) == 589
    monkeypatch.setattr(kernels, "enabled", False)
    fill(without, pieces, inv_freq)
    torch.testing.assert_close(with_kernel.keys[..., :589, :], without.keys[..., :589, :], rtol=0, atol=1e-6)
    assert torch.equal(with_kernel.values[..., :589, :], without.values[..., :589, :])


@pytest.mark.parametrize("in_bf16", [False, pytest.param(True, marks=needs_bf16)])
@needs_avx512
def test_engine_runs_the_kernels_and_answers_as_without(lib, tok, tmp_path, monkeypatch, in_bf16):
    """float16 storage and SmolLM2's head shape: both kernels run, the logits match torch's path
    (to float32 rounding, or to bfloat16's with its products)."""
    monkeypatch.setattr(kernels, "bf16", in_bf16)
    engine = KVEngine(tiny_model(tiny_configs(len(tok))["llama-head64"]), tok, home=tmp_path)
    texts = ["The river Olm freezes every winter.", "Ilsa Brandt built the lighthouse in 1873."]
    calls = {"attend": 0, "fill_block": 0}
    for name in calls:
        original = getattr(kernels, name)
        monkeypatch.setattr(kernels, name, lambda *a, name=name, original=original: calls.__setitem__(name, calls[name] + 1) or original(*a))

    def run():
        prompt, _ = engine.build_prompt("Who built the lighthouse?", texts)
        state = engine.prefill(prompt, "block", all_logits=True)
        logits = state.logits.clone()
        engine.release(state)
        return logits, engine.generate("Who built the lighthouse?", texts, max_new_tokens=12).token_ids

    logits, answer = run()
    assert calls["attend"] >= engine.model.config.num_hidden_layers and calls["fill_block"] >= len(texts)
    monkeypatch.setattr(kernels, "enabled", False)
    calls.update(attend=0, fill_block=0)
    torch_logits, torch_answer = run()
    assert calls == {"attend": 0, "fill_block": 0}
    if in_bf16:
        assert 1e-4 < (logits - torch_logits).abs().max() < 5e-2
    else:
        torch.testing.assert_close(logits, torch_logits, rtol=1e-4, atol=1e-4)
        assert answer == torch_answer


@needs_avx512
def test_kernels_are_built_once_per_machine(lib):
    built = sorted((Path(os.environ["KVRAG_HOME"]) / "kernels").glob("kernels-*.so"))
    assert len(built) == 1
    before = built[0].stat().st_mtime_ns
    assert kernels._build() == built[0] and built[0].stat().st_mtime_ns == before


@needs_avx512
def test_two_processes_building_at_once_both_get_the_kernels(tmp_path):
    env = {**os.environ, "KVRAG_HOME": str(tmp_path)}
    procs = [subprocess.Popen([sys.executable, "-c", PRINT_STATUS], env=env, stdout=subprocess.PIPE, text=True) for _ in range(2)]
    products = "bfloat16" if kernels.cpu_supported("avx512_bf16") else "float32"  # KVRAG_KERNELS's default
    expected = f"on (AVX-512 C kernels, {products} attention products)"
    assert [proc.communicate(timeout=300)[0].strip() for proc in procs] == [expected] * 2
    assert [path.name.startswith("kernels-") for path in (tmp_path / "kernels").iterdir()] == [True]


@pytest.mark.parametrize(
    "setting,status",
    [
        ("fp32", "on (AVX-512 C kernels, float32 attention products)"),
        ("0", "off (KVRAG_KERNELS=0)"),
        ("fast", "ValueError: KVRAG_KERNELS must be 0, fp32 or bf16, not 'fast'"),
    ],
)
def test_kvrag_kernels_setting(setting, status):
    env = {**os.environ, "KVRAG_KERNELS": setting}
    run = subprocess.run([sys.executable, "-c", PRINT_STATUS], env=env, capture_output=True, text=True, timeout=300)
    if status.startswith("on") and not kernels.cpu_supported():
        status = "off (they need Linux on an x86-64 CPU with AVX-512F)"
    assert status in run.stdout + run.stderr


def test_without_a_compiler_torch_runs(tok, tmp_path, monkeypatch):
    monkeypatch.setenv("CC", str(tmp_path / "no-such-cc"))
    monkeypatch.setenv("KVRAG_HOME", str(tmp_path))
    kernels._load.cache_clear()
    try:
        assert kernels.library() is None
        assert "no C compiler" in kernels.status() or "AVX-512F" in kernels.status()
        engine = KVEngine(tiny_model(tiny_configs(len(tok))["llama-head64"]), tok, home=tmp_path)
        assert engine.generate("Who built it?", ["Ilsa Brandt built it."], max_new_tokens=3).token_ids
        monkeypatch.setattr(kernels, "enabled", False)
        assert kernels.status() == "off (KVRAG_KERNELS=0)"
    finally:
        monkeypatch.undo()
        kernels._load.cache_clear()
