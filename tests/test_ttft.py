"""The TTFT benchmark's bookkeeping (timings themselves are never asserted on)."""

from tiny import tiny_configs

from kvrag.eval.ttft import FILLER, HEADER, flops_blend, flops_to_first_token, format_row, layer_flops, make_passages, ttft_table


def test_flops_formula_by_hand():
    config = tiny_configs()["llama"]  # d=64, 4 heads of 16, 2 kv heads, MLP 128, 2 layers, vocab 400
    per_token = 2 * 64 * (64 + 2 * 32) + 2 * 64 * 64 + 6 * 64 * 128  # QKV + output + SwiGLU MLP
    keys = 3 * 5 + (1 + 2 + 3)  # three tokens after five cached ones attend to 6, 7 and 8 keys
    assert flops_to_first_token(config, 3, 5) == 2 * (3 * per_token + 4 * 64 * keys) + 2 * 64 * 400
    # blend: layer 0 over 10 context tokens (55 query-key pairs), then 2 recomputed tokens (5 keys
    # each on average) and 3 question tokens (10 + 1, 10 + 2, 10 + 3 keys) through both layers
    selection = 10 * per_token + 4 * 64 * 55
    assert flops_blend(config, 10, 3, 2) == selection + 2 * (5 * per_token + 4 * 64 * (2 * 5 + 36)) + 2 * 64 * 400
    assert layer_flops(config, 1, 0) == per_token


def test_ttft_table_on_a_tiny_model(make_engine):
    engine = make_engine()
    lines = []
    rows = ttft_table(engine, lengths=(0, 96), runs=1, progress=lines.append)
    assert [r["context"] for r in rows][0] == len(engine.layout.prefix_ids)
    assert rows[1]["context"] >= 96  # system prompt and passages
    for row in rows:
        assert all(row[k] > 0 for k in ("floor", "full", "block", "prefix", "blend10", "blend15", "blend30", "ahead15", "ahead30",
                                     "auto"))
        assert row["flops_block"] < row["flops_full"] or row["context"] == len(engine.layout.prefix_ids)
        assert row["flops_block"] <= row["flops_blend15"] and row["flops_block"] <= row["flops_ahead15"]
    assert len(lines) == 2 and len(lines[0].split()) == 20 == HEADER.count(" ms") + 10  # one value per column
    assert format_row(rows[1]) == lines[1]


def test_filler_passages_reach_the_requested_length(make_engine):
    engine = make_engine()
    passages = make_passages(engine, 300, block_tokens=64)
    total = sum(len(engine.layout.passage_ids(p)) for p in passages)
    overshoot = len(engine.layout.passage_ids(f"Record 99. {FILLER}"))  # at most one more filler sentence
    assert 300 <= total < 300 + overshoot and len(set(passages)) == len(passages)
