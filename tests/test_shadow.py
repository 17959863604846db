"""Shadow checks (kvrag.shadow): requests answered in a reusing mode answered again in full mode in the background,
at the lowest priority, compared, exported, and the default mode stepped down when agreement falls. Tiny random
models; a deliberately broken block mode (a test-only perturbation of its keys) stands for a setting that drifts."""

import json
import logging
import time

import httpx
import pytest
from serving import running_server

from kvrag import calibrate, modes
from kvrag.app.server import create_app

PASSAGES = ["The lighthouse was built in 1873 by Ilsa Brandt.", "Orvanne's capital is Saltmere, a harbour town."]
QUESTIONS = ["Who built the lighthouse?", "What is the capital?", "When was it built?", "Where is Saltmere?"]


def _settled(engine, checks: int, timeout: float = 60) -> dict:
    """The shadow's counts once `checks` checks are done (the background runs after the requests)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        counts = engine.shadow.agreement()
        if sum(c["checks"] for c in counts.values()) >= checks:
            return counts
        time.sleep(0.05)
    raise AssertionError(f"{checks} shadow checks did not finish: {engine.shadow.agreement()}")


@pytest.fixture
def broken(monkeypatch):
    """Block mode with its cached keys negated: answers no longer full's."""
    placed = modes.placed

    def perturbed(*args, **kwargs):
        state = placed(*args, **kwargs)
        for layer in state.cache.layers:
            layer.keys.neg_()
        return state

    monkeypatch.setattr(modes, "placed", perturbed)


def test_a_mode_equal_to_full_agrees_on_every_check(make_engine):
    engine = make_engine(shadow=1.0)
    for question in QUESTIONS[:2] * 2:  # prefix mode on a repeated prompt reuses its own exact KV
        engine.generate(question, PASSAGES, mode="prefix", max_new_tokens=8)
    engine.generate(QUESTIONS[0], PASSAGES, mode="prefix", max_new_tokens=8, temperature=0.8, seed=0)  # not checked
    engine.generate(QUESTIONS[0], PASSAGES, mode="full", max_new_tokens=8)  # full itself: nothing to check
    counts = _settled(engine, 4)
    time.sleep(0.5)
    assert engine.shadow.agreement() == {"prefix": {"checks": 4, "agreed": 4, "window": 1.0}} == counts


def test_a_broken_setting_falls_steps_the_default_down_and_back_after_recalibration(make_engine, broken, caplog):
    engine = make_engine(shadow=1.0)
    engine.shadow.least = engine.shadow.window = 3
    with caplog.at_level(logging.WARNING, logger="kvrag"):
        for question in QUESTIONS[:3]:
            engine.generate(question, PASSAGES, max_new_tokens=8)  # the default mode: block
        counts = _settled(engine, 3)
    assert counts["block"]["agreed"] < 3 and engine.default_mode == "auto"
    said = [r.getMessage() for r in caplog.records if "shadow checks" in r.getMessage()]
    assert len(said) == 1 and "requests that name no mode now get auto" in said[0] and "\n" not in said[0]
    assert engine.generate(QUESTIONS[0], PASSAGES, max_new_tokens=2).mode == "auto"
    # `kvrag calibrate` writes a new record choosing block: the next check reads it and the default steps back
    record = {**calibrate.identity(engine), "target": 0.95, "chosen": "block",
              "settings": [{"setting": "block", "mode": "block", "blend": None}]}
    path = calibrate.record_path(engine)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(record))
    with caplog.at_level(logging.WARNING, logger="kvrag"):
        engine.generate(QUESTIONS[1], PASSAGES, max_new_tokens=8)
        _settled(engine, 5)  # the auto request's check and this one's
        deadline = time.monotonic() + 30
        while engine.default_mode != "block" and time.monotonic() < deadline:
            time.sleep(0.05)
    assert engine.default_mode == "block"
    assert any("recalibrated" in r.getMessage() for r in caplog.records)


def test_the_background_runs_only_while_no_request_does(make_engine):
    engine = make_engine(shadow=1.0)
    ended = []
    submit = engine.scheduler.submit

    def watched(generation, background=False):
        generation.stream.on_end(lambda result: ended.append(("shadow" if background else "user", time.monotonic())))
        return submit(generation, background)

    engine.scheduler.submit = watched
    streams = [engine.stream(q, PASSAGES, max_new_tokens=12) for q in QUESTIONS[:3]]
    for stream in streams:
        stream.drain()
    _settled(engine, 3)
    kinds = [kind for kind, _ in sorted(ended, key=lambda e: e[1])]
    assert kinds == ["user"] * 3 + ["shadow"] * 3


def test_shadow_agreement_is_exported_in_metrics_and_health(make_engine):
    engine = make_engine(shadow=1.0)
    engine.index(PASSAGES, progress=False)
    with running_server(create_app(engine)) as url:
        client = httpx.Client(base_url=url, timeout=60)
        text = f"{PASSAGES[0]}\n\n{PASSAGES[1]}\n\nQuestion: {QUESTIONS[0]}"
        reply = client.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": text}],
                                                          "max_tokens": 6, "kvrag": {"mode": "prefix"}})
        assert reply.status_code == 200
        _settled(engine, 1)
        metrics = client.get("/metrics").text
        assert 'kvrag_shadow_checks_total{mode="prefix"} 1.0' in metrics
        assert 'kvrag_shadow_agreements_total{mode="prefix"} 1.0' in metrics
        assert 'kvrag_default_mode{mode="block"} 1.0' in metrics
        health = client.get("/health").json()
        assert health["default_mode"] == "block" and health["shadow"]["prefix"]["checks"] == 1


def test_a_shadow_share_outside_0_1_is_refused(make_engine):
    for share in (-0.1, 1.5):
        with pytest.raises(ValueError, match="shadow share"):
            make_engine(shadow=share)


def test_checks_are_every_1_over_share_th_request(make_engine):
    engine = make_engine(shadow=0.5)
    for question in QUESTIONS:
        engine.generate(question, PASSAGES, mode="prefix", max_new_tokens=4)
    counts = _settled(engine, 2)
    time.sleep(0.5)
    assert engine.shadow.agreement()["prefix"]["checks"] == 2 == counts["prefix"]["checks"]
