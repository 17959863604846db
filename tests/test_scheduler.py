"""The scheduler: concurrent requests decoded in one batch give the answers each gets alone; a full
queue, a timeout, a cancelled or broken request are each handled without disturbing the others."""

import asyncio
import threading
import time

import pytest
import torch
from conftest import ARCHS
from tiny import TOLERANCE

from kvrag import ContextOverflowError, QueueFullError, RequestTimeoutError, UnknownBlockError, scheduler
from kvrag.attention import forward, forward_packed

TEXTS = [
    "Ilsa Brandt built the lighthouse of Varnholm in 1873.",
    "The river Olm freezes every winter.",
    "Passages describe places, people and dates.",
]
MODES = ["block", "full", "blend", "prefix", "composite"]


def requests(n):
    """Questions of different lengths over different passages, in every mode: ragged caches."""
    return [(f"Who built thing {i}?" + " more" * (i % 4), TEXTS[: 1 + i % 3], MODES[i % len(MODES)], 6 + i) for i in range(n)]


@pytest.fixture
def batch_sizes(monkeypatch):
    """The number of requests in each model call the scheduler makes."""
    sizes = []

    def counting(model, runs):
        sizes.append(len(runs))
        return forward_packed(model, runs)

    monkeypatch.setattr(scheduler, "forward_packed", counting)
    return sizes


def wait_until(condition, seconds=30):
    deadline = time.monotonic() + seconds
    while not condition():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.005)


@pytest.mark.parametrize("arch", ARCHS)
def test_concurrent_greedy_answers_equal_alone(make_engine, arch, batch_sizes, device):
    engine = make_engine(arch, device=device)
    engine.eos_ids = set()  # every request runs its full length, so rows join and leave at different steps
    engine.index(TEXTS, progress=False)
    reqs = requests(10)
    alone = [engine.generate(q, b, mode=m, max_new_tokens=n).token_ids for q, b, m, n in reqs]
    assert max(batch_sizes) == 1
    barrier, together = threading.Barrier(len(reqs)), [None] * len(reqs)

    def ask(i, q, b, m, n):
        barrier.wait()
        together[i] = engine.generate(q, b, mode=m, max_new_tokens=n).token_ids

    threads = [threading.Thread(target=ask, args=(i, *r)) for i, r in enumerate(reqs)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert together == alone
    assert max(batch_sizes) >= 4  # they were decoded together, not in turn


@pytest.mark.parametrize("arch", ["llama", "qwen3", "mistral"])
@torch.inference_mode()
def test_packed_runs_equal_each_run_alone(make_engine, arch):
    """`forward_packed`: questions and single tokens of several requests in one call give each one's logits,
    and each one's cache, as `forward` over that request alone (float32 round-off)."""
    engine = make_engine(arch)
    states, runs = [], []
    for i, (q, b, _, _) in enumerate(requests(4)):
        prompt, keys = engine.build_prompt(q, b)
        state = engine.prefill(prompt, "block", keys=keys, extra_capacity=4, question=False)
        states.append(state)
        runs.append((prompt.question if i % 2 else prompt.question[-1:], state.cache, state.next_position))
    alone = []
    for ids, cache, start in runs:
        copy = [(layer.keys.clone(), layer.values.clone()) for layer in cache.layers]
        alone.append((forward(engine.model, ids, cache, start)[-1], [(layer.keys.clone(), layer.values.clone()) for layer in cache.layers]))
        for layer, (k, v) in zip(cache.layers, copy):  # back to before, for the packed call
            layer.set_length(k.shape[2])
    together = forward_packed(engine.model, runs)
    for (logits, kv), row, (_, cache, _) in zip(alone, together, runs):
        torch.testing.assert_close(row, logits, atol=TOLERANCE[torch.float32], rtol=0)
        for (k, v), layer in zip(kv, cache.layers):
            torch.testing.assert_close(layer.keys, k, atol=TOLERANCE[torch.float32], rtol=0)
            torch.testing.assert_close(layer.values, v, atol=TOLERANCE[torch.float32], rtol=0)
    for state in states:
        engine.release(state)


def test_bad_requests_fail_alone(make_engine):
    engine = make_engine()
    engine.eos_ids = set()
    good = requests(4)
    alone = [engine.generate(q, b, mode=m, max_new_tokens=n).token_ids for q, b, m, n in good]
    streams = [engine.stream(q, b, mode=m, max_new_tokens=n) for q, b, m, n in good[:2]]
    with pytest.raises(ContextOverflowError):  # a bad prompt is refused at the call, never queued
        engine.stream("Why? " * engine.context_window, TEXTS)
    with pytest.raises(UnknownBlockError):
        engine.stream("Who?", ["kv_" + "0" * 32])
    streams += [engine.stream(q, b, mode=m, max_new_tokens=n) for q, b, m, n in good[2:]]
    assert [s.drain().token_ids for s in streams] == alone


def test_a_prompt_is_built_on_the_callers_thread_and_counts_in_its_ttft(make_engine, monkeypatch):
    """A prompt that takes long to build (here: held until released) holds up its own caller only: another
    request is answered meanwhile, as it is alone. Its TTFT still runs from the call."""
    engine = make_engine()
    engine.eos_ids = set()
    alone = engine.generate("Who built the lighthouse?", TEXTS, max_new_tokens=8).token_ids
    building, released, build = threading.Event(), threading.Event(), engine.build_prompt
    waited, builders = [], []

    def slow(question, blocks=()):
        builders.append(threading.current_thread())
        if question == "Slow?":
            start = time.perf_counter()
            building.set()
            assert released.wait(30)
            waited.append(time.perf_counter() - start)
        return build(question, blocks)

    monkeypatch.setattr(engine, "build_prompt", slow)
    streams = []
    caller = threading.Thread(target=lambda: streams.append(engine.stream("Slow?", TEXTS, max_new_tokens=4)))
    caller.start()
    assert building.wait(30)
    assert engine.generate("Who built the lighthouse?", TEXTS, max_new_tokens=8).token_ids == alone
    assert caller.is_alive() and not streams  # still building, on its own thread
    released.set()
    caller.join(30)
    result = streams[0].drain()
    assert result.generated_tokens == 4 and result.ttft >= waited[0]
    assert builders == [caller, threading.current_thread()]


def test_full_queue_refuses_and_a_cancelled_request_frees_its_slot(make_engine):
    engine = make_engine(max_batch=1, max_queue=1)
    engine.eos_ids = set()
    first = engine.stream("Who built the lighthouse?", TEXTS, max_new_tokens=10_000)
    wait_until(lambda: engine.scheduler.active == 1)
    second = engine.stream("Who built the lighthouse?", TEXTS, max_new_tokens=5)
    with pytest.raises(QueueFullError, match="max_queue=1"):
        engine.stream("Who built the lighthouse?", TEXTS, max_new_tokens=5)
    assert engine.scheduler.waiting == 1
    first.cancel()
    assert second.drain().generated_tokens == 5  # admitted once the first left
    assert first.result.finish_reason == "cancelled" and first.result.generated_tokens < 10_000
    assert len(engine.pool._free) >= 1  # its workspace went back


def test_leaving_a_stream_early_cancels_it(make_engine):
    engine = make_engine()
    engine.eos_ids = set()
    stream = engine.stream("Who built the lighthouse?", TEXTS, max_new_tokens=10_000)
    for delta in stream:
        if delta:
            break
    assert stream.cancelled
    wait_until(lambda: stream.done)
    assert stream.result.finish_reason == "cancelled"


def test_max_time_in_the_queue(make_engine):
    engine = make_engine(max_batch=1)
    engine.eos_ids = set()
    first = engine.stream("Who built the lighthouse?", TEXTS, max_new_tokens=10_000)
    wait_until(lambda: engine.scheduler.active == 1)
    late = engine.stream("Who built the lighthouse?", TEXTS, max_time=0.05)
    with pytest.raises(RequestTimeoutError, match="waited"):
        late.drain()
    first.cancel()
    assert first.drain().finish_reason == "cancelled"


def test_async_streams_equal_sync(make_engine, batch_sizes):
    engine = make_engine()
    engine.eos_ids = set()
    reqs = requests(6)
    alone = [engine.generate(q, b, mode=m, max_new_tokens=n).text for q, b, m, n in reqs]

    async def ask(q, b, m, n):
        return "".join([delta async for delta in engine.stream(q, b, mode=m, max_new_tokens=n)])

    async def main():
        return await asyncio.gather(*(ask(*r) for r in reqs))

    assert asyncio.run(main()) == alone
    assert max(batch_sizes) > 1


def test_the_worker_leaves_when_idle(make_engine):
    engine = make_engine()
    engine.generate("Who built the lighthouse?", TEXTS, max_new_tokens=3)
    wait_until(lambda: not any(t.name == "kvrag-scheduler" and t.is_alive() for t in threading.enumerate()))
    assert engine.scheduler.active == engine.scheduler.waiting == 0
