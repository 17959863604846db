"""Content-addressed KV store: tiers looked up top down (device ▸ memory ▸ disk ▸ remote), each a `Tier`
with `get_many`, `put`, `delete` and `in`; a hit below the top is copied into the tiers above it.

A block's key hashes the model fingerprint, the block context and the token ids, so KV from
another model, tokenizer, template or context can never be found under the same key. Files
are written to a temporary name, synced and renamed into place, so readers and concurrent writers
only ever see complete files; the disk tier evicts its least recently used files past a byte budget.
A file and a remote value hold the same bytes (`pack`).

Whatever comes back from a file or a shared server is untrusted input (`unpack`): the header must
name this key, fingerprint and context; the tensors' names, dtypes and shapes must be what this model's
blocks have (`BlockShape`) before any tensor is read; the token ids must hash to the key; with a shared
secret a keyed MAC (HMAC-SHA256) must match, else a CRC32 catches accidents; 4-bit codes (kept deflated where
that is smaller) must inflate to exactly their bytes; the values must be finite and of plausible size (for
8- and 4-bit blocks, `quant.py`, their scales and low ends: finite, non-negative scales, the range they span
within bounds). A value that fails is deleted from its tier, reported in one line and
recomputed, never served.

For a model on a GPU the host copies sit in pinned memory, from which the GPU copies blocks
asynchronously, and an optional device tier keeps the most recently used blocks on the GPU itself.
"""

import functools
import hashlib
import hmac
import json
import math
import os
import shutil
import stat
import threading
import time
import warnings
import zlib
from collections import OrderedDict
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

import safetensors.torch
import torch

from . import quant
from .errors import DiskFullError
from .paths import write_atomic
from .quant import Quantized

FORMAT = "kvrag-kv/1"
MAX_ABS = 1e4
"""Largest magnitude a stored key or value may have. Attention keys and values of real models stay far
below it (float16 storage itself ends at 65504); a larger one, or a NaN, is a damaged or planted block."""
DEFLATED_BITS = 4  # the codes files keep deflated where that is smaller (`_deflate`)
MAX_HEADER = 1 << 16  # bytes: a block's header names three tensors and a few fields
DTYPE_NAMES = {torch.float16: "F16", torch.bfloat16: "BF16", torch.float32: "F32", torch.int32: "I32", torch.uint8: "U8"}
SCALES = ("keys_scale", "keys_low", "values_scale", "values_low")  # besides keys and values, in an 8- or 4-bit block


class BadBlock(ValueError):
    """A stored value that must not be served: damaged, planted, or made for another model."""


@dataclass
class KVBlock:
    """The KV of one run of tokens, for every layer: keys/values are [layers, kv_heads, tokens, head_dim], tensors
    or (8- and 4-bit storage) `quant.Quantized` codes.

    Keys are stored post-RoPE as if the first token sat at position `start`.
    """

    token_ids: torch.Tensor
    keys: torch.Tensor | Quantized
    values: torch.Tensor | Quantized
    start: int

    def __len__(self) -> int:
        return self.token_ids.numel()

    @property
    def nbytes(self) -> int:
        return sum(t.nbytes if isinstance(t, Quantized) else t.numel() * t.element_size()
                   for t in (self.token_ids, self.keys, self.values))

    def map(self, fn) -> "KVBlock":
        """The block with each tensor of its keys and values (codes and scales too) passed through `fn`."""
        keys, values = (kv.map(fn) if isinstance(kv, Quantized) else fn(kv) for kv in (self.keys, self.values))
        return KVBlock(self.token_ids, keys, values, self.start)


@dataclass(frozen=True)
class BlockShape:
    """What every block of one model must be: [layers, kv_heads, tokens, head_dim] stored as `dtype` (a float
    dtype, or "int8"/"int4": `quant.py`), with at most `max_tokens` tokens starting below `max_tokens`."""

    layers: int
    kv_heads: int
    head_dim: int
    dtype: torch.dtype | str
    max_tokens: int

    @property
    def bits(self) -> int | None:
        return quant.bits_of(self.dtype)

    @property
    def deflated(self) -> bool:
        """Whether files keep these blocks' codes deflated, so that `kv_bytes` is an upper bound."""
        return self.bits == DEFLATED_BITS

    def tensors(self, tokens: int) -> dict[str, tuple[str, list[int]]]:
        """{name: (dtype name, shape)} of the tensors a block of `tokens` tokens is stored as."""
        full = [self.layers, self.kv_heads, tokens, self.head_dim]
        if self.bits is None:
            return {"token_ids": ("I32", [tokens]), "keys": (DTYPE_NAMES[self.dtype], full),
                    "values": (DTYPE_NAMES[self.dtype], full)}
        codes = ("U8", full[:3] + [self.head_dim * self.bits // 8])
        keys_group, values_group = (("F16", list(quant.group_shape(full, per))) for per in (quant.KEYS, quant.VALUES))
        return {"token_ids": ("I32", [tokens]), "keys": codes, "values": codes, "keys_scale": keys_group,
                "keys_low": keys_group, "values_scale": values_group, "values_low": values_group}

    def check(self, described: dict, start: int) -> None:
        """BadBlock unless tensors described as {name: (dtype name, shape)} are a block of this model's."""
        tokens = described.get("token_ids", ("", [0]))[1][0]
        expected = self.tensors(tokens)
        if set(described) != set(expected):
            raise BadBlock(f"tensors {sorted(described)}, a block of this model's {self.dtype} KV holds {sorted(expected)}")
        for name, (dtype, shape) in expected.items():
            if self.deflated and name in ("keys", "values") and _deflated(described[name], shape):
                continue
            if (described[name][0], list(described[name][1])) != (dtype, shape):
                raise BadBlock(f"{name} in {described[name][0]} of shape {list(described[name][1])}, the model's "
                               f"blocks hold {dtype} of shape {shape} ([layers, kv_heads, tokens, head_dim] = "
                               f"{[self.layers, self.kv_heads, tokens, self.head_dim]})")
        if not 0 < tokens <= self.max_tokens or not 0 <= start < self.max_tokens:
            raise BadBlock(f"{tokens} tokens from position {start}, beyond the model's {self.max_tokens}")

    def kv_bytes(self, tokens: int) -> int:
        """Bytes of a block's token ids, keys and values (and scales): its file less the header, at most (4-bit codes
        are kept deflated where that is smaller: about 7% fewer bytes on the default model)."""
        return 4 * tokens + quant.block_bytes(self.layers, self.kv_heads, self.head_dim, self.dtype, tokens)

    def max_bytes(self) -> int:
        """The most bytes `pack` writes for a block of this model: its longest keys, values and token ids, and
        the largest header read."""
        return 8 + MAX_HEADER + self.kv_bytes(self.max_tokens)


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


FLOATS = {"float16": torch.float16, "bfloat16": torch.bfloat16, "float32": torch.float32}
STORAGE = (*FLOATS, *quant.FORMATS)


def storage_format(storage, model_dtype: torch.dtype) -> torch.dtype | str:
    """The format blocks are stored in: a float dtype (given as one or by name) or an 8- or 4-bit format's name;
    None or "" is `default_storage_dtype`."""
    if storage is None or storage == "":
        return default_storage_dtype(model_dtype)
    if storage in FLOATS.values() or storage in quant.FORMATS:
        return storage
    if storage in FLOATS:
        return FLOATS[storage]
    raise ValueError(f"KV storage must be one of {', '.join(STORAGE)}, got {storage!r}")


def _bytes(tensor: torch.Tensor):
    return tensor.contiguous().view(torch.uint8).numpy()


def _checksum(tensors: dict) -> str:
    crc = 0
    for name in sorted(tensors):
        crc = zlib.crc32(tensors[name], crc)
    return f"{crc:08x}"


def _mac(secret: bytes, metadata: dict, tensors: dict) -> str:
    """HMAC-SHA256 of the header's fields (but the MAC) and of every tensor's name, dtype, shape and bytes."""
    fields = {k: v for k, v in metadata.items() if k != "mac"}
    h = hmac.new(secret, json.dumps(fields, sort_keys=True).encode(), hashlib.sha256)
    for name in sorted(tensors):
        dtype, shape, data = tensors[name]
        h.update(f"\0{name}\0{dtype}\0{list(shape)}\0".encode())
        h.update(data)
    return h.hexdigest()


def _deflated(described: tuple[str, list[int]], shape: list[int]) -> bool:
    """Whether a tensor described as (dtype name, shape) is codes of `shape` deflated: bytes, fewer than theirs."""
    dtype, dims = described
    return dtype == "U8" and len(dims) == 1 and 0 < dims[0] < math.prod(shape)


def _deflate(codes: torch.Tensor) -> torch.Tensor:
    """4-bit codes as raw deflate, Huffman codes only (a range's middle codes are more frequent than its ends': 7%
    fewer bytes on the default model, no match search, 70 MB/s), where that is smaller. 8-bit codes would save 3-4%
    for twice the bytes to inflate on every read, so they are kept as they are."""
    coder = zlib.compressobj(1, zlib.DEFLATED, -15, 9, zlib.Z_HUFFMAN_ONLY)
    packed = coder.compress(codes.contiguous().numpy()) + coder.flush()
    return torch.frombuffer(bytearray(packed), dtype=torch.uint8) if len(packed) < codes.numel() else codes


def _inflate(name: str, codes: torch.Tensor, shape: list[int]) -> torch.Tensor:
    """Codes of `shape` from deflated ones (`_deflate`); never more bytes than those codes take, else BadBlock."""
    count = math.prod(shape)
    coder = zlib.decompressobj(-15)
    try:
        raw = coder.decompress(codes.numpy(), count)
    except zlib.error as exc:
        raise BadBlock(f"{name}' deflated codes are damaged: {exc}") from None
    if len(raw) != count or not coder.eof or coder.unconsumed_tail or coder.unused_data:
        raise BadBlock(f"{name}' deflated codes do not hold the {count} bytes of codes of shape {shape}")
    return torch.frombuffer(bytearray(raw), dtype=torch.uint8).reshape(shape)


@functools.cache
def _inflater() -> ThreadPoolExecutor:
    """The thread that inflates a block's values while its reader inflates the keys."""
    return ThreadPoolExecutor(1, thread_name_prefix="kvrag-inflate")


def _stored(block: KVBlock) -> dict[str, torch.Tensor]:
    """The tensors a block is written as: token ids, keys and values, and an 8- or 4-bit block's scales."""
    tensors = {"token_ids": block.token_ids.to(torch.int32)}
    for name, kv in (("keys", block.keys), ("values", block.values)):
        if isinstance(kv, Quantized):
            codes = _deflate(kv.codes) if kv.bits == DEFLATED_BITS else kv.codes
            tensors.update({name: codes, f"{name}_scale": kv.scale, f"{name}_low": kv.low})
        else:
            tensors[name] = kv
    return {name: t.contiguous() for name, t in tensors.items()}


def pack(fingerprint: str, key: str, context: str, block: KVBlock, secret: bytes | None = None) -> bytes:
    """A block as the disk and remote tiers keep it: safetensors bytes whose header says what they hold,
    with a keyed MAC where the store has a shared secret."""
    tensors = _stored(block)
    raw = {name: _bytes(t) for name, t in tensors.items()}
    metadata = {
        "format": FORMAT,
        "fingerprint": fingerprint,
        "key": key,
        "context": context,
        "start": str(block.start),
        "ids_sha256": ids_digest(block.token_ids),
        "checksum": _checksum(raw),
    }
    if isinstance(block.keys, Quantized):
        metadata["storage"] = f"int{block.keys.bits}"
    if secret is not None:
        described = {name: (DTYPE_NAMES[t.dtype], t.shape, raw[name]) for name, t in tensors.items()}
        metadata["mac"] = _mac(secret, metadata, described)
    return safetensors.torch.save(tensors, metadata=metadata)


def _header(data: bytes) -> tuple[dict, dict, memoryview]:
    """(metadata, tensor entries, data section) of safetensors bytes, read without reading any tensor."""
    size = int.from_bytes(data[:8], "little")
    if len(data) < 8 or size > min(len(data) - 8, MAX_HEADER):
        raise BadBlock(f"not a KV block ({len(data)} bytes)")
    try:
        header = json.loads(bytes(data[8 : 8 + size]))
    except (UnicodeDecodeError, ValueError) as exc:
        raise BadBlock(f"unreadable header: {exc}") from None
    if not isinstance(header, dict) or not isinstance(header.get("__metadata__"), dict):
        raise BadBlock("no header fields")
    metadata = header.pop("__metadata__")
    return metadata, header, memoryview(data)[8 + size :]


def _entries(header: dict, body: memoryview, storage: str | None) -> dict:
    """{name: (dtype name, shape, bytes)} of the tensors, once their dtypes and shapes are those of a block
    stored as `storage` (the header's word: an 8- or 4-bit format, or None for float KV) and their offsets cover
    the data section exactly. (Whether they fit this model: `BlockShape.check`.)"""
    names = {"token_ids", "keys", "values", *(SCALES if storage else ())}
    if set(header) != names:
        raise BadBlock(f"tensors {sorted(header)}, expected {', '.join(sorted(names))}")
    sizes = {name: dtype.itemsize for dtype, name in DTYPE_NAMES.items()}
    described = []
    for name, entry in header.items():
        try:
            dtype, dims, (begin, stop) = entry["dtype"], [int(d) for d in entry["shape"]], entry["data_offsets"]
            count = 1
            for d in dims:
                count *= d
            if dtype in sizes and min(dims, default=0) >= 0 and int(stop) - int(begin) == count * sizes[dtype]:
                described.append((int(begin), int(stop), name, dtype, dims))
                continue
        except (KeyError, TypeError, ValueError):
            pass
        raise BadBlock(f"tensor {name!r} is described inconsistently: {entry}")
    entries, end = {}, 0
    for begin, stop, name, dtype, dims in sorted(described):
        if begin != end:
            raise BadBlock(f"tensor {name!r} at bytes {begin}-{stop} of the data section, expected from {end}")
        entries[name], end = (dtype, dims, body[begin:stop]), stop
    if end != len(body):
        raise BadBlock(f"data section of {len(body)} bytes, the tensors take {end}")
    ids_dtype, ids_shape, _ = entries["token_ids"]
    bits = quant.bits_of(storage)
    k_dtype, k_shape, _ = entries["keys"] if bits is None else entries["keys_scale"]  # codes may be deflated
    if (ids_dtype != "I32" or len(ids_shape) != 1 or len(k_shape) != 4
            or k_shape[2] != (ids_shape[0] if bits is None else 1)):
        raise BadBlock(f"inconsistent tensors: token_ids {ids_dtype}{ids_shape}, keys {k_dtype}{k_shape}")
    if bits is None and k_dtype in ("U8", "I32"):
        raise BadBlock(f"KV in {k_dtype} with no scales")
    layers, heads, _, width = k_shape
    own = BlockShape(layers, heads, width, storage or next(d for d, n in DTYPE_NAMES.items() if n == k_dtype),
                     ids_shape[0] + 1)
    own.check({name: entry[:2] for name, entry in entries.items()}, 0)  # keys, values and scales agree
    return entries


def _check_range(name: str, kv) -> None:
    """BadBlock unless every value `kv` stands for is finite and within MAX_ABS: for codes, the range their scales
    and low ends span (a negative or NaN scale is refused too)."""
    if isinstance(kv, Quantized):
        scale, low = kv.scale.float(), kv.low.float()
        if not bool(torch.isfinite(scale).all()) or float(scale.min()) < 0:
            raise BadBlock(f"{name}' scales are not all finite and non-negative")
        low_high = torch.stack((low.min(), (low + scale * ((1 << kv.bits) - 1)).max()))
    else:
        low_high = torch.stack(torch.aminmax(kv))  # a NaN anywhere makes both NaN
    low, high = (float(x) for x in low_high)
    if not (-MAX_ABS <= low and high <= MAX_ABS):
        raise BadBlock(f"{name} outside [-{MAX_ABS:g}, {MAX_ABS:g}] (min {low:g}, max {high:g})")


def unpack(data: bytes, fingerprint: str, key: str, context: str, shape: BlockShape | None = None,
           secret: bytes | None = None) -> KVBlock:
    """The block in `data`, or BadBlock (a ValueError) if anything in it is not what `pack` wrote for this
    key and this model. Everything that can be checked from the header is, before any tensor is read;
    the tensors are copies, not views of `data`."""
    metadata, header, body = _header(data)
    expected = {"format": FORMAT, "fingerprint": fingerprint, "key": key, "context": context}
    if shape is not None:
        expected["storage"] = shape.dtype if shape.bits else None
    for field, value in expected.items():
        if metadata.get(field) != value:
            raise BadBlock(f"header field {field!r} is {metadata.get(field)!r}, expected {value!r}")
    storage = metadata.get("storage")
    if storage is not None and quant.bits_of(storage) is None:
        raise BadBlock(f"header field 'storage' is {storage!r}, expected one of {sorted(quant.FORMATS)}")
    entries = _entries(header, body, storage)
    try:
        start = int(metadata["start"])
    except (KeyError, ValueError):
        raise BadBlock(f"header field 'start' is {metadata.get('start')!r}") from None
    if shape is not None:
        shape.check({name: entry[:2] for name, entry in entries.items()}, start)
    if secret is not None:
        if not hmac.compare_digest(str(metadata.get("mac", "")), _mac(secret, metadata, entries)):
            raise BadBlock("no valid MAC: not written with this store's shared secret")
    elif _checksum({name: entry[2] for name, entry in entries.items()}) != metadata.get("checksum"):
        raise BadBlock("checksum mismatch")
    tensors = safetensors.torch.load(bytes(data) if not isinstance(data, bytes) else data)
    ids = tensors["token_ids"]
    if ids_digest(ids) != metadata.get("ids_sha256") or block_key(fingerprint, context, ids) != key:
        raise BadBlock("token ids do not match the header and key")
    bits = quant.bits_of(storage)
    if bits is None:
        keys, values = tensors["keys"], tensors["values"]
    else:  # deflated values inflated beside the keys: zlib lets go of the GIL
        layers, heads, _, dim = tensors["keys_scale"].shape
        codes = [layers, heads, len(ids), dim * bits // 8]
        deflated = [name for name in ("keys", "values") if list(tensors[name].shape) != codes]
        later = _inflater().submit(_inflate, "values", tensors["values"], codes) if "values" in deflated else None
        if "keys" in deflated:
            tensors["keys"] = _inflate("keys", tensors["keys"], codes)
        if later is not None:
            tensors["values"] = later.result()
        keys, values = (Quantized(tensors[name], tensors[f"{name}_scale"], tensors[f"{name}_low"], bits)
                        for name in ("keys", "values"))
    for name, kv in (("keys", keys), ("values", values)):
        _check_range(name, kv)
    return KVBlock(ids.to(torch.long), keys, values, start)


class Tier(Protocol):
    """One level of the store. `get_many` answers the (key, context) pairs it holds intact (deleting and
    reporting what it finds damaged); `put` keeps a block and returns it as this tier holds it."""

    name: str

    def get_many(self, items: list[tuple[str, str]]) -> dict[str, KVBlock]: ...

    def put(self, key: str, context: str, block: KVBlock) -> KVBlock: ...

    def delete(self, key: str) -> None: ...

    def __contains__(self, key: str) -> bool: ...


class MemoryTier:
    """Least-recently-used blocks, evicted once their total size exceeds the byte budget; the blocks
    may sit in host or device memory (the store's memory and device tiers). `place` makes the copy the
    tier keeps (pinned host memory, or the device)."""

    def __init__(self, budget_bytes: int, name: str = "memory", place=None):
        self.budget, self.name = budget_bytes, name
        self.place = place or (lambda block: block)
        self.used = 0
        self._blocks: OrderedDict[str, KVBlock] = OrderedDict()
        self._lock = threading.Lock()

    def get(self, key: str) -> KVBlock | None:
        with self._lock:
            block = self._blocks.get(key)
            if block is not None:
                self._blocks.move_to_end(key)
            return block

    def get_many(self, items):
        return {key: block for key, _ in items if (block := self.get(key)) is not None}

    def put(self, key: str, context: str | None, block: KVBlock) -> KVBlock:
        block = self.place(block)
        if block.nbytes > self.budget:
            return block
        with self._lock:
            old = self._blocks.pop(key, None)
            if old is not None:
                self.used -= old.nbytes
            self._blocks[key] = block
            self.used += block.nbytes
            while self.used > self.budget:
                _, evicted = self._blocks.popitem(last=False)
                self.used -= evicted.nbytes
        return block

    def delete(self, key: str) -> None:
        with self._lock:
            old = self._blocks.pop(key, None)
            if old is not None:
                self.used -= old.nbytes

    def clear(self) -> None:
        with self._lock:
            self._blocks.clear()
            self.used = 0

    def __contains__(self, key: str) -> bool:
        return key in self._blocks

    def __len__(self) -> int:
        return len(self._blocks)


def parse_size(size: int | str | None) -> int | None:
    """Bytes in `size`: a number, or one with a unit ("500M", "20G", "1.5T", powers of 1024); None stays None."""
    if size is None or isinstance(size, int):
        return size
    text = str(size).strip().upper().removesuffix("B").removesuffix("I")
    scale = 1024 ** (" KMGT".index(text[-1]) if text and text[-1] in "KMGT" else 0)
    try:
        value = float(text.rstrip("KMGT")) * scale
    except ValueError:
        value = -1
    if not 0 <= value < 2**63:
        raise ValueError(f"a size is bytes or a number with K, M, G or T (e.g. 20G), got {size!r}")
    return int(value)


class DiskBudget:
    """The block files under one directory, kept within `limit` bytes or, with no limit, within what leaves
    `RESERVE` of the filesystem free. Past that, the files least recently written or read are deleted until
    a tenth of the allowance is free again. Every disk tier of this process under the same directory shares
    one (`for_root`); other processes' writes are counted at each sweep, and at least every `RESCAN` writes."""

    RESCAN, RESERVE = 1024, 0.1
    _shared: dict = {}
    _shared_lock = threading.Lock()

    def __init__(self, root: Path, limit: int | None):
        self.root, self.limit = root, limit
        self.used, self.writes = None, 0  # bytes of block files as last counted, plus this process's writes since
        self._lock = threading.Lock()

    @classmethod
    def for_root(cls, root: Path, limit: int | None) -> "DiskBudget":
        with cls._shared_lock:
            budget = cls._shared.setdefault(Path(root).resolve(), cls(Path(root), limit))
            budget.limit = limit  # the latest engine's word
            return budget

    def wrote(self, size: int) -> None:
        """Count a write; sweep when the allowance is exceeded (or may be: other processes write too)."""
        with self._lock:
            self.writes += 1
            if self.used is not None and self.writes % self.RESCAN:
                self.used += size
                if self.limit is not None and self.used <= self.limit:
                    return
                if self.limit is None:
                    usage = shutil.disk_usage(self.root)
                    if usage.free >= self.RESERVE * usage.total:
                        return
            self.used = self._sweep()

    def files(self) -> list[tuple[int, int, Path]]:
        """(last used in ns, bytes, path) of every block file under the root (none where there is no root yet)."""
        files = []
        for path in self.root.glob("**/??/*.safetensors"):
            try:
                info = path.stat()
            except FileNotFoundError:  # another process evicted it
                continue
            files.append((max(info.st_atime_ns, info.st_mtime_ns), info.st_size, path))
        return files

    def allowance(self, total: int | None = None) -> int:
        """The bytes the block files may take: the limit, else what they take (`total`, counted if None) and the
        filesystem's free space come to, less RESERVE of the filesystem."""
        if self.limit is not None:
            return self.limit
        total = sum(size for _, size, _ in self.files()) if total is None else total
        usage = shutil.disk_usage(next(p for p in (self.root, *self.root.parents) if p.exists()))
        return max(0, int(total + usage.free - self.RESERVE * usage.total))

    def _sweep(self) -> int:
        """Delete the least recently used block files while they exceed the allowance, down to 90% of it;
        the bytes the block files take afterwards."""
        files = self.files()
        total = sum(size for _, size, _ in files)
        allowance = self.allowance(total)
        if total <= allowance:
            return total
        for _, size, path in sorted(files):
            if total <= 0.9 * allowance:
                break
            path.unlink(missing_ok=True)
            total -= size
        return total


def _read_regular(path: Path, most: int | None) -> bytes:
    """The bytes of the regular file at `path`, opened without following a link or waiting on a FIFO;
    BadBlock for anything else, or for a file over `most` bytes (checked before reading)."""
    fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
    try:
        info = os.fstat(fd)
        if not stat.S_ISREG(info.st_mode):
            raise BadBlock("not a regular file")
        if most is not None and info.st_size > most:
            raise BadBlock(f"{info.st_size} bytes, more than a block of this model can hold ({most})")
        with os.fdopen(os.dup(fd), "rb") as f:
            return f.read(info.st_size + 1)
    finally:
        os.close(fd)


def stored_name(key: str, storage) -> str:
    """The name a block is kept under in the disk and remote tiers: its key, and for 8- and 4-bit KV the format,
    so that one home holds a block in several formats side by side and a block's id stays the same in all."""
    return f"{key}.{storage}" if quant.bits_of(storage) else key


class DiskTier:
    """One safetensors file per block under root/<key[:2]>/<name>.safetensors (`stored_name`), within a `DiskBudget` of
    `budget` bytes for every block file under `budget_root` (default: root; the engine's is the home's kv/,
    so that one budget covers the KV of every model there). A read refreshes a file's access time, which
    the budget's sweeps go by."""

    name = "disk"

    def __init__(self, root: Path, fingerprint: str, *, shape: BlockShape | None = None, secret: bytes | None = None,
                 budget: int | None = None, budget_root: Path | None = None, storage=None):
        self.root, self.fingerprint, self.shape, self.secret = Path(root), fingerprint, shape, secret
        self.storage = storage if storage is not None else shape and shape.dtype  # what `stored_name` goes by
        self.budget = DiskBudget.for_root(budget_root or root, budget)

    def path(self, key: str) -> Path:
        return self.root / key[:2] / f"{stored_name(key, self.storage)}.safetensors"

    def __contains__(self, key: str) -> bool:
        return self.path(key).is_file()

    def put(self, key: str, context: str, block: KVBlock) -> KVBlock:
        """Write the block's file (DiskFullError where there is no room for it)."""
        data = pack(self.fingerprint, key, context, block, self.secret)
        write_atomic(self.path(key), data)
        self.budget.wrote(len(data))
        return block

    def get_many(self, items):
        found = {}
        for key, context in items:
            block = self.read(key, context)
            if block is not None:
                found[key] = block
        return found

    def read(self, key: str, context: str) -> KVBlock | None:
        """The tensors come from one read of the file into memory: `safe_open`'s would stay mapped to the
        file, and a file truncated later would end the process. Only a regular file is read (a FIFO would block
        for ever, a link may lead out of the home), and only if no larger than a block of this model can be."""
        path = self.path(key)
        try:
            data = _read_regular(path, self.shape.max_bytes() if self.shape is not None else None)
            block = unpack(data, self.fingerprint, key, context, self.shape, self.secret)
        except (FileNotFoundError, IsADirectoryError, NotADirectoryError):
            return None
        except Exception as exc:  # any defect (a link, a FIFO, too large, bad bytes) means the file must not be served
            warnings.warn(f"kvrag: dropping unusable KV file {path}: {exc}", RuntimeWarning, stacklevel=4)
            path.unlink(missing_ok=True)
            return None
        try:  # most recently used, evicted last: the access time says so, the modification time stays the write's
            os.utime(path, ns=(time.time_ns(), os.stat(path).st_mtime_ns))
        except OSError:
            pass
        return block

    def delete(self, key: str) -> None:
        self.path(key).unlink(missing_ok=True)


class RemoteTier:
    """Blocks in a Redis server shared by replicas (`remote.Remote`), one value per block, `pack`'s bytes.

    A request's blocks are fetched together (`get_many`, a few per round trip). A value that fails its
    checks is deleted; an unreachable or slow server reads as misses and skips writes (remote.py says
    how it recovers)."""

    name = "remote"

    def __init__(self, remote, fingerprint: str, *, shape: BlockShape | None = None, secret: bytes | None = None,
                 storage=None):
        self.remote, self.fingerprint, self.shape, self.secret = remote, fingerprint, shape, secret
        self.storage = storage if storage is not None else shape and shape.dtype

    def __contains__(self, key: str) -> bool:
        return self.remote.exists(stored_name(key, self.storage))

    def put(self, key: str, context: str, block: KVBlock) -> KVBlock:
        self.remote.put(stored_name(key, self.storage), pack(self.fingerprint, key, context, block, self.secret))
        return block

    def delete(self, key: str) -> None:
        self.remote.delete(stored_name(key, self.storage))

    def get_many(self, items: list[tuple[str, str]]) -> dict[str, KVBlock]:
        """{key: block} for the (key, context) pairs found intact."""
        found = {}
        names = [stored_name(key, self.storage) for key, _ in items]
        for (key, context), data in zip(items, self.remote.iter_many(names)):
            if data is None:
                continue
            try:
                found[key] = unpack(data, self.fingerprint, key, context, self.shape, self.secret)
            except Exception as exc:
                warnings.warn(f"kvrag: dropping unusable remote KV value {key} from {self.remote}: {exc}",
                              RuntimeWarning, stacklevel=4)
                self.remote.delete(stored_name(key, self.storage))
        return found


class KVStore:
    """A device tier, a memory tier, an optional disk tier and an optional remote tier; `get` reports
    which tier answered.

    `device` is the model's. On a GPU the memory tier holds blocks in pinned host memory, so that a
    block's copy into the workspace runs asynchronously while the next one is fetched, and the device
    tier (`device_budget` bytes, 0 for none) holds the most recently used blocks on the GPU itself. On
    the CPU host memory is the device's: nothing is pinned and there is no device tier.
    Block token ids always stay on the host: they are read as Python lists.

    `shape`: what this model's blocks are, checked on every block read from disk or the remote tier
    (None: only their own consistency). `secret`: the key of the MAC every stored value carries and must
    carry to be read (see remote.shared_secret). `disk_budget`, `budget_root`: see DiskTier. `storage`: the format
    whose blocks the tiers name and look for (default: `shape`'s; a store told no shape, say one only asked what it
    holds, is told this).
    """

    def __init__(self, fingerprint: str, root: Path | None = None, memory_budget: int = 1 << 30, *,
                 device: str | torch.device | None = None, device_budget: int = 0, remote=None,
                 shape: BlockShape | None = None, secret: bytes | None = None, disk_budget: int | None = None,
                 budget_root: Path | None = None, storage=None):
        self.fingerprint, self.shape = fingerprint, shape
        self.device = torch.device(device if device is not None else "cpu")
        self.pinned = self.device.type == "cuda"
        self.memory = MemoryTier(memory_budget, "memory", self._on_host)
        on_device = self.device.type != "cpu" and device_budget > 0
        self.device_tier = MemoryTier(device_budget, "device", self._on_device) if on_device else None
        tiered = dict(shape=shape, secret=secret, storage=storage)
        self.disk = DiskTier(root, fingerprint, budget=disk_budget, budget_root=budget_root, **tiered) if root else None
        self.remote = RemoteTier(remote, fingerprint, **tiered) if remote is not None else None
        self.tiers: list[Tier] = [t for t in (self.device_tier, self.memory, self.disk, self.remote) if t is not None]
        self._full_reported = False

    def key(self, context: str, token_ids) -> str:
        return block_key(self.fingerprint, context, token_ids)

    def __contains__(self, key: str) -> bool:
        return any(key in tier for tier in self.tiers)

    def file_bytes(self, tokens: int) -> int:
        """Bytes a block of `tokens` tokens takes as a file (or remote value) for this model and storage format:
        its tensors (`BlockShape.kv_bytes`) and a header as `pack` writes it; for 4-bit KV at most that, its codes
        deflated."""
        if self.shape is None:
            raise ValueError("a store that is not told its model's block shape cannot say what a block takes")
        return self._header_bytes + self.shape.kv_bytes(tokens)

    @functools.cached_property
    def _header_bytes(self) -> int:
        shape = self.shape
        one = BlockShape(shape.layers, shape.kv_heads, shape.head_dim, shape.dtype, 1)
        layout = one.tensors(1)
        if shape.bits:
            full = torch.zeros(shape.layers, shape.kv_heads, 1, shape.head_dim)
            keys, values = quant.quantize(full, shape.bits, quant.KEYS), quant.quantize(full, shape.bits, quant.VALUES)
        else:
            keys, values = (torch.zeros(layout["keys"][1], dtype=shape.dtype) for _ in range(2))
        block = KVBlock(torch.zeros(1, dtype=torch.long), keys, values, 0)
        secret = next((tier.secret for tier in (self.disk, self.remote) if tier is not None), None)
        return 8 + int.from_bytes(pack(self.fingerprint, "0" * 32, "none", block, secret)[:8], "little")

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
        if not self.pinned:
            return block
        block = block.map(lambda t: t if t.device.type == "cpu" and t.is_pinned() else self.host_copy(t, t.dtype))
        return KVBlock(block.token_ids.cpu(), block.keys, block.values, block.start)

    def _on_device(self, block: KVBlock) -> KVBlock:
        """A device copy of `block`'s KV, queued (`non_blocking`) behind the work already on the device."""
        return block.map(lambda t: t.to(self.device, non_blocking=True))

    def get(self, key: str, context: str) -> tuple[KVBlock | None, str]:
        """Return (block, tier) with tier 'device', 'memory', 'disk', 'remote' or 'miss'. A hit below the
        top tier is copied into the tiers above it, and the copy nearest the device is returned."""
        return self.get_many([(key, context)])[key]

    def get_many(self, items: list[tuple[str, str]]) -> dict[str, tuple[KVBlock | None, str]]:
        """`get` for several (key, context) pairs, each tier asked once for what the tiers above it missed
        (the remote tier fetches its share together, `RemoteTier.get_many`)."""
        found, missing = {}, list(dict.fromkeys(items))
        for level, tier in enumerate(self.tiers):
            if not missing:
                break
            contexts = dict(missing)
            for key, block in tier.get_many(missing).items():
                for upper in reversed(self.tiers[:level]):
                    block = upper.put(key, contexts[key], block)
                found[key] = block, tier.name
            missing = [(key, context) for key, context in missing if key not in found]
        for key, _ in missing:
            found[key] = None, "miss"
        return found

    def put(self, key: str, context: str, block: KVBlock, disk: bool = True, strict: bool = False) -> None:
        """Keep `block` in memory, on the device when there is a device tier, and (unless `disk` is False:
        KV of one request, not worth keeping) on disk and in the remote tier. A full disk raises
        DiskFullError with `strict` (indexing, whose point is the files); otherwise the block stays in
        memory, and the first time this store finds no room it says so."""
        host = self._on_host(block)
        for tier in (self.disk, self.remote) if disk else ():
            if tier is None:
                continue
            try:
                tier.put(key, context, host)
            except DiskFullError as exc:
                if strict:
                    raise
                if not self._full_reported:
                    self._full_reported = True
                    warnings.warn(f"kvrag: {exc}; KV not written to disk stays in memory only", RuntimeWarning,
                                  stacklevel=2)
        self.memory.put(key, context, host)
        if self.device_tier is not None:
            self.device_tier.put(key, context, block)

    def drop(self, key: str, why: str) -> None:
        """Delete a block found unfit to serve from every tier, and say why once."""
        warnings.warn(f"kvrag: dropping unusable KV block {key}: {why}", RuntimeWarning, stacklevel=3)
        for tier in self.tiers:
            tier.delete(key)
