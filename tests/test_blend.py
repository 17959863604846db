"""Blend mode (CacheBlend): invariant 3 of docs/design.md on tiny random-weight models of every supported
family, the token selection against a brute-force reference, and blend's settings."""

import copy

import pytest
import torch
from conftest import ARCHS
from test_invariants import question_logits, random_prompt
from tiny import TOLERANCE, block_mask, tiny_configs, tiny_model

from kvrag import BlendConfig, KVEngine
from kvrag.blend import prefill


@pytest.fixture
def deep_engine(tok, tmp_path):
    """Like `make_engine`, with 4 layers: room for check layers past the second."""

    def make(arch="llama", **kwargs):
        config = tiny_configs(len(tok))[arch]
        settings = {k: v for k, v in config.to_dict().items() if k != "layer_types"}
        deep = type(config)(**{**settings, "num_hidden_layers": 4})
        return KVEngine(tiny_model(deep), tok, home=tmp_path, storage_dtype=torch.float32, **kwargs)

    return make


def blend_logits(engine, prompt, **settings):
    state = engine.prefill(prompt, "blend", all_logits=True, blend=BlendConfig(**settings))
    try:
        return state.logits.clone()
    finally:
        engine.release(state)


@pytest.mark.parametrize("select", ["deviation", "lookahead"])
@pytest.mark.parametrize("arch", ARCHS)
def test_blend_endpoints_are_full_and_block(make_engine, tok, arch, select, device):
    engine = make_engine(arch, device=device)
    prompt = random_prompt(len(tok))
    full, block = question_logits(engine, prompt, "full"), question_logits(engine, prompt, "block")
    tolerance = TOLERANCE[engine.model.dtype]
    at = lambda ratio: blend_logits(engine, prompt, recompute_ratio=ratio, select=select)  # noqa: E731
    torch.testing.assert_close(at(1.0), full, rtol=tolerance, atol=tolerance)
    torch.testing.assert_close(at(0.0), block, rtol=tolerance, atol=tolerance)
    # in between the selection pass runs, and the result lies between the two
    half = at(0.5)
    assert (half[-1] - full[-1]).norm() < (block[-1] - full[-1]).norm()


@torch.inference_mode()
def recomputed(engine, prompt, config, auto=False):
    """The passage positions blend mode (or auto) recomputes for `prompt`."""
    ws = engine.pool.acquire(len(prompt) + 1)
    try:
        position, _, _ = engine.blocks.assemble(prompt, [engine.store.key("none", b) for b in prompt.blocks], ws)
        return prefill(engine.model, ws, prompt.ids(), len(prompt.prefix), position, prompt.block_starts(), config,
                       auto=auto)[1]
    finally:
        engine.pool.release(ws)


@pytest.mark.parametrize("arch, deviation", [("llama", "values"), ("qwen3", "keys"), ("llama3-scaled", "keys")])
def test_selection_takes_the_tokens_whose_kv_deviates_most_in_context(deep_engine, tok, arch, deviation):
    """On one check layer the chosen tokens are the top share by the distance between their cached
    K or V and those of a plain causal forward over the whole context (what the layers before the
    check compute, every token running)."""
    engine = deep_engine(arch)
    prompt = random_prompt(len(tok))
    context = prompt.ids()[: len(prompt) - len(prompt.question)]
    first = len(prompt.prefix)
    ws = engine.pool.acquire(len(prompt) + 1)
    with torch.inference_mode():
        engine.blocks.assemble(prompt, [engine.store.key("none", b) for b in prompt.blocks], ws)
        cached = (ws.values if deviation == "values" else ws.keys)[2][:, :, : len(context)].clone()
    engine.pool.release(ws)
    with torch.no_grad():
        in_context = engine.model(torch.tensor([context]), use_cache=True).past_key_values.layers[2]
    fresh = in_context.values if deviation == "values" else in_context.keys
    distance = (fresh - cached).square().sum(dim=(0, 1, 3))[first:]
    expected = (distance.topk(round(0.3 * len(distance))).indices + first).sort().values
    got = recomputed(engine, prompt, BlendConfig(recompute_ratio=0.3, check_layers=(2,), deviation=deviation, select="deviation"))
    assert got.tolist() == expected.tolist()
    # mode "auto": as few of them as hold 60% of the deviation
    ordered = distance.sort(descending=True)
    needed = int((ordered.values.cumsum(0) < 0.6 * distance.sum()).sum()) + 1
    config = BlendConfig(check_layers=(2,), deviation=deviation, select="deviation", coverage=0.6, least=0.0, most=1.0)
    assert recomputed(engine, prompt, config, auto=True).tolist() == (ordered.indices[:needed] + first).sort().values.tolist()


def question_reads(engine, prompt):
    """The attention the question pays each passage token on every layer in block attention, as the model's
    own eager attention computes it over the whole prompt with the block mask, renormalized over the context:
    [layers, heads, question tokens, passage tokens]."""
    lengths = [len(prompt.prefix), *map(len, prompt.blocks), len(prompt.question)]
    context, first = len(prompt) - len(prompt.question), len(prompt.prefix)
    reference = copy.deepcopy(engine.model)  # the engine's own attention kernel returns no weights
    reference.set_attn_implementation("eager")
    with torch.no_grad():
        weights = reference(torch.tensor([prompt.ids()]), attention_mask=block_mask(lengths),
                            position_ids=torch.arange(len(prompt))[None], output_attentions=True).attentions
    read = torch.stack(weights)[:, 0, :, context:, :context]
    return (read / read.sum(-1, keepdim=True))[..., first:]


def question_mass(engine, prompt, layer=1):
    """`question_reads` on `layer`, summed over the question's tokens and the heads."""
    return question_reads(engine, prompt)[layer].sum(dim=(0, 1))


@pytest.mark.parametrize("arch", ["llama", "qwen3", "llama3-scaled"])
def test_attention_selection_takes_what_the_question_reads_most(make_engine, tok, arch):
    """select="attention": the chosen tokens are the top share of the attention the question pays each
    passage token on the check layer (1)."""
    engine, layer = make_engine(arch), 1
    prompt = random_prompt(len(tok))
    first = len(prompt.prefix)
    mass = question_mass(engine, prompt, layer)
    expected = (mass.topk(round(0.3 * len(mass))).indices + first).sort().values
    config = BlendConfig(recompute_ratio=0.3, check_layers=(layer,), select="attention")
    got = recomputed(engine, prompt, config)
    assert got.tolist() == expected.tolist()
    assert got.tolist() != recomputed(engine, prompt, BlendConfig(recompute_ratio=0.3, check_layers=(layer,), select="deviation")).tolist()


@pytest.mark.parametrize("arch", ["llama", "qwen3", "llama3-scaled"])
def test_lookahead_takes_what_block_modes_question_pass_reads_most(deep_engine, tok, arch):
    """select="lookahead": the top share of the attention block mode's question pays each passage token,
    summed over every layer; auto: the fewest tokens holding `coverage` of it."""
    engine = deep_engine(arch)
    prompt = random_prompt(len(tok))
    first = len(prompt.prefix)
    mass = question_reads(engine, prompt).sum(dim=(0, 1, 2))
    expected = (mass.topk(round(0.3 * len(mass))).indices + first).sort().values
    got = recomputed(engine, prompt, BlendConfig(recompute_ratio=0.3, select="lookahead"))
    assert got.tolist() == expected.tolist()
    assert got.tolist() != recomputed(engine, prompt, BlendConfig(recompute_ratio=0.3, select="attention")).tolist()
    ordered = mass.sort(descending=True)
    needed = int((ordered.values.cumsum(0) < 0.6 * mass.sum()).sum()) + 1
    config = BlendConfig(select="lookahead", coverage=0.6, least=0.0, most=1.0)
    assert recomputed(engine, prompt, config, auto=True).tolist() == (ordered.indices[:needed] + first).sort().values.tolist()


@pytest.mark.parametrize("coverage", [0.3, 0.6, 0.9])
def test_auto_recomputes_the_fewest_tokens_holding_the_coverage(make_engine, tok, coverage):
    """mode "auto": the tokens the question reads most, as few as hold `coverage` of its attention on the
    passages; the share follows the request, within [least, most]."""
    engine = make_engine("llama")
    prompt = random_prompt(len(tok))
    first = len(prompt.prefix)
    mass = question_mass(engine, prompt)
    ordered = mass.sort(descending=True)
    needed = int((ordered.values.cumsum(0) < coverage * mass.sum()).sum()) + 1
    got = recomputed(engine, prompt, BlendConfig(select="attention", coverage=coverage, least=0.0, most=1.0), auto=True)
    assert got.tolist() == (ordered.indices[:needed] + first).sort().values.tolist()
    assert mass[got - first].sum() >= coverage * mass.sum() * (1 - 1e-5)
    bounded = recomputed(engine, prompt, BlendConfig(select="attention", coverage=coverage, least=0.0, most=0.1), auto=True)
    assert len(bounded) == min(needed, round(0.1 * len(mass)))


def test_auto_endpoints_are_full_and_block(make_engine, tok):
    engine = make_engine("qwen2")
    prompt = random_prompt(len(tok))
    full, block = question_logits(engine, prompt, "full"), question_logits(engine, prompt, "block")

    def auto(**settings):
        state = engine.prefill(prompt, "auto", all_logits=True, blend=BlendConfig(**settings))
        try:
            return state.logits.clone()
        finally:
            engine.release(state)

    tolerance = TOLERANCE[engine.model.dtype]
    torch.testing.assert_close(auto(least=1.0, most=1.0), full, rtol=tolerance, atol=tolerance)
    torch.testing.assert_close(auto(least=0.0, most=0.0), block, rtol=tolerance, atol=tolerance)


def test_gradual_filtering_and_block_sinks(deep_engine, tok):
    engine = deep_engine("qwen2")
    prompt = random_prompt(len(tok))
    first = len(prompt.prefix)
    starts = prompt.block_starts()
    candidates = sum(map(len, prompt.blocks))
    narrowed = recomputed(engine, prompt, BlendConfig(0.25, check_layers=(1, 2, 3), widen=3.0))
    assert len(narrowed) == round(0.25 * candidates) and narrowed.tolist() == sorted(set(narrowed.tolist()))
    assert all(first <= p < first + candidates for p in narrowed.tolist())
    assert len(recomputed(engine, prompt, BlendConfig(0.25, check_layers=(1, 2, 3), widen=3.0, select="attention"))) == len(narrowed)
    with_sinks = recomputed(engine, prompt, BlendConfig(0.25, sink_tokens=2))
    sinks = {s + i for s in starts for i in range(2)}
    assert sinks <= set(with_sinks.tolist()) and len(with_sinks) <= round(0.25 * candidates) + len(sinks)
    assert BlendConfig(0.3, check_layers=(1, 2, 3), widen=2.0).kept(0, 100) == 60
    assert BlendConfig(0.3, check_layers=(1, 2, 3), widen=2.0).kept(1, 100) == 45
    assert BlendConfig(0.3, check_layers=(1, 2, 3), widen=2.0).kept(2, 100) == 30
    assert BlendConfig(0.3, check_layers=(1, 2, 3), widen=2.0).kept(0, 100, share=0.1) == 20  # auto's share
    # auto narrows the same way, to the share the first check layer's coverage chose
    single = recomputed(engine, prompt, BlendConfig(coverage=0.6, least=0.0, most=1.0), auto=True)
    gradual = recomputed(engine, prompt, BlendConfig(coverage=0.6, least=0.0, most=1.0, check_layers=(1, 2, 3)), auto=True)
    assert len(gradual) == len(single) and gradual.tolist() != single.tolist()


def test_blend_generation_reports_what_it_recomputed(make_engine, tok):
    engine = make_engine("llama", blend=BlendConfig(recompute_ratio=0.2))
    texts = ["The river Olm freezes every winter near the mill.", "Anna Kell built the mill in 1820 from grey stone."]
    engine.index(texts, progress=False)
    result = engine.generate("Who built the mill?", texts, mode="blend", max_new_tokens=4)
    prompt, _ = engine.build_prompt("Who built the mill?", texts)
    passage_tokens = len(prompt) - len(prompt.prefix) - len(prompt.question)
    recomputed = round(0.2 * passage_tokens)
    assert result.mode == "blend" and len(result.token_ids) == 4
    assert result.prefilled_tokens == len(prompt.question) + recomputed
    assert result.reused_tokens == len(prompt) - len(prompt.question) - recomputed
    streamed = "".join(engine.stream("Who built the mill?", texts, mode="blend", max_new_tokens=4))
    assert streamed == result.text
    ahead = engine.generate("Who built the mill?", texts, mode="blend", max_new_tokens=4,
                            blend=BlendConfig(recompute_ratio=0.2, select="lookahead"))
    assert ahead.prefilled_tokens == 2 * len(prompt.question) + recomputed  # its first stage ran the question too
    alone = engine.generate("Who built the mill?", [], mode="blend", max_new_tokens=4)  # nothing to blend
    assert alone.token_ids == engine.generate("Who built the mill?", [], mode="block", max_new_tokens=4).token_ids


@pytest.mark.parametrize(
    "settings, match",
    [
        (dict(recompute_ratio=1.5), "recompute_ratio"),
        (dict(check_layers=()), "check_layers"),
        (dict(check_layers=(2, 1)), "check_layers"),
        (dict(deviation="queries"), "deviation"),
        (dict(widen=0.5), "widen"),
        (dict(sink_tokens=-1), "sink_tokens"),
        (dict(select="queries"), "select"),
        (dict(coverage=0.0), "coverage"),
        (dict(least=0.6, most=0.5), "least"),
    ],
)
def test_bad_blend_settings_are_refused(settings, match):
    with pytest.raises(ValueError, match=match):
        BlendConfig(**settings)


def test_check_layers_must_exist_in_the_model(make_engine):
    engine = make_engine()
    with pytest.raises(ValueError, match="below the model's"):
        engine.generate("Who?", ["A passage about a mill."], mode="blend", blend=BlendConfig(check_layers=(99,)))
