"""kvrag: retrieval-augmented generation that prefills each passage once and reuses its KV cache."""

from .blend import BlendConfig
from .engine import MODES, GenerationStream, KVEngine, Mode
from .errors import (
    ContextOverflowError,
    EmptyInputError,
    InputEncodingError,
    KVRagError,
    UnknownBlockError,
    UnsupportedModelError,
)
from .generate import GenerationResult
from .prompt import Passage, Prompt, PromptFormat

__all__ = [
    "MODES",
    "BlendConfig",
    "ContextOverflowError",
    "EmptyInputError",
    "GenerationResult",
    "GenerationStream",
    "InputEncodingError",
    "KVEngine",
    "KVRagError",
    "Mode",
    "Passage",
    "Prompt",
    "PromptFormat",
    "UnknownBlockError",
    "UnsupportedModelError",
]
