"""One real vLLM server (its own virtualenv, the default model's weights as kvrag answers with them, kvrag's
connector) for the whole session: it takes about a minute to start."""

import pytest
import torch


@pytest.fixture(scope="session")
def weights(tmp_path_factory, kvrag_home):
    from kvrag.eval.vllm import export

    return export(tmp_path_factory.mktemp("weights") / "default")


@pytest.fixture(scope="session")
def vllm(weights, tmp_path_factory):
    from kvrag.eval.vllm import vllm_server

    home = tmp_path_factory.mktemp("vllm-home")
    with vllm_server(weights, home, home=home) as server:
        yield server


@pytest.fixture(scope="session")
def reference(weights):
    """The same weights in transformers, float32: what vLLM's KV and logits are checked against."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(weights, dtype=torch.float32).eval()
    return model, AutoTokenizer.from_pretrained(weights)
