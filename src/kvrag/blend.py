"""After CacheBlend: keep the cached KV of almost every passage token, recompute a few in context,
and so restore the cross-passage attention that matters most.

Block mode's passages never attended to each other. Recomputing every token (`full`) restores
that at the full prefill cost; CacheBlend observes that a small share of tokens carries most of
the difference, and that a token's deviation on an early layer predicts it on later ones.

One pass over the layers, starting from block mode's assembled cache. Every token is computed on layer
0, whose KV depends on the token alone (so its fresh KV is the cached KV, up to rounding) and whose
output every later choice needs. On each check layer only a share of the passage tokens still being
computed goes on: those whose fresh K or V deviates most from the cached ones (CacheBlend's choice and
the default, `select="deviation"`) or those the question attends to most over the cached KV
(`select="attention"`, as query-centric methods choose); the question always does. `select="lookahead"`
(after ProphetKV) chooses before the pass instead: block mode's own question pass runs first, through every
layer over the cached blocks, and the attention it pays each passage token, summed over layers and heads,
names the tokens that the pass then recomputes from layer 0 on. Mode "auto" takes the
fewest tokens that hold a share (`coverage`) of the measure on the first check layer, so the share
follows the request; with several check layers it is the share the last one keeps, as `recompute_ratio`
is blend's. A computed token writes its fresh K/V over the cached ones (the cache layers' `slots`) and
attends over the blended cache with an explicit causal mask. On the last layer the passage tokens only
write their K/V: nothing reads their output. Recompute ratio 1 recomputes every token, which is `full`;
ratio 0 only the question, which is `block` (when the first check layer is 0 or 1). Positions are block
mode's re-encoded ones.
"""

from dataclasses import dataclass
from typing import Literal, get_args

import torch
from transformers.models.llama.modeling_llama import rotate_half

from . import families
from .attention import mask as attention_mask

Select = Literal["attention", "deviation", "lookahead"]
"""How blend mode chooses the passage tokens it recomputes (`BlendConfig.select`); the server takes it per request."""


@dataclass(frozen=True)
class BlendConfig:
    """How much of the passages blend mode recomputes, and how it chooses.

    recompute_ratio  share of passage tokens recomputed (the question always is): 0 is block mode,
                     1 is full prefill; CacheBlend's default 0.15. Mode "auto" chooses its own.
    check_layers     decoder layers on which deviation is measured; layer 0's KV depends only on
                     the token itself, so the first layer that can deviate is 1 (the default).
    deviation        compare "keys" (measured closer to full here, see docs/modes.md) or "values"
                     (CacheBlend's implementation).
    widen            with several check layers, the first keeps `widen` times the final share and
                     later ones narrow it linearly to `recompute_ratio`, or auto's share (CacheBlend's
                     gradual filtering).
    sink_tokens      the first tokens of every block are recomputed as well (each block's own
                     attention sink, after EPIC), on top of the ratio.
    select           "deviation" (CacheBlend: the tokens whose K or V changes most in context),
                     "attention" (the tokens the question attends to most over the cached KV, on
                     the check layer), or "lookahead" (ProphetKV's two stages: the tokens block mode's
                     question pass reads most, summed over every layer, chosen before any recompute;
                     `check_layers` and `widen` do not apply). docs/modes.md has the measurements.
    coverage         mode "auto": recompute the fewest passage tokens that hold `coverage` of the total
                     deviation (or of the question's attention) on the first check layer, between `least`
                     and `most` of the passage tokens; the share then follows each request.
    """

    recompute_ratio: float = 0.15
    check_layers: tuple[int, ...] = (1,)
    deviation: Literal["keys", "values"] = "keys"
    widen: float = 2.0
    sink_tokens: int = 0
    select: Select = "deviation"
    coverage: float = 0.9
    least: float = 0.05
    most: float = 0.5

    def __post_init__(self):
        if not 0.0 <= self.recompute_ratio <= 1.0:
            raise ValueError(f"recompute_ratio must be within [0, 1], got {self.recompute_ratio}")
        layers = tuple(self.check_layers)
        if not layers or list(layers) != sorted(set(layers)) or layers[0] < 0:
            raise ValueError(f"check_layers must be distinct increasing layer indices, got {self.check_layers}")
        object.__setattr__(self, "check_layers", layers)
        if self.deviation not in ("values", "keys"):
            raise ValueError(f"deviation must be 'values' or 'keys', got {self.deviation!r}")
        if self.widen < 1.0:
            raise ValueError(f"widen must be at least 1, got {self.widen}")
        if self.sink_tokens < 0:
            raise ValueError(f"sink_tokens must be >= 0, got {self.sink_tokens}")
        if self.select not in get_args(Select):
            raise ValueError(f"select must be one of {', '.join(map(repr, get_args(Select)))}, got {self.select!r}")
        if not 0.0 < self.coverage <= 1.0:
            raise ValueError(f"coverage must be within (0, 1], got {self.coverage}")
        if not 0.0 <= self.least <= self.most <= 1.0:
            raise ValueError(f"least and most must satisfy 0 <= least <= most <= 1, got {self.least}, {self.most}")

    def compared(self, keys, values):
        """Whichever of the two `deviation` measures."""
        return values if self.deviation == "values" else keys

    def kept(self, check: int, candidates: int, share: float | None = None) -> int:
        """Tokens that survive the `check`-th check layer out of `candidates`, when `share` of them (default:
        `recompute_ratio`) survive the last."""
        last = len(self.check_layers) - 1
        share = (self.recompute_ratio if share is None else share) * (
            self.widen - (self.widen - 1) * check / last if last else 1.0)
        return min(candidates, round(min(share, 1.0) * candidates))


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    return x * cos[:, None] + rotate_half(x) * sin[:, None]


def fresh_kv(family, layer, hidden: torch.Tensor, cos: torch.Tensor,
             sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The keys (rotated to their positions) and values [1, kv_heads, n, head_dim] that `layer` (of a
    model of `family`, see families.py) computes from `hidden`, as its attention does before writing
    them to the cache."""
    keys, values = family.keys_values(layer.self_attn, layer.input_layernorm(hidden))
    return _rotate(keys.transpose(1, 2), cos, sin), values.transpose(1, 2)


def question_attention(family, layer, hidden: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                       keys: torch.Tensor) -> torch.Tensor:
    """How much attention the tokens `hidden` (the question) pay each of `keys` [1, kv_heads, n, head_dim]
    on `layer` [heads, tokens, n]; softmax over `keys` alone."""
    attn = layer.self_attn
    queries = _rotate(family.queries(attn, layer.input_layernorm(hidden)).transpose(1, 2), cos, sin)[0]
    heads, tokens, dim = queries.shape
    kv_heads = keys.shape[1]  # each key/value head's query heads stacked as its rows: the keys are read in place
    rows = queries.reshape(kv_heads, heads // kv_heads * tokens, dim)
    scores = rows @ keys[0].to(queries.dtype).transpose(-1, -2) * getattr(attn, "scaling", attn.head_dim**-0.5)
    return torch.softmax(scores, dim=-1).reshape(heads, tokens, -1)


@torch.inference_mode()
def prefill(model, workspace, ids: list[int], first: int, context: int, block_starts: list[int], config: BlendConfig,
            keep: int = 1, auto: bool = False):
    """Blend the question `ids[context:]` into the cache: `workspace` holds the block-mode KV of `ids[:context]`
    (the prefix, then blocks beginning at `block_starts`, passages from `first`). `auto`: the share recomputed
    is the least that holds `config.coverage` of the measure `config.select` names. Returns the logits of the
    last `keep` tokens and the passage positions recomputed throughout."""
    family, decoder = families.family(model.config), model.get_decoder()
    device, n = workspace.keys.device, len(ids)
    selection = Selection(config, first, context, block_starts, device, auto)
    active = torch.arange(n, device=device)
    ahead = config.select == "lookahead"  # the tokens are chosen before the pass, which runs only them from layer 0
    if ahead:
        active = torch.cat([selection.ahead(lookahead(family, decoder, workspace, ids, context)), active[context:]])
    hidden = decoder.embed_tokens(torch.tensor(ids, device=device)[active])[None]
    mask = attention_mask(active, n, hidden.dtype) if ahead else None  # else every token runs: plain causal attention
    cache = workspace.cache(n)
    last = len(decoder.layers) - 1
    for index, layer in enumerate(decoder.layers):
        cos, sin = decoder.rotary_emb(hidden, active[None])
        if index in selection.checks:
            stay = selection.survivors(family, layer, index, hidden, cos, sin, active, workspace)
            active, hidden, cos, sin = active[stay], hidden[:, stay], cos[:, stay], sin[:, stay]
            mask = attention_mask(active, n, hidden.dtype)
        if index == last:  # the passage tokens' output is never read: write their KV and drop them
            passage = int((active < context).sum())
            recomputed = active[:passage]  # the prefix left at the first check layer
            if passage:
                keys, values = fresh_kv(family, layer, hidden[:, :passage], cos[:, :passage], sin[:, :passage])
                workspace.keys[index][:, :, recomputed] = keys
                workspace.values[index][:, :, recomputed] = values
            active, hidden, cos, sin = active[passage:], hidden[:, passage:], cos[:, passage:], sin[:, passage:]
            mask = attention_mask(active, n, hidden.dtype)
        cache.layers[index].slots = active
        hidden = layer(
            hidden,
            attention_mask=mask,
            position_ids=active[None],
            cache=cache,
            position_embeddings=(cos, sin),
        )
    for buffer in cache.layers:
        buffer.slots = None
    logits = model.lm_head(decoder.norm(hidden[:, -keep:]))
    return logits[0], recomputed


def lookahead(family, decoder, workspace, ids: list[int], context: int) -> torch.Tensor:
    """Stage one of "lookahead": block mode's question pass over the cached `ids[:context]`, layer by layer,
    returning the attention it pays each of those tokens [context], summed over the layers, heads and question
    tokens. It writes the question's block-mode KV, which stage two overwrites; the last layer's output is never
    needed. (Summing only the deeper half of the layers, taking the most-reading head, or giving every passage
    its own share all came out further from full on SQuAD's and the generated dev questions: docs/accuracy.md.)"""
    device, n = workspace.keys.device, len(ids)
    active = torch.arange(context, n, device=device)
    hidden = decoder.embed_tokens(torch.tensor(ids[context:], device=device))[None]
    cache, mask = workspace.cache(context), attention_mask(active, n, hidden.dtype)
    read = torch.zeros(context, device=device)
    for index, layer in enumerate(decoder.layers):
        cos, sin = decoder.rotary_emb(hidden, active[None])
        read += question_attention(family, layer, hidden, cos, sin, workspace.keys[index][:, :, :context]).sum(dim=(0, 1))
        if index < len(decoder.layers) - 1:
            hidden = layer(hidden, attention_mask=mask, position_ids=active[None], cache=cache,
                           position_embeddings=(cos, sin))
    return read


class Selection:
    """Which passage tokens go on past each check layer: the question always does, and the block sinks;
    of the passage tokens, those `config.select` names, as many as the share (fixed, or `auto`'s).
    "lookahead" chooses once, before the pass (`ahead`), and has no check layers."""

    def __init__(self, config: BlendConfig, first: int, context: int, block_starts: list[int], device, auto: bool):
        self.config, self.first, self.context, self.auto = config, first, context, auto
        self.sinks = sink_positions(block_starts, config.sink_tokens, context, device)
        self.checks = () if config.select == "lookahead" else config.check_layers
        self.share = None  # auto's, once the first check layer has measured it

    def ahead(self, read: torch.Tensor) -> torch.Tensor:
        """The passage positions (sorted, with the sinks) that lookahead recomputes: the share (fixed, or the
        fewest holding `coverage` of it for auto) that the question's pass `read` most."""
        config, mass = self.config, read[self.first:self.context]
        if not len(mass):
            return self.sinks
        share = covering_share(mass, config.coverage, config.least, config.most, len(mass)) if self.auto \
            else config.recompute_ratio
        chosen = self.first + mass.topk(round(share * len(mass))).indices
        return torch.cat([chosen, self.sinks]).unique()

    def survivors(self, family, layer, index, hidden, cos, sin, active, workspace) -> torch.Tensor:
        config = self.config
        passage, question = (active >= self.first) & (active < self.context), active >= self.context
        if not passage.any():
            return question | torch.isin(active, self.sinks)
        candidates = self.context - self.first
        tokens = active[passage]
        if config.select == "attention":
            score = question_attention(family, layer, hidden[:, question], cos[:, question], sin[:, question],
                                       workspace.keys[index][:, :, :self.context]).sum(dim=(0, 1))[tokens]
        else:
            fresh = config.compared(*fresh_kv(family, layer, hidden[:, passage], cos[:, passage], sin[:, passage]))
            cached = config.compared(workspace.keys, workspace.values)[index][:, :, tokens]
            score = deviation(fresh, cached)
        if self.auto and self.share is None:
            self.share = covering_share(score, config.coverage, config.least, config.most, candidates)
        kept = min(len(tokens), config.kept(config.check_layers.index(index), candidates, self.share))
        chosen = tokens[score.topk(kept).indices]
        return question | torch.isin(active, chosen) | torch.isin(active, self.sinks)


def covering_share(mass: torch.Tensor, coverage: float, least: float, most: float, candidates: int) -> float:
    """The share of the `candidates` passage tokens that the fewest tokens holding `coverage` of `mass`
    (each token's deviation, or the question's attention on it) make, within [least, most]."""
    ordered = mass.sort(descending=True).values.cumsum(0)
    needed = int((ordered < coverage * ordered[-1]).sum()) + 1
    return min(max(needed / candidates, least), most)


def deviation(fresh: torch.Tensor, cached: torch.Tensor) -> torch.Tensor:
    """How far each token's fresh K or V [1, kv_heads, n, head_dim] lies from its cached one (squared)."""
    return (fresh - cached.to(fresh.dtype)).square().sum(dim=(0, 1, 3))


def most_deviating(fresh: torch.Tensor, cached: torch.Tensor, kept: int) -> torch.Tensor:
    """Indices of the `kept` tokens whose fresh K or V lie farthest from the cached."""
    distance = deviation(fresh, cached)
    return distance.topk(min(kept, len(distance))).indices


def sink_positions(block_starts, sink_tokens: int, context: int, device=None) -> torch.Tensor:
    """The first `sink_tokens` positions of every block (each block's own attention sink), before `context`."""
    positions = {p for start in block_starts for p in range(start, min(start + sink_tokens, context))}
    return torch.tensor(sorted(positions), dtype=torch.long, device=device)
