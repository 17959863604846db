"""The invariants 1, 2, 4 and 5 of docs/design.md on tiny random-weight models of every supported family."""

import pytest
import torch
from conftest import ARCHS
from tiny import TOLERANCE, block_mask, tiny_configs, tiny_model
from transformers import DynamicCache
from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

from kvrag import KVEngine, Prompt, UnsupportedModelError
from kvrag import attention
from kvrag.attention import causal_mask

LENGTHS = [7, 13, 9, 11, 6]  # prefix, three passages, question


def random_prompt(vocab, lengths=LENGTHS, seed=1):
    g = torch.Generator().manual_seed(seed)
    parts = [torch.randint(3, vocab, (n,), generator=g).tolist() for n in lengths]
    return Prompt(parts[0], parts[1:-1], parts[-1])


def question_logits(engine, prompt, mode):
    state = engine.prefill(prompt, mode, all_logits=True)
    try:
        return state.logits.clone()
    finally:
        engine.release(state)


def block_attention_reference(model, prompt):
    """One forward pass over all ids with the block attention mask and contiguous positions."""
    lengths = [len(prompt.prefix), *map(len, prompt.blocks), len(prompt.question)]
    ids = torch.tensor([prompt.ids()])
    with torch.no_grad():
        out = model(ids, attention_mask=block_mask(lengths), position_ids=torch.arange(ids.shape[1])[None])
    return out.logits[0, -len(prompt.question) :]


def assert_equal_logits(got, reference):
    """Equal up to the compute dtype's rounding; `got` may be on any device, the reference on the CPU."""
    tolerance = TOLERANCE[got.dtype]
    torch.testing.assert_close(got.cpu(), reference.to(got.dtype), rtol=tolerance, atol=tolerance)


@pytest.mark.parametrize("arch", ARCHS)
def test_block_mode_equals_block_attention_mask(make_engine, tok, arch, device):
    engine = make_engine(arch, device=device)
    prompt = random_prompt(len(tok))
    reference = block_attention_reference(tiny_model(tiny_configs(len(tok))[arch]), prompt)
    assert_equal_logits(question_logits(engine, prompt, "block"), reference)
    # the same blocks again, now all from the store, in another order: still exact
    swapped = Prompt(prompt.prefix, prompt.blocks[::-1], prompt.question)
    reference = block_attention_reference(tiny_model(tiny_configs(len(tok))[arch]), swapped)
    assert_equal_logits(question_logits(engine, swapped, "block"), reference)


@pytest.mark.parametrize("arch", ["llama", "llama3-scaled"])
def test_positions_matter(make_engine, tok, arch, device):
    """Without re-encoding (composite) the same check fails: the reference is sensitive to positions."""
    engine = make_engine(arch, device=device)
    prompt = random_prompt(len(tok))
    reference = block_attention_reference(tiny_model(tiny_configs(len(tok))[arch]), prompt)
    assert (question_logits(engine, prompt, "composite").cpu() - reference).abs().max() > 1e-2


@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_prefix_block_context_matches_its_definition(make_engine, tok, arch, device):
    """Block context 'prefix': each passage is encoded right after the prefix (positions P..), then
    rotated to where it sits. Built here with plain transformers calls and the model's own rotary module."""
    engine = make_engine(arch, device=device, block_context="prefix")
    model = tiny_model(tiny_configs(len(tok))[arch])
    prompt = random_prompt(len(tok))
    P = len(prompt.prefix)
    with torch.no_grad():
        prefix_cache = model(torch.tensor([prompt.prefix]), use_cache=True).past_key_values
        layers = [[layer.keys, layer.values] for layer in prefix_cache.layers]
        position = P
        for block in prompt.blocks:
            kv = model(torch.tensor([prompt.prefix + block]), use_cache=True).past_key_values
            delta = position - P
            cos, sin = model.model.rotary_emb(kv.layers[0].keys, torch.tensor([[delta]]))
            for i, layer in enumerate(kv.layers):
                keys = layer.keys[:, :, P:]
                _, rotated = apply_rotary_pos_emb(keys, keys, cos[:, :, None].expand(1, 1, keys.shape[2], -1)[0], sin[:, :, None].expand(1, 1, keys.shape[2], -1)[0])
                layers[i][0] = torch.cat([layers[i][0], rotated], dim=2)
                layers[i][1] = torch.cat([layers[i][1], layer.values[:, :, P:]], dim=2)
            position += len(block)
        cache = DynamicCache(ddp_cache_data=[tuple(kv) for kv in layers])
        q = len(prompt.question)
        reference = model(
            torch.tensor([prompt.question]),
            cache=cache,
            position_ids=torch.arange(position, position + q)[None],
            attention_mask=causal_mask(q, position, torch.float32),
        ).logits[0]
    assert_equal_logits(question_logits(engine, prompt, "block"), reference)
    # and it really is a different definition from block context 'none'
    none = make_engine(arch, device=device, home=engine.home / "none")
    assert (question_logits(none, prompt, "block").cpu() - reference).abs().max() > 1e-3


@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_ape_block_context_is_prefix_encoding_read_at_apes_temperature(make_engine, tok, arch, device):
    """Block context 'ape': passages encoded after the engine's own prefix, as 'prefix' encodes them, and read by
    the question and every later token with APE's temperature and scale (attention.py's `_ape`, checked against
    the paper's formula in test_attention.py); at T = S = 1 it is 'prefix'."""
    ape = make_engine(arch, device=device, block_context="ape")
    prefix = make_engine(arch, device=device, block_context="prefix", home=ape.home / "prefix")
    parts = random_prompt(len(tok))
    prompt = Prompt(list(ape.layout.prefix_ids), parts.blocks, parts.question)
    read = question_logits(ape, prompt, "block")
    ape.blocks.ape = (1.0, 1.0)
    assert_equal_logits(question_logits(ape, prompt, "block"), question_logits(prefix, prompt, "block").cpu())
    assert (read - question_logits(ape, prompt, "block")).abs().max() > 1e-3
    ape.blocks.ape = attention.APE_READING
    # a token decoded after the question reads the passages as the question did: as if it had been part of it
    shorter = Prompt(prompt.prefix, prompt.blocks, prompt.question[:-1])
    state = ape.prefill(shorter, "block", extra_capacity=2)
    try:
        with torch.inference_mode():
            step = attention.forward(ape.model, prompt.question[-1:], state.cache, state.next_position)
    finally:
        ape.release(state)
    assert_equal_logits(step, read[-1:].cpu())


def test_ape_reuses_indexed_passages_when_the_question_comes_first(make_engine, tmp_path):
    """'ape' encodes every passage after the engine's own prefix, so a rendered prompt whose question comes before
    its passages (LangChain's rag-prompt) reads the KV that `index` stored; 'prefix' encodes them after that
    prompt's own prefix, question included, so it cannot."""
    texts = ["The river Olm freezes every winter.", "Ilsa Brandt built the lighthouse in 1873."]
    text = "Question: Who built the lighthouse?\nContext:\n\n" + "\n\n".join(texts) + "\n\nAnswer:"
    for context, reused in (("ape", True), ("prefix", False)):
        engine = make_engine(block_context=context, home=tmp_path / context)
        ids = engine.index(texts)
        _, keys = engine.prompt_from_text(text)
        assert (set(ids) <= {f"kv_{k}" for k in keys}) == reused
        result = engine.generate_text(text, mode="block", max_new_tokens=2)
        assert (result.reused_tokens > 0) == reused


@pytest.mark.parametrize("arch", ARCHS)
def test_full_mode_is_plain_generation(make_engine, tok, arch):
    engine = make_engine(arch)
    texts = ["The river Olm freezes every winter.", "Ilsa Brandt built the lighthouse in 1873."]
    result = engine.generate("Who built the lighthouse?", texts, mode="full", max_new_tokens=24)
    prompt, _ = engine.build_prompt("Who built the lighthouse?", texts)
    reference_model = tiny_model(tiny_configs(len(tok))[arch])  # stock transformers SDPA attention
    out = reference_model.generate(
        torch.tensor([prompt.ids()]),
        max_new_tokens=24,
        do_sample=False,
        eos_token_id=sorted(engine.eos_ids),
        pad_token_id=tok.pad_token_id,
    )
    expected = [t for t in out[0, len(prompt) :].tolist() if t not in engine.eos_ids]
    assert result.token_ids == expected
    assert result.prefilled_tokens == len(prompt) and result.reused_tokens == 0


@pytest.mark.parametrize("arch", ARCHS)
def test_prefix_mode_is_full_prefill(make_engine, tok, arch, device):
    """Prefix caching is exact: a request that reuses cached leading blocks and computes a long rest
    after them (here 86 tokens after 47) gets full prefill's logits."""
    engine = make_engine(arch, device=device)
    first = random_prompt(len(tok), [7, 40, 50, 30, 6])
    state = engine.prefill(first, "prefix")
    engine.store_pending(state, "prefix")  # as a finished request does
    engine.release(state)
    again = random_prompt(len(tok), [7, 40, 50, 30, 6], seed=2)
    second = Prompt(first.prefix, [first.blocks[0], *again.blocks[1:]], again.question)
    state = engine.prefill(second, "prefix", all_logits=True)
    try:
        assert state.reused_tokens == 47 and state.prefilled_tokens == 86
        assert_equal_logits(state.logits, question_logits(engine, second, "full").cpu())
    finally:
        engine.release(state)


def test_assembled_ids_are_the_parts_tokenized_alone(make_engine, tok, monkeypatch):
    engine = make_engine("llama")
    texts = ["Orrin Vale paints murals.", "  Leading spaces and a tab\there.", "Ilsa Brandt built it in 1873."]
    question = "Who built it?"
    prompt, _ = engine.build_prompt(question, texts)
    layout = engine.layout
    assert prompt.prefix == layout.encode(layout.head)
    separator = layout.encode(layout.format.separator)
    passages = [layout.encode(layout.format.passage.format(text=t)) for t in texts]
    assert prompt.blocks == [passages[0], separator, passages[1], separator, passages[2]]
    assert prompt.question == layout.encode(
        layout.format.separator + layout.format.question.format(question=question) + layout.tail
    )
    rendered = layout.head + layout.format.separator.join(layout.format.passage.format(text=t) for t in texts)
    rendered += layout.format.separator + layout.format.question.format(question=question) + layout.tail
    assert tok.decode(prompt.ids()) == rendered

    seen = []
    forward = engine.model.forward
    monkeypatch.setattr(engine.model, "forward", lambda *a, **kw: seen.append(kw["input_ids"][0].tolist()) or forward(*a, **kw))
    engine.generate(question, texts, mode="full", max_new_tokens=1)
    assert seen[0] == prompt.ids()  # full mode prefills exactly these ids
    seen.clear()
    engine.generate(question, texts, mode="block", max_new_tokens=1)
    assert seen[0] == prompt.question  # block mode prefills only the question block
    stored = [engine.store.get(k, "none")[0].token_ids.tolist() for k in engine.build_prompt(question, texts)[1]]
    assert stored == prompt.blocks  # and the blocks it reused hold exactly the passage ids


def test_no_foreign_kv(make_engine, tok, tmp_path):
    texts = ["Ilsa Brandt built the lighthouse in 1873."]
    a = make_engine("llama", seed=0, home=tmp_path)
    b = make_engine("llama", seed=1, home=tmp_path)  # other weights, same home directory
    assert a.fingerprint != b.fingerprint
    assert a.index(texts) != b.index(texts)
    result = b.generate("Who built it?", texts, mode="block", max_new_tokens=4)
    assert result.cache_hits == {"memory": 2}  # its own prefix and passage, encoded by index() above
    assert a.generate("Who built it?", texts, mode="block", max_new_tokens=4).cache_hits == {"memory": 2}

    # a different chat template changes the fingerprint too
    other_tok = type(tok)(tokenizer_object=tok.backend_tokenizer, eos_token="<|im_end|>", pad_token="<|endoftext|>")
    other_tok.chat_template = tok.chat_template.replace("<|im_end|>\n", "<|im_end|>\n\n")
    c = KVEngine(tiny_model(tiny_configs(len(tok))["llama"], 0), other_tok, home=tmp_path)
    assert c.fingerprint != a.fingerprint
    d = make_engine("llama", seed=0, home=tmp_path, block_context="prefix")
    assert d.index(texts) != a.index(texts)  # block context is part of the key


def test_unsupported_models_are_refused(tok, tmp_path):
    from transformers import GPT2Config, LlamaConfig

    with pytest.raises(UnsupportedModelError, match="gpt2"):
        KVEngine(tiny_model(GPT2Config(vocab_size=len(tok), n_embd=32, n_layer=1, n_head=2)), tok, home=tmp_path)
    dynamic = LlamaConfig(
        vocab_size=len(tok), hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
        rope_parameters={"rope_type": "dynamic", "rope_theta": 10000.0, "factor": 2.0},
    )
    with pytest.raises(UnsupportedModelError, match="dynamic"):
        KVEngine(tiny_model(dynamic), tok, home=tmp_path)
    # from a directory: refused from the config, before any weights are read
    tiny_model(dynamic).save_pretrained(tmp_path / "dyn")
    tok.save_pretrained(tmp_path / "dyn")
    (tmp_path / "dyn" / "model.safetensors").write_bytes(b"not weights")
    with pytest.raises(UnsupportedModelError, match="dynamic"):
        KVEngine.from_pretrained(tmp_path / "dyn", home=tmp_path)
