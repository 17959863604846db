"""Tiny random-weight models and a tiny byte-level BPE tokenizer, built in-process (no download)."""

import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import AutoConfig, AutoModelForCausalLM, PreTrainedTokenizerFast

from kvrag.families import FAMILIES

CHATML = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
CORPUS = [
    "The lighthouse of Varnholm was built in 1873 by the engineer Ilsa Brandt.",
    "Question: who built the lighthouse? Answer briefly, in one sentence.",
    "Passages describe places, people and dates. The river Olm freezes every winter.",
    "You are a helpful assistant. Answer the question using only the passages.",
]


def tiny_tokenizer() -> PreTrainedTokenizerFast:
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=400,
        special_tokens=["<|endoftext|>", "<|im_start|>", "<|im_end|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(CORPUS, trainer)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok, eos_token="<|im_end|>", bos_token="<|im_start|>", pad_token="<|endoftext|>"
    )
    fast.chat_template = CHATML
    return fast


def _common(vocab: int) -> dict:
    return dict(
        vocab_size=vocab,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=1024,
        eos_token_id=2,
        bos_token_id=1,
        pad_token_id=0,
        tie_word_embeddings=False,
    )


VARIANTS = ["llama3-scaled", "qwen2-yarn", "llama-head64"]
"""Configs beside one per family: scaled RoPE, and the head shape where kvrag.kernels apply."""


def tiny_configs(vocab: int = 400) -> dict:
    """A tiny config of every model family kvrag supports (families.py), then the `VARIANTS`."""
    c = _common(vocab)
    config = AutoConfig.for_model
    return {
        # every layer attends in full; head_dim as the hidden size gives it (Qwen3's default is another)
        **{family: config(family, **c, head_dim=16, sliding_window=None) for family in FAMILIES},
        # SmolLM2's head shape (head_dim 64, three query heads per kv head): where kvrag.kernels apply
        "llama-head64": config("llama", **{**c, "hidden_size": 192, "num_attention_heads": 3, "num_key_value_heads": 1}),
        "llama3-scaled": config(
            "llama",
            **c,
            rope_parameters={
                "rope_type": "llama3",
                "rope_theta": 10000.0,
                "factor": 8.0,
                "low_freq_factor": 1.0,
                "high_freq_factor": 4.0,
                "original_max_position_embeddings": 64,
            },
        ),
        "qwen2-yarn": config(
            "qwen2",
            **{**c, "max_position_embeddings": 256},
            rope_parameters={"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0, "original_max_position_embeddings": 64},
        ),
    }


TOLERANCE = {torch.float32: 1e-4, torch.float16: 5e-3, torch.bfloat16: 3e-2}
"""Largest difference of logits that counts as equal, by compute dtype (tiny models' logits are ~1)."""


def tiny_model(config, seed: int = 0):
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32, attn_implementation="sdpa")
    with torch.no_grad():  # random init is small; widen it so logits differ clearly between positions
        for p in model.parameters():
            if p.dim() > 1:
                p.normal_(0, 0.08)
    return model.eval()


def block_mask(lengths: list[int], dtype=torch.float32) -> torch.Tensor:
    """4D additive mask: each block causal within itself, the last block causal over everything."""
    n = sum(lengths)
    allowed = torch.zeros(n, n, dtype=torch.bool)
    start = 0
    for i, length in enumerate(lengths):
        end = start + length
        lo = 0 if i == len(lengths) - 1 else start
        allowed[start:end, lo:end] = True
        start = end
    allowed &= torch.ones(n, n, dtype=torch.bool).tril()
    mask = torch.zeros(n, n, dtype=dtype).masked_fill(~allowed, torch.finfo(dtype).min)
    return mask[None, None]
