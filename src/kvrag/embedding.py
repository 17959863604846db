"""The passage index's sentence embeddings (all-MiniLM-L6-v2) computed with transformers' BertModel and tokenizers.

sentence-transformers computes the same vectors, with its Transformer (the same BertModel), mean Pooling and
Normalize modules; but importing it brings scikit-learn and SciPy, seconds on 2 cores before the first question of
a `kvrag ask` is embedded. Here the folder's tokenizer.json and BertModel are loaded directly and the mean taken:
the vectors agree with sentence-transformers' to float32 rounding (tests/test_retrieval.py), so indexes written by
either are searched alike.

`load` takes a folder of exactly that shape (BERT with absolute positions and exact GELU, mean pooling alone,
normalized, no lower-casing by sentence-transformers itself) and returns None for any other, which then loads
with sentence-transformers (retrieval.Embedder).
"""

import contextlib
import json
from pathlib import Path

import torch
import torch.nn.functional as F

MODULES = ("Transformer", "Pooling", "Normalize")
"""The class names of a supported folder's modules.json, in order."""
BATCH = 32
"""Texts embedded per forward, longest first (sentence-transformers' default batch and order)."""
SMALL = 256
"""Tokens in all, at most, that `MeanPoolingBert.encode` embeds on one thread (see `threads.single`): a question."""


def _json(path: Path):
    with open(path, encoding="utf-8") as f:
        return json.load(f)


def supported(directory: str | Path) -> dict | None:
    """The settings `MeanPoolingBert` reads from a sentence-transformers folder it computes exactly, or None."""
    directory = Path(directory)
    try:
        modules = _json(directory / "modules.json")
        if [m["type"].rsplit(".", 1)[-1] for m in modules] != list(MODULES) or modules[0].get("path", "") != "":
            return None
        pooling = _json(directory / modules[1]["path"] / "config.json")
        modes = {k for k, v in pooling.items() if k.startswith("pooling_mode") and v}
        if modes != {"pooling_mode_mean_tokens"} or pooling.get("include_prompt", True) is not True:
            return None
        st = _json(directory / "sentence_bert_config.json")
        config = _json(directory / "config.json")
    except (OSError, ValueError, KeyError, TypeError, AttributeError, IndexError):
        return None
    if (st.get("do_lower_case") or not isinstance(st.get("max_seq_length"), int) or config.get("model_type") != "bert"
            or config.get("position_embedding_type", "absolute") != "absolute" or config.get("hidden_act") != "gelu"
            or config.get("is_decoder") or config.get("add_cross_attention")
            or not (directory / "tokenizer.json").is_file() or not (directory / "model.safetensors").is_file()):
        return None
    max_length = min(st["max_seq_length"], config["max_position_embeddings"])
    return {"max_length": max_length}


def load(directory: str | Path, device: str | torch.device = "cpu") -> "MeanPoolingBert | None":
    """The folder's model, or None if `supported` says it is of another shape."""
    settings = supported(directory)
    if settings is None:
        return None
    return MeanPoolingBert(Path(directory), settings, device)


class MeanPoolingBert:
    """transformers' BertModel, then the mean of its outputs over each text's tokens, unit length: what
    sentence-transformers computes for a folder `supported` accepts (its Transformer module is the same AutoModel)."""

    def __init__(self, directory: Path, settings: dict, device: str | torch.device = "cpu"):
        from tokenizers import Tokenizer
        from transformers import BertModel

        self.max_seq_length = settings["max_length"]
        self.tokenizer = Tokenizer.from_file(str(directory / "tokenizer.json"))
        self.tokenizer.no_padding()  # the file's own padding and truncation are not sentence-transformers'
        self.tokenizer.enable_truncation(self.max_seq_length)
        self.device = torch.device(device)
        from .loading import quietly

        with quietly():  # no progress bar or load report for a model the package ships
            self.model = BertModel.from_pretrained(directory, local_files_only=True).to(self.device)  # pooler unused
        self.model.eval()

    def token_ids(self, texts: list[str]) -> list[list[int]]:
        """Each text's token ids, special tokens included, cut at `max_seq_length`."""
        return [e.ids for e in self.tokenizer.encode_batch(list(texts))]

    def count_tokens(self, texts: list[str]) -> int:
        return sum(len(ids) for ids in self.token_ids(texts))

    @torch.inference_mode()
    def encode(self, texts: list[str]) -> torch.Tensor:
        """(len(texts), hidden) unit vectors, float32, on the CPU. A question or two (SMALL tokens) on one thread."""
        from .threads import single

        ids = self.token_ids(texts)
        order = sorted(range(len(ids)), key=lambda i: -len(ids[i]))
        out = torch.empty(len(ids), self.model.config.hidden_size)
        small = self.device.type == "cpu" and sum(map(len, ids)) <= SMALL
        with single() if small else contextlib.nullcontext():
            for start in range(0, len(order), BATCH):
                rows = order[start : start + BATCH]
                length = max(len(ids[i]) for i in rows)
                batch = torch.zeros(len(rows), length, dtype=torch.long)
                mask = torch.zeros(len(rows), length, dtype=torch.long)
                for r, i in enumerate(rows):
                    batch[r, : len(ids[i])] = torch.tensor(ids[i])
                    mask[r, : len(ids[i])] = 1
                hidden = self.model(input_ids=batch.to(self.device), attention_mask=mask.to(self.device)).last_hidden_state
                weights = mask.to(self.device).unsqueeze(-1).to(hidden.dtype)
                mean = (hidden * weights).sum(dim=1) / weights.sum(dim=1).clamp(min=1e-9)
                out[rows] = F.normalize(mean, p=2, dim=1).cpu()
        return out
