"""One prefill function per mode. Every mode prefills exactly the ids of `Prompt.ids()`; they differ
in what is reused:

  full       plain causal prefill of every token, nothing reused (the "stuff" baseline)
  block      cached blocks moved to contiguous positions, only the question is prefilled
             (Block-Attention / TurboRAG "reordered")
  composite  cached blocks keep the positions they were encoded at (TurboRAG "composite")
  prefix     prefix caching: reuse the longest run of leading blocks whose exact causal KV was
             computed before in the same order, prefill the rest
  blend      block mode plus CacheBlend: recompute, with the question, the passage tokens whose KV
             deviates most in context (or, "lookahead", that block mode's question pass reads most),
             restoring cross-passage attention (see blend.py)
  auto       blend whose share follows the request: the fewest passage tokens that hold most of the
             deviation (BlendConfig.coverage), so that no share needs tuning

Each takes the `Blocks` of the weights it runs on (the causal modes, full and prefix, run on the
published weights when an adapter serves the block modes), the prompt, its blocks' store keys, a
workspace large enough for the prompt, how many logits to keep, and blend's settings.
"""

from dataclasses import dataclass, field
from typing import Literal, get_args

import torch

from . import blend as blend_lib
from .assemble import Blocks, Piece, fill
from .attention import Ape, forward
from .prompt import Prompt
from .store import BadBlock
from .workspace import Workspace

Mode = Literal["full", "block", "composite", "prefix", "blend", "auto"]
MODES: tuple[str, ...] = get_args(Mode)
CAUSAL_MODES = ("full", "prefix")
"""Plain causal attention, the attention the published weights were trained for."""
BLOCK_MODES = tuple(m for m in MODES if m not in CAUSAL_MODES)
"""block, composite, blend and auto: each passage attended alone, its stored KV reused; what a block-tuned adapter is
tuned for. The mode sets are written here only: the integrations, CLI and server import them from kvrag."""


@dataclass
class Prefill:
    """A prompt whose KV sits in `cache`; `logits` are the question tokens' (or only the last one's)."""

    logits: torch.Tensor
    cache: object
    next_position: int
    prefilled_tokens: int
    reused_tokens: int
    cache_hits: dict[str, int]
    workspace: Workspace
    pending: list = field(default_factory=list)  # (key, context, slot, token ids) to store afterwards


def full(blocks: Blocks, prompt: Prompt, keys, ws: Workspace, keep: int, config=None) -> Prefill:
    ids = prompt.ids()
    cache = ws.cache(0)
    logits = forward(blocks.model, ids, cache, 0, keep, causal_only=True)
    return Prefill(logits, cache, len(ids), len(ids), 0, {}, ws)


def block(blocks: Blocks, prompt: Prompt, keys, ws: Workspace, keep: int, config=None, reorder: bool = True) -> Prefill:
    state = placed(blocks, prompt, keys, ws, reorder)
    state.logits = forward(blocks.model, prompt.question, state.cache, state.next_position, keep)
    state.next_position += len(prompt.question)
    return state


def composite(blocks: Blocks, prompt: Prompt, keys, ws: Workspace, keep: int, config=None) -> Prefill:
    return block(blocks, prompt, keys, ws, keep, reorder=False)


def placed(blocks: Blocks, prompt: Prompt, keys, ws: Workspace, reorder: bool = True) -> Prefill:
    """Block (or composite) mode's cache without the question, whose prefill is left to the caller: the
    scheduler runs many requests' questions through the model together. `next_position` is the question's."""
    position, stored, hits = blocks.assemble(prompt, keys, ws, reorder)
    reused = int(stored.sum())
    computed = position - reused + len(prompt.question)
    cache = ws.cache(position)
    if blocks.ape and position > len(prompt.prefix):  # the question and answer read the passages as APE does
        cache.kvrag_ape = Ape(len(prompt.prefix), position, *blocks.ape)
    return Prefill(None, cache, position, computed, reused, hits, ws)


def blend(blocks: Blocks, prompt: Prompt, keys, ws: Workspace, keep: int, config: blend_lib.BlendConfig,
          auto: bool = False) -> Prefill:
    """Block mode's cache, then the question with the passage tokens `config` chooses (those whose KV
    deviates most, or that it reads most), recomputed in context over it; `auto`: as many as `config.coverage`
    asks for."""
    position, stored, hits = blocks.assemble(prompt, keys, ws)
    first, starts = len(prompt.prefix), prompt.block_starts()
    logits, recomputed = blend_lib.prefill(blocks.model, ws, prompt.ids(), first, position, starts, config, keep,
                                           auto)
    reused = int(stored.sum() - stored[recomputed.cpu()].sum())
    computed = int((~stored).sum()) + len(recomputed) + len(prompt.question)
    if config.select == "lookahead":  # its first stage ran the question too
        computed += len(prompt.question)
    return Prefill(logits, ws.cache(len(prompt)), len(prompt), computed, reused, hits, ws)


def auto(blocks: Blocks, prompt: Prompt, keys, ws: Workspace, keep: int, config: blend_lib.BlendConfig) -> Prefill:
    return blend(blocks, prompt, keys, ws, keep, config, auto=True)


def prefix(blocks: Blocks, prompt: Prompt, keys, ws: Workspace, keep: int, config=None) -> Prefill:
    """Prefix caching: segments are keyed by everything before them, so only exact prefixes match.
    The segments computed here are stored by `store_pending` once the request is done."""
    store, hits = blocks.store, {}
    segments = [s for s in [prompt.prefix, *prompt.blocks] if s]
    chain, parent = [], ""
    for ids in segments:
        parent = store.key(f"chain:{parent}", ids)
        chain.append(parent)
    contexts = [f"chain:{chain[i - 1] if i else ''}" for i in range(len(chain))]
    matched, position = 0, 0
    for key, context in zip(chain, contexts):
        found, tier = store.get(key, context)
        if found is None:
            break
        try:
            position = fill(ws, [Piece(found, position)], blocks.inv_freq, position)  # copied while the next is fetched
        except BadBlock as exc:  # computed again below, and stored afresh
            store.drop(key, f"{exc} (from the {tier} tier)")
            break
        hits[tier] = hits.get(tier, 0) + 1
        matched += 1
    reused = position
    cache = ws.cache(position)
    rest = [t for ids in segments[matched:] for t in ids] + prompt.question
    logits = forward(blocks.model, rest, cache, position, keep)
    pending, slot = [], position
    for i in range(matched, len(segments)):
        hits["computed"] = hits.get("computed", 0) + 1
        pending.append((chain[i], contexts[i], slot, segments[i]))
        slot += len(segments[i])
    return Prefill(logits, cache, len(prompt), len(rest), reused, hits, ws, pending)


def store_pending(blocks: Blocks, state: Prefill) -> None:
    """Save the segments a prefix-caching request computed, read back from its workspace."""
    for key, context, slot, ids in state.pending:
        blocks.store.put(key, context, blocks.copy_out(state.workspace, slot, ids))


QUESTION_LEFT = {"block": True, "composite": False}
"""The modes whose question can be left to the caller (`placed`), with their `reorder`."""

PREFILL = {"full": full, "block": block, "composite": composite, "prefix": prefix, "blend": blend, "auto": auto}
