"""kvrag's attention function against SDPA over the explicit mask, on each of the paths it picks."""

import math

import pytest
import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

from kvrag import attention, kernels
from kvrag.attention import causal_mask, grouped_sdpa_attention, mask
from tiny import TOLERANCE


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


# The CUDA path (`attention._fused`), case by case, with the mask and `kvrag_cached` kvrag's callers pass.
CASES = ["decode", "question", "prefix rest", "causal", "blend", "fine-tuning", "per-head", "window"]
SHAPES = {"grouped": (9, 3, 64), "one kv head": (4, 1, 16), "not grouped": (4, 4, 32)}  # heads, kv heads, head dim
ROUTES = {  # the kernel each case goes to with flash attention available, and without (float32)
    "decode": ("folded", "folded"),
    "question": ("flash", "folded with mask"),
    "prefix rest": ("flash", "folded with mask"),
    "causal": ("flash", "folded with mask"),
    "blend": ("folded with mask", "folded with mask"),
    "fine-tuning": ("folded with mask", "folded with mask"),
    "per-head": ("folded with mask", "folded with mask"),
    "window": ("folded with mask", "folded with mask"),
}


def attention_case(name: str, heads=9, kv_heads=3, dim=64, dtype=torch.float32, device="cpu"):
    """Query [1, heads, n, dim] (laid out as a model's projection leaves it), key, value, the mask and
    `kvrag_cached` kvrag's callers pass, and the boolean mask that defines the case."""
    g = torch.Generator().manual_seed(len(name) + heads)
    passed = cached = None
    if name in ("decode", "question", "prefix rest", "causal"):  # `forward`: n tokens after `past` cached ones
        n, past = {"decode": (1, 4096), "question": (20, 4096), "prefix rest": (150, 100), "causal": (120, 0)}[name]
        defining = causal_mask(n, past, torch.float32) == 0
        if past:  # with nothing cached `forward` passes no mask (causal_only)
            passed, cached = causal_mask(n, past, dtype), past
    elif name == "blend":  # recomputed passage tokens, then the question, over the whole prompt
        active = torch.cat([torch.randperm(380, generator=g)[:60].sort().values, torch.arange(380, 400)])
        defining, passed = mask(active, 400, torch.float32) == 0, mask(active, 400, dtype)
    elif name == "fine-tuning":  # three blocks, then the question's, trained through
        blocks = torch.arange(4).repeat_interleave(torch.tensor([30, 60, 60, 50]))
        defining = mask(torch.arange(200), 200, torch.float32, blocks) == 0
        passed = mask(torch.arange(200), 200, dtype, blocks)
    elif name == "per-head":  # a boolean mask that differs by head, as transformers may pass one
        defining = passed = torch.rand(1, heads, 30, 90, generator=g) < 0.6
        defining[..., 0] = True
    else:  # one query that sees only the last keys (transformers' sliding window): masked, not causal
        defining = passed = (torch.arange(301) > 200)[None, None, None]
    n, keys = defining.shape[-2:]
    query = torch.randn(1, n, heads, dim, generator=g).transpose(1, 2)
    key, value = torch.randn(2, 1, kv_heads, keys, dim, generator=g)
    query, key, value = (t.to(device, dtype) for t in (query, key, value))
    return query, key, value, None if passed is None else passed.to(device), cached, defining.to(device)


def run(query, key, value, passed, cached, train: bool):
    """kvrag's attention [1, n, heads, dim], and when `train` the gradients of its inputs under a fixed projection."""
    inputs = [t.detach().requires_grad_(train) for t in (query, key, value)]
    out, _ = grouped_sdpa_attention(None, *inputs, passed, kvrag_cached=cached)
    if train:
        out.float().mul(torch.linspace(-1, 1, out.shape[-1], device=out.device)).sum().backward()
    return out, [t.grad for t in inputs] if train else []


def reference(query, key, value, defining, train: bool):
    """`run`'s results from plain float32 SDPA, each key/value head repeated for its query heads, the mask explicit."""
    inputs = [t.detach().float().requires_grad_(train) for t in (query, key, value)]
    groups = query.shape[1] // key.shape[1]
    key, value = (t.repeat_interleave(groups, dim=1) for t in inputs[1:])
    out = F.scaled_dot_product_attention(inputs[0], key, value, attn_mask=defining).transpose(1, 2)
    if train:
        out.mul(torch.linspace(-1, 1, out.shape[-1], device=out.device)).sum().backward()
    return out, [t.grad for t in inputs] if train else []


@pytest.mark.parametrize("flash", [True, False], ids=["flash", "no-flash"])
@pytest.mark.parametrize("shape", SHAPES.values(), ids=SHAPES.keys())
@pytest.mark.parametrize("name", CASES)
def test_the_cuda_path_equals_repeated_heads_under_the_explicit_mask(name, shape, flash, monkeypatch):
    """The CUDA path's tensor logic run on CPU (SDPA's materialised fallback stands in for the fused kernels):
    exact to float32 round-off, gradients included, with flash attention available and without."""
    monkeypatch.setattr(attention, "FUSED_DEVICES", {"cpu"})
    monkeypatch.setattr(attention, "_flash_applies", lambda *args: flash)
    monkeypatch.setattr(kernels, "attention_applies", lambda *args: False)  # the C kernel is CPU's own
    query, key, value, passed, cached, defining = attention_case(name, *shape)
    train = name == "fine-tuning"
    out, grads = run(query, key, value, passed, cached, train)
    expected, expected_grads = reference(query, key, value, defining, train)
    torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-5)
    for grad, expected_grad in zip(grads, expected_grads, strict=True):
        torch.testing.assert_close(grad, expected_grad, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("flash", [True, False], ids=["flash", "no-flash"])
@pytest.mark.parametrize("name", CASES)
def test_the_cuda_path_takes_flash_for_causal_runs_and_folds_the_rest(name, flash, monkeypatch):
    """Bottom-right causal runs to flash attention where it applies; a single query folded with no mask;
    any other mask (and anything flash does not take) folded with its mask, for memory-efficient attention."""
    taken = []
    folded, lower_right = attention._folded, attention.causal_lower_right

    def spy_folded(query, key, value, mask, *args):
        taken.append("folded" if mask is None else "folded with mask")
        return folded(query, key, value, mask, *args)

    def spy_lower_right(*size):
        taken.append("flash")
        return lower_right(*size)

    monkeypatch.setattr(attention, "FUSED_DEVICES", {"cpu"})
    monkeypatch.setattr(attention, "_flash_applies", lambda *args: flash)
    monkeypatch.setattr(attention, "_folded", spy_folded)
    monkeypatch.setattr(kernels, "attention_applies", lambda *args: False)
    monkeypatch.setattr(attention, "causal_lower_right", spy_lower_right)
    query, key, value, passed, cached, _ = attention_case(name)
    grouped_sdpa_attention(None, query, key, value, passed, kvrag_cached=cached)
    assert taken == [ROUTES[name][0 if flash else 1]]


def test_folded_masks_are_additive_in_the_query_dtype_with_aligned_rows():
    """Memory-efficient attention reads only such masks without SDPA padding a copy of each first."""
    visible = torch.rand(1, 1, 5, 50) < 0.5
    folded = attention._fold_mask(visible, 3, 5, 2, torch.bfloat16)
    assert folded.dtype == torch.bfloat16 and folded.shape == (1, 1, 15, 50)
    assert all(stride % attention.MASK_ALIGNMENT == 0 for stride in folded.stride()[:-1])
    assert torch.equal(folded == 0, visible.repeat(1, 1, 3, 1))  # group after group, each with every row


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=str)
@pytest.mark.parametrize("name", CASES)
def test_every_case_runs_on_a_fused_kernel(name, dtype, device, monkeypatch):
    """With the math kernel ruled out, each case runs as kvrag runs it on `device` and matches the float32
    reference: on CUDA through flash or memory-efficient attention, a question or decoding step over a long
    cache in less memory than one copy of its keys (repeated heads would take several); on CPU through the
    C kernel or SDPA's CPU flash kernel."""
    monkeypatch.setattr(kernels, "bf16", False)  # the C kernel in float32 throughout
    query, key, value, passed, cached, defining = attention_case(name, dtype=dtype, device=device)
    train = name == "fine-tuning"
    expected, expected_grads = reference(query, key, value, defining, train)
    if device == "cuda":
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        before = torch.cuda.memory_allocated()
    with sdpa_kernel([SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION]):
        out, grads = run(query, key, value, passed, cached, train)
    if device == "cuda" and name in ("decode", "question"):
        assert torch.cuda.max_memory_allocated() - before < key.nbytes
    tolerance = TOLERANCE[dtype]
    torch.testing.assert_close(out.float(), expected, rtol=tolerance, atol=tolerance)
    for grad, expected_grad in zip(grads, expected_grads, strict=True):
        torch.testing.assert_close(grad.float(), expected_grad, rtol=tolerance, atol=tolerance)


def ape_reference(query, key, value, past, first, end, temperature, scale):
    """APE's attention as its paper writes it: the prefix's, the passages' and the rest's keys each a softmax of
    its own, the passages' at temperature T, mixed by their log-sum-exps, the passages' one T * LSE + log S.
    Heads repeated, one query at a time."""
    groups = query.shape[1] // key.shape[1]
    key, value = key[0].repeat_interleave(groups, 0), value[0].repeat_interleave(groups, 0)  # [heads, keys, dim]
    rows = []
    for i in range(query.shape[2]):
        scores = torch.einsum("hd,hkd->hk", query[0, :, i], key) * query.shape[-1] ** -0.5
        parts = [(slice(0, first), 1.0, 0.0), (slice(first, end), temperature, math.log(scale)),
                 (slice(end, past + i + 1), 1.0, 0.0)]
        lse = torch.stack([t * (scores[:, s] / t).logsumexp(-1) + shift for s, t, shift in parts], -1)  # [heads, 3]
        outs = torch.stack([torch.einsum("hk,hkd->hd", (scores[:, s] / t).softmax(-1), value[:, s])
                            for s, t, _ in parts], 1)  # [heads, 3, dim]
        rows.append((lse.softmax(-1)[..., None] * outs).sum(1))  # [heads, dim]
    return torch.stack(rows)[None]  # [1, queries, heads, dim]


@pytest.mark.parametrize("n", [5, 70])  # a question, and one longer than a query chunk
def test_ape_reads_the_passages_as_its_paper_writes_it(n, monkeypatch):
    monkeypatch.setattr(kernels, "bf16", False)  # plain attention in float32 too, for the last comparison
    g = torch.Generator().manual_seed(n)
    past, first, end = 90, 7, 80
    query = torch.randn(1, 9, n, 64, generator=g)
    key, value = torch.randn(2, 1, 3, past + n, 64, generator=g)
    ape = attention.Ape(first, end, 0.8, 0.7)
    out, _ = grouped_sdpa_attention(None, query, key, value, causal_mask(n, past, torch.float32), kvrag_cached=past,
                                    kvrag_ape=ape)
    expected = ape_reference(query, key, value, past, first, end, 0.8, 0.7)
    torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-5)
    plain, _ = grouped_sdpa_attention(None, query, key, value, causal_mask(n, past, torch.float32), kvrag_cached=past)
    assert (out - plain).abs().max() > 1e-3  # it is not plain attention
    same, _ = grouped_sdpa_attention(None, query, key, value, causal_mask(n, past, torch.float32), kvrag_cached=past,
                                     kvrag_ape=attention.Ape(first, end, 1.0, 1.0))
    torch.testing.assert_close(same, plain, rtol=1e-5, atol=1e-5)  # T = S = 1 is plain attention
