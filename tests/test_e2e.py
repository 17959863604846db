"""End to end on the real default model (SmolLM2-135M-Instruct), loaded once per session, and the CLI."""

import re

import pytest
import torch

from kvrag.app.cli import main
from kvrag.paths import kvrag_home

pytestmark = pytest.mark.e2e

PASSAGES = [
    "The Varnholm lighthouse was built in 1873 by the engineer Ilsa Brandt. It stands on the northern cliff.",
    "Orrin Vale is a painter from the town of Selby Cross. His best known work is a mural called The Tin Harvest.",
    "The river Olm freezes every winter. Fishermen of Kettering Bay cross it on foot in January.",
]


def test_block_mode_answers_from_the_one_passage_that_holds_the_answer(default_engine):
    default_engine.index(PASSAGES)
    result = default_engine.generate("Who built the Varnholm lighthouse?", PASSAGES, mode="block", max_new_tokens=30)
    assert "brandt" in result.text.lower()
    # prefix, 3 passages, 2 separators, none computed (from memory, or from disk where another engine wrote them)
    assert result.reused_tokens > 0 and "computed" not in result.cache_hits and sum(result.cache_hits.values()) == 6
    assert result.prefilled_tokens == len(default_engine.layout.question_ids("Who built the Varnholm lighthouse?"))


def test_full_mode_equals_model_generate_on_the_default_model(default_engine):
    """Full mode runs on the published weights (the shipped adapter is for the block modes)."""
    question = "What is the best known work of Orrin Vale?"
    result = default_engine.generate(question, PASSAGES, mode="full", max_new_tokens=20)
    prompt, _ = default_engine.build_prompt(question, PASSAGES)
    out = default_engine.causal_model.generate(
        torch.tensor([prompt.ids()]), max_new_tokens=20, do_sample=False, eos_token_id=sorted(default_engine.eos_ids)
    )
    assert result.token_ids == [t for t in out[0, len(prompt) :].tolist() if t not in default_engine.eos_ids]


def test_default_model_is_converted_once_and_cached(default_engine):
    from kvrag import KVEngine

    converted = list((kvrag_home() / "models").glob("SmolLM2-135M-Instruct.Q4_1-*/model.safetensors"))
    assert len(converted) == 1
    again = KVEngine.from_pretrained()
    assert again.fingerprint == default_engine.fingerprint


def test_cli_index_and_ask(tmp_path, capsys):
    docs = tmp_path / "docs"
    docs.mkdir()
    (docs / "island.md").write_text("\n\n".join(PASSAGES[:2]))
    (docs / "river.txt").write_text(PASSAGES[2])
    assert main(["index", str(docs)]) == 0
    # the first two passages are short (< 32 tokens each), so they are joined into one
    assert "indexed 2 passages from 2 files" in capsys.readouterr().out
    assert main(["ask", "Who built the Varnholm lighthouse?", "--top-k", "2", "--mode", "block"]) == 0
    captured = capsys.readouterr()
    assert "brandt" in captured.out.lower()
    assert "[block] TTFT" in captured.err and "blocks: disk 4" in captured.err  # a new engine reads the files: prefix, 2 passages, separator


def test_demo_runs_offline(capsys):
    assert main(["demo"]) == 0
    out = capsys.readouterr().out
    answers = {mode: re.findall(rf"^  {mode} +\d+ms  \S", out, re.M) for mode in ("full", "block")}
    assert len(answers["full"]) == len(answers["block"]) == 6  # every sample question, in both modes
    assert "median TTFT speed-up of block over full" in out
    # the shipped adapter's scale was chosen so that block mode answers every one of them (docs/finetuning.md)
    assert "gold answer in them: full 6 of 6, block 6 of 6" in out


def test_demo_asks_other_questions_from_a_file(tmp_path, capsys):
    questions = tmp_path / "q.json"
    questions.write_text('[{"question": "What is the capital of Orvanne?", "answers": ["saltmere"]}]')
    assert main(["demo", "--questions", str(questions)]) == 0
    out = capsys.readouterr().out
    assert out.count("?\n") == 1 and "What is the capital of Orvanne?" in out
    assert re.search(r"full [01] of 1, block [01] of 1", out)


def test_blend_moves_the_answer_logits_towards_full(default_engine):
    """Over kvrag's sample corpus (every passage, ~700 tokens) and its questions, blend at 15%
    recompute is measurably closer to full prefill than block mode: in L2 distance of the last
    token's logits and in KL(full || mode), all three on the weights blend mode runs on (the default
    engine's full mode runs on the published ones). Distances are printed (pytest -s)."""
    import json
    from importlib import resources
    from pathlib import Path

    from kvrag import BlendConfig, KVEngine
    from kvrag.app.split import read_text, split_passages, text_files

    engine = KVEngine(default_engine.model, default_engine.tokenizer, home=default_engine.home)
    sample = Path(str(resources.files("kvrag") / "sample"))
    count = lambda text: len(engine.layout.encode(text))  # noqa: E731
    passages = [p for path in text_files([sample]) for p in split_passages(read_text(path), count)]
    engine.index(passages, progress=False)
    questions = [item["question"] for item in json.loads((sample / "questions.json").read_text())[:3]]

    def last_logits(question, mode):
        state = engine.prefill(engine.build_prompt(question, passages)[0], mode, blend=BlendConfig(0.15, select="deviation"))
        try:
            return state.logits[-1].log_softmax(-1)
        finally:
            engine.release(state)

    for question in questions:
        full, block, blend = (last_logits(question, mode) for mode in ("full", "block", "blend"))
        l2 = {name: (x - full).norm().item() for name, x in (("block", block), ("blend", blend))}
        kl = {name: (full.exp() * (full - x)).sum().item() for name, x in (("block", block), ("blend", blend))}
        print(f"{question!r}: L2 block {l2['block']:.1f} blend {l2['blend']:.1f}; KL block {kl['block']:.4f} blend {kl['blend']:.4f}")
        assert l2["blend"] < 0.8 * l2["block"] and kl["blend"] < 0.5 * kl["block"]
