"""Re-encoding rotary positions of cached keys.

A key cached at position p holds R(p)·k. Moving it to position p + delta only needs the
rotation R(delta), because rotations compose. The angles come from the model's own
`inv_freq`, which already carries linear / llama3 / YaRN frequency scaling. We never reuse
the rotary module's cos/sin: for YaRN and LongRoPE they include an attention scaling factor
that the cached key already has, and applying it twice would corrupt the key. Which RoPE types
compose, and so which models load, says families.py.
"""

import torch


def delta_cos_sin(delta: int, inv_freq: torch.Tensor, dtype: torch.dtype):
    """cos/sin of the pure rotation by `delta` positions, one column per frequency: [1, head_dim // 2],
    on `inv_freq`'s device.

    Angles are computed in float64 so that large deltas lose no precision before the cast. `delta` is
    a Python number: on a GPU a tensor made from it would be copied over, waiting for the copies queued.
    """
    angles = inv_freq.to(torch.float64)[None, :] * delta
    return angles.cos().to(dtype), angles.sin().to(dtype)


def shift_keys(keys: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    """Write keys [..., n, head_dim] rotated by cos/sin [n or 1, head_dim // 2] into `out`.

    transformers pairs dimension i with i + head_dim/2 (rotate_half). Copying first (which also
    converts from the storage dtype, and moves host keys to `out`'s device) and rotating in place in
    the compute dtype is about twice as fast on CPU as mixed-dtype arithmetic straight from the
    stored tensor.
    """
    half = keys.shape[-1] // 2
    out.copy_(keys, non_blocking=True)  # from pinned host memory a GPU copies asynchronously
    first, second = out[..., :half], out[..., half:]
    first_before = first.clone()
    first.mul_(cos).addcmul_(second, sin, value=-1)
    second.mul_(cos).addcmul_(first_before, sin)
    return out
