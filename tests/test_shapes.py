"""`kvrag bench ttft --shape NAME --random-weights`: the published architectures, built with random weights
(no download); the bench end to end on CPU with a shape cut to 2 layers, and its refusals."""

import re

import pytest
import torch
from tiny import tiny_configs, tiny_model, tiny_tokenizer

from kvrag import families, loading
from kvrag.app.cli import build_parser, main
from kvrag.errors import KVRagError
from kvrag.eval import shapes
from kvrag.eval.ttft import MEMORY_HEADER, PEAK_MEMORY, kv_bytes_per_token

GiB = 2**30
# from each model's published config.json: hidden, MLP, layers, heads, KV heads, vocab, positions, rope theta
PUBLISHED = {
    "llama3-8b": (4096, 14336, 32, 32, 8, 128256, 131072, 500000.0),
    "llama3.2-1b": (2048, 8192, 16, 32, 8, 128256, 131072, 500000.0),
    "qwen2.5-7b": (3584, 18944, 28, 28, 4, 152064, 131072, 1000000.0),
    "mistral-7b": (4096, 14336, 32, 32, 8, 32768, 32768, 1000000.0),
}
PARAMS = {"llama3-8b": 8.03e9, "llama3.2-1b": 1.24e9, "qwen2.5-7b": 7.61e9, "mistral-7b": 7.25e9}


@pytest.fixture(scope="module")
def tokenizer_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("tokenizer")
    tiny_tokenizer().save_pretrained(path)
    return path


@pytest.mark.parametrize("name", PUBLISHED)
def test_shapes_have_the_published_dimensions_and_parameter_counts(name):
    config = shapes.shape_config(name)
    dims = (config.hidden_size, config.intermediate_size, config.num_hidden_layers, config.num_attention_heads,
            config.num_key_value_heads, config.vocab_size, config.max_position_embeddings,
            config.rope_parameters["rope_theta"])
    assert dims == PUBLISHED[name]
    assert families.context_window(config) == PUBLISHED[name][6]  # no sliding window shortens it
    families.check_supported(config)  # kvrag can re-encode its RoPE
    assert abs(loading.param_count(config) / PARAMS[name] - 1) < 0.01


def test_what_sets_the_shapes_apart():
    llama8, llama1, qwen, mistral = (shapes.shape_config(n) for n in PUBLISHED)
    assert llama8.rope_parameters["rope_type"] == llama1.rope_parameters["rope_type"] == "llama3"
    assert (llama8.rope_parameters["factor"], llama1.rope_parameters["factor"]) == (8.0, 32.0)
    assert llama1.tie_word_embeddings and not llama8.tie_word_embeddings
    with torch.device("meta"):
        from transformers import AutoModelForCausalLM

        attn = AutoModelForCausalLM.from_config(qwen).model.layers[0].self_attn
    assert attn.q_proj.bias is not None and attn.o_proj.bias is None  # Qwen2's q/k/v biases
    assert mistral.sliding_window is None
    assert kv_bytes_per_token(llama8, torch.float16) == 32 * 8 * 128 * 2 * 2 == 131072


def test_layers_cut_a_shape_and_are_checked():
    assert shapes.shape_config("qwen2.5-7b", 2).num_hidden_layers == 2
    assert len(shapes.shape_config("qwen2.5-7b", 2).layer_types) == 2
    for layers in (1, 33):  # blend mode needs layer 1; llama3-8b has 32
        with pytest.raises(KVRagError, match="between 2 and llama3-8b's 32"):
            shapes.shape_config("llama3-8b", layers)


def test_the_cli_offers_every_shape():
    bench = build_parser()._subparsers._group_actions[0].choices["bench"]
    ttft = bench._subparsers._group_actions[0].choices["ttft"]
    shape = next(a for a in ttft._actions if "--shape" in a.option_strings)
    assert tuple(shape.choices) == tuple(shapes.SHAPES)


def test_random_weights_are_small_finite_and_tied(device):
    config = shapes.shape_config("llama3.2-1b", 2)
    model = shapes.random_model(config, torch.device(device), torch.bfloat16)
    assert model.lm_head.weight is model.model.embed_tokens.weight
    assert sum(p.numel() for p in model.parameters()) == loading.param_count(config)
    q = model.model.layers[1].self_attn.q_proj.weight.float()
    assert abs(q.std().item() - shapes.INIT_STD) < 1e-3 and (model.model.norm.weight == 1).all()
    logits = model(torch.randint(0, config.vocab_size, (1, 32), device=device)).logits
    assert logits.isfinite().all() and logits.std() > 0.1


def test_ids_beyond_the_vocabulary_are_folded_into_it():
    model = tiny_model(tiny_configs(vocab=50)["llama"])
    shapes.fold_vocabulary(model, 50)
    ids = torch.tensor([[3, 57, 149, 9]])
    assert torch.equal(model(ids).logits, model(ids % 50).logits)


def test_the_estimate_refuses_8b_and_lets_1b_run_in_8_gib(monkeypatch):
    monkeypatch.setattr(shapes, "available_memory", lambda device: 8 * GiB)
    cpu = torch.device("cpu")
    big = shapes.shape_config("llama3-8b")
    assert shapes.memory_needed(big, torch.bfloat16, torch.float16, 4096)["weights"] == 8030261248 * 2
    with pytest.raises(KVRagError, match=r"llama3-8b in bfloat16 on cpu needs about 1\d\.\d GiB at 4096 tokens"):
        shapes.check_fits("llama3-8b", big, torch.bfloat16, torch.float16, cpu, 4096)
    shapes.check_fits("llama3.2-1b", shapes.shape_config("llama3.2-1b"), torch.float32, torch.float16, cpu, 4096)


def _bench(*args, device="cpu"):
    return main(["--device", device, "bench", "ttft", "--random-weights", *args])


def test_bench_runs_a_cut_shape_and_prints_every_column(device, tokenizer_dir, capsys):
    assert _bench("--shape", "llama3.2-1b", "--layers", "2", "--tokenizer", str(tokenizer_dir), "--dtype", "bfloat16",
                  "--lengths", "120", "--runs", "1", device=device) == 0  # bfloat16: half the weights to fill
    lines = capsys.readouterr().out.splitlines()
    assert "llama3.2-1b (meta-llama/Llama-3.2-1B's config, CUT TO 2 OF 16 LAYERS): random weights, 0.38B" in lines[1]
    assert "(400 ids)" in lines[1]
    assert lines[2].startswith(f"device {torch.device(device).type}")
    assert "compute bfloat16, KV stored in bfloat16: 4096 bytes per token" in lines[2]
    assert PEAK_MEMORY[torch.device(device).type] in lines[2]
    assert lines[3] == MEMORY_HEADER and len(lines) == 5
    row = lines[4].split()
    assert len(row) == 21  # the 20 columns of every TTFT table, and peak GiB
    assert int(row[0]) >= 120 and all(float(value.rstrip("x")) > 0 for value in row)
    weights = loading.param_count(shapes.shape_config("llama3.2-1b", 2)) * 2
    assert float(row[-1]) * GiB > weights  # the weights are part of the peak


@pytest.mark.parametrize(
    "args, message",
    [
        (["--shape", "llama3-8b", "--dtype", "bfloat16", "--lengths", "0,1024"],
         r"llama3-8b in bfloat16 on cpu needs about 1\d\.\d GiB at 1\d{3} tokens .* but 8\.0 GiB is available"),
        (["--shape", "mistral-7b", "--layers", "2", "--lengths", "32768"],
         r"mistral-7b's context window is 32768 tokens; a 3\d{4}-token prompt does not fit"),
        (["--shape", "llama3.2-1b", "--layers", "1"], r"--layers must be between 2 and llama3.2-1b's 16"),
    ],
)
def test_bench_refuses_before_building_anything(args, message, tokenizer_dir, capsys, monkeypatch):
    monkeypatch.setattr(shapes, "available_memory", lambda device: 8 * GiB)
    monkeypatch.setattr(shapes, "random_model", lambda *a, **k: pytest.fail("built a model it should have refused"))
    assert _bench(*args, "--tokenizer", str(tokenizer_dir)) == 2
    assert re.search(message, capsys.readouterr().err)


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--device", "cpu", "bench", "ttft", "--shape", "llama3-8b"], "--shape and --random-weights go together"),
        (["--device", "cpu", "--model", "x", "bench", "ttft", "--shape", "llama3-8b", "--random-weights"],
         "name the prompts' tokenizer with --tokenizer"),
        (["--device", "cpu", "bench", "ttft", "--layers", "2"], "--layers and --tokenizer go with --shape"),
        (["--device", "cpu", "bench", "ttft", "--shape", "mistral-7b", "--random-weights", "--tokenizer", "/no/such"],
         "cannot load a tokenizer from '/no/such'"),
    ],
)
def test_bench_option_mistakes(argv, message, capsys):
    assert main(argv) == 2
    assert message in capsys.readouterr().err
