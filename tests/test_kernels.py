"""kvrag.kernels: the C kernels against torch, their use in the engine, the fallback without them,
and how a build is made, verified and refused."""

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from tiny import tiny_configs, tiny_model

from kvrag import KVEngine, kernels
from kvrag.assemble import Piece, fill
from kvrag.attention import mask
from kvrag.store import KVBlock
from kvrag.workspace import Workspace

needs_kernels = pytest.mark.skipif(not kernels.machine_supported(), reason="kvrag.kernels are built on Linux x86-64")
needs_avx512 = pytest.mark.skipif(not kernels.cpu_supported(), reason="the C attention needs an x86-64 CPU with AVX-512F")
needs_bf16 = pytest.mark.skipif(not kernels.cpu_supported("avx512_bf16"), reason="bfloat16 products need AVX512-BF16")
needs_cc = pytest.mark.skipif(shutil.which(os.environ.get("CC", "cc")) is None, reason="no C compiler")
FILLS_ONLY = "on (C block fills; attention in torch: the C attention needs AVX-512F)"
PRINT_STATUS = "from kvrag import kernels; print(kernels.status())"  # in a fresh process, which reads KVRAG_KERNELS at import
TEXTS = ["The river Olm freezes every winter.", "Ilsa Brandt built the lighthouse in 1873."]
QUESTION = "Who built the lighthouse?"


@pytest.fixture
def lib():
    library = kernels.library()
    assert library is not None, f"kernels: {kernels.status()} (tests/conftest.py builds them once per session)"
    return library


@pytest.fixture
def home(tmp_path, monkeypatch):
    """A KVRAG_HOME of the test's own, with the kernels loaded afresh there and again after the test."""
    monkeypatch.setenv("KVRAG_HOME", str(tmp_path))
    kernels._load.cache_clear()
    yield tmp_path
    monkeypatch.undo()
    kernels._load.cache_clear()


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
    causal = mask(torch.arange(past, past + n), past + n, dtype)
    return F.scaled_dot_product_attention(query, key, value, attn_mask=causal, enable_gqa=gqa)


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


@needs_kernels
def test_fill_kernel_matches_torch(lib, monkeypatch):
    g = torch.Generator().manual_seed(0)
    inv_freq = 1.0 / 10000 ** (torch.arange(0, 64, 2) / 64)
    pieces = [
        Piece(KVBlock(torch.zeros(n), *torch.randn(2, 4, 3, n, 64, generator=g).half(), start), position)
        for n, start, position in ((34, 0, 0), (300, 0, 34), (250, 34, 334), (5, 900, 7))
    ]
    pieces[0].block.values[0, 0, 0, :4] = torch.tensor([6e-8, -3e-5, 65504.0, float("-inf")])  # subnormals, extremes
    with_kernel, without = (Workspace(4, 3, 64, 1024, torch.float32, "cpu") for _ in range(2))
    assert fill(with_kernel, pieces, inv_freq) == 589
    monkeypatch.setattr(kernels, "enabled", False)
    fill(without, pieces, inv_freq)
    torch.testing.assert_close(with_kernel.keys[..., :589, :], without.keys[..., :589, :], rtol=0, atol=1e-6)
    assert torch.equal(with_kernel.values[..., :589, :], without.values[..., :589, :])


@pytest.mark.parametrize("in_bf16", [False, pytest.param(True, marks=needs_bf16)])
@needs_kernels
def test_engine_runs_the_kernels_and_answers_as_without(lib, tok, tmp_path, monkeypatch, in_bf16):
    """float16 storage and SmolLM2's head shape: the fill kernel runs (and the attention kernel where the CPU has
    AVX-512F), the logits match torch's path (to float32 rounding, or to bfloat16's with its products)."""
    monkeypatch.setattr(kernels, "bf16", in_bf16)
    engine = KVEngine(tiny_model(tiny_configs(len(tok))["llama-head64"]), tok, home=tmp_path)
    calls = {"attend": 0, "fill_block": 0}
    for name in calls:
        original = getattr(kernels, name)
        monkeypatch.setattr(kernels, name, lambda *a, name=name, original=original: calls.__setitem__(name, calls[name] + 1) or original(*a))

    def run():
        prompt, _ = engine.build_prompt(QUESTION, TEXTS)
        state = engine.prefill(prompt, "block", all_logits=True)
        logits = state.logits.clone()
        engine.release(state)
        return logits, engine.generate(QUESTION, TEXTS, mode="block", max_new_tokens=12).token_ids

    logits, answer = run()
    assert calls["fill_block"] >= len(TEXTS)
    assert calls["attend"] >= engine.model.config.num_hidden_layers if lib.has_attend else calls["attend"] == 0
    monkeypatch.setattr(kernels, "enabled", False)
    calls.update(attend=0, fill_block=0)
    torch_logits, torch_answer = run()
    assert calls == {"attend": 0, "fill_block": 0}
    if in_bf16:
        assert 1e-4 < (logits - torch_logits).abs().max() < 5e-2
    else:
        torch.testing.assert_close(logits, torch_logits, rtol=1e-4, atol=1e-4)
        assert answer == torch_answer


@needs_kernels
def test_the_library_uses_torchs_openmp_runtime(lib):
    """kvrag adds no OpenMP runtime: in a fresh process that runs the kernels, the only libgomp mapped is torch's,
    which the build links against by path (this test process may hold other packages' copies)."""
    run = subprocess.run([sys.executable, "-c", ANSWER + MAPPED_OPENMP], env=os.environ.copy(), capture_output=True,
                         text=True, timeout=300)
    assert run.returncode == 0, run.stderr
    status, runtime, mapped = run.stdout.strip().splitlines()[-3:]
    assert status.startswith("on (") and "torch" in runtime  # torch/lib, or torch.libs in some wheels
    assert mapped == str([runtime])


@needs_kernels
@needs_cc
def test_a_build_is_private_recorded_and_made_once(home):
    built = kernels.build()
    assert built.startswith("on (")
    path = kernels.build_path()
    assert path.parent == home / "kernels" / f"user-{os.getuid()}"
    assert path.parent.stat().st_mode & 0o777 == 0o700 and path.stat().st_uid == os.getuid()
    assert path.with_suffix(".sha256").read_text().split() == [kernels.hashlib.sha256(path.read_bytes()).hexdigest()]
    before = path.stat().st_mtime_ns
    assert kernels.build() == built and path.stat().st_mtime_ns == before
    assert sorted(p.name for p in path.parent.iterdir()) == sorted([path.name, path.with_suffix(".sha256").name])


@needs_kernels
@needs_cc
def test_two_processes_building_at_once_both_get_the_kernels(tmp_path):
    env = {**os.environ, "KVRAG_HOME": str(tmp_path)}
    build = "from kvrag import kernels; print(kernels.build())"
    procs = [subprocess.Popen([sys.executable, "-c", build], env=env, stdout=subprocess.PIPE, text=True) for _ in range(2)]
    products = "bfloat16" if kernels.cpu_supported("avx512_bf16") else "float32"  # KVRAG_KERNELS's default
    expected = f"on (AVX-512 C kernels, {products} attention products)" if kernels.cpu_supported() else FILLS_ONLY
    assert [proc.communicate(timeout=300)[0].strip() for proc in procs] == [expected] * 2
    assert sorted(p.suffix for p in (tmp_path / "kernels" / f"user-{os.getuid()}").iterdir()) == [".sha256", ".so"]


@needs_kernels
def test_a_request_never_compiles(home, tok, monkeypatch, caplog):
    """Without a build torch runs, and says once how to get the kernels."""
    monkeypatch.setenv("CC", "/bin/false")  # a compiler that fails, were one run
    engine = KVEngine(tiny_model(tiny_configs(len(tok))["llama-head64"]), tok, home=home)
    with caplog.at_level("INFO", logger="kvrag.kernels"):
        assert engine.generate(QUESTION, TEXTS, mode="block", max_new_tokens=3).token_ids
        assert engine.generate(QUESTION, TEXTS, mode="block", max_new_tokens=3).token_ids
    assert kernels.library() is None and "not built" in kernels.status()
    said = [r.getMessage() for r in caplog.records if r.name == "kvrag.kernels"]
    assert len(said) == 1 and "`kvrag kernels build`" in said[0]
    assert not (home / "kernels").exists()


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
    if status.startswith("on") and not kernels.machine_supported():
        status = "off (they need Linux on an x86-64 CPU)"
    elif status.startswith("on") and not kernels.cpu_supported():
        status = FILLS_ONLY
    assert status in run.stdout + run.stderr


def test_without_a_compiler_torch_runs(home, tok, monkeypatch):
    monkeypatch.setenv("CC", str(home / "no-such-cc"))
    assert kernels.build().startswith("off (")
    assert kernels.library() is None
    assert "no C compiler" in kernels.build() or not kernels.machine_supported()
    engine = KVEngine(tiny_model(tiny_configs(len(tok))["llama-head64"]), tok, home=home)
    assert engine.generate(QUESTION, TEXTS, mode="block", max_new_tokens=3).token_ids
    monkeypatch.setattr(kernels, "enabled", False)
    assert kernels.status() == "off (KVRAG_KERNELS=0)"


ANSWER = f"""
import sys
sys.path.insert(0, {str(Path(__file__).parent)!r})
from tiny import tiny_configs, tiny_model, tiny_tokenizer
from kvrag import KVEngine, kernels
tok = tiny_tokenizer()
engine = KVEngine(tiny_model(tiny_configs(len(tok))["llama-head64"]), tok)
print(engine.generate({QUESTION!r}, {TEXTS!r}, mode="block", max_new_tokens=8).token_ids)
print(kernels.status())
"""
MAPPED_OPENMP = """
from pathlib import Path
print(kernels.openmp_runtime())
print(sorted({line.split()[-1] for line in Path("/proc/self/maps").read_text().splitlines() if "libgomp" in line}))
"""
PLANTED = r"""
#include <stdio.h>
__attribute__((constructor)) static void planted(void) { fopen(MARKER, "w"); }
void attend(void) {}
void fill_block(void) {}
"""


def corrupt(path: Path) -> None:
    with open(path, "r+b") as f:
        f.seek(path.stat().st_size // 2)
        f.write(os.urandom(64))


def plant(path: Path) -> None:
    """A library of the right name and symbols whose load would leave a marker file."""
    source = path.with_name("planted.c")
    source.write_text(PLANTED)
    marker = path.parent.parent / "planted-ran"
    subprocess.run(["cc", "-shared", "-fPIC", f'-DMARKER="{marker}"', "-o", str(path), str(source)], check=True)
    source.unlink()


@needs_kernels
@needs_cc
@pytest.mark.parametrize("damage", ["corrupted", "planted", "shared directory"])
def test_a_damaged_build_is_never_loaded(home, tok, monkeypatch, damage):
    """Random bytes in the library, a different library in its place, or a directory that others may
    write: a fresh process never loads it, answers as torch does, and warns once."""
    assert kernels.build().startswith("on (")
    path = kernels.build_path()
    {"corrupted": corrupt, "planted": plant, "shared directory": lambda p: p.parent.chmod(0o770)}[damage](path)
    run = subprocess.run([sys.executable, "-c", ANSWER], env={**os.environ, "KVRAG_HOME": str(home)},
                         capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr
    answer, status = run.stdout.strip().splitlines()[-2:]
    monkeypatch.setattr(kernels, "enabled", False)
    torch_engine = KVEngine(tiny_model(tiny_configs(len(tok))["llama-head64"]), tok, home=home / "torch")
    assert answer == str(torch_engine.generate(QUESTION, TEXTS, mode="block", max_new_tokens=8).token_ids)
    assert status.startswith("off (not loaded: ")
    assert run.stderr.count("C kernels not loaded") == 1, run.stderr
    assert not (home / "kernels" / "planted-ran").exists()


REWRITTEN = """
import torch
from kvrag import kernels
kernels.build()
lib = kernels._loaded()
def agrees(lib):
    block, out = torch.randn(2, 3, 2, 70, 64).half(), torch.zeros(2, 3, 2, 70, 64)
    kernels.fill_block(lib, block[0], block[1], out[0], out[1], torch.ones(32), torch.zeros(32))
    return torch.equal(out, block.float())
kernels.build_path().write_bytes(b"\\0" * 16)  # the loaded file, cut short and overwritten in place
print(agrees(lib))
kernels._load.cache_clear()
kernels.build(force=True)  # a new build under the same name, loaded again in the same process
again = kernels._loaded()
print(again is not None and again._name != lib._name and agrees(again))
"""


@needs_kernels
@needs_cc
def test_what_is_done_to_the_file_after_loading_cannot_reach_the_loaded_code(home):
    """The loader maps a sealed copy: overwriting the library in place neither crashes the process
    that loaded it (a mapped file cut short raises SIGBUS) nor changes its code, and a rebuild loaded
    in the same process is the new library, not the old one under a reused /proc/self/fd name."""
    run = subprocess.run([sys.executable, "-c", REWRITTEN], env={**os.environ, "KVRAG_HOME": str(home)},
                         capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-3000:]
    assert run.stdout.split() == ["True", "True"]
