"""Reading and writing token slots of vLLM's paged caches, and moving keys to new positions."""

import pytest
import torch

from kvrag_vllm import paged, positions

BLOCKS, HEADS, BLOCK_SIZE, HEAD_DIM = 5, 3, 16, 8


def test_cpu_vec_layout_keeps_a_blocks_keys_dimension_major_then_its_values():
    cache = torch.zeros(BLOCKS, HEADS, BLOCK_SIZE, 2 * HEAD_DIM)
    keys, values = paged.views(cache, "CPU_ATTN/vec", HEAD_DIM)
    k, v = torch.randn(HEADS, 20, HEAD_DIM), torch.randn(HEADS, 20, HEAD_DIM)
    where = paged.slots([4, 1], 0, 20, BLOCK_SIZE)  # tokens 0-15 in block 4, 16-19 in block 1
    paged.write(keys, where, k)
    paged.write(values, where, v)
    raw = cache.view(BLOCKS, HEADS, 2, BLOCK_SIZE * HEAD_DIM)
    key_half = raw[:, :, 0].view(BLOCKS, HEADS, HEAD_DIM, BLOCK_SIZE)
    torch.testing.assert_close(key_half[4, :, :, 3], k[:, 3], rtol=0, atol=0)  # dimension d of slot t at d·16 + t
    torch.testing.assert_close(key_half[1, :, :, 2], k[:, 18], rtol=0, atol=0)
    value_half = raw[:, :, 1].view(BLOCKS, HEADS, BLOCK_SIZE, HEAD_DIM)
    torch.testing.assert_close(value_half[1, :, 2], v[:, 18], rtol=0, atol=0)
    torch.testing.assert_close(paged.read(keys, where), k, rtol=0, atol=0)
    torch.testing.assert_close(paged.read(values, where), v, rtol=0, atol=0)
    assert cache[0].abs().sum() == 0  # nothing outside the slots written


@pytest.mark.parametrize("backend", ["FLASH_ATTN", "FLASHINFER"])
def test_gpu_layouts_split_each_slots_channels_into_key_then_value(backend):
    # the logical [blocks, heads, block_size, 2·head_dim] view vLLM 0.32 hands over, physically NHD (LBNHC)
    physical = torch.zeros(BLOCKS, BLOCK_SIZE, HEADS, 2 * HEAD_DIM)
    cache = physical.permute(0, 2, 1, 3)
    keys, values = paged.views(cache, backend, HEAD_DIM)
    k, v = torch.randn(HEADS, 3, HEAD_DIM), torch.randn(HEADS, 3, HEAD_DIM)
    where = paged.slots([2], 5, 8, BLOCK_SIZE)
    paged.write(keys, where, k)
    paged.write(values, where, v)
    torch.testing.assert_close(physical[2, 6, :, :HEAD_DIM], k[:, 1], rtol=0, atol=0)
    torch.testing.assert_close(physical[2, 6, :, HEAD_DIM:], v[:, 1], rtol=0, atol=0)
    torch.testing.assert_close(paged.read(keys, where), k, rtol=0, atol=0)


def test_an_unknown_layout_is_refused_by_name():
    with pytest.raises(ValueError, match="CPU_ATTN/amx"):
        paged.views(torch.zeros(BLOCKS, HEADS, BLOCK_SIZE, 2 * HEAD_DIM), "CPU_ATTN/amx", HEAD_DIM)


def _rope(x, position, frequencies, neox):
    """x [tokens, head_dim] rotated to `position` from scratch (the definition, not the code under test)."""
    angles = (frequencies * position).float()
    cos, sin = angles.cos(), angles.sin()
    if neox:
        first, second = x.chunk(2, -1)
        return torch.cat([first * cos - second * sin, second * cos + first * sin], -1)
    even, odd = x[..., 0::2], x[..., 1::2]
    out = torch.empty_like(x)
    out[..., 0::2], out[..., 1::2] = even * cos - odd * sin, odd * cos + even * sin
    return out


@pytest.mark.parametrize("neox", [True, False])
def test_keys_move_by_the_rotation_of_the_position_difference(neox):
    from types import SimpleNamespace

    config = SimpleNamespace(model_type="llama" if neox else "gptj", rope_parameters={"rope_theta": 10000.0})
    frequencies = positions.inv_freq(config, HEAD_DIM)
    assert positions.neox_style(config) is neox
    raw = torch.randn(4, HEAD_DIM)
    at_3 = _rope(raw, 3, frequencies, neox)
    moved = positions.rotate(at_3[None], 997, frequencies, neox)[0]
    torch.testing.assert_close(moved, _rope(raw, 1000, frequencies, neox), rtol=1e-5, atol=1e-5)


def test_scaled_rope_takes_transformers_frequencies_and_dynamic_is_refused():
    from transformers import LlamaConfig
    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

    config = LlamaConfig(hidden_size=64, num_attention_heads=4, max_position_embeddings=4096,
                         rope_parameters={"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0,
                                          "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                                          "original_max_position_embeddings": 1024})
    torch.testing.assert_close(positions.inv_freq(config, 16).float(), LlamaRotaryEmbedding(config).inv_freq.float())
    config.rope_parameters = {"rope_type": "dynamic", "rope_theta": 10000.0, "factor": 2.0}
    with pytest.raises(ValueError, match="dynamic"):
        positions.inv_freq(config, 16)
