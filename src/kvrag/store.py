"""Content-addressed KV store: an in-process LRU under a byte budget, then safetensors files.

A block's key hashes the model fingerprint, the block context and the token ids, so KV from
another model, tokenizer, template or context can never be found under the same key. Files
are written to a temporary name and renamed into place, so readers and concurrent writers only
ever see complete files; each file's header repeats the fingerprint, key, context and a
checksum, and a file that fails any check is deleted and reported as a miss.
"""

import hashlib
import os
import threading
import uuid
import warnings
import zlib
from collections import OrderedDict
from dataclasses import dataclass
from pathlib import Path

import safetensors.torch
import torch
from safetensors import safe_open

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


def _checksum(tensors: dict[str, torch.Tensor]) -> str:
    crc = 0
    for name in sorted(tensors):
        crc = zlib.crc32(tensors[name].contiguous().view(torch.uint8).numpy(), crc)
    return f"{crc:08x}"


class MemoryTier:
    """Least-recently-used blocks, evicted once their total size exceeds the byte budget."""

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
        tensors = {
            "token_ids": block.token_ids.to(torch.int32).contiguous(),
            "keys": block.keys.contiguous(),
            "values": block.values.contiguous(),
        }
        metadata = {
            "format": FORMAT,
            "fingerprint": self.fingerprint,
            "key": key,
            "context": context,
            "start": str(block.start),
            "ids_sha256": ids_digest(block.token_ids),
            "checksum": _checksum(tensors),
        }
        data = safetensors.torch.save(tensors, metadata=metadata)
        path = self.path(key)
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(f".{key}.{os.getpid()}.{uuid.uuid4().hex}.tmp")
        try:
            with open(tmp, "wb") as f:
                f.write(data)
            os.replace(tmp, path)
        finally:
            tmp.unlink(missing_ok=True)

    def get(self, key: str, context: str) -> KVBlock | None:
        path = self.path(key)
        try:
            return self._read(path, key, context)
        except FileNotFoundError:
            return None
        except Exception as exc:  # any defect means the file must not be served
            warnings.warn(f"kvrag: dropping unusable KV file {path}: {exc}", RuntimeWarning, stacklevel=3)
            path.unlink(missing_ok=True)
            return None

    def _read(self, path: Path, key: str, context: str) -> KVBlock:
        """The header through `safe_open`; the tensors from one read of the file into memory, because
        `safe_open`'s tensors stay mapped to the file, and a file truncated later would end the process."""
        with safe_open(path, framework="pt") as f:
            metadata = f.metadata() or {}
        expected = {"format": FORMAT, "fingerprint": self.fingerprint, "key": key, "context": context}
        for field, value in expected.items():
            if metadata.get(field) != value:
                raise ValueError(f"header field {field!r} is {metadata.get(field)!r}, expected {value!r}")
        tensors = safetensors.torch.load(path.read_bytes())
        if _checksum(tensors) != metadata.get("checksum"):
            raise ValueError("checksum mismatch")
        if ids_digest(tensors["token_ids"]) != metadata.get("ids_sha256"):
            raise ValueError("token ids do not match the header")
        keys, values, ids = tensors["keys"], tensors["values"], tensors["token_ids"]
        if keys.shape != values.shape or keys.ndim != 4 or keys.shape[2] != ids.numel():
            raise ValueError(f"inconsistent shapes keys={tuple(keys.shape)} values={tuple(values.shape)}")
        return KVBlock(ids.to(torch.long), keys, values, int(metadata["start"]))


class KVStore:
    """Memory tier in front of an optional disk tier; `get` reports which tier answered."""

    def __init__(self, fingerprint: str, root: Path | None = None, memory_budget: int = 1 << 30):
        self.fingerprint = fingerprint
        self.memory = MemoryTier(memory_budget)
        self.disk = DiskTier(root, fingerprint) if root is not None else None

    def key(self, context: str, token_ids) -> str:
        return block_key(self.fingerprint, context, token_ids)

    def __contains__(self, key: str) -> bool:
        return key in self.memory or (self.disk is not None and key in self.disk)

    def persisted(self, key: str) -> bool:
        """Whether the block outlives the process: on disk, or there is no disk to put it on."""
        return self.disk is None or key in self.disk

    def get(self, key: str, context: str) -> tuple[KVBlock | None, str]:
        """Return (block, tier) with tier 'memory', 'disk' or 'miss'."""
        block = self.memory.get(key)
        if block is not None:
            return block, "memory"
        if self.disk is not None:
            block = self.disk.get(key, context)
            if block is not None:
                self.memory.put(key, block)
                return block, "disk"
        return None, "miss"

    def put(self, key: str, context: str, block: KVBlock, disk: bool = True) -> None:
        """Keep `block` in memory, and on disk unless told not to."""
        if self.disk is not None and disk:
            self.disk.put(key, context, block)
        self.memory.put(key, block)
