"""Writing cached blocks into a workspace, each rotated from the position it was encoded at to
the position it takes in this prompt."""

from dataclasses import dataclass

import torch

from . import kernels
from .rope import delta_cos_sin, shift_keys
from .store import KVBlock


@dataclass
class Piece:
    block: KVBlock
    position: int  # where the block's first token sits in the assembled prompt


def fill(workspace, pieces: list[Piece], inv_freq: torch.Tensor) -> int:
    """Copy the pieces' KV into consecutive workspace slots; return the number of slots filled."""
    slot, lib = 0, kernels.library()
    for piece in pieces:
        block, n = piece.block, len(piece.block)
        keys = workspace.keys[:, 0, :, slot : slot + n]  # [layers, kv_heads, n, head_dim]
        values = workspace.values[:, 0, :, slot : slot + n]
        delta = piece.position - block.start
        cos, sin = delta_cos_sin(torch.tensor([delta]), inv_freq, keys.dtype)
        if lib and kernels.fill_applies(block.keys, block.values, keys, values):
            kernels.fill_block(lib, block.keys, block.values, keys, values, cos, sin)
        else:
            if delta == 0:
                keys.copy_(block.keys)
            else:
                shift_keys(block.keys, cos.to(keys.device), sin.to(keys.device), out=keys)
            values.copy_(block.values)
        slot += n
    return slot
