"""Blocks in, one workspace cache out: fetch each block's KV from the store (encoding it on a miss)
and write it into consecutive workspace slots, rotated from the position it was encoded at to the
position it takes in this prompt."""

import threading
from collections import OrderedDict
from dataclasses import dataclass

import torch

from . import families, kernels, quant
from .attention import APE_READING, forward, forward_packed
from .quant import Quantized
from .rope import delta_cos_sin, shift_keys
from .store import BadBlock, KVBlock, KVStore
from .workspace import Workspace, WorkspacePool


@dataclass
class Piece:
    block: KVBlock
    position: int  # where the block's first token sits in the assembled prompt


def fill(workspace: Workspace, pieces: list[Piece], inv_freq: torch.Tensor, slot: int = 0) -> int:
    """Copy the pieces' KV into consecutive workspace slots from `slot`; return the slot after them.
    A block whose layers, heads, tokens or head dim differ from the slots it is meant for is refused
    (BadBlock) before anything is written: copied as it is, it would leave slots holding another
    request's KV, or write past the workspace.

    On a GPU nothing here waits for the device: blocks come from pinned host memory (or are on the
    device already) through `non_blocking` copies and the rotation runs on the device, so the caller
    goes on to fetch the next block while this one is copied. 8- and 4-bit blocks are dequantized on the way
    (on the CPU by the C kernel where it applies, in one pass with the rotation)."""
    lib = kernels.library()
    for piece in pieces:
        block, n = piece.block, len(piece.block)
        keys = workspace.keys[:, 0, :, slot : slot + n]  # [layers, kv_heads, n, head_dim]
        values = workspace.values[:, 0, :, slot : slot + n]
        if not block.keys.shape == block.values.shape == keys.shape:
            raise BadBlock(f"KV of shape {tuple(block.keys.shape)} for workspace slots of shape {tuple(keys.shape)}")
        delta = piece.position - block.start
        cos, sin = delta_cos_sin(delta, inv_freq, keys.dtype)
        if isinstance(block.keys, Quantized):
            if lib and kernels.fill_quantized_applies(block.keys, block.values, keys, values):
                kernels.fill_quantized(lib, block.keys, block.values, keys, values, cos, sin)
            else:
                quant.dequantize_into(block.keys, keys, *((cos, sin) if delta else ()))
                quant.dequantize_into(block.values, values)
        elif lib and kernels.fill_applies(block.keys, block.values, keys, values):
            kernels.fill_block(lib, block.keys, block.values, keys, values, cos, sin)
        else:
            if delta == 0:
                keys.copy_(block.keys, non_blocking=True)
            else:
                shift_keys(block.keys, cos, sin, out=keys)
            values.copy_(block.values, non_blocking=True)
        slot += n
    return slot


class Blocks:
    """One weight set's blocks: their store, how they are encoded, and how a prompt's are assembled.

    `block_context` "none" encodes a passage alone (Block-Attention); "prefix" encodes it after the
    prompt's prefix, which then becomes part of its key (every block shares that attention sink); "ape" after
    `shared_prefix` (the engine's own prompt prefix, whatever the prompt's is, so that a prompt whose question
    comes first still reuses it), and block mode's question and answer read the passages at APE's temperature
    and scale (`ape`: (T, S), see attention.py): APE's whole recipe; "document" encodes a passage indexed with
    the text before it in its document after that text (`encode_many`'s `leads`), keeping the passage's KV
    alone (FusionRAG's context at indexing), and any other passage alone."""

    def __init__(self, model, store: KVStore, pool: WorkspacePool, storage_dtype: torch.dtype, block_context: str,
                 shared_prefix: list[int] | None = None):
        self.model, self.store, self.pool = model, store, pool
        self.storage_dtype, self.block_context = storage_dtype, block_context
        self.shared_prefix = list(shared_prefix or [])
        self.ape = APE_READING if block_context == "ape" else None
        self.inv_freq = families.family(model.config).inv_freq(model)
        self._prefixes_seen: OrderedDict[str, None] = OrderedDict()  # prefixes computed once, kept in memory only
        self._seen_lock = threading.Lock()

    def _recurs(self, key: str) -> bool:
        """Whether a prefix not on disk was computed before in this process. A rendered prompt that puts
        the question before its passages has a prefix of its own per question: writing every one to disk
        would fill it with KV that is never read again."""
        with self._seen_lock:
            if key in self._prefixes_seen:
                del self._prefixes_seen[key]
                return True
            self._prefixes_seen[key] = None
            if len(self._prefixes_seen) > 4096:
                self._prefixes_seen.popitem(last=False)
            return False

    def encoded_after(self, prefix: list[int]) -> list[int] | None:
        """What passage blocks are encoded after: nothing, the prefix, or (ape) the shared one."""
        if self.block_context == "ape":
            return self.shared_prefix or None
        return prefix if self.block_context == "prefix" and prefix else None

    def context(self, prefix: list[int]) -> str:
        """Block context string: part of every passage block's key."""
        after = self.encoded_after(prefix)
        if after:
            return f"prefix:{self.store.key('none', after)}"
        return "document" if self.block_context == "document" else "none"

    def keys(self, prefix: list[int], blocks: list[list[int]]) -> list[str]:
        context = self.context(prefix)
        return [self.store.key(context, ids) for ids in blocks]

    @torch.inference_mode()
    def encode(self, ids: list[int], after: list[int] | None = None) -> KVBlock:
        """KV of `ids` alone at position 0, or right after the (cached) block `after`."""
        return self.encode_many([ids], after)[0]

    @torch.inference_mode()
    def encode_many(self, ids_list: list[list[int]], after: list[int] | None = None,
                    leads: list[list[int]] | None = None) -> list[KVBlock]:
        """`encode` of several passages in one forward (`forward_packed`, each in its own workspace and
        attending to itself alone): on a GPU the linear layers then see all their tokens at once. `leads`: the
        tokens each passage is encoded after, computed with it and not kept (block context "document")."""
        leads = leads or [[] for _ in ids_list]
        workspaces = []
        try:
            for ids, lead in zip(ids_list, leads, strict=True):
                workspaces.append(self.pool.acquire(len(after or ()) + len(lead) + len(ids)))
            starts = [self._place_after(ws, after) for ws in workspaces]
            runs = [lead + ids for lead, ids in zip(leads, ids_list)]
            if len(ids_list) == 1:
                forward(self.model, runs[0], workspaces[0].cache(starts[0]), starts[0], keep=-1,
                        causal_only=not starts[0])
            else:
                forward_packed(self.model, [(run, ws.cache(start), start)
                                            for run, ws, start in zip(runs, workspaces, starts)])
            return [self.copy_out(ws, start + len(lead), ids)
                    for ids, lead, ws, start in zip(ids_list, leads, workspaces, starts)]
        finally:
            for ws in workspaces:
                self.pool.release(ws)

    def _place_after(self, ws: Workspace, after: list[int] | None) -> int:
        """Put the cached block `after` at the start of `ws` (nothing if None); the slot after it."""
        if after is None:
            return 0
        part = (self.store.key("none", after), "none", after, None, True)
        start, _, _ = self.place(ws, 0, part, self.store.get(part[0], "none"))
        return start

    def copy_out(self, ws: Workspace, slot: int, ids: list[int]) -> KVBlock:
        """A stored copy of the KV that `ids` left in workspace slots slot.. (keys as encoded there): on
        the host in the storage dtype or format (quantized where the workspace is), pinned for a GPU, and complete
        when this returns."""
        span = slice(slot, slot + len(ids))
        bits = quant.bits_of(self.storage_dtype)
        if bits is None:
            keys, values = (self.store.host_copy(t[:, 0, :, span], self.storage_dtype) for t in (ws.keys, ws.values))
        else:
            keys, values = (quant.quantize(t[:, 0, :, span], bits, per).map(lambda x: self.store.host_copy(x, x.dtype))
                            for t, per in ((ws.keys, quant.KEYS), (ws.values, quant.VALUES)))
        return KVBlock(torch.tensor(ids, dtype=torch.long), keys, values, slot)

    def fetch(self, key: str, context: str, ids: list[int], after: list[int] | None = None, disk: bool = True):
        """(block, tier) from the store, encoding and storing the block on a miss (in memory only, if told)."""
        block, tier = self.store.get(key, context)
        if block is None:
            block, tier = self.compute(key, context, ids, after, disk), "computed"
        return block, tier

    def place(self, ws: Workspace, slot: int, part, found, reorder: bool = True) -> tuple[int, KVBlock, str]:
        """Write a block into `ws` from `slot`, moved there (`reorder`) or left where it was encoded; returns
        (next slot, block, tier). `part`: (key, context, ids, encoded after, to disk); `found`: what the store
        gave, (block or None, tier). A stored block that does not fit the workspace is deleted from every
        tier, said once, and computed afresh."""
        key, context, ids, after, disk = part
        block, tier = found
        if block is None:
            block, tier = self.compute(key, context, ids, after, disk), "computed"
        try:
            return fill(ws, [Piece(block, slot if reorder else block.start)], self.inv_freq, slot), block, tier
        except BadBlock as exc:
            if tier == "computed":
                raise
            self.store.drop(key, f"{exc} (from the {tier} tier)")
        return self.place(ws, slot, part, (None, "computed"), reorder)

    def compute(self, key: str, context: str, ids: list[int], after: list[int] | None = None, disk: bool = True):
        block = self.encode(ids, after)
        self.store.put(key, context, block, disk=disk)
        return block

    def assemble(self, prompt, keys: list[str], ws: Workspace, reorder: bool = True):
        """Write the prefix's and blocks' KV into `ws`, each block moved to where it sits (`reorder`)
        or left where it was encoded. Returns the slots filled, a bool per slot telling whether its KV
        came from the store, and the hits per tier. The blocks are looked up together first (those no
        local tier holds come from the remote tier in few round trips); on a GPU their copies to the
        device are queued as they are read, and run while the next are read."""
        hits: dict[str, int] = {}
        context, after = self.context(prompt.prefix), self.encoded_after(prompt.prefix)
        parts = [(self.store.key("none", prompt.prefix), "none", prompt.prefix, None)] if prompt.prefix else []
        parts += [(k, context, ids, after) for k, ids in zip(keys, prompt.blocks)]
        found = self.store.get_many(list(dict.fromkeys((key, ctx) for key, ctx, _, _ in parts)))
        slot, stored = 0, []
        for n, (key, ctx, ids, encoded_after) in enumerate(parts):
            prefix = n == 0 and bool(prompt.prefix)
            looked_up = found.pop(key, None) or self.store.get(key, ctx)  # not there: a repeat (separators)
            start = slot
            slot, block, tier = self.place(ws, slot, (key, ctx, ids, encoded_after, not prefix), looked_up, reorder)
            if prefix and not self.store.persisted(key) and self._recurs(key):  # a prefix: to disk from its second sight
                self.store.put(key, ctx, block)
            hits[tier] = hits.get(tier, 0) + 1
            stored += [tier != "computed"] * (slot - start)
        return slot, torch.tensor(stored, dtype=torch.bool), hits
