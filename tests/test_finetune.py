"""Block fine-tuning on tiny random models: the training attention is block mode's, a step lowers the
loss, a stopped run resumes to the same weights, and an adapter changes the fingerprint."""

import json

import pytest
import torch
from test_blend import blend_logits, recomputed
from test_invariants import question_logits, random_prompt
from tiny import block_mask, tiny_configs, tiny_model

from kvrag import BlendConfig, KVEngine, attention
from kvrag.eval.accuracy import _settings
from kvrag.eval.layouts import LAYOUTS
from kvrag.train import finetune as ft
from kvrag.train.finetune import TrainConfig, block_index, block_lengths, encode, loss, train

PASSAGES = ["Ravel Osk was born in Dranvi in 1901.", "Dranvi lies in the country of Brasdra.", "Lailgro Works makes rope."]
QUESTION = "In which country was Ravel Osk born?"
ANSWER = "Ravel Osk was born in Dranvi, which is in Brasdra."


def _forward(model, example):
    ids = torch.tensor([example.ids])
    with torch.no_grad():
        out = model(input_ids=ids, position_ids=torch.arange(len(example.ids))[None], attention_mask=example.mask())
    return out.logits[0]


def test_the_training_mask_is_the_block_attention_mask(tok):
    """The core's one mask builder, given each token's block, is the block-attention mask."""
    prompt = random_prompt(len(tok))
    lengths = block_lengths(prompt, answer_tokens=5)
    assert lengths == [len(prompt.prefix), *map(len, prompt.blocks), len(prompt.question) + 5]
    n = sum(lengths)
    ids = list(range(n))
    example = ft.TrainingExample(ids, ids, lengths)
    torch.testing.assert_close(example.mask(), block_mask(lengths), rtol=0, atol=0)
    torch.testing.assert_close(attention.mask(torch.arange(n), n, torch.float32, blocks=block_index(lengths)),
                               block_mask(lengths), rtol=0, atol=0)
    torch.testing.assert_close(ft.TrainingExample(ids, ids, [n]).mask(), block_mask([n]), rtol=0, atol=0)  # plain causal


@pytest.mark.parametrize("arch", ["llama", "qwen3", "llama3-scaled"])
def test_training_sees_what_block_mode_computes(make_engine, arch):
    """The logits a training example is scored on equal block mode's for the same prompt (and, with
    plain attention, full mode's): training and inference attend alike."""
    engine = make_engine(arch)
    example = encode(engine, QUESTION, PASSAGES, ANSWER)
    prompt, _ = engine.build_prompt(QUESTION, PASSAGES)
    assert example.ids[: len(prompt)] == prompt.ids() and len(prompt.blocks) == 5  # three passages, two separators
    answer = [t for t in example.labels if t != ft.IGNORE]
    assert answer == example.ids[len(prompt) :] and answer[-1] == engine.tokenizer.eos_token_id
    question = slice(len(prompt) - len(prompt.question), len(prompt))
    trained_on = _forward(engine.model, example)[question]
    torch.testing.assert_close(trained_on, question_logits(engine, prompt, "block"), rtol=1e-4, atol=1e-4)
    plain = encode(engine, QUESTION, PASSAGES, ANSWER, full_attention=True)
    assert plain.lengths == [len(plain.ids)]
    torch.testing.assert_close(_forward(engine.model, plain)[question], question_logits(engine, prompt, "full"),
                               rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("layout", ["langchain-rag-prompt", "numbered"])
def test_training_in_an_apps_layout_sees_what_block_mode_computes_on_that_prompt(make_engine, layout):
    """Asked in another layout, the example is the rendered prompt cut as the drop-in path cuts it:
    with the question first, the passages are trained not to see it, as in block mode."""
    engine = make_engine("llama")
    example = encode(engine, QUESTION, PASSAGES, ANSWER, layout=layout)
    prompt, _ = engine.prompt_from_text(*LAYOUTS[layout].render(engine, QUESTION, PASSAGES))
    assert example.ids[: len(prompt)] == prompt.ids() and len(example.lengths) == 1 + len(prompt.blocks) + 1
    assert (QUESTION in engine.tokenizer.decode(prompt.prefix)) == LAYOUTS[layout].question_first
    question = slice(len(prompt) - len(prompt.question), len(prompt))
    torch.testing.assert_close(_forward(engine.model, example)[question], question_logits(engine, prompt, "block"),
                               rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("arch, settings", [
    ("llama", {}), ("qwen3", {"recompute_ratio": 0.3}), ("llama", {"select": "deviation"}),
    ("qwen3", {"recompute_ratio": 0.3, "deviation": "values", "select": "deviation"}),
    ("llama", {"sink_tokens": 2, "select": "deviation"})])
def test_training_in_blend_attention_sees_what_blend_mode_computes(make_engine, tok, arch, settings):
    """A blend example recomputes the positions blend mode chooses for its prompt (by the question's
    attention or by deviation), and its logits are blend mode's: the chosen rows attend over
    everything, the rest keep their block."""
    engine = make_engine(arch)
    config = BlendConfig(**settings)
    example = encode(engine, QUESTION, PASSAGES, ANSWER, blend=config)
    prompt, _ = engine.build_prompt(QUESTION, PASSAGES)
    rows = ft.blend_rows(engine.model, example)
    assert rows.tolist() == recomputed(engine, prompt, config).tolist()
    assert 0 < len(rows) < example.passages[1] - example.passages[0]
    question = slice(len(prompt) - len(prompt.question), len(prompt))
    with torch.no_grad():
        out = engine.model(input_ids=torch.tensor([example.ids]), position_ids=torch.arange(len(example.ids))[None],
                           attention_mask=example.mask(recomputed=rows))
    torch.testing.assert_close(out.logits[0][question], blend_logits(engine, prompt, **settings), rtol=1e-4, atol=1e-4)
    assert not torch.allclose(out.logits[0][question], question_logits(engine, prompt, "block"), rtol=1e-4, atol=1e-4)
    with torch.no_grad():  # the loss scores that attention
        expected = torch.nn.functional.cross_entropy(out.logits[0][question.stop - 1 : -1], torch.tensor(example.ids[question.stop :]))
        torch.testing.assert_close(loss(engine.model, example), expected)
    with pytest.raises(ValueError, match="check_layers"):
        encode(engine, QUESTION, PASSAGES, ANSWER, blend=BlendConfig(check_layers=(2,)))


def test_training_examples_draw_a_layout_each_and_keep_the_attention_draws(make_engine):
    engine = make_engine("llama")
    qa = [type("QA", (), {"question": QUESTION, "passages": PASSAGES, "target": ANSWER})()] * 12
    own = ft.training_examples(engine, qa, full_attention_share=0.5, seed=3)
    mixed = ft.training_examples(engine, qa, full_attention_share=0.5, seed=3, layouts=["kvrag", "numbered"])
    assert [len(e.lengths) == 1 for e in mixed] == [len(e.lengths) == 1 for e in own]
    layouts = {tuple(e.ids) for e in mixed}
    assert len(layouts) == 2 and {tuple(e.ids) for e in own} < layouts
    with pytest.raises(ValueError, match="unknown prompt layout"):
        ft.training_examples(engine, qa, layouts=["chatml"])
    blended = ft.training_examples(engine, qa, full_attention_share=0.5, seed=3, blend_share=0.5)
    assert [e.lengths for e in blended] == [e.lengths for e in own]  # the full-attention draws stay
    assert {e.blend for e in blended if len(e.lengths) == 1} == {None} and engine.blend in {e.blend for e in blended}


def test_loss_counts_only_the_answer(make_engine):
    engine = make_engine("llama")
    example = encode(engine, QUESTION, PASSAGES, ANSWER)
    logits = _forward(engine.model, example)
    n = len(example.ids) - example.labels.count(ft.IGNORE)
    expected = torch.nn.functional.cross_entropy(logits[-n - 1 : -1], torch.tensor(example.ids[-n:]))
    with torch.no_grad():
        torch.testing.assert_close(loss(engine.model, example), expected)


def test_distillation_adds_block_modes_divergence_from_full_mode(make_engine):
    """With `distill`, a block example's loss adds the weighted KL(full || block) over the question and
    answer positions; a plain-attention example has nothing to be pulled toward."""
    engine = make_engine("llama")
    block, plain = (encode(engine, QUESTION, PASSAGES, ANSWER, full_attention=f) for f in (False, True))
    last = slice(len(block.ids) - block.lengths[-1], len(block.ids) - 1)
    student, teacher = (_forward(engine.model, e)[last].log_softmax(-1) for e in (block, plain))
    divergence = (teacher.exp() * (teacher - student)).sum(-1).mean()
    assert divergence > 1e-4
    with torch.no_grad():
        torch.testing.assert_close(loss(engine.model, block, distill=2.0), loss(engine.model, block) + 2.0 * divergence)
        torch.testing.assert_close(loss(engine.model, plain, distill=2.0), loss(engine.model, plain))


def test_distilling_from_the_published_weights_switches_the_adapter_off_for_the_teacher(make_engine):
    """`teacher="published"`: the KL is taken from the untouched model's full-mode predictions, while
    the student is block mode with the adapter on; the default teacher is the adapted model itself."""
    published = make_engine("llama")
    block, plain = (encode(published, QUESTION, PASSAGES, ANSWER, full_attention=f) for f in (False, True))
    last = slice(len(block.ids) - block.lengths[-1], len(block.ids) - 1)
    untouched = _forward(published.model, plain)[last].log_softmax(-1)
    model = ft._trainable(make_engine("llama").model, TrainConfig(lora_dropout=0.0))
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.normal_(std=0.2)  # an adapter that changes the model
    student, own = (_forward(model, e)[last].log_softmax(-1) for e in (block, plain))
    assert (own - untouched).abs().max() > 1e-2
    with torch.no_grad():
        for teacher, target in (("published", untouched), ("adapter", own)):
            divergence = (target.exp() * (target - student)).sum(-1).mean()
            torch.testing.assert_close(loss(model, block, distill=1.0, teacher=teacher), loss(model, block) + divergence)
    torch.testing.assert_close(_forward(model, block)[last].log_softmax(-1), student)  # the adapter is back on
    with pytest.raises(ValueError, match="teacher must be one of"):
        loss(model, block, distill=1.0, teacher="base")
    with pytest.raises(ValueError, match="needs a LoRA adapter"):
        train(make_engine("llama"), [block], "unused", TrainConfig(steps=1, full=True, distill=1.0, distill_from="published"))


def test_a_few_steps_lower_the_loss_on_a_fixed_batch(make_engine, tmp_path):
    engine = make_engine("llama")
    batch = [encode(engine, QUESTION, PASSAGES, ANSWER), encode(engine, "What does Lailgro Works make?", PASSAGES, "Rope.")]
    with torch.no_grad():
        before = sum(loss(engine.model, e).item() for e in batch)
    config = TrainConfig(steps=3, accumulate=len(batch), learning_rate=5e-2, lora_dropout=0.0)
    adapter = train(engine, batch, tmp_path, config, progress=False, scale=0.5)
    with torch.no_grad():
        after = sum(loss(engine.model, e).item() for e in batch)
    assert after < before
    assert json.loads((adapter / "adapter_config.json").read_text())["lora_alpha"] == 4  # scale 0.5 x r 8
    record = json.loads((tmp_path / "training.json").read_text())
    assert record["step"] == 3 and len(record["losses"]) == 3 and record["config"]["learning_rate"] == 5e-2
    assert record["config"]["lora_alpha"] == 16 and record["adapter_scale"] == 0.5
    with pytest.raises(ValueError, match="scale applies to a LoRA adapter"):
        train(make_engine("llama"), batch, tmp_path / "full", TrainConfig(steps=1, full=True), scale=1.0)


def test_a_stopped_run_resumes_to_the_same_weights(make_engine, tmp_path, monkeypatch):
    # with dropout, so that the random state must resume too
    config = TrainConfig(steps=4, accumulate=1, learning_rate=1e-2, save_every=2, lora_dropout=0.3)

    def examples(engine):
        return [encode(engine, QUESTION, PASSAGES, ANSWER), encode(engine, "Where is Dranvi?", PASSAGES, "In Brasdra.")]

    straight = make_engine("llama")
    train(straight, examples(straight), tmp_path / "straight", config, progress=False)

    calls = {"n": 0}
    real_loss = ft.loss

    def failing(*args):
        calls["n"] += 1
        if calls["n"] == 4:  # during the 4th step: the checkpoint of step 2 is the last one written
            raise KeyboardInterrupt
        return real_loss(*args)

    stopped = make_engine("llama")
    monkeypatch.setattr(ft, "loss", failing)
    with pytest.raises(KeyboardInterrupt):
        train(stopped, examples(stopped), tmp_path / "resumed", config, progress=False)
    monkeypatch.setattr(ft, "loss", real_loss)
    state_file = tmp_path / "resumed" / "checkpoint" / "state.json"
    state = json.loads(state_file.read_text())
    assert state["step"] == 2
    del state["config"]["distill"], state["config"]["distill_from"]  # as written before those settings existed: they resume at their defaults
    state_file.write_text(json.dumps(state))
    resumed = make_engine("llama")
    train(resumed, examples(resumed), tmp_path / "resumed", config, progress=False)
    a = dict(straight.model.named_parameters())
    for name, p in resumed.model.named_parameters():
        if "lora" in name:
            torch.testing.assert_close(p, a[name], rtol=1e-5, atol=1e-6)
    with pytest.raises(ValueError, match="other settings"):
        train(make_engine("llama"), examples(resumed), tmp_path / "resumed", TrainConfig(steps=5), progress=False)


def test_the_init_seed_decides_the_lora_init_and_dropout(make_engine, tmp_path):
    def trained(init_seed, name, draws):
        engine = make_engine("llama")
        torch.rand(draws)  # what the process drew before must not matter
        example = encode(engine, QUESTION, PASSAGES, ANSWER)
        config = TrainConfig(steps=2, accumulate=1, lora_dropout=0.3, init_seed=init_seed)
        train(engine, [example], tmp_path / name, config, progress=False)
        return {n: p.detach().clone() for n, p in engine.model.named_parameters() if "lora" in n}

    first, again, other = trained(1, "a", 1), trained(1, "b", 5), trained(2, "c", 1)
    for name, value in first.items():
        torch.testing.assert_close(again[name], value, rtol=0, atol=0)
    assert any(not torch.equal(other[name], value) for name, value in first.items())


def test_a_run_can_continue_from_a_saved_adapter(make_engine, tmp_path):
    from safetensors.torch import load_file

    def run(out, **settings):
        engine = make_engine("llama")
        config = TrainConfig(steps=2, accumulate=1, lora_dropout=0.0, **settings)
        return train(engine, [encode(engine, QUESTION, PASSAGES, ANSWER)], tmp_path / out, config, progress=False,
                     scale=0.5) / "adapter_model.safetensors"

    first = load_file(run("first", learning_rate=1e-2))
    # with no learning rate the continued run saves exactly the weights it started from
    kept = load_file(run("kept", learning_rate=0.0, init_adapter=str(tmp_path / "first" / "adapter")))
    fresh = load_file(run("fresh", learning_rate=0.0))
    assert kept.keys() == first.keys()
    for name, value in first.items():
        torch.testing.assert_close(kept[name], value, rtol=0, atol=0)
    assert any(not torch.equal(fresh[name], value) for name, value in first.items())
    record = json.loads((tmp_path / "kept" / "training.json").read_text())  # its own run: the start named, not nested
    assert record["config"]["init_adapter"] == str(tmp_path / "first" / "adapter") and record["step"] == 2
    assert "init_adapter_training" not in record["about"]
    with pytest.raises(ValueError, match="rank-8 adapter.*pass --lora-r 8"):
        run("rank", lora_r=4, lora_alpha=8, init_adapter=str(tmp_path / "first" / "adapter"))


def test_an_adapter_changes_the_fingerprint_and_the_answers(make_engine, tok, tmp_path):
    base = tmp_path / "base"
    tiny_model(tiny_configs(len(tok))["llama"]).save_pretrained(base)
    tok.save_pretrained(base)
    engine = KVEngine.from_pretrained(str(base), home=tmp_path / "home", block_context="none")  # what adapters train in
    adapter = train(engine, [encode(engine, QUESTION, PASSAGES, ANSWER)], tmp_path / "tuned",
                    TrainConfig(steps=2, accumulate=1, learning_rate=5e-2, lora_dropout=0.0), progress=False)
    plain = KVEngine.from_pretrained(str(base), home=tmp_path / "home")
    tuned = KVEngine.from_pretrained(str(base), home=tmp_path / "home", adapter=adapter)
    assert tuned.fingerprint != plain.fingerprint
    assert not any("lora" in name for name, _ in tuned.model.named_parameters())  # merged: plain modules again
    # docs/accuracy.md's default mode: no reusing mode kept full's answers, with an adapter or without
    assert (plain.default_mode, tuned.default_mode) == ("full", "full")
    # docs/closer-to-full.md's block context: APE's recipe on published weights, the adapter's own context with it
    assert (plain.block_context, tuned.block_context) == ("ape", "none")
    assert KVEngine.from_pretrained(str(base), home=tmp_path / "home", default_mode="auto").default_mode == "auto"
    prompt, _ = plain.build_prompt(QUESTION, PASSAGES)
    assert not torch.allclose(question_logits(tuned, prompt, "block"), question_logits(plain, prompt, "block"))
    again = KVEngine.from_pretrained(str(base), home=tmp_path / "home", adapter=adapter)
    assert again.fingerprint == tuned.fingerprint
    with pytest.raises(FileNotFoundError, match="not an adapter directory"):
        KVEngine.from_pretrained(str(base), home=tmp_path / "home", adapter=tmp_path)


def test_the_adapter_serves_the_block_modes_and_the_published_weights_the_causal_ones(tok, tmp_path):
    """adapter_scope="block": full and prefix run on the published weights, exactly, and keep prefix KV
    with them; the weights the adapter leaves alone are one copy. "all" (the default): every mode."""
    base = tmp_path / "base"
    tiny_model(tiny_configs(len(tok))["llama"]).save_pretrained(base)
    tok.save_pretrained(base)
    kw = {"home": tmp_path / "home", "storage_dtype": torch.float32, "block_context": "none"}
    plain = KVEngine.from_pretrained(str(base), **kw)
    adapter = train(plain, [encode(plain, QUESTION, PASSAGES, ANSWER)], tmp_path / "tuned",
                    TrainConfig(steps=2, accumulate=1, learning_rate=5e-2, lora_dropout=0.0), progress=False)
    plain = KVEngine.from_pretrained(str(base), **kw)  # `train` left its LoRA layers in the first one
    tuned = KVEngine.from_pretrained(str(base), **kw, adapter=adapter, adapter_scope="block")
    everywhere = KVEngine.from_pretrained(str(base), **kw, adapter=adapter)
    prompt, _ = plain.build_prompt(QUESTION, PASSAGES)

    assert tuned.causal_fingerprint == plain.fingerprint != tuned.fingerprint == everywhere.fingerprint
    assert everywhere.causal_fingerprint == everywhere.fingerprint
    assert tuned.model.get_input_embeddings().weight is tuned.causal_model.get_input_embeddings().weight
    q_proj = lambda m: m.get_decoder().layers[0].self_attn.q_proj.weight  # noqa: E731
    assert not torch.equal(q_proj(tuned.model), q_proj(tuned.causal_model))
    assert torch.equal(q_proj(tuned.causal_model), q_proj(plain.model))

    published_full = question_logits(plain, prompt, "full")
    assert torch.equal(question_logits(tuned, prompt, "full"), published_full)
    assert not torch.allclose(question_logits(everywhere, prompt, "full"), published_full)
    for mode in ("block", "composite", "blend"):
        torch.testing.assert_close(question_logits(tuned, prompt, mode), question_logits(everywhere, prompt, mode))
    tuned_text = tuned.generate(QUESTION, PASSAGES, mode="full", max_new_tokens=6)
    assert tuned_text.token_ids == plain.generate(QUESTION, PASSAGES, mode="full", max_new_tokens=6).token_ids

    first = tuned.generate(QUESTION, PASSAGES, mode="prefix", max_new_tokens=1)  # stores its segments
    assert first.reused_tokens == 0
    assert plain.generate(QUESTION, PASSAGES, mode="prefix", max_new_tokens=1).reused_tokens > 0  # same weights
    assert everywhere.generate(QUESTION, PASSAGES, mode="prefix", max_new_tokens=1).reused_tokens == 0  # not these
    torch.testing.assert_close(question_logits(tuned, prompt, "prefix"), published_full)
    # benchmark results record both weight sets, so that a resumed run never mixes answers
    assert _settings(tuned, 8, None)["causal_model"] == plain.fingerprint
    assert "causal_model" not in _settings(everywhere, 8, None)
    with pytest.raises(ValueError, match="adapter_scope must be one of"):
        KVEngine.from_pretrained(str(base), **kw, adapter=adapter, adapter_scope="full")


def test_prefix_block_context_is_refused(make_engine):
    with pytest.raises(ValueError, match="block_context='none'"):
        encode(make_engine("llama", block_context="prefix"), QUESTION, PASSAGES, ANSWER)


def test_the_unanswerable_share_keeps_every_answerable_question():
    from kvrag.eval import data

    questions = data.generate("train", n=200, passages=5)
    answerable = [q for q in questions if q.type != "unanswerable"]
    for share in (0.0, 0.05, 0.25):
        kept = ft.with_unanswerable_share(questions, share)
        assert [q for q in kept if q.type != "unanswerable"] == answerable
        assert sum(q.type == "unanswerable" for q in kept) / len(kept) == pytest.approx(share, abs=0.005)
    with pytest.raises(ValueError, match="needs 100 unanswerable questions; the data has 50 \\(a share of 0.25\\)"):
        ft.with_unanswerable_share(questions, 0.4)


def test_short_contexts_keep_the_gold_passages_in_order_and_at_most_three_distractors():
    from kvrag.eval import data

    questions = data.generate("train", n=200, passages=10, seed=1)
    cut = ft.with_short_contexts(questions, 0.5, seed=1)
    short = [(q, c) for q, c in zip(questions, cut) if c.passages != q.passages]
    assert 70 <= len(short) <= 130  # about half
    for q, c in short:
        assert [c.passages[i] for i in c.gold] == [q.passages[i] for i in q.gold]
        assert len(c.gold) <= len(c.passages) <= len(c.gold) + 3
        assert [q.passages.index(p) for p in c.passages] == sorted(q.passages.index(p) for p in c.passages)
        assert (c.question, c.target, c.type) == (q.question, q.target, q.type)
    assert {len(c.passages) - len(c.gold) for _, c in short} == {0, 1, 2, 3}
    assert ft.with_short_contexts(questions, 0.0) == questions
    with pytest.raises(ValueError, match="short-context share must be in"):
        ft.with_short_contexts(questions, 1.5)


@pytest.mark.e2e
def test_the_default_model_comes_with_the_shipped_block_adapter(default_engine):
    """adapter="auto" (the default) merges the adapter shipped in the package into the default model's
    weights, in every mode; None loads the published weights: another fingerprint, so that KV never mix."""
    from kvrag.loading import DEFAULT_ADAPTER

    shipped = {p.name: p.stat().st_size for p in DEFAULT_ADAPTER.iterdir()}
    assert {"adapter_config.json", "adapter_model.safetensors"} <= shipped.keys()
    assert sum(shipped.values()) < 10_000_000  # a few MB
    published = KVEngine.from_pretrained(adapter=None)
    assert published.fingerprint != default_engine.fingerprint
    assert (published.default_mode, default_engine.default_mode) == ("full", "full")
    assert default_engine.causal_fingerprint == default_engine.fingerprint  # full and prefix on the same weights
    assert default_engine.causal_model is default_engine.model  # one copy of the weights
    assert KVEngine.from_pretrained(adapter=DEFAULT_ADAPTER).fingerprint == default_engine.fingerprint


@pytest.mark.e2e
def test_finetune_command_on_the_default_model(kvrag_home, tmp_path, capsys):
    from kvrag.app.cli import main

    out = tmp_path / "run"
    argv = ["finetune", str(out), "--questions", "4", "--passages", "5", "--steps", "2", "--accumulate", "1",
            "--save-every", "1", "--prose", "0.5", "--prompts", "langchain-rag-prompt,llamaindex-chat-qa",
            "--blend-share", "0.5", "--blend-select", "deviation", "--squad-share", "0.25", "--squad-passages", "2"]
    assert main(argv) == 0
    assert "saved" in capsys.readouterr().out
    record = json.loads((out / "training.json").read_text())
    assert record["step"] == 2 and all(v > 0 for v in record["losses"])
    assert record["about"]["dataset"] == {"split": "train", "n": 3, "passages": 5, "noise": 0.5, "seed": 0,
                                          "prose": 0.5}
    assert record["about"]["squad"] == 1  # a quarter of the 4 questions from SQuAD's train file
    assert record["about"]["squad_passages"] == 2
    assert record["about"]["unanswerable_share"] == 0.05
    assert record["about"]["layouts"] == ["langchain-rag-prompt", "llamaindex-chat-qa"]
    assert record["about"]["blend_select"] == "deviation" and record["config"]["blend_share"] == 0.5
    tuned = KVEngine.from_pretrained(adapter=out / "adapter")
    assert tuned.fingerprint != KVEngine.shared().fingerprint
    assert tuned.generate("Where is Dranvi?", ["Dranvi lies in Brasdra."], max_new_tokens=4).generated_tokens > 0
