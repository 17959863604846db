"""The data path on the model's device: blocks filled from the host (pinned for a GPU) or from the
device into workspaces on the device and moved to their positions there, copied back out to the host
in the storage dtype, and bfloat16 blocks through the disk tier. Tiny random models on every device
there is (`device`)."""

import pytest
import torch
from safetensors import safe_open
from test_invariants import random_prompt
from tiny import TOLERANCE
from transformers.models.llama.modeling_llama import rotate_half

from kvrag.assemble import Blocks, Piece, fill
from kvrag.store import KVBlock, KVStore

# (tokens, position encoded at, position filled at): moved by 0, forward, back, forward from 0
PIECES = [(5, 0, 0), (7, 3, 5), (6, 40, 12), (4, 0, 18)]


@pytest.mark.parametrize("arch", ["llama", "llama3-scaled"])
def test_fill_moves_blocks_to_their_positions_on_the_device(make_engine, device, arch):
    """Keys rotated by the model's own rotary embedding at one position, filled at another, equal the
    keys rotated at the other; from host blocks (pinned for a GPU) as from blocks on the device."""
    engine = make_engine(arch, device=device)
    rotary = engine.model.get_decoder().rotary_emb
    layers, kv_heads, head_dim = engine.pool.shape
    store = KVStore("0" * 64, device=device)
    g = torch.Generator().manual_seed(0)

    def rotated(raw, start):
        """raw keys [layers, kv_heads, n, head_dim] at positions start.., as the model's attention rotates them"""
        raw = raw.to(device)
        cos, sin = rotary(raw, torch.arange(start, start + raw.shape[2], device=device)[None])
        return raw * cos + rotate_half(raw) * sin

    pieces, expected = [], []
    for i, (n, start, position) in enumerate(PIECES):
        raw, values = torch.randn(2, layers, kv_heads, n, head_dim, generator=g)
        block = KVBlock(torch.arange(n), rotated(raw, start).cpu(), values, start)
        key = store.key(str(i), block.token_ids)
        store.put(key, str(i), block, disk=False)
        block, _ = store.get(key, str(i))
        assert block.keys.device.type == "cpu" and block.keys.is_pinned() == (device == "cuda")
        if i == 3:  # a block from the device tier
            block = KVBlock(block.token_ids, block.keys.to(device), block.values.to(device), start)
        pieces.append(Piece(block, position))
        expected.append((rotated(raw, position), values))
    ws = engine.pool.acquire(32)
    with torch.inference_mode():
        assert fill(ws, pieces[:2], engine.blocks.inv_freq) == 12
        assert fill(ws, pieces[2:], engine.blocks.inv_freq, 12) == 22  # as assemble fills, a block at a time
    slot, tolerance = 0, TOLERANCE[ws.keys.dtype]
    for (n, _, _), (keys, values) in zip(PIECES, expected):
        torch.testing.assert_close(ws.keys[:, 0, :, slot : slot + n], keys, rtol=tolerance, atol=tolerance)
        assert torch.equal(ws.values[:, 0, :, slot : slot + n].cpu(), values)
        slot += n


def test_copy_out_is_a_host_copy_in_the_storage_dtype(make_engine, device):
    engine = make_engine(device=device)
    blocks = Blocks(engine.model, KVStore("1" * 64, device=device), engine.pool, torch.bfloat16, "none")
    ws = engine.pool.acquire(16)
    assert ws.keys.device.type == ws.values.device.type == device  # workspaces live on the model's device
    ws.keys.normal_(), ws.values.normal_()
    expected = [t[:, 0, :, 3:7].to(torch.bfloat16).cpu() for t in (ws.keys, ws.values)]
    block = blocks.copy_out(ws, 3, [5, 6, 7, 8])
    ws.keys.zero_(), ws.values.zero_()  # the next request reuses the workspace: the block is a copy
    for got, want in zip((block.keys, block.values), expected):
        assert got.device.type == "cpu" and got.dtype == torch.bfloat16 and got.is_pinned() == (device == "cuda")
        assert torch.equal(got, want)
    assert block.token_ids.tolist() == [5, 6, 7, 8] and block.start == 3


def test_bfloat16_blocks_through_the_disk_tier(make_engine, tok, device, tmp_path):
    """bfloat16 blocks are computed, served from memory, written and read back from disk unchanged, and
    answer as the float32 blocks do, up to bfloat16's rounding."""
    prompt = random_prompt(len(tok))

    def block_mode(engine):
        state = engine.prefill(prompt, "block", all_logits=True)
        try:
            return state.logits.clone(), state.cache_hits
        finally:
            engine.release(state)

    first = make_engine(device=device, storage_dtype=torch.bfloat16, home=tmp_path / "bf16")
    top = "device" if first.store.device_tier is not None else "memory"
    computed, hits = block_mode(first)
    assert hits == {"computed": 4}  # the prefix and three passages
    again, hits = block_mode(first)  # the prefix goes to disk on this second sight
    assert hits == {top: 4}
    fresh = make_engine(device=device, storage_dtype=torch.bfloat16, home=tmp_path / "bf16")
    from_disk, hits = block_mode(fresh)
    assert hits == {"disk": 4}
    for key in first.blocks.keys(prompt.prefix, prompt.blocks):
        path = fresh.store.disk.path(key)
        with safe_open(path, framework="pt") as f:
            assert f.get_slice("keys").get_dtype() == "BF16"
        stored, read = first.store.memory.get(key), fresh.store.memory.get(key)
        assert read.keys.dtype == torch.bfloat16 and torch.equal(read.keys, stored.keys)
        assert torch.equal(read.values, stored.values)
    tolerance = TOLERANCE[torch.float32]
    torch.testing.assert_close(again, computed, rtol=tolerance, atol=tolerance)
    torch.testing.assert_close(from_disk, computed, rtol=tolerance, atol=tolerance)
    exact, _ = block_mode(make_engine(device=device, home=tmp_path / "f32"))
    rounding = (computed - exact).abs().max()
    assert TOLERANCE[torch.float32] < rounding < TOLERANCE[torch.bfloat16]
