"""Published architectures with random weights: the TTFT table at real shapes without downloading.

Time to first token depends on a model's shape (layers, widths, heads, vocabulary), its dtype and the
device, not on its weight values, so `kvrag bench ttft --shape NAME --random-weights` builds the
model from a config written here from the published config.json and fills it with small random
values. Every shape has its published context length: `llama3-8b` is Llama-3.1-8B's config (Llama-3-8B's
dimensions with llama3 RoPE scaling to 128K positions; Llama-3-8B itself has 8K), `qwen2.5-7b` is the
base model's (131072 positions; the instruct model's config says 32768). The prompt's tokens come
from another tokenizer (SmolLM2's by default); ids beyond a shape's vocabulary are folded into it.
"""

import copy
import hashlib
import json
import os
from dataclasses import dataclass

import torch

from kvrag import KVEngine, attention, families, loading
from kvrag.errors import KVRagError
from kvrag.store import default_storage_dtype

from .ttft import kv_bytes_per_token


@dataclass(frozen=True)
class Shape:
    source: str  # the published model whose config.json this is
    params: float  # its published parameter count
    model_type: str
    config: dict


_LLAMA3_ROPE = {"rope_type": "llama3", "rope_theta": 500000.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                "original_max_position_embeddings": 8192}
SHAPES = {
    "llama3-8b": Shape("meta-llama/Llama-3.1-8B", 8.03e9, "llama", dict(
        hidden_size=4096, intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32,
        num_key_value_heads=8, vocab_size=128256, max_position_embeddings=131072, rms_norm_eps=1e-5,
        tie_word_embeddings=False, rope_parameters={**_LLAMA3_ROPE, "factor": 8.0})),
    "llama3.2-1b": Shape("meta-llama/Llama-3.2-1B", 1.24e9, "llama", dict(
        hidden_size=2048, intermediate_size=8192, num_hidden_layers=16, num_attention_heads=32,
        num_key_value_heads=8, head_dim=64, vocab_size=128256, max_position_embeddings=131072, rms_norm_eps=1e-5,
        tie_word_embeddings=True, rope_parameters={**_LLAMA3_ROPE, "factor": 32.0})),
    "qwen2.5-7b": Shape("Qwen/Qwen2.5-7B", 7.61e9, "qwen2", dict(  # q/k/v biases: Qwen2's architecture
        hidden_size=3584, intermediate_size=18944, num_hidden_layers=28, num_attention_heads=28,
        num_key_value_heads=4, vocab_size=152064, max_position_embeddings=131072, rms_norm_eps=1e-6,
        tie_word_embeddings=False, use_sliding_window=False, max_window_layers=28,
        rope_parameters={"rope_type": "default", "rope_theta": 1000000.0})),
    "mistral-7b": Shape("mistralai/Mistral-7B-v0.3", 7.25e9, "mistral", dict(
        hidden_size=4096, intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32,
        num_key_value_heads=8, vocab_size=32768, max_position_embeddings=32768, rms_norm_eps=1e-5,
        tie_word_embeddings=False, sliding_window=None,  # v0.3 attends to every position
        rope_parameters={"rope_type": "default", "rope_theta": 1000000.0})),
}
INIT_STD = 0.02
"""The published configs' initializer_range: small enough that bfloat16 activations stay finite."""
MEMORY_MARGIN = 0.9
"""Share of the available memory a run may plan to use; the estimate leaves out allocator slack."""


def shape_config(name: str, layers: int | None = None):
    """The transformers config of a shape, cut to its first `layers` decoder layers if given."""
    from transformers import AutoConfig

    if name not in SHAPES:
        raise KVRagError(f"unknown shape {name!r}; shapes: {', '.join(SHAPES)}")
    shape = SHAPES[name]
    kwargs = dict(shape.config)
    if layers is not None:
        if not 2 <= layers <= kwargs["num_hidden_layers"]:  # blend mode measures deviation on layer 1
            raise KVRagError(f"--layers must be between 2 and {name}'s {kwargs['num_hidden_layers']}, got {layers}")
        kwargs["num_hidden_layers"] = layers
    return AutoConfig.for_model(shape.model_type, **kwargs)


def available_memory(device: torch.device) -> int:
    """Bytes a run can still allocate: free GPU memory, or the kernel's MemAvailable on CPU."""
    if device.type == "cuda":
        return torch.cuda.mem_get_info(device)[0]
    try:
        with open("/proc/meminfo") as f:
            return next(int(line.split()[1]) * 1024 for line in f if line.startswith("MemAvailable:"))
    except (OSError, StopIteration):
        return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")


def memory_needed(config, dtype: torch.dtype, storage_dtype: torch.dtype, tokens: int) -> dict:
    """Bytes the bench needs on the device at its longest prompt: the weights; the stored KV of the
    passages and of prefix mode's fresh ones (the memory tier holds both, and on a GPU the device tier);
    two workspaces in the compute dtype (the engine's pool keeps two); one layer's activations for a
    full prefill."""
    compute_kv = kv_bytes_per_token(config, dtype)
    capacity = -(-(tokens + 1) // 1024) * 1024  # the pool's rounding
    return {
        "weights": loading.param_count(config) * dtype.itemsize,
        "stored KV": 2 * tokens * kv_bytes_per_token(config, storage_dtype),
        "workspaces": 2 * capacity * compute_kv,
        "activations": tokens * (3 * config.intermediate_size + 6 * config.hidden_size) * dtype.itemsize,
    }


def check_fits(name: str, config, dtype, storage_dtype, device, tokens: int) -> None:
    """Refuse before allocating anything when the run would not fit, instead of being OOM-killed."""
    needed = memory_needed(config, dtype, storage_dtype, tokens)
    available = available_memory(device)
    if sum(needed.values()) > MEMORY_MARGIN * available:
        parts = ", ".join(f"{k} {v / 2**30:.1f}" for k, v in needed.items())
        raise KVRagError(
            f"{name} in {str(dtype).removeprefix('torch.')} on {device} needs about "
            f"{sum(needed.values()) / 2**30:.1f} GiB at {tokens} tokens ({parts}) but {available / 2**30:.1f} GiB "
            f"is available; try a GPU, --dtype bfloat16, --layers N or shorter --lengths"
        )


def random_model(config, device: torch.device, dtype: torch.dtype, seed: int = 0):
    """The model built on `device` without transformers' slow init, then filled with small normal
    weights, unit norms and zero biases (seeded; values do not change the timings)."""
    from transformers import AutoModelForCausalLM
    from transformers.initialization import no_init_weights

    with torch.device(device), no_init_weights():
        model = AutoModelForCausalLM.from_config(copy.deepcopy(config), dtype=dtype, attn_implementation=attention.NAME)
    model.tie_weights()  # skipped with the init
    generator = torch.Generator(device).manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() > 1:
                p.normal_(0.0, INIT_STD, generator=generator)
            else:
                p.fill_(1.0 if "norm" in name else 0.0)
    return model.eval()


def fold_vocabulary(model, vocab_size: int) -> None:
    """Token ids at or above `vocab_size` read embedding row id % vocab_size: a tokenizer with more ids
    than the shape (SmolLM2's 49152 against mistral-7b's 32768) can then feed it."""
    model.get_input_embeddings().register_forward_pre_hook(lambda module, args: (args[0] % vocab_size,))


def random_engine(name: str, tokenizer, *, device: torch.device, dtype: torch.dtype, tokens: int,
                  layers: int | None = None, seed: int = 0, **kwargs):
    """A KVEngine over shape `name` with random weights, sized for prompts up to `tokens` tokens: it checks
    the shape's context window and the memory first, keeps every block in memory, on a GPU in its memory
    too (where Block-Attention's table has the cached KV), and writes nothing to disk."""
    config = shape_config(name, layers)
    storage_dtype = default_storage_dtype(dtype)
    window = families.context_window(config)
    if tokens >= window:
        raise KVRagError(f"{name}'s context window is {window} tokens; a {tokens}-token prompt does not fit")
    check_fits(name, config, dtype, storage_dtype, device, tokens)
    model = random_model(config, device, dtype, seed)
    if len(tokenizer) > config.vocab_size:
        fold_vocabulary(model, config.vocab_size)
    # the weights are random: their identity is the recipe, hashing gigabytes of them would only cost time
    recipe = {"shape": name, "layers": config.num_hidden_layers, "seed": seed, "dtype": str(dtype),
              "tokenizer": loading.tokenizer_digest(tokenizer)}
    fingerprint = hashlib.sha256(json.dumps(recipe, sort_keys=True).encode()).hexdigest()
    budget = memory_needed(config, dtype, storage_dtype, tokens)["stored KV"] + (64 << 20)
    return KVEngine(model, tokenizer, fingerprint=fingerprint, persist=False, memory_budget=budget,
                    device_budget=budget, storage_dtype=storage_dtype, **kwargs)


def describe(name: str, config) -> str:
    """One header line: what the shape is and how much of it runs."""
    shape, total = SHAPES[name], SHAPES[name].config["num_hidden_layers"]
    cut = "" if config.num_hidden_layers == total else f", CUT TO {config.num_hidden_layers} OF {total} LAYERS"
    return (f"shape {name} ({shape.source}'s config{cut}): random weights, "
            f"{loading.param_count(config) / 1e9:.2f}B parameters, {config.num_hidden_layers} layers x "
            f"{config.num_attention_heads} heads ({config.num_key_value_heads} KV) of {families.head_dim(config)}, "
            f"vocab {config.vocab_size}")
