"""Time to load a checkpoint: kvrag's `from_pretrained` against transformers' own.

The first `KVEngine.from_pretrained` of a checkpoint hashes its weights and tokenizer once for the KV
fingerprint; later loads read the digests remembered under KVRAG_HOME. A random-weight checkpoint of
a published shape is saved once, then the loads take turns, so a noisy machine affects them alike:
transformers' model alone, its model and tokenizer (what kvrag loads), and kvrag's.
"""

import gc
import statistics
import time
from pathlib import Path

import torch

from kvrag import KVEngine

from .shapes import random_model, shape_config


def save_checkpoint(name: str, directory: Path, dtype: torch.dtype, tokenizer) -> Path:
    """Shape `name` with random weights, saved as a user's checkpoint (safetensors, config, tokenizer)."""
    if not (directory / "config.json").is_file():
        model = random_model(shape_config(name), torch.device("cpu"), dtype)
        model.save_pretrained(directory)
        tokenizer.save_pretrained(directory)
        del model
        gc.collect()
    return directory


def _seconds(load) -> float:
    start = time.perf_counter()
    loaded = load()
    seconds = time.perf_counter() - start
    del loaded
    gc.collect()
    return seconds


def load_times(directory: Path, device: torch.device, dtype: torch.dtype, home: Path, runs: int = 3) -> dict:
    """Seconds: kvrag's first load (weights hashed), then the medians of `runs` alternating loads of
    transformers' model (`plain`), its model and tokenizer (`plain_tokenizer`) and kvrag's engine (`kvrag`)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    placement = {"device_map": {"": device}} if device.type == "cuda" else {}

    def plain():
        return AutoModelForCausalLM.from_pretrained(directory, dtype=dtype, local_files_only=True, **placement)

    def plain_tokenizer():
        return plain(), AutoTokenizer.from_pretrained(directory, local_files_only=True)

    def kvrag():
        return KVEngine.from_pretrained(str(directory), device=device, dtype=dtype, adapter=None, home=home,
                                        warm_up=False)  # the load alone, as transformers' is timed

    first = _seconds(kvrag)
    loads = {"plain": plain, "plain_tokenizer": plain_tokenizer, "kvrag": kvrag}
    times = {name: [] for name in loads}
    for _ in range(runs):
        for name, load in loads.items():
            times[name].append(_seconds(load))
    return {"first": first, **{name: statistics.median(values) for name, values in times.items()}}
