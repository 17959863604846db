"""Content-addressed KV store: in-process LRUs under byte budgets, then safetensors files, then a
shared remote tier (Redis, see remote.py) that replicas on other machines read and write.

A block's key hashes the model fingerprint, the block context and the token ids, so KV from
another model, tokenizer, template or context can never be found under the same key. Files
are written to a temporary name and renamed into place, so readers and concurrent writers only
ever see complete files. A file and a remote value hold the same bytes (`pack`), whose header
repeats the fingerprint, key, context, token ids' hash and a checksum; one that fails any check
is deleted and reported as a miss, never served.

For a model on a GPU the host copies sit in pinned memory, from which the GPU copies blocks
asynchronously, and an optional device tier keeps the most recently used blocks on the GPU itself.
"""

import hashlib
import json
import threading
import warnings
import zlib
from collections import OrderedDict
from dataclasses import dataclass
from pathlib import Path

import safetensors.torch
import torch

from .paths import write_atomic

FORMAT = "kvrag-kv/1"


@dataclass
class KVBlock:
    """The KV of one run of tokens, for every layer: keys/values are [layers, kv_heads, tokens, head_dim].

    Keys are stored post-RoPE as if the first token sat at position `start`.
    """

    token_ids: torch.Tensor
    keys: torch.Tensor
    values: torch.Tensor
    start: int

    def __len__(self) -> int:
        return self.token_ids.numel()

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.token_ids, self.keys, self.values))


def ids_digest(token_ids) -> str:
    data = torch.as_tensor(token_ids, dtype=torch.int32).contiguous().numpy().tobytes()
    return hashlib.sha256(data).hexdigest()


def block_key(fingerprint: str, context: str, token_ids) -> str:
    """128-bit content address of a block."""
    h = hashlib.sha256()
    h.update(f"{FORMAT}\0{fingerprint}\0{context}\0".encode())
    h.update(torch.as_tensor(token_ids, dtype=torch.int32).contiguous().numpy().tobytes())
    return h.hexdigest()[:32]


def default_storage_dtype(model_dtype: torch.dtype) -> torch.dtype:
    """The dtype blocks are stored in unless the engine is told otherwise: a half-precision model's own,
    so that a block reaches a GPU workspace without a conversion, and float16 for anything wider (half the
    bytes of float32 in memory and on disk, and what the CPU's fill kernel reads)."""
    return model_dtype if model_dtype in (torch.float16, torch.bfloat16) else torch.float16


def _checksum(tensors: dict[str, torch.Tensor]) -> str:
    crc = 0
    for name in sorted(tensors):
        crc = zlib.crc32(tensors[name].contiguous().view(torch.uint8).numpy(), crc)
    return f"{crc:08x}"


def pack(fingerprint: str, key: str, context: str, block: KVBlock) -> bytes:
    """A block as the disk and remote tiers keep it: safetensors bytes whose header says what they hold."""
    tensors = {
        "token_ids": block.token_ids.to(torch.int32).contiguous(),
        "keys": block.keys.contiguous(),
        "values": block.values.contiguous(),
    }
    metadata = {
        "format": FORMAT,
        "fingerprint": fingerprint,
        "key": key,
        "context": context,
        "start": str(block.start),
        "ids_sha256": ids_digest(block.token_ids),
        "checksum": _checksum(tensors),
    }
    return safetensors.torch.save(tensors, metadata=metadata)


def unpack(data: bytes, fingerprint: str, key: str, context: str) -> KVBlock:
    """The block in `data`, or ValueError if anything in it is not what `pack` wrote for this key. The header
    is checked before any tensor is read; the tensors are copies, not views of `data`."""
    size = int.from_bytes(data[:8], "little")
    if len(data) < 8 or size > len(data) - 8:
        raise ValueError(f"not a safetensors value ({len(data)} bytes)")
    header = json.loads(data[8 : 8 + size])
    metadata = header.get("__metadata__") if isinstance(header, dict) else None
    metadata = metadata if isinstance(metadata, dict) else {}
    expected = {"format": FORMAT, "fingerprint": fingerprint, "key": key, "context": context}
    for field, value in expected.items():
        if metadata.get(field) != value:
            raise ValueError(f"header field {field!r} is {metadata.get(field)!r}, expected {value!r}")
    tensors = safetensors.torch.load(data)
    if _checksum(tensors) != metadata.get("checksum"):
        raise ValueError("checksum mismatch")
    if ids_digest(tensors["token_ids"]) != metadata.get("ids_sha256"):
        raise ValueError("token ids do not match the header")
    keys, values, ids = tensors["keys"], tensors["values"], tensors["token_ids"]
    if keys.shape != values.shape or keys.ndim != 4 or keys.shape[2] != ids.numel():
        raise ValueError(f"inconsistent shapes keys={tuple(keys.shape)} values={tuple(values.shape)}")
    return KVBlock(ids.to(torch.long), keys, values, int(metadata["start"]))


class MemoryTier:
    """Least-recently-used blocks, evicted once their total size exceeds the byte budget; the blocks
    may sit in host or device memory (the store's memory and device tiers)."""

    def __init__(self, budget_bytes: int):
        self.budget = budget_bytes
        self.used = 0
        self._blocks: OrderedDict[str, KVBlock] = OrderedDict()
        self._lock = threading.Lock()

    def get(self, key: str) -> KVBlock | None:
        with self._lock:
            block = self._blocks.get(key)
            if block is not None:
                self._blocks.move_to_end(key)
            return block

    def put(self, key: str, block: KVBlock) -> None:
        if block.nbytes > self.budget:
            return
        with self._lock:
            old = self._blocks.pop(key, None)
            if old is not None:
                self.used -= old.nbytes
            self._blocks[key] = block
            self.used += block.nbytes
            while self.used > self.budget:
                _, evicted = self._blocks.popitem(last=False)
                self.used -= evicted.nbytes

    def __contains__(self, key: str) -> bool:
        return key in self._blocks

    def __len__(self) -> int:
        return len(self._blocks)


class DiskTier:
    """One safetensors file per block under root/<key[:2]>/<key>.safetensors."""

    def __init__(self, root: Path, fingerprint: str):
        self.root = Path(root)
        self.fingerprint = fingerprint

    def path(self, key: str) -> Path:
        return self.root / key[:2] / f"{key}.safetensors"

    def __contains__(self, key: str) -> bool:
        return self.path(key).is_file()

    def put(self, key: str, context: str, block: KVBlock) -> None:
        write_atomic(self.path(key), pack(self.fingerprint, key, context, block))

    def get(self, key: str, context: str) -> KVBlock | None:
        """The tensors come from one read of the file into memory: `safe_open`'s would stay mapped to the
        file, and a file truncated later would end the process."""
        path = self.path(key)
        try:
            return unpack(path.read_bytes(), self.fingerprint, key, context)
        except FileNotFoundError:
            return None
        except Exception as exc:  # any defect means the file must not be served
            warnings.warn(f"kvrag: dropping unusable KV file {path}: {exc}", RuntimeWarning, stacklevel=3)
            path.unlink(missing_ok=True)
            return None


class RemoteTier:
    """Blocks in a Redis server shared by replicas (`remote.Remote`), one value per block, `pack`'s bytes.

    A request's blocks are fetched together (`get_many`, a few per round trip). A value that fails its
    checks is deleted; an unreachable or slow server reads as misses and skips writes (remote.py says
    how it recovers)."""

    def __init__(self, remote, fingerprint: str):
        self.remote, self.fingerprint = remote, fingerprint

    def __contains__(self, key: str) -> bool:
        return self.remote.exists(key)

    def put(self, key: str, context: str, block: KVBlock) -> None:
        self.remote.put(key, pack(self.fingerprint, key, context, block))

    def get_many(self, items: list[tuple[str, str]]) -> dict[str, KVBlock]:
        """{key: block} for the (key, context) pairs found intact."""
        found = {}
        for (key, context), data in zip(items, self.remote.iter_many([key for key, _ in items])):
            if data is None:
                continue
            try:
                found[key] = unpack(data, self.fingerprint, key, context)
            except Exception as exc:
                warnings.warn(f"kvrag: dropping unusable remote KV value {key}: {exc}", RuntimeWarning, stacklevel=3)
                self.remote.delete(key)
        return found


class KVStore:
    """A device tier, a memory tier, an optional disk tier and an optional remote tier; `get` reports
    which tier answered.

    `device` is the model's. On a GPU the memory tier holds blocks in pinned host memory, so that a
    block's copy into the workspace runs asynchronously while the next one is fetched, and the device
    tier (`device_budget` bytes, 0 for none) holds the most recently used blocks on the GPU itself. On
    the CPU host memory is the device's: nothing is pinned and there is no device tier.
    Block token ids always stay on the host: they are read as Python lists.
    """

    def __init__(self, fingerprint: str, root: Path | None = None, memory_budget: int = 1 << 30, *,
                 device: str | torch.device | None = None, device_budget: int = 0, remote=None):
        self.fingerprint = fingerprint
        self.device = torch.device(device if device is not None else "cpu")
        self.pinned = self.device.type == "cuda"
        self.memory = MemoryTier(memory_budget)
        self.device_tier = MemoryTier(device_budget) if self.device.type != "cpu" and device_budget > 0 else None
        self.disk = DiskTier(root, fingerprint) if root is not None else None
        self.remote = RemoteTier(remote, fingerprint) if remote is not None else None

    def key(self, context: str, token_ids) -> str:
        return block_key(self.fingerprint, context, token_ids)

    def __contains__(self, key: str) -> bool:
        return (key in self.memory or (self.device_tier is not None and key in self.device_tier)
                or (self.disk is not None and key in self.disk) or (self.remote is not None and key in self.remote))

    def persisted(self, key: str) -> bool:
        """Whether the block outlives the process: on disk, or there is no disk to put it on."""
        return self.disk is None or key in self.disk

    def host_copy(self, tensor: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """A new host tensor holding `tensor` in `dtype`, pinned where the store serves a GPU. From a GPU
        it is converted there (fewer bytes cross) and the copy has finished when this returns, so the
        result can be checksummed and written at once."""
        if not self.pinned:
            return tensor.to("cpu", dtype, copy=True)
        return torch.empty(tensor.shape, dtype=dtype, pin_memory=True).copy_(tensor.to(dtype))

    def _on_host(self, block: KVBlock) -> KVBlock:
        """`block` as the memory tier keeps it: host tensors, pinned where the store serves a GPU."""
        if not self.pinned or all(t.device.type == "cpu" and t.is_pinned() for t in (block.keys, block.values)):
            return block
        keys, values = (self.host_copy(t, t.dtype) for t in (block.keys, block.values))
        return KVBlock(block.token_ids.cpu(), keys, values, block.start)

    def _on_device(self, block: KVBlock) -> KVBlock:
        """A device copy of `block`'s KV, queued (`non_blocking`) behind the work already on the device."""
        keys, values = (t.to(self.device, non_blocking=True) for t in (block.keys, block.values))
        return KVBlock(block.token_ids, keys, values, block.start)

    def get(self, key: str, context: str) -> tuple[KVBlock | None, str]:
        """Return (block, tier) with tier 'device', 'memory', 'disk', 'remote' or 'miss'. A hit below the
        top tier is copied into the tiers above it, and the copy nearest the device is returned."""
        return self.get_many([(key, context)])[key]

    def get_many(self, items: list[tuple[str, str]]) -> dict[str, tuple[KVBlock | None, str]]:
        """`get` for several (key, context) pairs; the ones no local tier holds come from the remote tier
        together (`RemoteTier.get_many`)."""
        found, remote = {}, []
        for key, context in items:
            found[key] = self._get_local(key, context)
            if found[key][0] is None and self.remote is not None:
                remote.append((key, context))
        if remote:
            contexts = dict(remote)
            for key, block in self.remote.get_many(remote).items():
                block = self._on_host(block)
                if self.disk is not None:
                    self.disk.put(key, contexts[key], block)
                found[key] = self._fill(key, block), "remote"
        return found

    def _get_local(self, key: str, context: str) -> tuple[KVBlock | None, str]:
        if self.device_tier is not None:
            block = self.device_tier.get(key)
            if block is not None:
                return block, "device"
        block, tier = self.memory.get(key), "memory"
        if block is None and self.disk is not None:
            block, tier = self.disk.get(key, context), "disk"
            if block is not None:  # pinned only once read and checked: a failure to pin is not a bad file
                block = self._on_host(block)
        if block is None:
            return None, "miss"
        return self._fill(key, block) if tier != "memory" else self._to_device(key, block), tier

    def _fill(self, key: str, host: KVBlock) -> KVBlock:
        """Keep a block read from below in memory (and on the device); the copy nearest the device."""
        self.memory.put(key, host)
        return self._to_device(key, host)

    def _to_device(self, key: str, block: KVBlock) -> KVBlock:
        if self.device_tier is None:
            return block
        block = self._on_device(block)
        self.device_tier.put(key, block)
        return block

    def put(self, key: str, context: str, block: KVBlock, disk: bool = True) -> None:
        """Keep `block` in memory, on the device when there is a device tier, and (unless `disk` is False:
        KV of one request, not worth keeping) on disk and in the remote tier."""
        host = self._on_host(block)
        if self.disk is not None and disk:
            self.disk.put(key, context, host)
        if self.remote is not None and disk:
            self.remote.put(key, context, host)
        self.memory.put(key, host)
        if self.device_tier is not None:
            self.device_tier.put(key, self._on_device(block))
