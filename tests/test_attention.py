"""kvrag's attention function against SDPA over the explicit mask, on each of the paths it picks."""

import pytest
import torch
import torch.nn.functional as F

from kvrag import kernels
from kvrag.attention import causal_mask, grouped_sdpa_attention, mask


@pytest.mark.parametrize(
    "n,past",
    [
        (100, 0),  # nothing cached: plain causal
        (100, 30),  # a long run after a few cached keys: flash attention's causal path
        (100, 100),
        (70, 300),  # after more cached keys than queries: masked, a query chunk at a time
        (20, 300),  # a question after cached keys: the C kernel where it applies
    ],
)
def test_queries_after_cached_keys_see_exactly_the_causal_mask(n, past, monkeypatch):
    monkeypatch.setattr(kernels, "bf16", False)  # float32 throughout: exact to round-off
    g = torch.Generator().manual_seed(n + past)
    query = torch.randn(1, 9, n, 64, generator=g)
    key, value = torch.randn(2, 1, 3, past + n, 64, generator=g)
    mask = causal_mask(n, past, torch.float32)
    expected = F.scaled_dot_product_attention(query, key, value, attn_mask=mask.clone(), enable_gqa=True)
    out, _ = grouped_sdpa_attention(None, query, key, value, mask, kvrag_cached=past)
    torch.testing.assert_close(out, expected.transpose(1, 2), rtol=1e-5, atol=1e-5)
    read, _ = grouped_sdpa_attention(None, query, key, value, mask)  # any other mask is read as given
    torch.testing.assert_close(read, expected.transpose(1, 2), rtol=1e-5, atol=1e-5)


def test_one_mask_builder_makes_causal_position_and_block_masks():
    causal = mask(torch.arange(2, 5), 5, torch.float32)[0, 0] == 0
    assert causal.tolist() == [[True, True, True, False, False], [True] * 4 + [False], [True] * 5]
    at = mask(torch.tensor([1, 3]), 4, torch.float32)[0, 0] == 0  # blend's recomputed tokens
    assert at.tolist() == [[True, True, False, False], [True] * 4]
    blocks = torch.tensor([0, 0, 1, 1, 2, 2])  # two blocks, then the question: block attention
    seen = mask(torch.arange(6), 6, torch.float32, blocks)[0, 0] == 0
    assert seen.tolist() == [
        [True, False, False, False, False, False],
        [True, True, False, False, False, False],
        [False, False, True, False, False, False],
        [False, False, True, True, False, False],
        [True, True, True, True, True, False],
        [True] * 6,
    ]


def test_queries_after_cached_keys_without_a_mask_are_refused():
    """TurboRAG's trap: `is_causal` would align the triangle to the wrong corner."""
    query, key = torch.randn(1, 9, 100, 64), torch.randn(1, 3, 130, 64)
    with pytest.raises(RuntimeError, match="explicit attention mask"):
        grouped_sdpa_attention(None, query, key, key, None)
