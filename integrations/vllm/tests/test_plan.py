"""Which run of a prompt the connector supplies: found passages, glue, header, the question left to vLLM."""

from kvrag_vllm import plan

A, B, C = list(range(100, 112)), list(range(200, 209)), list(range(300, 320))
GLUE = [7, 7]


def stored_all(ids):
    return True


def test_passages_are_found_anywhere_in_any_order_longest_first():
    found = plan.Passages()
    for p in (A, B, C, A[:9]):
        assert found.add(p)
    assert not found.add([1, 2, 3])  # glue-sized: never searched for
    ids = [1, 2] + C + GLUE + A + GLUE + B + [5, 6]
    assert found.find(ids) == [(2, 22), (24, 36), (38, 47)]
    assert found.find([1, 2] + A[:11] + [9]) == [(2, 11)]  # only the passage that is there whole


def test_leading_run_is_header_passages_and_glue_up_to_the_question():
    found = plan.Passages()
    for p in (A, B):
        found.add(p)
    ids = [1, 2, 3] + A + GLUE + B + [8, 9]
    pieces = plan.leading_run(ids, found.find(ids), stored_all)
    assert [(p.kind, p.start, p.stop) for p in pieces] == [("header", 0, 3), ("passage", 3, 15), ("glue", 15, 17),
                                                          ("passage", 17, 26)]
    assert list(pieces[-1].ids) == B


def test_the_run_stops_where_a_block_is_missing_or_the_gap_is_text():
    found = plan.Passages()
    for p in (A, B):
        found.add(p)
    ids = A + GLUE + B + [8]
    assert [p.kind for p in plan.leading_run(ids, found.find(ids), lambda ids: list(ids) != GLUE)] == ["passage"]
    assert plan.unknown_glue(ids, found.find(ids), lambda ids: list(ids) != GLUE) == tuple(GLUE)
    assert [p.kind for p in plan.leading_run(ids, found.find(ids), lambda ids: list(ids) != B)] == ["passage"]
    long_gap = A + [9] * (plan.MAX_GLUE_TOKENS + 1) + B + [8]
    assert [p.kind for p in plan.leading_run(long_gap, found.find(long_gap), stored_all)] == ["passage"]


def test_a_passage_that_ends_the_prompt_is_left_to_vllm():
    found = plan.Passages()
    for p in (A, B):
        found.add(p)
    assert [p.kind for p in plan.leading_run(A + GLUE + B, found.find(A + GLUE + B), stored_all)] == ["passage"]
    assert plan.leading_run(A, found.find(A), stored_all) == []
    assert plan.leading_run([1, 2, 3], [], stored_all) == []
