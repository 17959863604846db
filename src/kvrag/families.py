"""Model families: what kvrag needs to know about an architecture, in one place.

kvrag runs a model through transformers, but reaches inside it where no transformers API serves: it
re-rotates cached keys with the model's own rotary frequencies (assemble.py, rope.py), recomputes some
tokens' queries, keys and values layer by layer (blend.py, and fine-tuning's blend rows), and sizes its
workspaces and context window from the config (engine.py, the benches). A `Family` says how, for one
`config.model_type`, looked up when an engine is built (by blend mode once per request, never per
token). Supporting a new family is one entry in `FAMILIES`; the tests build a tiny random model of every
entry (tests/tiny.py) and check the invariants on it.

Its RoPE must be position-composable too: a cached key is moved by rotating it by the difference of
angles, which needs each position's angle to be `position * inv_freq` with a fixed `inv_freq`
(see rope.py). Dynamic NTK scaling and LongRoPE change the frequencies with the sequence length; they
are refused at load.
"""

from dataclasses import dataclass

import torch

from .errors import UnsupportedModelError

COMPOSABLE_ROPE_TYPES = {"default", "linear", "llama3", "yarn"}
"""rope_type values whose angle at position p is exactly p * inv_freq with a fixed inv_freq."""


@dataclass(frozen=True)
class Family:
    """How kvrag reaches into one architecture's decoder (transformers' Llama layout unless said otherwise)."""

    qk_norm: bool = False  # queries and keys are normalized per head before RoPE (`q_norm`, `k_norm`)
    sliding_everywhere: bool = False  # a `sliding_window` without `layer_types` applies to every layer

    def inv_freq(self, model) -> torch.Tensor:
        """The rotary frequencies the model's attention rotates keys by, scaling (linear, llama3, YaRN) included."""
        return model.get_decoder().rotary_emb.inv_freq

    def queries(self, attn, x: torch.Tensor) -> torch.Tensor:
        """Queries [batch, n, heads, head_dim] that attention module `attn` computes from its input `x`,
        before RoPE."""
        queries = attn.q_proj(x).view(*x.shape[:-1], -1, attn.head_dim)
        return attn.q_norm(queries) if self.qk_norm else queries

    def keys_values(self, attn, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Keys (before RoPE) and values [batch, n, kv_heads, head_dim] that `attn` computes from `x`."""
        shape = (*x.shape[:-1], -1, attn.head_dim)
        keys = attn.k_proj(x).view(shape)
        return attn.k_norm(keys) if self.qk_norm else keys, attn.v_proj(x).view(shape)


FAMILIES = {
    "llama": Family(),
    "mistral": Family(sliding_everywhere=True),
    "qwen2": Family(),
    "qwen3": Family(qk_norm=True),
}
SUPPORTED_MODEL_TYPES = tuple(FAMILIES)


def family(config) -> Family:
    """The family of a model's config; an UnsupportedModelError for any other architecture."""
    found = FAMILIES.get(config.model_type)
    if found is None:
        raise UnsupportedModelError(
            f"model type {config.model_type!r} is not supported; kvrag supports {', '.join(SUPPORTED_MODEL_TYPES)}"
        )
    return found


def rope_type(config) -> str:
    params = getattr(config, "rope_parameters", None) or {}
    return params.get("rope_type", "default")


def check_supported(config) -> None:
    """Refuse a model kvrag cannot serve exactly: an unknown family, or RoPE whose frequencies depend on
    the sequence length."""
    family(config)
    kind = rope_type(config)
    if kind not in COMPOSABLE_ROPE_TYPES:
        raise UnsupportedModelError(
            f"RoPE type {kind!r} is not supported: its frequencies change with the sequence length "
            "(dynamic NTK / LongRoPE), so a cached key cannot be moved to a new position exactly. "
            f"Supported RoPE types: {', '.join(sorted(COMPOSABLE_ROPE_TYPES))}."
        )


def head_dim(config) -> int:
    return getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads


def context_window(config) -> int:
    """Longest prompt every layer attends to in full; sliding-window layers shorten it."""
    window = config.max_position_embeddings
    layer_types = getattr(config, "layer_types", None) or []
    sliding = getattr(config, "sliding_window", None)
    everywhere = getattr(FAMILIES.get(config.model_type), "sliding_everywhere", False)
    if sliding and ("sliding_attention" in layer_types or (everywhere and not layer_types)):
        window = min(window, sliding)
    return window
