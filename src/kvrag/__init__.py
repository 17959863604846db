"""kvrag: retrieval-augmented generation that prefills each passage once and reuses its KV cache.

The names below load their module (and torch) when first used, so `import kvrag` and `kvrag --help`
cost nothing."""

import importlib

_WHERE = {
    "BlendConfig": "blend",
    "GenerationResult": "decode",
    "GenerationStream": "decode",
    "KVEngine": "engine",
    "preceding_in_documents": "engine",
    "ChromaUnavailableError": "errors",
    "QueueFullError": "errors",
    "RequestTimeoutError": "errors",
    "ContextOverflowError": "errors",
    "EmptyInputError": "errors",
    "InputEncodingError": "errors",
    "KVRagError": "errors",
    "ModelFileError": "errors",
    "UnknownBlockError": "errors",
    "UnsupportedModelError": "errors",
    "BLOCK_MODES": "modes",
    "CAUSAL_MODES": "modes",
    "MODES": "modes",
    "Mode": "modes",
    "Passage": "prompt",
    "Prompt": "prompt",
    "PromptFormat": "prompt",
    "check_text": "prompt",
}
__all__ = sorted(_WHERE)


def __getattr__(name: str):
    if name not in _WHERE:
        raise AttributeError(f"module 'kvrag' has no attribute {name!r}")
    value = getattr(importlib.import_module(f".{_WHERE[name]}", __name__), name)
    globals()[name] = value  # found directly from now on
    return value


def __dir__():
    return sorted({*globals(), *__all__})
