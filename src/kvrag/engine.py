"""KVEngine: index passages once, answer questions over their cached KV.

The data path, one module each: a request becomes a `Prompt` of blocks (prompt.py, match.py), their
KV comes from the store or is encoded and is written re-rotated into a workspace (store.py,
assemble.py, rope.py, workspace.py), the mode's prefill runs (modes.py, blend.py), then the token
loop (decode.py). One weight set serves every mode by default; two may: `model` the block modes,
`causal_model` full and prefix, as when a block-tuned adapter serves the block modes only
(`from_pretrained(adapter_scope="block")`).
"""

import os
import re
import threading
import time
import warnings
from collections import deque
from collections.abc import Iterable
from contextlib import ExitStack, nullcontext
from dataclasses import dataclass
from pathlib import Path

import torch
from tqdm.auto import tqdm

from . import calibrate, families, loading, modes, threads
from .assemble import Blocks
from .blend import BlendConfig
from .decode import Generation, GenerationResult, GenerationStream, Prefiller, Sampler
from .errors import ContextOverflowError, EmptyInputError, UnknownBlockError
from .locks import file_lock, sweep
from .match import PassageMatcher, unmarked_passages
from .paths import kvrag_home, writable_home
from .prompt import Prompt, PromptFormat, PromptLayout, check_text
from .remote import Remote, shared_secret
from .scheduler import Scheduler
from .store import BlockShape, DiskTier, KVStore, parse_size, storage_format
from .workspace import WorkspacePool

ADAPTER_SCOPES = ("block", "all")
LEARN_PROMPTS = 4096
"""Passages an engine learns from prompts at most: what a chat history or one-off pastes add is bounded."""
PACK_TOKENS_CPU, PACK_TOKENS_MAX = 1024, 65536
"""Passage tokens one indexing forward encodes on a CPU, and at most on a GPU (see `KVEngine._pack_tokens`)."""
UNREUSED_WARNING_TOKENS = 64
"""A prompt this long that reuses nothing in a reusing mode most likely held passages: said once."""
DEFAULT_MODE = "calibrated"
"""The mode of requests that name none: the one `kvrag calibrate` measured to keep full's answers on these weights,
layout and corpus (calibrate.py), else full: by docs/accuracy.md's rule no reusing mode keeps full's accuracy on the
default model in general."""
BLOCK_CONTEXTS = ("none", "prefix", "ape", "document")
PUBLISHED_BLOCK_CONTEXT = "ape"
"""`from_pretrained`'s block context for weights without a block-tuned adapter, chosen by the rule in issue #99's
note (docs/closer-to-full.md); with an adapter "none", the context adapters are tuned in."""
DEFAULT_MODEL_STORAGE = "int4"
"""`from_pretrained`'s KV storage for the default model when none is given (nor $KVRAG_STORAGE): 4-bit codes, 6.1 KB
a token against float16's 22.5, chosen by the rule in issue #101's note (block mode's answers against full's, paired
with float16 storage's on SQuAD, the generated worlds and examples/heldout; docs/storage.md). Other models keep
their half dtype (else float16): nothing was measured on them."""
DOCUMENT_LEAD = 256
"""Tokens of the text before a passage in its document that block context "document" encodes it after, at most."""


def chosen_block_context(block_context: str, adapter) -> str:
    """`block_context`, "auto" resolved: PUBLISHED_BLOCK_CONTEXT for weights as published, "none" with `adapter`."""
    if block_context != "auto":
        return block_context
    return "none" if adapter else PUBLISHED_BLOCK_CONTEXT


def preceding_in_documents(texts: list[str], documents: list) -> list[str | None]:
    """`KVEngine.index`'s `preceding` for passages given in their documents' order: each text's predecessor where it
    follows a text of the same document (`documents[i]`, its source; None: unknown), else None."""
    return [texts[i - 1] if i and doc is not None and documents[i - 1] == doc else None
            for i, doc in enumerate(documents)]


@dataclass
class IndexCost:
    """What indexing `passages` distinct passages (of `passage_tokens` tokens) writes (`KVEngine.index_cost`): `new`
    blocks not stored yet, of `tokens` tokens, in block files of `bytes` in all."""

    passages: int
    new: int
    tokens: int
    bytes: int
    passage_tokens: int


_BLOCK_ID = re.compile(r"^kv_([0-9a-f]{32})$")
_SHARED: dict = {}
_SHARED_LOCK = threading.Lock()


class KVEngine:
    def __init__(self, model, tokenizer, *, causal_model=None, block_context: str = "none",
                 storage_dtype: torch.dtype | str | None = None, memory_budget: int = 1 << 30, device_budget: int = 0,
                 prompt_format: PromptFormat | None = None, home: str | Path | None = None, persist: bool = True,
                 fingerprint: str | None = None, causal_fingerprint: str | None = None,
                 blend: BlendConfig | None = None, max_batch: int = 16, max_queue: int = 256,
                 remote: "str | Remote | None" = None, secret: str | bytes | None = None,
                 disk_budget: int | str | None = None, default_mode: str = DEFAULT_MODE,
                 learn_prompts: int = LEARN_PROMPTS, adapter: str | None = None, shadow: float = 0.0):
        """`causal_model`: other weights for the causal modes (full, prefix), say the published ones when
        `model` carries a block-tuned adapter (default: `model` in every mode). The engine runs on the
        model's device. `block_context`: what a passage is encoded after and how block mode reads it, one of
        BLOCK_CONTEXTS (see assemble.Blocks; "none", Block-Attention's exact definition, by default here).
        `storage_dtype`: the stored KV's dtype, or "int8"/"int4" for 8- and 4-bit codes with scales (quant.py; a
        quarter of float16's bytes at 4 bits) (default: $KVRAG_STORAGE, else the model's half dtype, else float16).
        `memory_budget`: bytes of KV kept in (host) memory; `device_budget`: bytes kept on the GPU besides,
        the most used blocks (each per weight set). `fingerprint`, `causal_fingerprint`: the models'
        `loading.fingerprint`s, when known (computed otherwise). `blend`: the default of blend mode's
        settings (each request may pass its own). `max_batch`, `max_queue`: requests decoded together and
        requests allowed to wait for a place among them (see scheduler.py). `remote`: the URL of a Redis
        server shared with other replicas (default: $KVRAG_REMOTE, else none), the tier below the disk
        for KV and a passage registry beside the local one (see remote.py). `secret`: the key of the MAC
        that stored KV values carry, shared by every replica (default: $KVRAG_SECRET_FILE's content or
        $KVRAG_SECRET; required with a remote tier, see `remote.shared_secret`). `disk_budget`: bytes (or
        "20G", "500M") of KV files kept under the home's kv/ directory, least recently used evicted
        (default: $KVRAG_DISK_BUDGET, else whatever keeps a tenth of the disk free). `default_mode`: the mode
        of requests that name none; "calibrated" (the default): the one the home's calibration record chose for
        this engine (`calibrate`), else full. `learn_prompts`: how many passages this engine may learn from the
        rendered prompts it completes in a reusing mode (`stream_text`: the text between blank lines, see
        `match.unmarked_passages`); 0: none. `adapter`: the name of the adapter merged into `model`, which a
        calibration record names (`from_pretrained` sets it). `shadow`: the share of greedy requests answered in a
        reusing mode that are answered again in full mode in the background and compared (shadow.py); 0: none."""
        families.check_supported(model.config)
        if default_mode not in (*modes.MODES, "calibrated"):
            raise ValueError(f"default_mode must be 'calibrated' or one of {modes.MODES}, got {default_mode!r}")
        self.adapter = adapter
        if block_context not in BLOCK_CONTEXTS:
            raise ValueError(f"block_context must be one of {BLOCK_CONTEXTS}, got {block_context!r}")
        self.model, self.tokenizer = loading.prepare(model), tokenizer
        self.block_context = block_context
        self.storage_dtype = storage_dtype = storage_format(
            storage_dtype if storage_dtype is not None else os.environ.get("KVRAG_STORAGE"), model.dtype)
        self.layout = PromptLayout(tokenizer, prompt_format)
        self.fingerprint = fingerprint or loading.fingerprint(model, tokenizer)
        self.home = Path(home) if home is not None else kvrag_home()
        self.kv_dir = self.home / "kv" / self.fingerprint[:16]  # this model's block files (and passages.sqlite)
        root = writable_home(self.home) / "kv" / self.fingerprint[:16] if persist else None
        remote = remote if remote is not None else os.environ.get("KVRAG_REMOTE") or None
        secret = shared_secret(secret, remote=remote if isinstance(remote, str) else remote and remote.url)
        self.remote = Remote(remote) if isinstance(remote, str) else remote
        config = model.config
        self.context_window = families.context_window(config)
        shape = BlockShape(config.num_hidden_layers, config.num_key_value_heads, families.head_dim(config),
                           storage_dtype, self.context_window)
        disk_budget = parse_size(disk_budget if disk_budget is not None else os.environ.get("KVRAG_DISK_BUDGET"))
        tiers = dict(memory_budget=memory_budget, device_budget=device_budget, remote=self.remote, shape=shape,
                     secret=secret, disk_budget=disk_budget, budget_root=self.home / "kv")
        self.store = KVStore(self.fingerprint, root, device=model.device, **tiers)
        self.scheduler = Scheduler(max_batch, max_queue)
        self.pool = WorkspacePool(config.num_hidden_layers, config.num_key_value_heads, families.head_dim(config),
                                  model.dtype, model.device, keep=max(2, max_batch))
        self.blocks = Blocks(self.model, self.store, self.pool, storage_dtype, block_context, self.layout.prefix_ids)
        self.causal_model, self.causal_fingerprint, self.causal_store = self.model, self.fingerprint, self.store
        self.causal_blocks = self.blocks
        if causal_model is not None and causal_model is not model:
            loading.check_same_shape(model, causal_model)
            self.causal_model = loading.prepare(causal_model)
            self.causal_fingerprint = causal_fingerprint or loading.fingerprint(causal_model, tokenizer)
            causal_root = self.home / "kv" / self.causal_fingerprint[:16] if persist else None
            self.causal_store = KVStore(self.causal_fingerprint, causal_root, device=causal_model.device, **tiers)
            self.causal_blocks = Blocks(self.causal_model, self.causal_store, self.pool, storage_dtype, block_context,
                                        self.layout.prefix_ids)
        self.passages = PassageMatcher(root / "passages.sqlite" if root is not None else None, remote=self.remote)
        self.eos_ids = loading.eos_ids(model, tokenizer)
        self.blend = self._check_blend(blend or BlendConfig())
        self._known: dict[str, list[int]] = {}  # block key -> token ids, for ids handed out by index()
        self.learn_prompts = self._learn_left = learn_prompts
        self._special_tokens = tuple(tokenizer.all_special_tokens)  # where a chat template's parts begin and end
        self._said: set[str] = set()  # the warnings said once
        self.calibrated, self.calibration, self.default_mode = default_mode == "calibrated", None, default_mode
        if self.calibrated:
            self.use_calibration(calibrate.load(self) if persist else None)
        self.shadow = None
        if shadow:
            from .shadow import Shadow

            self.shadow = Shadow(self, shadow)

    @classmethod
    def from_pretrained(
        cls,
        model: str | None = None,
        *,
        device: str | torch.device | None = "auto",
        dtype: str | torch.dtype | None = "auto",
        adapter: str | Path | None = "auto",
        adapter_scope: str = "all",
        block_context: str = "auto",
        warm_up: bool = True,
        **kwargs,
    ):
        """Load a local model directory, a GGUF file, a hub id already on disk, or (None) the default model.

        `device`: "auto" (the first CUDA device torch sees, else the CPU), "cpu", "cuda" or "cuda:N".
        `dtype`: "auto" (bfloat16 on a GPU that has it, else float16; float32 on the CPU), "float32",
        "float16", "bfloat16" or a torch dtype.
        `adapter`: a LoRA adapter directory (peft's format, e.g. from `kvrag finetune`), merged into the
        weights; the fingerprint covers the merged weights, so KV made with and without it never mix.
        "auto" (the default) is the block-tuned adapter shipped for the default model, and nothing for
        any other model; None loads the weights as published.
        `adapter_scope`: "all" (the default) uses the adapter in every mode, so that choosing a mode changes
        speed and the accuracy cost docs/accuracy.md measures, never the model, and one copy of the weights
        serves. "block" uses it only in the modes with block attention (block, composite, blend), what it
        was tuned for, and the published weights in the causal modes (full, prefix); the weights the adapter
        leaves alone (embeddings, norms) are shared, the rest held twice.
        `block_context`: see `KVEngine`; "auto" (the default) is PUBLISHED_BLOCK_CONTEXT for weights as published
        and "none" with an adapter, which block fine-tuning tunes in that context.
        `storage_dtype` (in kwargs): see `KVEngine`; by default DEFAULT_MODEL_STORAGE (4-bit) for the default model.
        `warm_up`: answer one tiny request before returning (`warm_up()`), so the first user's does not pay for
        torch's first calls.
        """
        engine = cls._load(model, device, dtype, adapter, adapter_scope, block_context=block_context, **kwargs)
        if warm_up:
            engine.warm_up()
        return engine

    @classmethod
    def _load(cls, model, device, dtype, adapter, adapter_scope, **kwargs):
        if adapter_scope not in ADAPTER_SCOPES:
            raise ValueError(f"adapter_scope must be one of {ADAPTER_SCOPES}, got {adapter_scope!r}")
        home = Path(kwargs["home"]) if kwargs.get("home") is not None else None
        lm, tokenizer, source = loading.load(model, device=device, dtype=dtype, home=home)

        def fingerprint(weights, *adapters):  # the weights' digest remembered per checkpoint, where its files are known
            return loading.fingerprint(weights, tokenizer, files=[source, *adapters] if source else (), home=home)

        if adapter == "auto":
            adapter = loading.DEFAULT_ADAPTER if model is None else None
        kwargs["block_context"] = chosen_block_context(kwargs["block_context"], adapter)
        if model is None and kwargs.get("storage_dtype") is None and not os.environ.get("KVRAG_STORAGE"):
            kwargs["storage_dtype"] = DEFAULT_MODEL_STORAGE
        kwargs["adapter"] = Path(adapter).name if adapter else None
        if adapter is None:
            return cls(lm, tokenizer, fingerprint=fingerprint(lm), **kwargs)
        if adapter_scope == "all":
            merged = loading.merge_adapter(lm, adapter)
            return cls(merged, tokenizer, fingerprint=fingerprint(merged, adapter), **kwargs)
        causal_fingerprint = fingerprint(lm)
        merged = loading.merge_adapter(lm, adapter, keep_base=True)
        return cls(merged, tokenizer, causal_model=lm, fingerprint=fingerprint(merged, adapter),
                   causal_fingerprint=causal_fingerprint, **kwargs)

    def warm_up(self) -> None:
        """Answer a one-word question with no passages on each model the modes use: torch's first calls
        (kernel choices, allocations, weights read from disk) then fall here, not on the first user's TTFT
        (on 2 cores after the page cache was dropped, the default model's first request took 0.33 s to its
        first token against 0.11 s for the next). Full mode stores nothing; block mode, on the other
        weights of `adapter_scope="block"`, stores the prompt's system part, as the first request would."""
        self.generate("Hello", [], mode="full", max_new_tokens=2)
        if self.causal_blocks is not self.blocks:
            self.generate("Hello", [], mode="block", max_new_tokens=2)

    @classmethod
    def shared(cls, model: str | None = None, **kwargs) -> "KVEngine":
        """`from_pretrained`, but once per process for the same arguments and KVRAG_HOME.

        Integrations build many model objects (one per chain, per test); the weights load once.
        """
        device = loading.resolve_device(kwargs.pop("device", "auto"))
        kwargs.update(device=device, dtype=loading.resolve_dtype(kwargs.pop("dtype", "auto"), device))
        key = (model, os.environ.get("KVRAG_HOME"), tuple(sorted(kwargs.items())))
        with _SHARED_LOCK:
            if key not in _SHARED:
                _SHARED[key] = cls.from_pretrained(model, **kwargs)
            return _SHARED[key]

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

    # ---- index: passages -> blocks in the store ------------------------------------------------------

    def index(self, texts: Iterable[str], *, progress: bool = True, names: Iterable[str] | None = None,
              pack_tokens: int | None = None, preceding: Iterable[str | None] | None = None) -> list[str]:
        """Compute and store the KV of every passage that is not stored yet; return their block ids.

        Every passage is checked before anything is computed, so a bad one stores nothing. `names`
        label the passages in error messages (default "passage 0", "passage 1", ...). `pack_tokens`: how
        many tokens of passages one forward encodes together (default `_pack_tokens()`: 1024 on a CPU, what a
        quarter of a GPU's free memory holds there; 0: one passage per forward). `preceding`: with
        block_context "document", the text before each passage in its document (the passage before it, or the
        document's title; None: nothing), whose last DOCUMENT_LEAD tokens the passage is encoded after.
        """
        threads.adapt()
        texts = list(texts) if not isinstance(texts, str) else [texts]
        if not texts:
            raise EmptyInputError("no passages to index")
        if self.remote is None and self.store.disk is not None:  # the claims of indexers killed before
            sweep(self.store.disk.root / "claims")
        names = list(names) if names is not None else [f"passage {i}" for i in range(len(texts))]
        texts = [check_text(t, name) for t, name in zip(texts, names, strict=True)]
        prefix = self.layout.prefix_ids
        ids_list = [self.layout.passage_ids(t) for t in texts]
        for name, ids in zip(names, ids_list):
            self._check_fits(len(prefix) + len(ids), name)
        leads = self._leads(preceding, ids_list)
        context, after = self.blocks.context(prefix), self.blocks.encoded_after(prefix)
        keys = self.blocks.keys(prefix, ids_list)
        todo = {k: ids for k, ids in zip(keys, ids_list) if k not in self.store}
        lead_of = dict(zip(keys, leads))
        for key, block_context, ids, encoded_after in self._shared_blocks():
            with self._claim(key, wait=True):
                self.blocks.fetch(key, block_context, ids, encoded_after)
        pack = self._pack_tokens() if pack_tokens is None else pack_tokens
        with tqdm(total=len(todo), desc="kvrag: encoding passages", unit="passage",
                  disable=not progress or not todo) as bar:
            encoded = 0  # tokens, for the rate beside the passages'
            for wait in (False, True):  # the blocks nobody else is encoding first, then wait for the others
                busy, items = {}, deque(todo.items())
                while items:
                    with ExitStack() as claims:
                        group, tokens = [], 0
                        # only the group's claims are held, and only while none is waited for: no deadlock
                        while items and (not group or (not wait and tokens + len(items[0][1]) <= pack)):
                            key, ids = items.popleft()
                            held = ExitStack()
                            claimed = held.enter_context(self._claim(key, wait))
                            if claimed and key not in self.store:
                                claims.enter_context(held)  # released once the group is stored
                                group.append((key, ids))
                                tokens += len(ids) + len(lead_of[key])
                                continue
                            held.close()
                            if claimed:  # stored by another process since `todo` was made
                                bar.update()
                            else:
                                busy[key] = ids
                        if group:
                            blocks = self.blocks.encode_many([ids for _, ids in group], after,
                                                             [lead_of[key] for key, _ in group])
                            for (key, _), block in zip(group, blocks):
                                self.store.put(key, context, block, strict=True)
                    encoded += tokens
                    bar.set_postfix_str(f"{encoded / max(bar.format_dict['elapsed'], 1e-3):.0f} tokens/s", refresh=False)
                    bar.update(len(group))
                todo = busy
        self._known.update(zip(keys, ids_list))
        self.passages.add(texts)
        return [f"kv_{k}" for k in keys]

    def _leads(self, preceding, ids_list: list[list[int]]) -> list[list[int]]:
        """The tokens each passage is encoded after (`index`'s `preceding`), checked; within the context window."""
        n = len(ids_list)
        if preceding is None:
            return [[] for _ in range(n)]
        if self.block_context != "document":
            raise ValueError(f"preceding texts are read with block_context='document' only (this engine's is "
                             f"{self.block_context!r})")
        preceding = list(preceding)
        if len(preceding) != n:
            raise ValueError(f"{len(preceding)} preceding texts for {n} passages")
        leads = []
        for i, (text, ids) in enumerate(zip(preceding, ids_list)):
            lead = self.layout.passage_ids(check_text(text, f"the text before passage {i}")) if text else []
            room = max(0, min(DOCUMENT_LEAD, self.context_window - len(ids)))
            leads.append(lead[len(lead) - room:] if room else [])
        return leads

    def _pack_tokens(self) -> int:
        """Passage tokens one forward encodes while indexing. On a GPU, as many as a quarter of its free memory
        holds (their workspace KV and activations), so that its linear layers run full; on a CPU `PACK_TOKENS_CPU`,
        which the matrix products there run faster on than on one passage's rows (`kvrag bench index`)."""
        if self.model.device.type != "cuda":
            return PACK_TOKENS_CPU
        free, _ = torch.cuda.mem_get_info(self.model.device)
        config = self.model.config
        kv = 2 * config.num_hidden_layers * config.num_key_value_heads * families.head_dim(config)
        per_token = (kv + 8 * config.hidden_size + 3 * config.intermediate_size) * self.model.dtype.itemsize
        return int(min(PACK_TOKENS_MAX, free // 4 // per_token))

    def _shared_blocks(self) -> list[tuple[str, str, list[int], list[int] | None]]:
        """(key, context, ids, encoded after) of the blocks every request shares: the prompt's prefix and, where
        there is one, the separator between two passages."""
        prefix = self.layout.prefix_ids
        context, after = self.blocks.context(prefix), self.blocks.encoded_after(prefix)
        shared = [(self.store.key("none", prefix), "none", prefix, None)]  # every request starts with it
        if separator := self.layout.separator_ids:  # and every request with two passages has it
            shared.append((self.store.key(context, separator), context, separator, after))
        return shared

    def index_cost(self, texts: Iterable[str]) -> IndexCost:
        """What `index(texts)` would write, computing nothing: the blocks it would encode (those no tier holds, nor
        this model's block files under the home, for an engine that persists nothing) and their bytes on disk
        (`KVStore.file_bytes`), the shared blocks included where they are missing."""
        on_disk = self.store.disk or DiskTier(self.kv_dir, self.fingerprint, shape=self.store.shape)  # only looked in
        stored = lambda key: key in self.store or key in on_disk  # noqa: E731
        ids_list = [self.layout.passage_ids(text) for text in dict.fromkeys(texts)]
        blocks = dict(zip(self.blocks.keys(self.layout.prefix_ids, ids_list), ids_list))
        new = {key: ids for key, ids in blocks.items() if not stored(key)}
        writes = [*new.values(), *(ids for key, _, ids, _ in self._shared_blocks() if not stored(key))]
        return IndexCost(len(blocks), len(new), sum(map(len, new.values())),
                         sum(self.store.file_bytes(len(ids)) for ids in writes), sum(map(len, ids_list)))

    def _claim(self, key: str, wait: bool):
        """Context manager: whether this process may encode block `key` now, the other processes indexing
        into the same shared tier (a claim there, expiring, see `Remote.claimed`) or the same KV directory (a
        lock file per block, removed after; a process that dies releases its claims) being told no until it
        is stored. Without either there is nobody to share it with."""
        if self.remote is not None:
            return self.remote.claimed(key, wait)
        if self.store.disk is None:
            return nullcontext(True)
        return file_lock(self.store.disk.root / "claims" / f"{key}.lock", wait=wait, remove=True)

    def learn(self, texts: Iterable[str]) -> None:
        """Remember passages without computing their KV: a rendered prompt that holds one (`generate_text`)
        gets it as a block, encoded and stored the first time, reused after. Retrievals feed this."""
        self.passages.add([t for t in texts if isinstance(t, str) and t.strip()])

    def calibrate(self, questions=None, *, index=None, **options) -> dict:
        """Measure each reusing setting against full on `questions` (texts or (text, gold answers) pairs; None: made
        from the indexed passages), each with its passages retrieved from `index` (a `retrieval.PassageIndex`;
        default: the home's, as `kvrag index` and `ask` keep it), record the fastest that keeps full's answers, and,
        with default_mode "calibrated", answer requests that name no mode with it from now on. Options and the
        record: `calibrate.calibrate`."""
        from .retrieval import PassageIndex, chroma_url

        index = index if index is not None else PassageIndex(chroma_url() or self.home / "chroma")
        record = calibrate.calibrate(self, index, questions, **options)
        if self.calibrated:
            self.use_calibration(record)
        return record

    def use_calibration(self, record: dict | None) -> None:
        """Answer requests that name no mode as `record` chose (None, or no choice: full), with the blend settings
        it measured."""
        self.calibration = record
        self.default_mode, self.blend = calibrate.chosen(record, self.blend)

    # ---- prompt: a request -> token ids by block -----------------------------------------------------

    def _resolve(self, blocks) -> list[tuple[str, list[int]]]:
        """(key, token ids) for each passage given as text or block id."""
        context = self.blocks.context(self.layout.prefix_ids)
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
        separator_key = self.blocks.keys(self.layout.prefix_ids, [separator])[0]
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
        """Token ids of an already rendered prompt (chat template applied) whose passages become blocks:
        the given (start, end) character spans, or (None) the indexed passages found in it by content.
        See `PromptLayout.cut`."""
        text = check_text(text, "prompt")
        if spans is None:
            spans = self.passages.find(text)
            if spans and not text[spans[-1][1] :].strip():  # a known passage ends it: the question, then
                spans.pop()
        prompt = self.layout.cut(text, spans)
        for i, ids in enumerate(prompt.blocks):
            self._check_fits(len(prompt.prefix) + len(ids), f"block {i} of the prompt")
        self._check_fits(len(prompt), "the prompt with its passages")
        return prompt, self.blocks.keys(prompt.prefix, prompt.blocks)

    # ---- modes: a prompt -> its KV in a workspace ----------------------------------------------------

    def model_for(self, mode: str):
        return self._blocks_for(mode).model

    def _blocks_for(self, mode: str) -> Blocks:
        """`causal_blocks` (the published weights with an adapter) for full and prefix, `blocks` otherwise."""
        return self.causal_blocks if mode in modes.CAUSAL_MODES else self.blocks

    @torch.inference_mode()
    def prefill(self, prompt: Prompt, mode: str = "block", *, keys=None, extra_capacity: int = 1,
                all_logits: bool = False, blend: BlendConfig | None = None, question: bool = True) -> modes.Prefill:
        """Put the prompt's KV into a workspace cache and compute the question tokens' logits.

        The caller owns `result.workspace` and must hand it back with `engine.release(result)`.
        `blend` overrides the engine's settings for modes "blend" and "auto". `question=False`, in the modes of
        `modes.QUESTION_LEFT`, leaves the question out: its logits are None and the caller prefills it
        at `next_position`; in full mode it leaves the whole prompt out, for the caller to prefill a chunk at a time.
        """
        if mode not in modes.PREFILL:
            raise ValueError(f"mode must be one of {modes.MODES}, got {mode!r}")
        threads.adapt()  # a CPU shared with other processes: leave their cores to them
        blocks = self._blocks_for(mode)
        keys = blocks.keys(prompt.prefix, prompt.blocks) if keys is None else keys
        config = self._check_blend(blend) if blend else self.blend
        ws = self.pool.acquire(len(prompt) + extra_capacity)
        try:
            if not question and mode in modes.QUESTION_LEFT:
                return modes.placed(blocks, prompt, keys, ws, modes.QUESTION_LEFT[mode])
            if not question and mode == "full":
                return modes.Prefill(None, ws.cache(0), 0, len(prompt), 0, {}, ws)
            return modes.PREFILL[mode](blocks, prompt, keys, ws, len(prompt.question) if all_logits else 1, config)
        except BaseException:
            self.pool.release(ws)
            raise

    def store_pending(self, state: modes.Prefill, mode: str) -> None:
        """Store what the request computed for later ones (prefix mode's segments)."""
        modes.store_pending(self._blocks_for(mode), state)

    def release(self, state: modes.Prefill) -> None:
        self.pool.release(state.workspace)

    # ---- decode: generation ----------------------------------------------------------------------------

    def generate(self, question: str, blocks=(), **kwargs) -> GenerationResult:
        """Answer `question` from `blocks` (passage texts or block ids). See `stream` for the options."""
        return self.stream(question, blocks, **kwargs).drain()

    def stream(self, question: str, blocks=(), **kwargs) -> GenerationStream:
        """Build the request's prompt on this thread, submit it to the scheduler and stream its answer as text
        deltas (`for`, or `async for`); the returned object's `result` holds text, timings and reuse, and
        `cancel()` stops it. A bad prompt (empty, unknown block, over the context window) and a full queue
        (`QueueFullError`) raise here; errors while it runs surface as the stream is read.

        Options: mode (default: the engine's `default_mode`), max_new_tokens, temperature, top_p, top_k, seed,
        stop, max_time (seconds from the call: a request still queued then fails with `RequestTimeoutError`,
        one generating ends with finish_reason "timeout"), and blend (a `BlendConfig` for modes "blend" and
        "auto"; default: the engine's).
        """
        return self._stream(lambda: self.build_prompt(question, list(blocks)), **kwargs)

    def generate_text(self, text: str, spans=None, **kwargs) -> GenerationResult:
        """Complete an already rendered prompt. See `stream_text`."""
        return self.stream_text(text, spans, **kwargs).drain()

    def stream_text(self, text: str, spans=None, **kwargs) -> GenerationStream:
        """Stream the completion of an already rendered prompt (chat template applied), its passages
        (the given character spans, or the indexed passages found in it) reused as blocks. Options as
        for `stream`; see `prompt_from_text` for how the text is cut.

        In a reusing mode, passages found in the text without being told (`match.unmarked_passages`: text
        between blank lines) are learned first, within the engine's `learn_prompts`: they become blocks,
        encoded and stored now and reused by the next prompt that holds them."""
        reusing = spans is None and (kwargs.get("mode") or self.default_mode) in modes.BLOCK_MODES

        def build():
            if reusing:
                self._learn_from(text)
            prompt, keys = self.prompt_from_text(text, spans)
            if reusing and not prompt.blocks and len(prompt) >= UNREUSED_WARNING_TOKENS:
                self._say_once("unreused", f"kvrag: a prompt of {len(prompt)} tokens held no passage kvrag has "
                               "indexed or could learn, so it reused no KV. Index passages ahead (KVEngine.index, "
                               "the integrations' vector stores, POST /v1/passages) or put a blank line between "
                               "the passages a prompt pastes in, which kvrag learns. (Said once.)")
            return prompt, keys

        return self._stream(build, **kwargs)

    def _learn_from(self, text: str) -> None:
        if self._learn_left <= 0:
            return
        found = unmarked_passages(text, self._special_tokens, self.passages.min_chars)
        found = [t for t in found if t not in self.passages]
        if found:  # not the paragraphs of a passage known whole
            known = [text[a:b] for a, b in self.passages.find(text)]
            found = [t for t in found if not any(t in passage for passage in known)][: self._learn_left]
        if not found:
            return
        self._learn_left -= len(found)
        self.passages.add(found)
        if self._learn_left <= 0:
            self._say_once("budget", f"kvrag: this engine has learned {self.learn_prompts} passages from prompts, "
                           "its learn_prompts budget: passages new to later prompts are prefilled as text. Index "
                           "them ahead (KVEngine.index) to reuse them.")

    def _say_once(self, what: str, message: str) -> None:
        if what not in self._said:
            self._said.add(what)
            warnings.warn(message, RuntimeWarning, stacklevel=4)

    def _stream(self, build, *, mode: str | None = None, max_new_tokens: int = 128, temperature: float = 0.0,
                top_p: float = 1.0, top_k: int = 0, seed: int | None = None, stop: list[str] | str | None = None,
                max_time: float | None = None, blend: BlendConfig | None = None) -> GenerationStream:
        """`build()` makes (prompt, keys) here, on the caller's thread and inside TTFT: tokenizing and
        matching passages never run on the scheduler's worker, which every request's next token waits for."""
        start = time.perf_counter()
        mode = mode or self.default_mode
        if mode not in modes.PREFILL:
            raise ValueError(f"mode must be one of {modes.MODES}, got {mode!r}")
        if max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be >= 1, got {max_new_tokens}")
        sampler = Sampler(temperature, top_p, top_k, seed)
        stops = [stop] if isinstance(stop, str) else list(stop or [])
        blend = self._check_blend(blend) if blend is not None else self.blend
        prompt, keys = build()
        prefiller = Prefiller(self.prefill, self.model_for, self.store_pending, self.release, self.tokenizer,
                              self.eos_ids, self.context_window)  # all the worker may call of the engine
        generation = Generation(prefiller, prompt, keys, mode, max_new_tokens, sampler, stops, max_time, blend, start)
        self.scheduler.submit(generation)
        if self.shadow is not None:
            self.shadow.consider(generation)
        return generation.stream
