"""KVEngine: index passages once, answer questions over their cached KV.

Modes (all prefill exactly the ids of `Prompt.ids()`; they differ in what is reused):
  full       plain causal prefill of every token, nothing reused (the "stuff" baseline)
  block      cached blocks moved to contiguous positions, only the question is prefilled
             (Block-Attention / TurboRAG "reordered")
  composite  cached blocks keep the positions they were encoded at (TurboRAG "composite")
  prefix     prefix caching: reuse the longest run of leading blocks whose exact causal KV was
             computed before in the same order, prefill the rest
  blend      block mode plus CacheBlend: recompute the passage tokens whose KV deviates most
             (a `BlendConfig.recompute_ratio` share) with the question, restoring cross-passage
             attention (see blend.py)

An engine may hold two weight sets: `model` for the block modes and `causal_model` for full and
prefix, as when a block-tuned adapter serves the block modes only (`from_pretrained`'s default).
"""

import os
import re
import threading
import time
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal, get_args

import torch
from tqdm.auto import tqdm

from . import attention, blend as blend_lib, model as model_lib
from .assemble import Piece, fill
from .blend import BlendConfig
from .cache import WorkspacePool
from .errors import ContextOverflowError, EmptyInputError, InputEncodingError, UnknownBlockError
from .generate import GenerationResult, Sampler, TextTracker
from .match import PassageMatcher
from .prompt import Prompt, PromptFormat, PromptLayout
from .store import KVBlock, KVStore

Mode = Literal["full", "block", "composite", "prefix", "blend"]
MODES: tuple[str, ...] = get_args(Mode)
CAUSAL_MODES = ("full", "prefix")  # plain causal attention, the attention the published weights were trained for
ADAPTER_SCOPES = ("block", "all")
BLOCK_CONTEXTS = ("none", "prefix")
_BLOCK_ID = re.compile(r"^kv_([0-9a-f]{32})$")
_SHARED: dict = {}
_SHARED_LOCK = threading.Lock()


def _prepare(model):
    if model.config._attn_implementation != attention.NAME:
        model.set_attn_implementation(attention.NAME)
    return model.eval()


def _check_same_shape(model, other) -> None:
    """Two weight sets an engine can switch between per request: their KV must fit the same workspaces."""
    shape = lambda m: (m.config.model_type, m.config.num_hidden_layers, m.config.num_key_value_heads,  # noqa: E731
                       m.config.hidden_size, m.config.num_attention_heads, m.dtype, m.device)
    if shape(model) != shape(other):
        raise ValueError(f"causal_model {shape(other)} does not match the model {shape(model)}")


def check_text(text, what: str = "passage") -> str:
    """A usable passage or question: a str (or UTF-8 bytes) with something besides whitespace."""
    if isinstance(text, (bytes, bytearray)):
        try:
            text = bytes(text).decode("utf-8")
        except UnicodeDecodeError as exc:
            raise InputEncodingError(f"{what} is not valid UTF-8: {exc}") from exc
    if not isinstance(text, str):
        raise TypeError(f"{what} must be str, got {type(text).__name__}")
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as exc:
        raise InputEncodingError(f"{what} contains characters that are not valid UTF-8: {exc}") from exc
    if not text.strip():
        raise EmptyInputError(f"{what} is empty or whitespace only")
    return text


@dataclass
class Prefill:
    """A prompt whose KV sits in `cache`; `logits` are the question tokens' (or only the last one's)."""

    logits: torch.Tensor
    cache: object
    next_position: int
    prefilled_tokens: int
    reused_tokens: int
    cache_hits: dict[str, int]
    workspace: object
    pending: list = field(default_factory=list)  # (key, context, slot, token ids) to store afterwards


class GenerationStream:
    """Iterate for text deltas; `result` is set once the iteration is over."""

    def __init__(self, run: Iterator[str]):
        self._run = run
        self.result: GenerationResult | None = None

    def __iter__(self) -> Iterator[str]:
        self.result = yield from self._run


class KVEngine:
    def __init__(
        self,
        model,
        tokenizer,
        *,
        causal_model=None,
        block_context: str = "none",
        storage_dtype: torch.dtype = torch.float16,
        memory_budget: int = 1 << 30,
        prompt_format: PromptFormat | None = None,
        home: str | Path | None = None,
        persist: bool = True,
        fingerprint: str | None = None,
        blend: BlendConfig | None = None,
    ):
        """`causal_model`: other weights for the causal modes (full, prefix), say the published ones when
        `model` carries a block-tuned adapter (default: `model` in every mode). `blend`: the default of
        blend mode's settings (each request may pass its own)."""
        model_lib.check_supported(model.config)
        if block_context not in BLOCK_CONTEXTS:
            raise ValueError(f"block_context must be one of {BLOCK_CONTEXTS}, got {block_context!r}")
        self.model, self.tokenizer = _prepare(model), tokenizer
        self.block_context = block_context
        self.storage_dtype = storage_dtype
        self.layout = PromptLayout(tokenizer, prompt_format)
        self.fingerprint = fingerprint or model_lib.fingerprint(model, tokenizer)
        self.home = Path(home) if home is not None else model_lib.kvrag_home()
        root = self.home / "kv" / self.fingerprint[:16] if persist else None
        self.store = KVStore(self.fingerprint, root, memory_budget)
        self.causal_model, self.causal_fingerprint, self.causal_store = self.model, self.fingerprint, self.store
        if causal_model is not None and causal_model is not model:
            _check_same_shape(model, causal_model)
            self.causal_model = _prepare(causal_model)
            self.causal_fingerprint = model_lib.fingerprint(causal_model, tokenizer)
            causal_root = self.home / "kv" / self.causal_fingerprint[:16] if persist else None
            self.causal_store = KVStore(self.causal_fingerprint, causal_root, memory_budget)
        self.passages = PassageMatcher(root / "passages.sqlite" if root is not None else None)
        self.context_window = model_lib.context_window(model.config)
        config = model.config
        head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
        self.inv_freq = model.get_decoder().rotary_emb.inv_freq
        self.pool = WorkspacePool(
            config.num_hidden_layers, config.num_key_value_heads, head_dim, model.dtype, model.device
        )
        self.eos_ids = self._eos_ids()
        self.blend = self._check_blend(blend or BlendConfig())
        self._known: dict[str, list[int]] = {}  # block key -> token ids, for ids handed out by index()

    @classmethod
    def from_pretrained(
        cls,
        model: str | None = None,
        *,
        dtype: torch.dtype = torch.float32,
        adapter: str | Path | None = "auto",
        adapter_scope: str = "block",
        **kwargs,
    ):
        """Load a local model directory, a GGUF file, a hub id already on disk, or (None) the default model.

        `adapter`: a LoRA adapter directory (peft's format, e.g. from `kvrag finetune`), merged into the
        weights; the fingerprint covers the merged weights, so KV made with and without it never mix.
        "auto" (the default) is the block-tuned adapter shipped for the default model, and nothing for
        any other model; None loads the weights as published.
        `adapter_scope`: "block" (the default) uses the adapter in the modes with block attention
        (block, composite, blend), what it was tuned for, and the published weights in the causal modes
        (full, prefix), so that the baselines stay the published model's; the weights the adapter leaves
        alone (embeddings, norms) are shared, the rest held twice. "all" uses the adapter in every mode.
        """
        if adapter_scope not in ADAPTER_SCOPES:
            raise ValueError(f"adapter_scope must be one of {ADAPTER_SCOPES}, got {adapter_scope!r}")
        home = kwargs.get("home")
        lm, tokenizer = model_lib.load(model, dtype=dtype, home=Path(home) if home is not None else None)
        if adapter == "auto":
            adapter = model_lib.DEFAULT_ADAPTER if model is None else None
        if adapter is None:
            return cls(lm, tokenizer, **kwargs)
        if adapter_scope == "all":
            return cls(model_lib.merge_adapter(lm, adapter), tokenizer, **kwargs)
        return cls(model_lib.merge_adapter(lm, adapter, keep_base=True), tokenizer, causal_model=lm, **kwargs)

    @classmethod
    def shared(cls, model: str | None = None, **kwargs) -> "KVEngine":
        """`from_pretrained`, but once per process for the same arguments and KVRAG_HOME.

        Integrations build many model objects (one per chain, per test); the weights load once.
        """
        key = (model, os.environ.get("KVRAG_HOME"), tuple(sorted(kwargs.items())))
        with _SHARED_LOCK:
            if key not in _SHARED:
                _SHARED[key] = cls.from_pretrained(model, **kwargs)
            return _SHARED[key]

    # ---- blocks -------------------------------------------------------------------------------------

    def _eos_ids(self) -> set[int]:
        ids = set()
        for source in (self.model.generation_config.eos_token_id, self.tokenizer.eos_token_id):
            if source is not None:
                ids.update(source if isinstance(source, list) else [source])
        return ids

    def _context(self, prefix: list[int]) -> str:
        """Block context string: part of every passage block's key."""
        return f"prefix:{self.store.key('none', prefix)}" if self._encoded_after(prefix) else "none"

    def _encoded_after(self, prefix: list[int]) -> list[int] | None:
        """What passage blocks are encoded after: nothing, or the prefix."""
        return prefix if self.block_context == "prefix" and prefix else None

    def _check_blend(self, config: BlendConfig) -> BlendConfig:
        layers = self.model.config.num_hidden_layers
        if config.check_layers[-1] >= layers:
            raise ValueError(f"blend check_layers {config.check_layers} must be below the model's {layers} layers")
        return config

    def _check_fits(self, n_tokens: int, what: str) -> None:
        if n_tokens >= self.context_window:
            raise ContextOverflowError(
                f"{what} needs {n_tokens} tokens plus at least one to generate, "
                f"but the model's context window is {self.context_window} tokens"
            )

    def index(self, texts: Iterable[str], *, progress: bool = True, names: Iterable[str] | None = None) -> list[str]:
        """Compute and store the KV of every passage that is not stored yet; return their block ids.

        Every passage is checked before anything is computed, so a bad one stores nothing. `names`
        label the passages in error messages (default "passage 0", "passage 1", ...).
        """
        texts = list(texts) if not isinstance(texts, str) else [texts]
        if not texts:
            raise EmptyInputError("no passages to index")
        names = list(names) if names is not None else [f"passage {i}" for i in range(len(texts))]
        texts = [check_text(t, name) for t, name in zip(texts, names, strict=True)]
        ids_list = [self.layout.passage_ids(t) for t in texts]
        for name, ids in zip(names, ids_list):
            self._check_fits(len(self.layout.prefix_ids) + len(ids), name)
        prefix = self.layout.prefix_ids
        context = self._context(prefix)
        keys = [self.store.key(context, ids) for ids in ids_list]
        todo = {k: ids for k, ids in zip(keys, ids_list) if k not in self.store}
        self._fetch(self.store.key("none", prefix), "none", prefix)  # every request starts with it
        if self.layout.separator_ids:  # and every request with two passages has it
            separator = self.layout.separator_ids
            self._fetch(self.store.key(context, separator), context, separator, self._encoded_after(prefix))
        for key, ids in tqdm(todo.items(), desc="kvrag: encoding passages", unit="passage", disable=not progress or not todo):
            self.store.put(key, context, self._encode(ids, self._encoded_after(prefix)))
        self._known.update(zip(keys, ids_list))
        self.passages.add(texts)
        return [f"kv_{k}" for k in keys]

    def _resolve(self, blocks) -> list[tuple[str, list[int]]]:
        """(key, token ids) for each passage given as text or block id."""
        context = self._context(self.layout.prefix_ids)
        resolved = []
        for i, item in enumerate(blocks):
            match = _BLOCK_ID.match(item) if isinstance(item, str) else None
            if match:
                key = match.group(1)
                ids = self._known.get(key)
                if ids is None:
                    block, _ = self.store.get(key, context)
                    if block is None:
                        raise UnknownBlockError(f"block id {item} is not in this engine's store")
                    ids = self._known[key] = block.token_ids.tolist()
                resolved.append((key, ids))
            else:
                ids = self.layout.passage_ids(check_text(item, f"passage {i}"))
                resolved.append((self.store.key(context, ids), ids))
        return resolved

    def build_prompt(self, question: str, blocks=()) -> tuple[Prompt, list[str]]:
        """Token ids of the request and the store keys of its passage blocks."""
        question = check_text(question, "question")
        resolved = self._resolve(blocks)
        separator = self.layout.separator_ids
        separator_key = self.store.key(self._context(self.layout.prefix_ids), separator)
        prompt, keys = Prompt(list(self.layout.prefix_ids)), []
        for i, (key, ids) in enumerate(resolved):
            if i and separator:
                prompt.blocks.append(separator)
                keys.append(separator_key)
            prompt.blocks.append(ids)
            keys.append(key)
        prompt.question = self.layout.question_ids(question, after_passages=bool(resolved))
        self._check_fits(len(prompt), "the question with its passages")
        return prompt, keys

    def prompt_from_text(self, text: str, spans=None) -> tuple[Prompt, list[str]]:
        """Token ids of an already rendered prompt (chat template applied) whose passages become blocks.

        `spans` are the passages' (start, end) character ranges; None finds the indexed passages in
        `text` by content. With a passage format that adds text around the passage (say
        "[doc] {text}"), a span widens to it where the text has it, so that the block is exactly the
        one `index` stored.
        Text before the first passage is the prefix, text between passages forms small blocks of its
        own, text after the last passage is the question.
        """
        text = check_text(text, "prompt")
        spans = self.passages.find(text) if spans is None else sorted(spans)
        before, after = self.layout.format.passage.split("{text}")
        cuts, end = [], 0
        for start, stop in spans:
            if not end <= start < stop <= len(text):
                raise ValueError(f"passage span {(start, stop)} is empty, overlaps another or lies outside the prompt")
            if not text[start:stop].strip():
                raise EmptyInputError(f"the passage at {(start, stop)} is whitespace only")
            if text.startswith(after, stop) and text[start - len(before) : start] == before and start - len(before) >= end:
                start, stop = start - len(before), stop + len(after)
            cuts.append((start, stop))
            end = stop
        if not cuts:
            prompt = Prompt([], [], self.layout.encode(text))
            self._check_fits(len(prompt), "the prompt")
            return prompt, []
        if not text[end:].strip():
            raise EmptyInputError("the prompt ends with a passage: a question must follow the passages")
        pieces = []
        for (start, stop), next_start in zip(cuts, [c[0] for c in cuts[1:]] + [None]):
            pieces.append(text[start:stop])
            if next_start is not None and next_start > stop:
                pieces.append(text[stop:next_start])
        prompt = Prompt(
            self.layout.encode(text[: cuts[0][0]]), [self.layout.block_ids(p) for p in pieces], self.layout.encode(text[end:])
        )
        for i, (start, stop) in enumerate(cuts):
            self._check_fits(len(prompt.prefix) + len(self.layout.block_ids(text[start:stop])), f"passage {i} of the prompt")
        self._check_fits(len(prompt), "the prompt with its passages")
        context = self._context(prompt.prefix)
        return prompt, [self.store.key(context, ids) for ids in prompt.blocks]

    def model_for(self, mode: str):
        """The weights `mode` runs on: `causal_model` for full and prefix, `model` for the block modes."""
        return self.causal_model if mode in CAUSAL_MODES else self.model

    def _forward(self, ids, cache, start: int, logits_to_keep: int = 0, causal_only: bool = False, model=None):
        """Run `model` (default: the block modes' weights) on `ids` at positions start.., appending to
        `cache`, which holds `start` tokens."""
        model = model if model is not None else self.model
        ids_t = torch.tensor([ids], device=model.device)
        positions = torch.arange(start, start + len(ids), device=model.device)[None]
        mask = None if causal_only else attention.causal_mask(len(ids), start, model.dtype, model.device)
        if logits_to_keep < 0:  # hidden states only
            return model.get_decoder()(input_ids=ids_t, position_ids=positions, past_key_values=cache, attention_mask=mask)
        out = model(
            input_ids=ids_t, position_ids=positions, past_key_values=cache, attention_mask=mask, logits_to_keep=logits_to_keep
        )
        return out.logits[0]

    @torch.inference_mode()
    def _encode(self, ids: list[int], after: list[int] | None = None) -> KVBlock:
        """KV of `ids` alone at position 0, or right after the (cached) block `after`."""
        pieces, start = [], 0
        if after is not None:
            block, _ = self._fetch(self.store.key("none", after), "none", after)
            pieces, start = [Piece(block, 0)], len(block)
        ws = self.pool.acquire(start + len(ids))
        try:
            fill(ws, pieces, self.inv_freq)
            cache = ws.cache(start)
            self._forward(ids, cache, start, logits_to_keep=-1, causal_only=not pieces)
            return self._block_from(ws, start, ids)
        finally:
            self.pool.release(ws)

    def _block_from(self, ws, slot: int, ids: list[int]) -> KVBlock:
        """A stored copy of the KV that `ids` left in workspace slots slot.. (keys as encoded there)."""
        span = slice(slot, slot + len(ids))
        keys = ws.keys[:, 0, :, span].to(self.storage_dtype, copy=True)
        values = ws.values[:, 0, :, span].to(self.storage_dtype, copy=True)
        return KVBlock(torch.tensor(ids, dtype=torch.long), keys, values, slot)

    def _fetch(self, key: str, context: str, ids: list[int], after: list[int] | None = None, hits: dict | None = None):
        """(block, tier) from the store, encoding and storing the block on a miss."""
        block, tier = self.store.get(key, context)
        if block is None:
            block, tier = self._encode(ids, after), "computed"
            self.store.put(key, context, block)
        if hits is not None:
            hits[tier] = hits.get(tier, 0) + 1
        return block, tier

    # ---- prefill ------------------------------------------------------------------------------------

    @torch.inference_mode()
    def prefill(
        self,
        prompt: Prompt,
        mode: str = "block",
        *,
        keys=None,
        extra_capacity: int = 1,
        all_logits: bool = False,
        blend: BlendConfig | None = None,
    ) -> Prefill:
        """Put the prompt's KV into a workspace cache and compute the question tokens' logits.

        The caller owns `result.workspace` and must hand it back with `engine.release(result)`.
        `blend` overrides the engine's blend settings for mode "blend".
        """
        if mode not in MODES:
            raise ValueError(f"mode must be one of {MODES}, got {mode!r}")
        if keys is None:
            context = self._context(prompt.prefix)
            keys = [self.store.key(context, b) for b in prompt.blocks]
        ws = self.pool.acquire(len(prompt) + extra_capacity)
        keep = len(prompt.question) if all_logits else 1
        try:
            if mode == "blend":
                return self._prefill_blend(prompt, keys, ws, keep, self._check_blend(blend) if blend else self.blend)
            return getattr(self, f"_prefill_{mode}")(prompt, keys, ws, keep)
        except BaseException:
            self.pool.release(ws)
            raise

    def release(self, prefill: Prefill) -> None:
        self.pool.release(prefill.workspace)

    def _prefill_full(self, prompt, keys, ws, keep):
        ids = prompt.ids()
        cache = ws.cache(0)
        logits = self._forward(ids, cache, 0, logits_to_keep=keep, causal_only=True, model=self.causal_model)
        return Prefill(logits, cache, len(ids), len(ids), 0, {}, ws)

    def _assemble(self, prompt, keys, ws, reorder: bool = True):
        """Write the prefix's and blocks' cached KV (computed on a miss) into `ws`, each block moved to
        where it sits (`reorder`) or left where it was encoded. Returns the slots filled, a bool per
        slot telling whether its KV came from the store, and the hits per tier."""
        hits: dict[str, int] = {}
        context = self._context(prompt.prefix)
        pieces, position, stored = [], 0, []
        after = self._encoded_after(prompt.prefix)
        parts = [(self.store.key("none", prompt.prefix), "none", prompt.prefix, None)] if prompt.prefix else []
        parts += [(k, context, ids, after) for k, ids in zip(keys, prompt.blocks)]
        for key, ctx, ids, encoded_after in parts:
            block, tier = self._fetch(key, ctx, ids, encoded_after, hits)
            pieces.append(Piece(block, position if reorder else block.start))
            position += len(block)
            stored += [tier != "computed"] * len(block)
        fill(ws, pieces, self.inv_freq)
        return position, torch.tensor(stored, dtype=torch.bool), hits

    def _prefill_block(self, prompt, keys, ws, keep, reorder: bool = True):
        position, stored, hits = self._assemble(prompt, keys, ws, reorder)
        cache = ws.cache(position)
        logits = self._forward(prompt.question, cache, position, logits_to_keep=keep)
        reused = int(stored.sum())
        computed = position - reused + len(prompt.question)
        return Prefill(logits, cache, position + len(prompt.question), computed, reused, hits, ws)

    def _prefill_blend(self, prompt, keys, ws, keep, config: BlendConfig):
        """Block mode's cache, then the question with the passage tokens whose KV deviates most,
        recomputed in context over it (see blend.py)."""
        position, stored, hits = self._assemble(prompt, keys, ws)
        first, starts = len(prompt.prefix), prompt.block_starts()
        logits, recomputed = blend_lib.prefill(self.model, ws, prompt.ids(), first, position, starts, config, keep)
        cache = ws.cache(len(prompt))
        reused = int(stored.sum() - stored[recomputed.cpu()].sum())
        computed = int((~stored).sum()) + len(recomputed) + len(prompt.question)
        return Prefill(logits, cache, len(prompt), computed, reused, hits, ws)

    def _prefill_composite(self, prompt, keys, ws, keep):
        return self._prefill_block(prompt, keys, ws, keep, reorder=False)

    def _prefill_prefix(self, prompt, keys, ws, keep):
        """Prefix caching: segments are keyed by everything before them, so only exact prefixes match.
        Their KV is causal attention's, so it lives with the causal weights."""
        hits: dict[str, int] = {}
        segments = [s for s in [prompt.prefix, *prompt.blocks] if s]
        chain, parent = [], ""
        for ids in segments:
            parent = self.causal_store.key(f"chain:{parent}", ids)
            chain.append(parent)
        pieces, position = [], 0
        for i, key in enumerate(chain):
            context = f"chain:{chain[i - 1] if i else ''}"
            block, tier = self.causal_store.get(key, context)
            if block is None:
                break
            hits[tier] = hits.get(tier, 0) + 1
            pieces.append(Piece(block, position))
            position += len(block)
        reused = position
        fill(ws, pieces, self.inv_freq)
        cache = ws.cache(position)
        rest = [t for ids in segments[len(pieces) :] for t in ids] + prompt.question
        logits = self._forward(rest, cache, position, logits_to_keep=keep, model=self.causal_model)
        pending, slot = [], position
        for i in range(len(pieces), len(segments)):
            hits["computed"] = hits.get("computed", 0) + 1
            context = f"chain:{chain[i - 1] if i else ''}"
            pending.append((chain[i], context, slot, segments[i]))
            slot += len(segments[i])
        return Prefill(logits, cache, len(prompt), len(rest), reused, hits, ws, pending)

    def _store_pending(self, prefill: Prefill) -> None:
        """Save the segments a prefix-caching request computed, read back from its workspace."""
        for key, context, slot, ids in prefill.pending:
            self.causal_store.put(key, context, self._block_from(prefill.workspace, slot, ids))

    # ---- generation ---------------------------------------------------------------------------------

    def generate(self, question: str, blocks=(), **kwargs) -> GenerationResult:
        """Answer `question` from `blocks` (passage texts or block ids). See `stream` for the options."""
        return _drain(self.stream(question, blocks, **kwargs))

    def stream(self, question: str, blocks=(), **kwargs) -> GenerationStream:
        """Stream the answer as text deltas; the returned object's `result` holds text, timings and reuse.

        Options: mode, max_new_tokens, temperature, top_p, top_k, seed, stop, max_time (seconds,
        after which generation ends with finish_reason "timeout"), and blend (a `BlendConfig` for
        mode "blend"; default: the engine's).
        """
        blocks = list(blocks)
        return self._stream(lambda: self.build_prompt(question, blocks), **kwargs)

    def generate_text(self, text: str, spans=None, **kwargs) -> GenerationResult:
        """Complete an already rendered prompt. See `stream_text`."""
        return _drain(self.stream_text(text, spans, **kwargs))

    def stream_text(self, text: str, spans=None, **kwargs) -> GenerationStream:
        """Stream the completion of an already rendered prompt (chat template applied), its passages
        (the given character spans, or the indexed passages found in it) reused as blocks. Options as
        for `stream`; see `prompt_from_text` for how the text is cut."""
        return self._stream(lambda: self.prompt_from_text(text, spans), **kwargs)

    def _stream(
        self,
        build,
        *,
        mode: str = "block",
        max_new_tokens: int = 128,
        temperature: float = 0.0,
        top_p: float = 1.0,
        top_k: int = 0,
        seed: int | None = None,
        stop: list[str] | str | None = None,
        max_time: float | None = None,
        blend: BlendConfig | None = None,
    ) -> GenerationStream:
        if mode not in MODES:
            raise ValueError(f"mode must be one of {MODES}, got {mode!r}")
        if max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be >= 1, got {max_new_tokens}")
        sampler = Sampler(temperature, top_p, top_k, seed)
        stops = [stop] if isinstance(stop, str) else list(stop or [])
        blend = self._check_blend(blend) if blend is not None else self.blend
        return GenerationStream(self._run(build, mode, max_new_tokens, sampler, stops, max_time, blend))

    @torch.inference_mode()
    def _run(self, build, mode, max_new_tokens, sampler, stops, max_time=None, blend=None):
        """Yield text deltas; return the GenerationResult. `build` makes (prompt, keys): inside the timing."""
        start = time.perf_counter()
        prompt, keys = build()
        budget = min(max_new_tokens, self.context_window - len(prompt))
        state = self.prefill(prompt, mode, keys=keys, extra_capacity=budget, blend=blend)
        model = self.model_for(mode)
        tracker = TextTracker(self.tokenizer, stops)
        ttft, finish = None, "length"
        try:
            logits, position = state.logits[-1], state.next_position
            for step in range(budget):
                token = sampler(logits)
                if ttft is None:
                    ttft = time.perf_counter() - start
                if token in self.eos_ids:
                    finish = "stop"
                    break
                delta = tracker.push(token)
                if delta:
                    yield delta
                if tracker.stopped:
                    finish = "stop"
                    break
                if max_time is not None and time.perf_counter() - start > max_time:
                    finish = "timeout"
                    break
                if step + 1 < budget:
                    logits = self._forward([token], state.cache, position, model=model)[-1]
                    position += 1
            tail = tracker.flush()
            if tail:
                yield tail
            self._store_pending(state)
        finally:
            self.release(state)
        return GenerationResult(
            text=tracker.text,
            token_ids=list(tracker.ids),
            mode=mode,
            ttft=ttft,
            total_time=time.perf_counter() - start,
            prompt_tokens=len(prompt),
            prefilled_tokens=state.prefilled_tokens,
            reused_tokens=state.reused_tokens,
            cache_hits=state.cache_hits,
            finish_reason=finish,
        )


def _drain(stream: GenerationStream) -> GenerationResult:
    for _ in stream:
        pass
    return stream.result
