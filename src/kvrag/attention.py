"""The attention kvrag runs the model with, its one mask builder, and the forward call that uses them.

PyTorch SDPA with grouped-query heads kept grouped: transformers' own SDPA path repeats every
key/value head for each query head whenever a mask is passed, which copies the whole cache once per
layer; `enable_gqa` reads the grouped heads in place and is exact. Queries that follow cached keys
must come with an explicit mask: relying on `is_causal` there silently aligns the causal triangle
to the wrong corner (TurboRAG's bug).

`forward` tells the attention how many cached keys the new tokens follow (`kvrag_cached`, an
argument transformers hands down to every layer's attention). On CPU, under that plain causal pattern
a question over a long cache goes to the C kernel of `kernels.py` where it applies, and a long run
after a few cached keys to flash attention's causal path; any other mask (blend, training) is read
as given.

A cache that carries `kvrag_ape` (block mode with `block_context="ape"`) has the tokens after its
passages read them as APE has them (`_ape`), on any device.

On CUDA every case goes to a fused kernel (`_fused`) that reads the grouped heads in place. Under
the plain causal pattern a single query (decoding) needs no mask, and a longer run (a question, prefix
mode's rest) goes to flash attention, aligned to the bottom-right corner through `causal_lower_right`.
Any other mask (blend's recompute, fine-tuning's blocks), and whatever flash does not take (float32),
goes to memory-efficient attention, which reads masks, with the query heads of each key/value head
stacked as its query rows (`_folded`) so that the head counts match.
"""

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch.backends.cuda import SDPAParams, can_use_flash_attention
from torch.nn.attention.bias import causal_lower_right
from transformers import AttentionInterface
from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, sdpa_mask

from . import kernels

NAME = "kvrag_sdpa"
QUERY_CHUNK = 64
FUSED_DEVICES = {"cuda"}
"""Devices whose attention runs through `_fused`; the tests add "cpu" to check its tensor logic there."""
APE_READING = (0.9, 0.5)
"""APE's attention temperature and scale factor, (T, S), as `block_context="ape"` reads passages (docs/modes.md)."""
MASK_ALIGNMENT = 16
"""Memory-efficient attention reads a mask whose rows start at multiples of this many elements; SDPA pads a copy
of any other."""


@dataclass(frozen=True)
class Ape:
    """Where a cache's parallel-encoded passages lie (slots first..end) and how the tokens after them read them:
    APE's attention temperature and scale factor (Yang et al., ICLR 2025, arXiv 2502.05431)."""

    first: int
    end: int
    temperature: float
    scale: float


def mask(positions: torch.Tensor, keys: int, dtype: torch.dtype, blocks: torch.Tensor | None = None) -> torch.Tensor:
    """Additive [1, 1, len(positions), keys] mask: the token at `positions[i]` sees keys 0..positions[i].

    `blocks` (a block index per key) narrows that to the token's own block, except for tokens of the
    last block, which see everything: block attention as fine-tuning trains it."""
    visible = torch.arange(keys, device=positions.device)[None, :] <= positions[:, None]
    if blocks is not None:
        own = blocks[positions][:, None]
        visible &= (blocks[None, :] == own) | (own == blocks.max())
    return torch.zeros(visible.shape, dtype=dtype, device=positions.device).masked_fill_(
        ~visible, torch.finfo(dtype).min
    )[None, None]


def causal_mask(new: int, past: int, dtype: torch.dtype, device=None) -> torch.Tensor:
    """`new` tokens after `past` cached ones: each sees the whole cache and the new tokens before it."""
    return mask(torch.arange(past, past + new, device=device), past + new, dtype)


def forward(model, ids: list[int], cache, start: int, keep: int = 1, causal_only: bool = False):
    """Run `model` on `ids` at positions start.., appending to `cache`, which holds `start` tokens.

    Returns the logits of the last `keep` tokens, or the decoder's output when `keep` < 0 (KV only).
    `causal_only`: nothing is cached before `ids`, so no mask is needed."""
    device = model.device
    ids_t = torch.tensor([ids], device=device)
    positions = torch.arange(start, start + len(ids), device=device)[None]
    extra = {} if causal_only else {"attention_mask": causal_mask(len(ids), start, model.dtype, device), "kvrag_cached": start,
                                    "kvrag_ape": getattr(cache, "kvrag_ape", None)}
    if keep < 0:
        return model.get_decoder()(input_ids=ids_t, position_ids=positions, cache=cache, **extra)
    return model(input_ids=ids_t, position_ids=positions, cache=cache, logits_to_keep=keep, **extra).logits[0]


class Packed:
    """The new tokens of several requests run as one sequence (a decode step shared by many users): each
    request's run is appended to its own cache and attends only to it, so no cache is copied or padded.
    Stands in for the cache in the model's call; the attention reads `kvrag_packed`."""

    def __init__(self, caches: list, starts: list[int], lengths: list[int], dtype, device):
        self.caches, self.starts = caches, starts
        self.apes = [getattr(cache, "kvrag_ape", None) for cache in caches]  # read once, not per layer
        ends = torch.tensor(lengths).cumsum(0).tolist()
        self.spans = [(end - n, end) for end, n in zip(ends, lengths)]
        self.masks = [causal_mask(n, start, dtype, device) for n, start in zip(lengths, starts)]

    def update(self, key_states, value_states, layer_idx: int, *args, **kwargs):
        for cache, (a, b) in zip(self.caches, self.spans):
            cache.layers[layer_idx].update(key_states[:, :, a:b], value_states[:, :, a:b])
        return key_states, value_states

    def attend(self, module, query, dropout, scaling) -> torch.Tensor:
        """Each run's queries over its own cache, exactly as `forward` would run it alone."""
        outs = []
        for cache, start, mask, ape, (a, b) in zip(self.caches, self.starts, self.masks, self.apes, self.spans):
            layer = cache.layers[module.layer_idx]
            out, _ = grouped_sdpa_attention(module, query[:, :, a:b], layer.keys, layer.values, mask, dropout,
                                            scaling, kvrag_cached=start, kvrag_ape=ape)
            outs.append(out)
        return torch.cat(outs, dim=1)


def forward_packed(model, runs: list[tuple[list[int], object, int]]) -> torch.Tensor:
    """`forward` for several requests at once: (ids, cache, start) each; returns each run's last logits.

    The linear layers see every request's tokens together, which is what makes decoding many users
    cheaper than decoding them in turn; attention stays per request (`Packed`)."""
    device = model.device
    ids = [t for run_ids, _, _ in runs for t in run_ids]
    positions = [p for run_ids, _, start in runs for p in range(start, start + len(run_ids))]
    packed = Packed([c for _, c, _ in runs], [s for _, _, s in runs], [len(r) for r, _, _ in runs], model.dtype, device)
    last = torch.tensor([b - 1 for _, b in packed.spans], device=device)
    return model(input_ids=torch.tensor([ids], device=device), position_ids=torch.tensor([positions], device=device),
                 cache=packed, attention_mask=packed.masks[0], kvrag_packed=packed, logits_to_keep=last).logits[0]


def grouped_sdpa_attention(module, query, key, value, attention_mask, dropout=0.0, scaling=None, is_causal=None,
                           kvrag_cached=None, kvrag_packed=None, kvrag_ape=None, **kwargs):
    """`kvrag_cached`: the number of cached keys before the queries, given only where `attention_mask` is
    `causal_mask`'s (see `forward`). `kvrag_packed`: several requests' runs (see `Packed`). `kvrag_ape`: the
    cache's passages and how the queries after them read them (`Ape`)."""
    if kvrag_packed is not None:
        return kvrag_packed.attend(module, query, dropout, scaling), None
    q_len, kv_len = query.shape[2], key.shape[2]
    after_cache = kvrag_cached == kv_len - q_len and not dropout
    if after_cache and kvrag_ape is not None and kvrag_ape.end <= kvrag_cached:
        return _ape(query, key, value, kvrag_cached, kvrag_ape, scaling or query.shape[-1] ** -0.5), None
    if after_cache and kernels.attention_applies(query, key, value):
        lib = kernels.library()
        if lib and lib.has_attend:
            out = kernels.attend(lib, query, key, value, scaling or query.shape[-1] ** -0.5)
            return out.transpose(1, 2).contiguous(), None
    if attention_mask is None and q_len > 1 and q_len != kv_len:
        raise RuntimeError(f"{q_len} queries after {kv_len - q_len} cached keys need an explicit attention mask")
    if attention_mask is not None and attention_mask.dtype != torch.bool:
        attention_mask = attention_mask.to(query.dtype)
    if query.device.type in FUSED_DEVICES:
        return _fused(query, key, value, attention_mask, after_cache, dropout, scaling), None
    options = dict(dropout_p=dropout, scale=scaling, enable_gqa=query.shape[1] != key.shape[1])
    if after_cache and QUERY_CHUNK < q_len and kvrag_cached <= q_len:
        out = _causal_after(query, key, value, kvrag_cached, options)
    elif attention_mask is None or q_len <= QUERY_CHUNK or attention_mask.shape[-2] == 1:
        out = F.scaled_dot_product_attention(
            query, key, value, attn_mask=attention_mask, is_causal=attention_mask is None and q_len > 1, **options
        )
    else:
        chunks = [slice(start, min(start + QUERY_CHUNK, q_len)) for start in range(0, q_len, QUERY_CHUNK)]
        out = torch.cat([_rows(query, key, value, attention_mask, rows, options) for rows in chunks], dim=2)
    return out.transpose(1, 2).contiguous(), None


def _ape(query, key, value, past: int, ape: Ape, scale: float) -> torch.Tensor:
    """Causal attention of queries after `past` cached keys in which the passages' keys (slots ape.first..ape.end)
    are read as APE reads them; [batch, queries, heads, dim].

    APE splits a query's attention into the prefix's, the passages' and the rest's, each a softmax of its own,
    and mixes them by their log-sum-exps, the passages' taken at temperature T (their scores divided by T),
    multiplied back by T and shifted by log S. That is one softmax in which the passages' scores are divided by
    T and shifted, per query, by log S + (T - 1) * LSE(scores / T): their share of the attention becomes
    S * exp(T * LSE(scores / T)) against the others' unchanged exp(LSE). T = S = 1 is plain attention. Sharper
    (T < 1) and scaled down (S < 1), the passages encoded apart stop drawing more attention together than they
    would in one sequence. Scores in float32 (a cache in another dtype is read as a float32 copy), the query
    heads of each key/value head stacked, QUERY_CHUNK queries at a time."""
    batch, heads, q_len, dim = query.shape
    kv_heads, keys = key.shape[1], key.shape[2]
    grouped = query.unflatten(1, (kv_heads, heads // kv_heads)).float()  # [batch, kv_heads, groups, queries, dim]
    key_t, values = key[:, :, None].float().transpose(-1, -2), value[:, :, None].float()
    span, shift = slice(ape.first, ape.end), math.log(ape.scale)
    outs = []
    for start in range(0, q_len, QUERY_CHUNK):
        rows = torch.arange(past + start, past + min(start + QUERY_CHUNK, q_len), device=query.device)
        scores = grouped[..., start : start + len(rows), :] @ key_t * scale
        passages = scores[..., span] / ape.temperature
        scores[..., span] = passages + (shift + (ape.temperature - 1) * passages.logsumexp(-1, keepdim=True))
        scores.masked_fill_(torch.arange(keys, device=query.device) > rows[:, None], float("-inf"))
        outs.append(scores.softmax(-1) @ values)
    out = torch.cat(outs, dim=-2).flatten(1, 2)  # [batch, heads, queries, dim]
    return out.transpose(1, 2).to(query.dtype).contiguous()


def _causal_after(query, key, value, past: int, options) -> torch.Tensor:
    """Causal attention of queries that follow `past` cached keys, on flash attention's causal path.

    That path puts the causal triangle in the top-left corner; `past` placeholder queries in front
    move the real ones to the bottom-right, where they belong. Their past²/2 extra scores stay a
    small share while `past` is at most the queries' length, and no mask is read."""
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


def _fused(query, key, value, mask, after_cache: bool, dropout: float, scale) -> torch.Tensor:
    """Attention on SDPA's fused kernels, grouped heads read in place; returns [batch, queries, heads, dim].

    Under the plain causal pattern (after the cache, or with no mask at all) one query sees every key:
    its heads fold into rows with no mask. Longer runs take flash attention's causal path, which puts the
    triangle in the bottom-right corner only through `causal_lower_right` (`is_causal` would put it
    top-left, and flash refuses it for unequal lengths); flash reads grouped heads natively but takes no
    mask. The rest goes folded, with its mask (the causal one where flash does not apply), to
    memory-efficient attention."""
    q_len, kv_len = query.shape[2], key.shape[2]
    causal = after_cache or mask is None
    if causal and q_len == 1:
        return _folded(query, key, value, None, dropout, scale)
    if causal and _flash_applies(query, key, value, dropout):
        out = F.scaled_dot_product_attention(query, key, value, attn_mask=causal_lower_right(q_len, kv_len),
                                             dropout_p=dropout, scale=scale, enable_gqa=query.shape[1] != key.shape[1])
        return out.transpose(1, 2).contiguous()
    if mask is None:
        mask = causal_mask(q_len, kv_len - q_len, query.dtype, query.device)
    return _folded(query, key, value, mask, dropout, scale)


def _flash_applies(query, key, value, dropout: float) -> bool:
    """Whether flash attention takes these tensors as they are, grouped heads and no mask (not float32)."""
    grouped = query.shape[1] != key.shape[1]
    return can_use_flash_attention(SDPAParams(query, key, value, None, dropout, False, grouped))


def _folded(query, key, value, mask, dropout: float, scale) -> torch.Tensor:
    """Grouped attention with the query heads of each key/value head stacked as its rows; [batch, queries, heads, dim].

    Query head h reads key/value head h // groups, as `enable_gqa` has it. Stacked, the head counts
    match, so any fused kernel takes them and reads the cache in place, whether or not it reads grouped
    heads itself (memory-efficient attention does not in every torch build, and SDPA then falls back to
    the math kernel, which repeats them). A mask, the same for the heads of a group, has its rows
    repeated once per group (`_fold_mask`); a single query after the cache needs none."""
    batch, heads, q_len, dim = query.shape
    kv_heads = key.shape[1]
    groups = heads // kv_heads
    rows = query.reshape(batch, kv_heads, groups * q_len, dim)
    if mask is not None:
        mask = _fold_mask(mask, groups, q_len, kv_heads, query.dtype)
    out = F.scaled_dot_product_attention(rows, key, value, attn_mask=mask, dropout_p=dropout, scale=scale)
    return out.unflatten(2, (groups, q_len)).permute(0, 3, 1, 2, 4).reshape(batch, q_len, heads, value.shape[3])


def _fold_mask(mask, groups: int, q_len: int, kv_heads: int, dtype) -> torch.Tensor:
    """`mask` [batch, 1 or heads, 1 or q_len, keys] on `_folded`'s rows, as memory-efficient attention reads
    a mask without a copy of its own: additive, in the queries' `dtype`, rows MASK_ALIGNMENT-aligned."""
    batch, mask_heads, _, keys = mask.shape
    if mask.dtype == torch.bool:
        mask = torch.zeros(mask.shape, dtype=dtype, device=mask.device).masked_fill_(~mask, torch.finfo(dtype).min)
    rows = mask.expand(batch, mask_heads, q_len, keys)
    rows = rows[:, :, None] if mask_heads == 1 else rows.unflatten(1, (kv_heads, groups))
    width = -(-keys // MASK_ALIGNMENT) * MASK_ALIGNMENT
    folded = torch.empty(batch, rows.shape[1], groups * q_len, width, dtype=dtype, device=mask.device)[..., :keys]
    folded.unflatten(2, (groups, q_len)).copy_(rows)
    return folded


AttentionInterface.register(NAME, grouped_sdpa_attention)
ALL_MASK_ATTENTION_FUNCTIONS.register(NAME, sdpa_mask)
