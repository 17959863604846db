"""kvrag: retrieval-augmented generation that prefills each passage once and reuses its KV cache."""

from .blend import BlendConfig
from .decode import GenerationResult, GenerationStream
from .engine import KVEngine
from .errors import (
    ChromaUnavailableError,
    QueueFullError,
    RequestTimeoutError,
    ContextOverflowError,
    EmptyInputError,
    InputEncodingError,
    KVRagError,
    ModelFileError,
    UnknownBlockError,
    UnsupportedModelError,
)
from .modes import BLOCK_MODES, CAUSAL_MODES, MODES, Mode
from .prompt import Passage, Prompt, PromptFormat, check_text

__all__ = [
    "BLOCK_MODES",
    "CAUSAL_MODES",
    "MODES",
    "BlendConfig",
    "ChromaUnavailableError",
    "ContextOverflowError",
    "EmptyInputError",
    "GenerationResult",
    "GenerationStream",
    "InputEncodingError",
    "KVEngine",
    "KVRagError",
    "Mode",
    "ModelFileError",
    "Passage",
    "Prompt",
    "PromptFormat",
    "QueueFullError",
    "RequestTimeoutError",
    "UnknownBlockError",
    "UnsupportedModelError",
    "check_text",
]
