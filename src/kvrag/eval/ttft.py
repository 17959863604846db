"""Time to first token against cached context length: Block-Attention's Table 2 set-up.

A ~50-token question follows about 0..8K tokens of context (system prompt and passages). `full`
prefills everything, `block` prefills the question only, `prefix` can reuse only the system prompt
(each run brings passages no earlier request had, as a new retrieval does), `blend` recomputes
10%, 15% or 30% of the passage tokens with the question (CacheBlend), `ahead` 15% or 30% of them chosen by
the question's block-mode pass (`select="lookahead"`), and `floor` is the same
request without passages: the least any mode can take for this question. Runs of the modes are
interleaved so that a noisy machine affects them alike; ratios are against `full` from the same run.
FLOPs to first token follow the TurboRAG appendix (QKV, attention, output projection and MLP per
computed token). With `memory`, each row also holds the peak memory while its length ran: on CUDA
torch's peak allocation on the device, on CPU the process's peak resident set (weights included).
"""

import os
import re
import statistics

import torch

from kvrag import BlendConfig, quant
from kvrag.families import head_dim

BLEND_RATIOS = (0.10, 0.15, 0.30)
AHEAD_RATIOS = (0.15, 0.30)

QUESTION = (
    "Considering every passage above about the island, its towns, its engineers and its festivals, "
    "which person designed the northern lighthouse, in what year was it completed, and what material "
    "was used for its lantern room according to the records?"
)
FILLER = (
    "The archive of the harbour office records ships, cargo, weather and the names of the pilots who "
    "guided them. Each entry lists the date, the tide, the berth and the fee that was paid. "
)


def kv_bytes_per_token(config, dtype: torch.dtype | str) -> int:
    """Bytes of one token's keys and values over every layer, held in `dtype` (or an 8- or 4-bit format: with
    each value's scale, less the keys' per block)."""
    return round(quant.bytes_per_token(config.num_hidden_layers, config.num_key_value_heads, head_dim(config), dtype))


def layer_flops(config, tokens: float, keys: float) -> float:
    """FLOPs of one decoder layer computing `tokens` tokens whose attention reads `keys` keys in all."""
    d = config.hidden_size
    d_q = config.num_attention_heads * head_dim(config)
    d_kv = config.num_key_value_heads * head_dim(config)
    per_token = 2 * d * (d_q + 2 * d_kv) + 2 * d_q * d + 6 * d * config.intermediate_size
    return tokens * per_token + 4 * d_q * keys  # QK^T and AV: 4 * d_q per query-key pair


def flops_to_first_token(config, computed: int, context_before: int) -> float:
    """FLOPs to prefill `computed` tokens that follow `context_before` cached tokens, plus one LM head."""
    # token i of the computed run attends to context_before + i + 1 keys
    keys = computed * context_before + computed * (computed + 1) / 2
    return config.num_hidden_layers * layer_flops(config, computed, keys) + 2 * config.hidden_size * config.vocab_size


def flops_blend(config, context: int, question: int, recomputed: int) -> float:
    """Blend mode with one check layer: the selection pass runs the first layer over the whole
    context, then `recomputed` context tokens (spread over it: half the context's keys each, on
    average) and the question run through every layer."""
    selection = layer_flops(config, context, context * (context + 1) / 2)
    keys = recomputed * context / 2 + question * context + question * (question + 1) / 2
    computed = config.num_hidden_layers * layer_flops(config, recomputed + question, keys)
    return selection + computed + 2 * config.hidden_size * config.vocab_size


def flops_lookahead(config, context: int, question: int, recomputed: int) -> float:
    """Blend with select="lookahead": block mode's question pass over the context through every layer, then
    `recomputed` context tokens and the question as blend runs them, without its first-layer selection pass."""
    selection = layer_flops(config, context, context * (context + 1) / 2)
    return flops_to_first_token(config, question, context) + flops_blend(config, context, question, recomputed) - selection


def make_passages(engine, total_tokens: int, block_tokens: int = 256, tag: str = "") -> list[str]:
    """Distinct filler passages of about `block_tokens` tokens adding up to about `total_tokens`.
    `engine`: an engine or its PromptLayout."""
    layout = getattr(engine, "layout", engine)
    passages, count = [], 0
    unit = len(layout.passage_ids(FILLER))
    while count < total_tokens:
        n = max(1, min(block_tokens, total_tokens - count) // unit)
        text = f"Record {tag}{len(passages)}. " + FILLER * n
        passages.append(text)
        count += len(layout.passage_ids(text))
    return passages


def prompt_length(layout, length: int, question: str = QUESTION) -> int:
    """Tokens of `ttft_table`'s request at `length`, known from the tokenizer alone: before a model is built."""
    system = len(layout.prefix_ids)
    passages = make_passages(layout, length - system) if length > system else []
    body = sum(len(layout.passage_ids(p)) for p in passages) + max(0, len(passages) - 1) * len(layout.separator_ids)
    return system + body + len(layout.question_ids(question, after_passages=bool(passages)))


def device_name(device: torch.device) -> str:
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    try:
        with open("/proc/cpuinfo") as f:
            model = next((line.split(":", 1)[1].strip() for line in f if line.startswith("model name")), "CPU")
    except OSError:
        model = "CPU"
    return f"{model}, {os.cpu_count()} cores, {torch.get_num_threads()} torch threads"


PEAK_MEMORY = {"cuda": "peak memory allocated by torch on the device", "cpu": "peak resident set of the process"}


def reset_peak_memory(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
        return
    try:  # Linux: "5" resets the process's peak resident set (VmHWM)
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
    except OSError:
        pass  # the peak then covers the whole process so far


def peak_memory(device: torch.device) -> int:
    """Bytes at the peak since `reset_peak_memory` (see PEAK_MEMORY for what is counted)."""
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device)
    try:
        with open("/proc/self/status") as f:
            return int(re.search(r"VmHWM:\s+(\d+) kB", f.read()).group(1)) * 1024
    except (OSError, AttributeError):
        import resource

        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # KiB on Linux


def _ttft(engine, question, passages, mode, blend=None) -> float:
    return engine.generate(question, passages, mode=mode, max_new_tokens=1, blend=blend).ttft


def ttft_table(engine, lengths=(0, 512, 1024, 2048, 4096, 8000), runs: int = 3, question: str = QUESTION,
               progress=print, memory: bool = False):
    """Median TTFT (seconds) per mode and context length (tokens before the question); returns row dicts,
    with the peak memory in bytes (`peak_memory`) when `memory`."""
    config = engine.model.config
    system = len(engine.layout.prefix_ids)
    rows = []
    for length in lengths:
        if memory:
            reset_peak_memory(engine.model.device)
        budget = length - system
        passages = make_passages(engine, budget) if budget > 0 else []
        if passages:
            engine.index(passages, progress=False)
        prompt, _ = engine.build_prompt(question, passages)
        q_tokens = len(prompt.question)
        cached = len(prompt) - q_tokens
        blends = {f"blend{round(r * 100)}": BlendConfig(recompute_ratio=r) for r in BLEND_RATIOS}
        blends |= {f"ahead{round(r * 100)}": BlendConfig(recompute_ratio=r, select="lookahead") for r in AHEAD_RATIOS}
        times = {name: [] for name in ("floor", "full", "block", "prefix", *blends, "auto")}
        _ttft(engine, question, passages, "block")  # warm-up: buffers and allocator
        for run in range(runs):
            times["floor"].append(_ttft(engine, question, [], "block"))
            times["full"].append(_ttft(engine, question, passages, "full"))
            times["block"].append(_ttft(engine, question, passages, "block"))
            for name, blend in blends.items():
                times[name].append(_ttft(engine, question, passages, "blend", blend))
            times["auto"].append(_ttft(engine, question, passages, "auto"))
            # passages no earlier request has seen: only the system prompt can be a cached prefix
            unseen = make_passages(engine, budget, tag=f"{length}-{run}-") if passages else []
            times["prefix"].append(_ttft(engine, question, unseen, "prefix"))
        row = {name: statistics.median(values) for name, values in times.items()}
        passage_tokens = cached - system
        row.update(
            context=cached,
            question_tokens=q_tokens,
            flops_full=flops_to_first_token(config, cached + q_tokens, 0),
            flops_block=flops_to_first_token(config, q_tokens, cached),
            flops_blend15=flops_blend(config, cached, q_tokens, round(0.15 * passage_tokens)),
            flops_ahead15=flops_lookahead(config, cached, q_tokens, round(0.15 * passage_tokens)),
        )
        if memory:
            row["peak_memory"] = peak_memory(engine.model.device)
        rows.append(row)
        progress(format_row(row))
    return rows


HEADER = (
    f"{'context':>8} {'floor ms':>9} {'full ms':>9} {'prefix ms':>9} {'block ms':>9} "
    f"{'blend10 ms':>10} {'blend15 ms':>10} {'blend30 ms':>10} {'ahead15 ms':>10} {'ahead30 ms':>10} {'auto ms':>9} "
    f"{'full/block':>10} {'full/blend15':>12} {'full/ahead15':>12} {'full/auto':>9} "
    f"{'block/floor':>11} {'GFLOPs full':>11} {'GFLOPs block':>12} {'GFLOPs blend15':>14} {'GFLOPs ahead15':>14}"
)
MEMORY_HEADER = f"{HEADER} {'peak GiB':>9}"
"""HEADER with the column `ttft_table(..., memory=True)` adds."""


def format_row(row) -> str:
    return (
        f"{row['context']:>8} {row['floor'] * 1e3:>9.1f} {row['full'] * 1e3:>9.1f} {row['prefix'] * 1e3:>9.1f} "
        f"{row['block'] * 1e3:>9.1f} {row['blend10'] * 1e3:>10.1f} {row['blend15'] * 1e3:>10.1f} "
        f"{row['blend30'] * 1e3:>10.1f} {row['ahead15'] * 1e3:>10.1f} {row['ahead30'] * 1e3:>10.1f} "
        f"{row['auto'] * 1e3:>9.1f} {row['full'] / row['block']:>9.1f}x "
        f"{row['full'] / row['blend15']:>11.1f}x {row['full'] / row['ahead15']:>11.1f}x {row['full'] / row['auto']:>8.1f}x "
        f"{row['block'] / row['floor']:>10.2f}x {row['flops_full'] / 1e9:>11.1f} {row['flops_block'] / 1e9:>12.2f} "
        f"{row['flops_blend15'] / 1e9:>14.1f} {row['flops_ahead15'] / 1e9:>14.1f}"
        + (f" {row['peak_memory'] / 2**30:>9.2f}" if "peak_memory" in row else "")
    )
