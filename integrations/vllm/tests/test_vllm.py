"""kvrag's connector in a real vLLM server: passages indexed through it are reused in any order, as exactly as
block attention defines it, never leak into vLLM's prefix cache, and bad or missing KV costs a prefill, never
a request."""

import glob
import math
import os
from pathlib import Path

import pytest
import torch

from kvrag.attention import mask
from kvrag_vllm import plan
from kvrag.vllm_client import index
from kvrag.vllm_client import SEPARATORS

pytestmark = pytest.mark.e2e  # the default model, served by vLLM

WORLD = [
    "The Zorvani river flows north from the Kelt mountains and reaches the sea at Port Amsel after 420 kilometres.",
    "Mira Tolvanen founded the glassworks of Hessby in 1871; it closed in 1952 after a fire destroyed the kilns.",
    "The national bird of Ostrava Minor is the grey heron, chosen by a public vote held in 1988.",
    "Port Amsel has two harbours: the old fishing harbour and a container terminal opened in 2004.",
    "The Kelt mountains rise to 3120 metres at Mount Varn, whose glacier feeds the Zorvani river.",
    "Hessby glass was exported to Denmark and Prussia, most of it as green bottles for mineral water.",
]


def _prompt(reference, passages, question, system="Answer from the context, in one sentence."):
    _, tokenizer = reference
    context = "\n\n".join(passages)
    messages = [{"role": "system", "content": system},
                {"role": "user", "content": f"Context:\n{context}\n\nQuestion: {question}"}]
    return tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True, return_dict=False)


def _complete(vllm, ids, connector=True, max_tokens=1):
    body = vllm.request(connector, prompt=ids, max_tokens=max_tokens, temperature=0, logprobs=5,
                        return_tokens_as_token_ids=True)
    reply = vllm.call("POST", "/v1/completions", body)
    choice = reply["choices"][0]
    top = {int(k.removeprefix("token_id:")): v for k, v in choice["logprobs"]["top_logprobs"][0].items()}
    return top, reply["usage"]["prompt_tokens_details"]["cached_tokens"], choice["text"]


def _reference_logprobs(reference, ids, pieces):
    """Log-probabilities of the next token with block attention over `pieces` (each attending to itself
    alone, the header causally) and the rest of the prompt attending to everything: kvrag's definition."""
    model, _ = reference
    blocks = torch.full((len(ids),), len(pieces), dtype=torch.long)
    for number, piece in enumerate(pieces):
        blocks[piece.start : piece.stop] = number
    positions = torch.arange(len(ids))
    with torch.no_grad():
        logits = model(torch.tensor([ids]), attention_mask=mask(positions, len(ids), torch.float32, blocks),
                       position_ids=positions[None]).logits[0, -1]
    return torch.log_softmax(logits.double(), -1)


@pytest.fixture(scope="module")
def indexed(vllm):
    assert index(vllm.url, WORLD, model=vllm.model) == len(WORLD)
    return vllm


def _pieces(vllm, ids, texts=WORLD):
    found = plan.Passages()
    for text in texts:
        found.add(vllm.tokens(text))
    glue = {tuple(vllm.glue(s)) for s in SEPARATORS}
    return plan.leading_run(ids, found.find(ids), lambda run: len(run) >= plan.MIN_PASSAGE_TOKENS or run in glue)


def _stored_file(vllm, text):
    ids = vllm.tokens(text)
    from safetensors import safe_open

    for f in glob.glob(str(vllm.home / "vllm" / "*" / "kv" / "*" / "*")):
        with safe_open(f, "pt") as stored:
            if stored.get_tensor("token_ids").tolist() == ids:
                return Path(f)
    raise AssertionError(f"no stored block for {text[:40]!r}")


def test_saved_kv_is_the_models_own(indexed, reference):
    model, _ = reference
    from safetensors.torch import load

    for text in WORLD:
        stored = load(_stored_file(indexed, text).read_bytes())
        with torch.no_grad():
            cache = model(stored["token_ids"].long()[None], use_cache=True).past_key_values
        for layer in (0, 11, len(cache.layers) - 1):
            torch.testing.assert_close(stored["keys"][layer], cache.layers[layer].keys[0], rtol=1e-4, atol=1e-4)
            torch.testing.assert_close(stored["values"][layer], cache.layers[layer].values[0], rtol=1e-4, atol=1e-4)


def test_passages_are_reused_in_any_order_exactly_as_block_attention(indexed, reference):
    question = "Where does the Zorvani river reach the sea?"
    first = _prompt(reference, [WORLD[i] for i in (2, 0, 3)], question)
    _, cached, _ = _complete(indexed, first)  # a new header: prefilled, and its KV kept for the next
    assert cached == 0
    for order in ((0, 3, 2), (3, 2, 0, 4), (4, 1, 5, 0)):
        ids = _prompt(reference, [WORLD[i] for i in order], question)
        pieces = _pieces(indexed, ids)
        assert [p.kind for p in pieces].count("passage") == len(order)
        top, cached, _ = _complete(indexed, ids)
        assert cached == pieces[-1].stop  # header and every passage, not one token of the question
        _, alone_cached, _ = _complete(indexed, ids, connector=False)  # vLLM alone: a new order, nothing to reuse
        assert alone_cached < pieces[1].start  # at most whole 128-token blocks of a header seen before
        expected = _reference_logprobs(reference, ids, pieces)
        for token, logprob in top.items():
            assert math.isclose(logprob, expected[token].item(), abs_tol=2e-3), (order, token)
        assert max(top, key=top.get) == expected.argmax().item()


def test_a_plain_request_after_a_kvrag_one_gets_full_prefills_output(indexed, reference):
    model, _ = reference
    question = "Who founded the glassworks of Hessby?"
    ids = _prompt(reference, [WORLD[i] for i in (1, 5, 4, 0, 3, 2)], question)
    assert len(ids) > 128  # two paged blocks, both holding block-attention KV after the header
    _complete(indexed, _prompt(reference, [WORLD[i] for i in (5, 1)], question))  # the header kept
    _, cached, _ = _complete(indexed, ids)
    assert cached > 128
    top, cached, _ = _complete(indexed, ids, connector=False)
    assert cached <= 128  # never the blocks the connector filled: only a causal header block, if any
    with torch.no_grad():
        expected = torch.log_softmax(model(torch.tensor([ids])).logits[0, -1].double(), -1)
    for token, logprob in top.items():
        assert math.isclose(logprob, expected[token].item(), abs_tol=2e-3)


def test_after_a_restart_kv_is_read_back_and_damaged_or_foreign_kv_dropped(indexed, reference, weights):
    question = "What is the national bird of Ostrava Minor?"
    _complete(indexed, _prompt(reference, [WORLD[i] for i in (2, 3)], question))  # its header kept
    damaged, foreign = _stored_file(indexed, WORLD[2]), _stored_file(indexed, WORLD[3])
    data = bytearray(damaged.read_bytes())
    data[-64:] = bytes(64)  # the last values zeroed: the checksum no longer holds
    damaged.write_bytes(bytes(data))
    foreign.write_bytes(_stored_file(indexed, WORLD[4]).read_bytes())  # another passage's KV under this key
    from kvrag.eval.vllm import vllm_server

    # a second server on the same home: its scheduler reads the passages indexed through the first, its
    # worker every block from disk (the first one's memory holds the good copies)
    with vllm_server(weights, indexed.home, home=indexed.home) as restarted:
        healthy = _prompt(reference, [WORLD[i] for i in (4, 0)], question)
        _, cached, _ = _complete(restarted, healthy)
        assert cached == _pieces(restarted, healthy)[-1].stop
        ids = _prompt(reference, [WORLD[i] for i in (3, 2)], question)
        _, _, plain = _complete(restarted, ids, connector=False, max_tokens=16)
        _, cached, answer = _complete(restarted, ids, max_tokens=16)
        assert answer == plain  # recomputed by vLLM: the answer of a full prefill
        assert not damaged.exists() and not foreign.exists()  # dropped, never served
        assert restarted.log_text().count("kvrag: dropping unusable KV") == 2  # one line each, in vLLM's log


def test_kv_stored_in_8_bits_is_read_back_dequantized(weights, reference, tmp_path):
    """`KVRAG_STORAGE=int8` (or the extra config's "storage"): the connector keeps 8-bit codes and scales and loads
    them dequantized; the answer is block attention's over the passages, up to 8-bit rounding."""
    from kvrag.eval.vllm import vllm_server

    question = "Who founded the glassworks of Hessby?"
    with vllm_server(weights, tmp_path, home=tmp_path, env={"KVRAG_STORAGE": "int8"}) as server:
        assert index(server.url, WORLD[:3], model=server.model) == 3
        stored = glob.glob(str(tmp_path / "vllm" / "*" / "kv" / "*" / "*.safetensors"))
        assert len(stored) >= 3 and all(f.endswith(".int8.safetensors") for f in stored)  # passages, and glue
        _complete(server, _prompt(reference, [WORLD[i] for i in (2, 0)], question))  # the header kept
        ids = _prompt(reference, [WORLD[i] for i in (0, 2, 1)], question)
        pieces = _pieces(server, ids, WORLD[:3])
        top, cached, _ = _complete(server, ids)
        assert cached == pieces[-1].stop
        expected = _reference_logprobs(reference, ids, pieces)
        assert max(top, key=top.get) == expected.argmax().item()
        for token, logprob in top.items():
            assert math.isclose(logprob, expected[token].item(), abs_tol=0.05), token


def test_missing_kv_means_a_plain_prefill(indexed, reference):
    question = "When was the container terminal of Port Amsel opened?"
    _complete(indexed, _prompt(reference, [WORLD[i] for i in (5, 1)], question))
    _stored_file(indexed, WORLD[5]).unlink()
    ids = _prompt(reference, [WORLD[i] for i in (5, 1, 0)], question)
    _, cached, answer = _complete(indexed, ids, max_tokens=16)
    assert cached == 0  # its first passage is gone: nothing to supply before it
    _, _, plain = _complete(indexed, ids, connector=False, max_tokens=16)
    assert answer == plain


def test_replicas_share_kv_through_redis_and_prefill_when_it_is_gone(weights, reference, tmp_path):
    """Two servers with homes of their own (two machines) and one Redis: passages indexed through one are
    reused by the other; with Redis stopped, a passage only it held is prefilled, and no request fails."""
    from kvrag.eval.scaleout import RedisServer
    from kvrag.eval.vllm import vllm_server

    shared = [text.replace("Zorvani", "Quellin").replace("Hessby", "Dunmarch") for text in WORLD[:4]]
    question = "Where does the Quellin river reach the sea?"
    redis = RedisServer(tmp_path / "redis")
    redis.start()
    secret = {"KVRAG_SECRET": "kvrag-test-secret-" + "0" * 32}
    try:
        with vllm_server(weights, tmp_path / "a", home=tmp_path / "a", remote=redis.url, env=secret) as a, \
                vllm_server(weights, tmp_path / "b", home=tmp_path / "b", remote=redis.url, env=secret) as b:
            assert index(a.url, shared, model=a.model) == len(shared)  # through A only
            _complete(b, _prompt(reference, [shared[i] for i in (0, 1)], question))  # B's header kept
            ids = _prompt(reference, [shared[i] for i in (1, 0)], question)
            _, cached, _ = _complete(b, ids)
            assert cached == _pieces(b, ids, shared)[-1].stop  # A's passages, read from Redis by B
            redis.stop()
            ids = _prompt(reference, [shared[i] for i in (2, 0)], question)  # shared[2]: only Redis had it
            _, cached, answer = _complete(b, ids, max_tokens=12)
            _, _, plain = _complete(b, ids, connector=False, max_tokens=12)
            assert answer == plain and cached < _pieces(b, ids, shared)[1].start
    finally:
        redis.stop()


def _tiny_llama(directory: Path, tokenizer) -> Path:
    """A random two-layer Llama, 4 query and 2 KV heads (so two tensor-parallel ranks hold one KV head each),
    with the default model's tokenizer and chat template."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=len(tokenizer), hidden_size=256, intermediate_size=512, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, head_dim=64, max_position_embeddings=4096,
                         initializer_range=0.1, tie_word_embeddings=True, bos_token_id=tokenizer.bos_token_id,
                         eos_token_id=tokenizer.eos_token_id)
    LlamaForCausalLM(config).save_pretrained(directory)
    tokenizer.save_pretrained(directory)
    return directory


def test_tensor_parallel_ranks_keep_and_load_their_own_heads(reference, tmp_path):
    """`--tensor-parallel-size 2` on vLLM's CPU backend: each rank keeps its KV head's slice of a passage and
    loads it back re-rotated; the answer is block attention's over all heads."""
    from safetensors.torch import load
    from transformers import AutoModelForCausalLM

    from kvrag.eval.vllm import vllm_server

    tiny = _tiny_llama(tmp_path / "tiny", reference[1])
    model = AutoModelForCausalLM.from_pretrained(tiny, dtype=torch.float32).eval()
    cores = os.cpu_count() or 1
    binding = f"0-{cores // 2 - 1}|{cores // 2}-{cores - 1}" if cores > 1 else "0|0"
    with vllm_server(tiny, tmp_path, home=tmp_path / "home", extra=("--tensor-parallel-size", "2"),
                     env={"VLLM_CPU_OMP_THREADS_BIND": binding}) as server:
        assert index(server.url, WORLD, model=server.model) == len(WORLD)
        ids = server.tokens(WORLD[1])
        slices = [load(f.read_bytes()) for f in (tmp_path / "home" / "vllm").glob("*/kv/*/*.safetensors")]
        slices = [s for s in slices if s["token_ids"].tolist() == ids]
        with torch.no_grad():
            cache = model(torch.tensor([ids]), use_cache=True).past_key_values
        assert len(slices) == 2 and all(s["keys"].shape[1] == 1 for s in slices)  # one KV head per rank
        heads = []
        for stored in slices:
            head = [h for h in range(2) if torch.allclose(stored["keys"][0, 0], cache.layers[0].keys[0, h], atol=1e-4)]
            assert len(head) == 1
            heads += head
            for layer in range(2):
                torch.testing.assert_close(stored["keys"][layer, 0], cache.layers[layer].keys[0, head[0]], rtol=1e-4, atol=1e-4)
                torch.testing.assert_close(stored["values"][layer, 0], cache.layers[layer].values[0, head[0]], rtol=1e-4, atol=1e-4)
        assert sorted(heads) == [0, 1]  # each rank its own head
        question = "Who founded the glassworks of Hessby?"
        _complete(server, _prompt(reference, [WORLD[i] for i in (1, 4)], question))  # the header kept
        ids = _prompt(reference, [WORLD[i] for i in (4, 0, 1)], question)
        pieces = _pieces(server, ids)
        top, cached, _ = _complete(server, ids)
        assert cached == pieces[-1].stop
        block = _reference_logprobs((model, None), ids, pieces)
        with torch.no_grad():
            causal = torch.log_softmax(model(torch.tensor([ids])).logits[0, -1].double(), -1)
        assert max(abs(block[t] - causal[t]).item() for t in top) > 0.02  # the check below tells the two apart
        for token, logprob in top.items():
            assert math.isclose(logprob, block[token].item(), abs_tol=2e-3), token
