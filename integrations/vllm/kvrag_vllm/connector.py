"""kvrag as a vLLM KV connector: indexed passages' KV reused wherever a prompt holds them.

Load it with
    --kv-transfer-config '{"kv_connector": "KVRagConnector", "kv_connector_module_path": "kvrag_vllm.connector",
                           "kv_role": "kv_both", "kv_load_failure_policy": "recompute"}'
(`kvrag_vllm.transfer_config()` writes it). Two halves, in vLLM's scheduler process and in each worker:

- scheduler: finds the indexed passages in a new request's token ids (`plan.Passages`), claims the leading
  run header + passages (`plan.leading_run`) when every piece's block is stored, and keeps those paged
  blocks out of vLLM's prefix cache (their hashes salted: block-attention KV is not the causal KV of that
  prefix, and must never be served as one). A request whose header is not stored yet is prefilled as
  usual and its header's (causal) KV saved for the next.
- worker: writes each piece's stored KV into the request's paged blocks, keys rotated from the position
  they were computed at to the one they now hold (`rotate`); saves the KV that index requests (and unseen
  headers) computed.

A request sent with `kv_transfer_params={"kvrag": "index"}` is a passage to index: vLLM prefills it alone
and the connector keeps its KV (`kvrag.vllm_client.index`). `{"kvrag": "off"}` turns the connector off for
one request. KV lives in kvrag's store (memory ▸ disk under KVRAG_HOME/vllm), validated on every read: a
damaged or foreign block is dropped, and the blocks it was to fill are recomputed by vLLM.
"""

import hashlib
import json
import logging
import os
import re
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorBase_V1, KVConnectorMetadata, KVConnectorRole
from vllm.v1.metrics.cache_hit_source import CacheHitSource

from kvrag.locks import file_lock
from kvrag.paths import kvrag_home, safetensors_header_digest
from kvrag.quant import KEYS, VALUES, as_tensor, bits_of, quantize
from kvrag.store import BlockShape, KVBlock, KVStore, storage_format

from . import paged, plan, positions

logger = logging.getLogger("vllm.kvrag")  # under vLLM's logger, so that its handlers show it
CONTEXT = "vllm-alone"
"""Every stored block holds the KV of its tokens computed alone from position 0: a passage or glue sent
alone, or a header, which is the causal start of its prompt. With tensor parallelism each rank keeps its
heads' share under its own context (`rank_context`); the scheduler looks for rank 0's."""


def rank_context(rank: int) -> str:
    return CONTEXT if rank == 0 else f"{CONTEXT}/rank{rank}"
SALT = b"kvrag-block-attention"


@dataclass
class Load:
    req_id: str
    block_ids: list[int]
    first: int  # tokens before it are vLLM's own (prefix cache)
    pieces: list[tuple[list[int], int]]  # (token ids, start): each rank finds its own block of them


@dataclass
class Save:
    req_id: str
    block_ids: list[int]
    ids: list[int]  # tokens 0..len(ids) of the request


@dataclass
class KVRagMetadata(KVConnectorMetadata):
    loads: list[Load] = field(default_factory=list)
    saves: list[Save] = field(default_factory=list)


def fingerprint(vllm_config) -> str:
    """What shapes the KV vLLM computes: the model's files, dtype, cache dtype and tensor parallelism."""
    model = vllm_config.model_config
    identity: list = [model.model, getattr(model, "revision", None)]
    directory = Path(model.model)
    if directory.is_dir():
        for path in sorted(directory.iterdir()):
            if path.is_file() and path.suffix in (".json", ".safetensors", ".jinja", ".model"):
                entry = [path.name, path.stat().st_size]
                if path.suffix == ".safetensors":
                    entry.append(safetensors_header_digest(path))
                identity.append(entry)
    identity += [str(model.dtype), str(vllm_config.cache_config.cache_dtype),
                 vllm_config.parallel_config.tensor_parallel_size, "kvrag-vllm/1"]
    return hashlib.sha256(json.dumps(identity, default=str).encode()).hexdigest()


def home(config) -> Path:
    extra = config.kv_transfer_config.kv_connector_extra_config or {}
    return (Path(extra["home"]).expanduser() if extra.get("home") else kvrag_home()) / "vllm"


class KVRagConnector(KVConnectorBase_V1):
    _cache_hit_source = CacheHitSource.HOST

    def __init__(self, vllm_config, role: KVConnectorRole, kv_cache_config=None):
        super().__init__(vllm_config, role, kv_cache_config)
        self.fingerprint = fingerprint(vllm_config)
        self.root = home(vllm_config) / self.fingerprint[:16]
        self.block_size = vllm_config.cache_config.block_size
        self.max_tokens = vllm_config.model_config.max_model_len
        self.vocab = vllm_config.model_config.get_vocab_size()
        self.remote, self.secret = _remote(vllm_config)
        if role == KVConnectorRole.SCHEDULER:
            self._init_scheduler()
        else:
            self._init_worker(vllm_config)

    # ---- scheduler side ------------------------------------------------------------------------------

    def _init_scheduler(self) -> None:
        self.stored = KVStore(self.fingerprint, self.root / "kv", memory_budget=0, remote=self.remote,
                              secret=self.secret, storage=_storage(self._vllm_config))  # only asked what it holds:
        # the workers read and write, in this format
        self.passages = plan.Passages()
        self._registry = self.root / "passages.txt"
        self._registry_read = self._remote_read = 0
        self._remote_registry = f"vllm-passages:{self.fingerprint[:16]}"
        self._refresh()
        self._kind: dict[str, str] = {}  # request id -> "index" | "off"
        self._plans: dict[str, tuple[int, list[plan.Piece]]] = {}
        self._loading: dict[str, tuple[int, list[plan.Piece]]] = {}
        self._pending: dict[str, list[int]] = {}  # saves (of tokens 0..n) waiting for them to be computed
        self._said: set[str] = set()
        self._salted: set[str] = set()
        policy = getattr(self._kv_transfer_config, "kv_load_failure_policy", "recompute")
        if policy != "recompute":
            logger.warning("kvrag: kv_load_failure_policy is %r: a damaged stored block fails its request instead "
                           "of being recomputed; set \"kv_load_failure_policy\": \"recompute\"", policy)

    def _stored(self, ids) -> bool:
        return self.stored.key(CONTEXT, list(ids)) in self.stored

    def _refresh(self) -> None:
        """Passages indexed since the last look, by this scheduler or another replica sharing the home or
        the Redis tier."""
        lines = []
        try:
            with open(self._registry, "rb") as f:
                f.seek(self._registry_read)
                data = f.read()
            end = data.rfind(b"\n") + 1
            self._registry_read += end
            lines = data[:end].decode("ascii", "replace").splitlines()
        except FileNotFoundError:
            pass
        if self.remote is not None:
            shared, self._remote_read = self.remote.passages(self._remote_read, self._remote_registry)
            lines += [line for line in shared if line]
        for line in lines:
            try:  # untrusted: a line that is not token ids of this model is skipped
                ids = [int(t) for t in line.split(",")]
            except ValueError:
                continue
            if 0 < len(ids) <= self.max_tokens and all(0 <= t < self.vocab for t in ids):
                self.passages.add(ids)

    def _remember(self, ids: list[int]) -> None:
        if len(ids) < plan.MIN_PASSAGE_TOKENS or len(ids) > self.max_tokens:
            return
        self._registry.parent.mkdir(parents=True, exist_ok=True)
        line = ",".join(map(str, ids))
        with file_lock(self._registry.with_suffix(".lock")):
            with open(self._registry, "ab") as f:
                f.write(line.encode() + b"\n")
        if self.remote is not None:
            self.remote.add_passages([line], self._remote_registry)
        self._refresh()

    def _say_once(self, what: str, message: str, *args) -> None:
        if what not in self._said:
            self._said.add(what)
            logger.warning(message, *args)

    def get_num_new_matched_tokens(self, request, num_computed_tokens: int) -> tuple[int, bool]:
        kind = (request.kv_transfer_params or {}).get("kvrag")
        if kind in ("index", "off"):
            self._kind[request.request_id] = kind
            return 0, False
        self._refresh()
        ids = list(request.prompt_token_ids or ())
        found = self.passages.find(ids)
        pieces = plan.leading_run(ids, found, self._stored)
        if not pieces:
            glue = plan.unknown_glue(ids, found, self._stored)
            if glue:
                self._say_once("glue", "kvrag: the tokens %s between two indexed passages have no stored KV, so the "
                               "passages after them are prefilled; index that separator with kvrag_vllm.index("
                               "..., separators=[...])", list(glue))
            return 0, False
        header = pieces[0] if pieces[0].kind == "header" else None
        if header and header.stop > num_computed_tokens and not self._stored(header.ids):
            self._pending[request.request_id] = list(header.ids)
            return 0, False
        stop = pieces[-1].stop
        if stop <= num_computed_tokens:
            return 0, False
        self._plans[request.request_id] = (num_computed_tokens, pieces)
        self._keep_out_of_prefix_cache(request, next(p.start for p in pieces if p.kind != "header"))
        return stop - num_computed_tokens, False

    def update_state_after_alloc(self, request, blocks, num_external_tokens: int) -> None:
        planned = self._plans.pop(request.request_id, None)
        if num_external_tokens > 0 and planned is not None:
            self._loading[request.request_id] = planned

    def _keep_out_of_prefix_cache(self, request, first_token: int) -> None:
        """Salt the hashes of the paged blocks from the first passage on, and so of every block after them
        (each hash chains from the one before): vLLM caches them under hashes no plain prompt computes.
        Done here, before vLLM allocates (and caches) the request's blocks, once per request."""
        if request.request_id in self._salted:
            return
        self._salted.add(request.request_id)
        hashes = request.block_hashes
        for i in range(first_token // self.block_size, len(hashes)):
            hashes[i] = type(hashes[i])(hashlib.sha256(SALT + bytes(hashes[i])).digest())

    def build_connector_meta(self, scheduler_output) -> KVRagMetadata:
        meta = KVRagMetadata()
        computed = {}  # request id -> tokens computed once this step ran
        for new in scheduler_output.scheduled_new_reqs:
            computed[new.req_id] = new.num_computed_tokens + scheduler_output.num_scheduled_tokens.get(new.req_id, 0)
            if self._kind.get(new.req_id) == "index":
                self._pending[new.req_id] = list(new.prompt_token_ids or ())
        cached = scheduler_output.scheduled_cached_reqs
        for i, rid in enumerate(cached.req_ids):  # a preempted request that resumes is planned again, here
            computed[rid] = cached.num_computed_tokens[i] + scheduler_output.num_scheduled_tokens.get(rid, 0)
        for rid in [rid for rid in self._loading if rid in computed]:
            first, pieces = self._loading.pop(rid)
            meta.loads.append(Load(rid, self._block_ids(rid), first,
                                   [(list(p.ids), p.start) for p in pieces if p.stop > first]))
        for rid, ids in list(self._pending.items()):
            if computed.get(rid, 0) >= len(ids):
                del self._pending[rid]
                meta.saves.append(Save(rid, self._block_ids(rid), ids))
        return meta

    def _block_ids(self, rid: str) -> list[int]:
        """The request's paged blocks, in order (of its only KV cache group)."""
        return list(self._kv_cache_manager.get_block_ids(rid)[0])

    def request_finished(self, request, block_ids) -> tuple[bool, dict[str, Any] | None]:
        rid = request.request_id
        if self._kind.pop(rid, None) == "index":
            ids = list(request.prompt_token_ids or ())
            if self._stored(ids):
                self._remember(ids)
        for table in (self._plans, self._loading, self._pending):
            table.pop(rid, None)
        self._salted.discard(rid)
        return False, None

    # ---- worker side ---------------------------------------------------------------------------------

    def _init_worker(self, vllm_config) -> None:
        model = vllm_config.model_config
        self.head_dim = model.get_head_size()
        self.inv_freq = positions.inv_freq(model.hf_config, self.head_dim)
        self.neox = positions.neox_style(model.hf_config)
        self.caches: list[torch.Tensor] = []
        self.keys: list[torch.Tensor] = []
        self.values: list[torch.Tensor] = []
        self.store: KVStore | None = None
        self.failed: set[int] = set()
        self.context = CONTEXT

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        from vllm.distributed.parallel_state import get_tensor_model_parallel_rank

        self.context = rank_context(get_tensor_model_parallel_rank())
        names = sorted(kv_caches, key=lambda n: [int(x) for x in re.findall(r"\d+", n)])
        self.caches = [kv_caches[n] for n in names]
        backend = _backend(self._vllm_config, names[0], self.caches[0])
        try:
            for cache in self.caches:
                k, v = paged.views(cache, backend, self.head_dim)
                self.keys.append(k)
                self.values.append(v)
        except ValueError as exc:
            logger.warning("kvrag: connector off, every prompt prefilled as without it: %s", exc)
            self.keys, self.values = [], []
            return
        first = self.keys[0]
        self.storage = storage_format(_storage(self._vllm_config) or first.dtype, first.dtype)
        shape = BlockShape(len(self.caches), first.shape[1], self.head_dim, self.storage, self.max_tokens)
        self.store = KVStore(self.fingerprint, self.root / "kv", memory_budget=_memory_budget(self._vllm_config),
                             shape=shape, remote=self.remote, secret=self.secret)
        logger.info("kvrag: %d layers of %s KV (%s, stored as %s), blocks in %s", len(self.caches), backend,
                    first.dtype, self.storage, self.root)

    def start_load_kv(self, forward_context, **kwargs) -> None:
        meta = self._get_connector_metadata()
        if not isinstance(meta, KVRagMetadata):
            return
        for load in meta.loads:
            keys = [self.store.key(self.context, ids) if self.store else "" for ids, _ in load.pieces]
            found = self._fetch(keys)
            missing = [key for key in keys if found.get(key, (None,))[0] is None]
            if missing:  # dropped as damaged or foreign, or gone: vLLM recomputes these tokens
                if self.store is not None:
                    logger.warning("kvrag: %d stored block(s) of request %s missing or unusable; its passages are "
                                   "prefilled instead", len(missing), load.req_id)
                first_block = load.first // self.block_size
                last_block = (load.pieces[-1][1] + len(load.pieces[-1][0]) - 1) // self.block_size
                self.failed.update(load.block_ids[first_block : last_block + 1])
                continue
            for key, (ids, start) in zip(keys, load.pieces):
                stop = start + len(ids)
                block = found[key][0]
                skip = max(0, load.first - start)
                where = paged.slots(load.block_ids, start + skip, stop, self.block_size)
                keys, values = as_tensor(block.keys), as_tensor(block.values)  # 8- and 4-bit: dequantized
                rotated = positions.rotate(keys[:, :, skip:], start - block.start, self.inv_freq, self.neox)
                for layer in range(len(self.caches)):
                    paged.write(self.keys[layer], where, rotated[layer])
                    paged.write(self.values[layer], where, values[layer, :, skip:])

    def _fetch(self, keys: list[str]) -> dict:
        """The stored blocks of `keys`; what the store drops as damaged or foreign it says in vLLM's log."""
        if self.store is None:
            return {}
        with warnings.catch_warnings(record=True) as said:
            warnings.simplefilter("always")
            found = self.store.get_many([(key, self.context) for key in keys])
        for warning in said:
            logger.warning("%s", warning.message)
        return found

    def wait_for_layer_load(self, layer_name: str) -> None:
        return

    def save_kv_layer(self, layer_name: str, kv_layer, attn_metadata, **kwargs) -> None:
        return  # saved in wait_for_save, once every layer holds this step's KV

    def wait_for_save(self) -> None:
        meta = self._connector_metadata
        if not isinstance(meta, KVRagMetadata) or self.store is None:
            return
        for save in meta.saves:
            where = paged.slots(save.block_ids, 0, len(save.ids), self.block_size)
            keys = torch.stack([paged.read(k, where) for k in self.keys]).cpu()
            values = torch.stack([paged.read(v, where) for v in self.values]).cpu()
            if bits := bits_of(self.storage):
                keys, values = quantize(keys, bits, KEYS), quantize(values, bits, VALUES)
            else:
                keys, values = keys.to(self.storage), values.to(self.storage)
            block = KVBlock(torch.tensor(save.ids, dtype=torch.long), keys, values, 0)
            self.store.put(self.store.key(self.context, save.ids), self.context, block)

    def get_block_ids_with_load_errors(self) -> set[int]:
        failed, self.failed = self.failed, set()
        return failed


def _backend(vllm_config, layer_name: str, cache: torch.Tensor) -> str:
    """The attention backend's name; for CPU_ATTN with the kernel set it picks for this CPU and dtype."""
    layer = vllm_config.compilation_config.static_forward_context.get(layer_name)
    from vllm.platforms import current_platform

    if layer is not None and hasattr(layer, "get_attn_backend"):
        name = layer.get_attn_backend().get_name()
    else:
        name = "CPU_ATTN" if current_platform.is_cpu() else "FLASH_ATTN"
    if name != "CPU_ATTN":
        return name
    from vllm.v1.attention.backends.cpu_attn import _get_attn_isa

    isa = _get_attn_isa(cache.dtype, vllm_config.cache_config.block_size, vllm_config.model_config.get_head_size(),
                        str(vllm_config.cache_config.cache_dtype))
    return f"{name}/{isa}"


def _remote(vllm_config):
    """The shared Redis tier (extra config "remote", else $KVRAG_REMOTE) and its MAC secret ($KVRAG_SECRET_FILE
    or $KVRAG_SECRET, required with it), as kvrag's engines take them: replicas on several machines share KV
    and the passage registry there."""
    extra = vllm_config.kv_transfer_config.kv_connector_extra_config or {}
    url = extra.get("remote") or os.environ.get("KVRAG_REMOTE")
    if not url:
        return None, None
    from kvrag.remote import Remote, shared_secret

    return Remote(url), shared_secret(remote=url)


def _storage(vllm_config) -> str | None:
    """How blocks are stored (extra config "storage", else $KVRAG_STORAGE): "int8" or "int4" for kvrag's 8- and
    4-bit formats, a float dtype's name; None: as vLLM's cache holds them."""
    extra = vllm_config.kv_transfer_config.kv_connector_extra_config or {}
    return extra.get("storage") or os.environ.get("KVRAG_STORAGE") or None


def _memory_budget(vllm_config) -> int:
    extra = vllm_config.kv_transfer_config.kv_connector_extra_config or {}
    return int(extra.get("memory_budget", 1 << 30))
