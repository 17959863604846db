"""LlamaIndex integration for kvrag: answers start after the question's prefill, because every
retrieved node's KV cache was computed when the node was ingested."""

from .base import KVRagLLM
from .precompute import KVPrecompute
from .storage import default_embed_model, default_vector_store
from .synthesizers import KVBlockSynthesizer, MapRerankSynthesizer

__all__ = [
    "KVBlockSynthesizer",
    "KVPrecompute",
    "KVRagLLM",
    "MapRerankSynthesizer",
    "default_embed_model",
    "default_vector_store",
]
