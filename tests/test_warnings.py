"""A request emits no deprecation warning: kvrag calls transformers and peft only in their current ways."""

import warnings

import pytest
from tiny import tiny_configs, tiny_model

from kvrag import MODES, KVEngine

PASSAGE = "The lighthouse of Varnholm was built in 1873 by the engineer Ilsa Brandt."


@pytest.fixture
def saved_model_and_adapter(tok, tmp_path):
    """A tiny Llama and a LoRA adapter for it, saved as a user's checkpoint and `kvrag finetune` output are."""
    from peft import LoraConfig, get_peft_model

    model_dir, adapter_dir = tmp_path / "model", tmp_path / "adapter"
    tiny_model(tiny_configs(len(tok))["llama"], 0).save_pretrained(model_dir)
    tok.save_pretrained(model_dir)
    with warnings.catch_warnings():  # peft's own set-up here is the test's, not kvrag's
        warnings.simplefilter("ignore")
        lora = get_peft_model(tiny_model(tiny_configs(len(tok))["llama"], 1), LoraConfig(r=4, target_modules=["q_proj"]))
    lora.save_pretrained(adapter_dir)
    return model_dir, adapter_dir


def test_loading_and_every_mode_emit_no_deprecation_warning(saved_model_and_adapter, tmp_path):
    model_dir, adapter_dir = saved_model_and_adapter
    with warnings.catch_warnings():
        warnings.simplefilter("error", FutureWarning)
        warnings.simplefilter("error", DeprecationWarning)
        engine = KVEngine.from_pretrained(str(model_dir), adapter=adapter_dir, home=tmp_path / "home")
        engine.index([PASSAGE], progress=False)
        for mode in MODES:
            result = engine.generate("Who built the lighthouse?", [PASSAGE], mode=mode, max_new_tokens=3)
            assert result.generated_tokens > 0 or result.finish_reason == "stop"
        rendered, spans = engine.layout.render_chat([("user", [PASSAGE, "Who built the lighthouse?"])])
        engine.generate_text(rendered, mode="block", max_new_tokens=3)
