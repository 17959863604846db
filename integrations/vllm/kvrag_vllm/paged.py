"""Where a token's key and value sit in one layer of vLLM's paged KV cache, per attention backend.

vLLM 0.32 hands a connector each layer's cache as a logical [blocks, kv_heads, block_size, 2·head_dim]
tensor (physical order per `KVCacheLayout`). The backends read it two ways:
- CPU_ATTN (its "vec" kernels, x86 without AMX) keeps the bytes of a (block, head) as the block's keys,
  then its values: keys dimension-major ([head_dim, block_size], so that a query meets a key's dimension d
  for every slot in one vector), values slot-major ([block_size, head_dim]);
- the GPU backends (FLASH_ATTN, FLASHINFER) split the last axis: key = [..., :head_dim], value = the rest.
`views` turns either into a keys view and a values view of shape [blocks, kv_heads, block_size, head_dim]
over the same memory, so that reading and writing slots is one piece of code for every backend.
"""

import torch

SPLIT_TOKENS = ("CPU_ATTN/vec",)
"""Measured on this layout alone (tests/test_vllm.py compares saved KV with the model's own); CPU_ATTN's
other kernels (amx, neon, vec16, ...) may pack keys otherwise, so the connector turns itself off there."""
SPLIT_CHANNELS = ("FLASH_ATTN", "FLASHINFER", "TRITON_ATTN")


def views(cache: torch.Tensor, backend: str, head_dim: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(keys, values), each [blocks, kv_heads, block_size, head_dim], views of one layer's `cache`."""
    if cache.dim() != 4 or cache.shape[-1] != 2 * head_dim:
        raise ValueError(f"a {backend} cache of shape {tuple(cache.shape)}: expected [blocks, kv_heads, block_size, "
                         f"2·{head_dim}]")
    blocks, heads, block_size, _ = cache.shape
    if backend in SPLIT_TOKENS:
        if not cache.is_contiguous():
            raise ValueError(f"{backend} expects a contiguous cache, got strides {cache.stride()}")
        halves = cache.view(blocks, heads, 2, block_size * head_dim)
        keys = halves[:, :, 0].view(blocks, heads, head_dim, block_size).transpose(2, 3)
        return keys, halves[:, :, 1].view(blocks, heads, block_size, head_dim)
    if backend in SPLIT_CHANNELS:
        return cache[..., :head_dim], cache[..., head_dim:]
    raise ValueError(f"kvrag's connector does not know where the {backend} attention backend keeps keys and values "
                     f"(it knows {', '.join(SPLIT_TOKENS + SPLIT_CHANNELS)})")


def slots(block_ids: list[int], start: int, stop: int, block_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(block, offset) of the request's tokens start..stop-1, given the request's blocks in order."""
    positions = torch.arange(start, stop)
    table = torch.as_tensor(block_ids, dtype=torch.long)
    return table[positions // block_size], positions % block_size


def write(view: torch.Tensor, where: tuple[torch.Tensor, torch.Tensor], data: torch.Tensor) -> None:
    """data [kv_heads, tokens, head_dim] into the slots `where` of a keys or values view."""
    blocks, offsets = where
    view[blocks.to(view.device), :, offsets.to(view.device)] = data.transpose(0, 1).to(view.dtype)


def read(view: torch.Tensor, where: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    """The [kv_heads, tokens, head_dim] held in the slots `where`."""
    blocks, offsets = where
    return view[blocks.to(view.device), :, offsets.to(view.device)].transpose(0, 1)
