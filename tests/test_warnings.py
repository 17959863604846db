"""A request emits no deprecation warning: kvrag calls transformers and peft only in their current ways."""

import warnings

from kvrag import MODES, KVEngine

PASSAGE = "The lighthouse of Varnholm was built in 1873 by the engineer Ilsa Brandt."


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
