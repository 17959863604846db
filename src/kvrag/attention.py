"""The attention kvrag runs the model with: PyTorch SDPA with grouped-query heads kept grouped.

transformers' own SDPA path repeats every key/value head for each query head whenever a mask
is passed, which copies the whole cache once per layer; with cached passages the mask is always
passed, so that copy dominated time to first token. `enable_gqa` reads the grouped heads in
place and is exact. Queries that follow cached keys must come with an explicit mask: relying on
`is_causal` there silently aligns the causal triangle to the wrong corner (TurboRAG's bug).
A question after cached keys, under the mask `causal_mask` makes, goes to the C kernel of
`kernels.py` where it applies: on CPU that attention is most of block mode's time. Longer runs
after a few cached keys (prefix caching's uncached rest, a passage encoded after the prefix) go
to flash attention's causal path, which no mask can reach.
"""

import torch
import torch.nn.functional as F
from transformers import AttentionInterface
from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, sdpa_mask

from . import kernels

NAME = "kvrag_sdpa"


QUERY_CHUNK = 64


def grouped_sdpa_attention(module, query, key, value, attention_mask, dropout=0.0, scaling=None, is_causal=None, **kwargs):
    q_len, kv_len = query.shape[2], key.shape[2]
    lib = kernels.library()
    past = kv_len - q_len
    after_cache = getattr(attention_mask, "past", None) == past and not dropout
    if lib and after_cache and kernels.attention_applies(query, key, value):
        out = kernels.attend(lib, query, key, value, scaling or query.shape[-1] ** -0.5)
        return out.transpose(1, 2).contiguous(), None
    if attention_mask is None and q_len > 1 and q_len != kv_len:
        raise RuntimeError(f"{q_len} queries after {past} cached keys need an explicit attention mask")
    if attention_mask is not None and attention_mask.dtype != torch.bool:
        attention_mask = attention_mask.to(query.dtype)
    options = dict(dropout_p=dropout, scale=scaling, enable_gqa=query.shape[1] != key.shape[1])
    if after_cache and QUERY_CHUNK < q_len and past <= q_len:
        out = _causal_after(query, key, value, past, options)
    elif attention_mask is None or q_len <= QUERY_CHUNK or attention_mask.shape[-2] == 1:
        out = F.scaled_dot_product_attention(
            query, key, value, attn_mask=attention_mask, is_causal=attention_mask is None and q_len > 1, **options
        )
    else:
        chunks = [slice(start, min(start + QUERY_CHUNK, q_len)) for start in range(0, q_len, QUERY_CHUNK)]
        out = torch.cat([_rows(query, key, value, attention_mask, rows, options) for rows in chunks], dim=2)
    return out.transpose(1, 2).contiguous(), None


def _causal_after(query, key, value, past: int, options) -> torch.Tensor:
    """Causal attention of queries that follow `past` cached keys, on flash attention's causal path.

    That path puts the causal triangle in the top-left corner; `past` placeholder queries in front
    move the real ones to the bottom-right, where they belong. Their past²/2 extra scores stay a
    small share while `past` is at most the queries' length, and no mask is read: prefix mode on a
    miss now takes full prefill's time (through the mask, 1.15x that at 8K tokens)."""
    placeholders = query.new_zeros(*query.shape[:2], past, query.shape[3])
    out = F.scaled_dot_product_attention(torch.cat([placeholders, query], dim=2), key, value, is_causal=True, **options)
    return out[:, :, past:]


def _rows(query, key, value, mask, rows: slice, options) -> torch.Tensor:
    """Attention of a run of queries over only the keys they can see.

    Every mask here is causal in row order (kvrag's, and transformers' causal or sliding-window
    ones): a later query never sees a later key less, so the run's last row sees furthest. Cutting
    the keys beyond it is exact and saves the work a full-width mask spends on zeros: with blend
    mode's recomputed tokens spread over the prompt, about half of it."""
    last_row = mask[0, 0, rows.stop - 1]
    visible = last_row if last_row.dtype == torch.bool else last_row > torch.finfo(last_row.dtype).min
    extent = int(visible.nonzero().max()) + 1
    return F.scaled_dot_product_attention(
        query[:, :, rows], key[:, :, :extent], value[:, :, :extent], attn_mask=mask[..., rows, :extent], **options
    )


AttentionInterface.register(NAME, grouped_sdpa_attention)
ALL_MASK_ATTENTION_FUNCTIONS.register(NAME, sdpa_mask)


def causal_mask(new: int, past: int, dtype: torch.dtype, device=None) -> torch.Tensor:
    """Additive [1, 1, new, past + new] mask: every new token sees all past tokens and earlier new ones.

    It records `past`, so that attention can run a kernel that knows this pattern without reading it."""
    mask = torch.zeros(new, past + new, dtype=dtype, device=device)
    mask[:, past:] = torch.triu(torch.full((new, new), torch.finfo(dtype).min, dtype=dtype, device=device), 1)
    mask = mask[None, None]
    mask.past = past
    return mask
