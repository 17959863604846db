"""The attention kvrag runs the model with: PyTorch SDPA with grouped-query heads kept grouped.

transformers' own SDPA path repeats every key/value head for each query head whenever a mask
is passed, which copies the whole cache once per layer; with cached passages the mask is always
passed, so that copy dominated time to first token. `enable_gqa` reads the grouped heads in
place and is exact. Queries that follow cached keys must come with an explicit mask: relying on
`is_causal` there silently aligns the causal triangle to the wrong corner (TurboRAG's bug).
"""

import torch
import torch.nn.functional as F
from transformers import AttentionInterface
from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, sdpa_mask

NAME = "kvrag_sdpa"


def grouped_sdpa_attention(module, query, key, value, attention_mask, dropout=0.0, scaling=None, is_causal=None, **kwargs):
    q_len, kv_len = query.shape[2], key.shape[2]
    if attention_mask is None and q_len > 1 and q_len != kv_len:
        raise RuntimeError(f"{q_len} queries after {kv_len - q_len} cached keys need an explicit attention mask")
    if attention_mask is not None and attention_mask.dtype != torch.bool:
        attention_mask = attention_mask.to(query.dtype)
    out = F.scaled_dot_product_attention(
        query,
        key,
        value,
        attn_mask=attention_mask,
        dropout_p=dropout,
        scale=scaling,
        is_causal=attention_mask is None and q_len > 1,
        enable_gqa=query.shape[1] != key.shape[1],
    )
    return out.transpose(1, 2).contiguous(), None


AttentionInterface.register(NAME, grouped_sdpa_attention)
ALL_MASK_ATTENTION_FUNCTIONS.register(NAME, sdpa_mask)


def causal_mask(new: int, past: int, dtype: torch.dtype, device=None) -> torch.Tensor:
    """Additive [1, 1, new, past + new] mask: every new token sees all past tokens and earlier new ones."""
    mask = torch.zeros(new, past + new, dtype=dtype, device=device)
    mask[:, past:] = torch.triu(torch.full((new, new), torch.finfo(dtype).min, dtype=dtype, device=device), 1)
    return mask[None, None]
