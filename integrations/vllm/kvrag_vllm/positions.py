"""Moving stored keys to the positions they take in a prompt: the rotation by the position difference.

The angles are the model's own frequencies (kvrag.rope explains why a pure rotation is exact); vLLM's
config carries them as the Hugging Face config does. Llama-style models pair dimension i with
i + head_dim/2 (neox), GPT-J-style ones with i + 1.
"""

import torch

from kvrag.rope import delta_cos_sin, shift_keys

GPTJ_STYLE = ("gptj", "chatglm", "glm", "cohere", "cohere2")


def neox_style(hf_config) -> bool:
    return getattr(hf_config, "model_type", "") not in GPTJ_STYLE


def inv_freq(hf_config, head_dim: int) -> torch.Tensor:
    """The rotary frequencies [head_dim // 2] of the model, scaling included (as its attention computes them)."""
    params = dict(getattr(hf_config, "rope_parameters", None) or getattr(hf_config, "rope_scaling", None) or {})
    kind = params.get("rope_type", params.get("type", "default"))
    partial = params.get("partial_rotary_factor", getattr(hf_config, "partial_rotary_factor", 1.0))
    if kind == "dynamic":
        raise ValueError("dynamic NTK RoPE scales with the sequence length, so stored keys cannot be moved: "
                         "kvrag's connector does not serve this model")
    if partial != 1.0:
        raise ValueError(f"RoPE on {partial} of each head: kvrag's connector rotates whole heads only")
    if kind == "default":
        theta = params.get("rope_theta", getattr(hf_config, "rope_theta", 10000.0))
        return 1.0 / theta ** (torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim)
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    frequencies, _ = ROPE_INIT_FUNCTIONS[kind](hf_config, "cpu")
    return frequencies.to(torch.float64)


def rotate(keys: torch.Tensor, delta: int, frequencies: torch.Tensor, neox: bool = True) -> torch.Tensor:
    """keys [..., tokens, head_dim] moved `delta` positions, in float32."""
    cos, sin = delta_cos_sin(delta, frequencies, torch.float32)
    out = torch.empty(keys.shape, dtype=torch.float32, device=keys.device)
    if neox:
        return shift_keys(keys, cos, sin, out)
    out.copy_(keys)
    pairs = out.unflatten(-1, (-1, 2))
    even, odd = pairs[..., 0].clone(), pairs[..., 1].clone()
    pairs[..., 0] = even * cos - odd * sin
    pairs[..., 1] = odd * cos + even * sin
    return out
