"""kvrag: retrieval-augmented generation that prefills each passage once and reuses its KV cache."""

from .engine import MODES, GenerationStream, KVEngine
from .errors import (
    ContextOverflowError,
    EmptyInputError,
    InputEncodingError,
    KVRagError,
    UnknownBlockError,
    UnsupportedModelError,
)
from .generate import GenerationResult
from .prompt import Prompt, PromptFormat

__all__ = [
    "MODES",
    "ContextOverflowError",
    "EmptyInputError",
    "GenerationResult",
    "GenerationStream",
    "InputEncodingError",
    "KVEngine",
    "KVRagError",
    "Prompt",
    "PromptFormat",
    "UnknownBlockError",
    "UnsupportedModelError",
]
