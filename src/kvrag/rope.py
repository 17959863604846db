"""Re-encoding rotary positions of cached keys.

A key cached at position p holds R(p)·k. Moving it to position p + delta only needs the
rotation R(delta), because rotations compose. The angles come from the model's own
`inv_freq`, which already carries linear / llama3 / YaRN frequency scaling. We never reuse
the rotary module's cos/sin: for YaRN and LongRoPE they include an attention scaling factor
that the cached key already has, and applying it twice would corrupt the key.
"""

import torch

# rope_type values whose angle at position p is exactly p * inv_freq with a fixed inv_freq.
COMPOSABLE_ROPE_TYPES = {"default", "linear", "llama3", "yarn"}


def rope_type(config) -> str:
    params = getattr(config, "rope_parameters", None) or {}
    return params.get("rope_type", "default")


def check_composable(config) -> None:
    """Refuse RoPE variants whose frequencies depend on the sequence length."""
    from .errors import UnsupportedModelError

    kind = rope_type(config)
    if kind not in COMPOSABLE_ROPE_TYPES:
        raise UnsupportedModelError(
            f"RoPE type {kind!r} is not supported: its frequencies change with the sequence length "
            "(dynamic NTK / LongRoPE), so a cached key cannot be moved to a new position exactly. "
            f"Supported RoPE types: {', '.join(sorted(COMPOSABLE_ROPE_TYPES))}."
        )


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def delta_cos_sin(delta: torch.Tensor, inv_freq: torch.Tensor, dtype: torch.dtype):
    """cos/sin of the pure rotation by `delta` positions, shaped [n, head_dim].

    Angles are computed in float64 so that large deltas lose no precision before the cast.
    """
    angles = delta.to(torch.float64)[:, None] * inv_freq.to(torch.float64)[None, :]
    angles = torch.cat((angles, angles), dim=-1)
    return angles.cos().to(dtype), angles.sin().to(dtype)


def shift_keys(keys: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, out: torch.Tensor | None = None):
    """Rotate keys [..., n, head_dim] by per-token cos/sin [n, head_dim] (HF's rotate_half layout)."""
    keys = keys.to(cos.dtype)
    rotated = keys * cos + rotate_half(keys) * sin
    if out is None:
        return rotated
    out.copy_(rotated)
    return out
