"""Block fine-tuning: supervised fine-tuning under the attention that block mode gives at inference.

Block-Attention's central result: a model switched to block attention untrained loses ~20 points,
and fine-tuning it with the same attention recovers them all. So a training example is exactly an
inference prompt (the engine's `build_prompt`: prefix, passage and separator blocks, question)
followed by the answer, run in one pass with the mask block mode amounts to: every block causal
within itself only, the question and answer causal over everything, positions contiguous (where
block mode re-encodes each block to). That is exact because rotary attention depends on relative
positions only: a block encoded alone and moved equals the block under this mask (invariant 1).
The loss counts the answer tokens only. A share of the examples may use plain causal attention
(Block-Attention trains on both), so that `full` mode keeps working, and a share blend mode's
attention: the passage tokens blend would recompute see everything before them, the rest their own
block only. That too is exact: a token blend leaves alone keeps its block KV on every layer past the
first, and a recomputed one attends over that mix, as such a row of the mask does.

Weights are adapted with LoRA (peft) so that the result is a few MB; `full=True` trains every
weight instead. Checkpoints let a long CPU run stop and resume.
"""

import contextlib
import itertools
import json
import random
import re
import shutil
import time
import warnings
from collections.abc import Sequence
from dataclasses import asdict, dataclass, replace
from pathlib import Path

import torch
from tqdm.auto import tqdm
from transformers import get_linear_schedule_with_warmup

from kvrag import attention, families
from kvrag.blend import BlendConfig, fresh_kv, most_deviating, question_attention, sink_positions
from kvrag.eval.layouts import LAYOUTS, OWN, check_layouts
from kvrag.eval.metrics import answer_in_output
from kvrag.prompt import Prompt

IGNORE = -100  # label of tokens the loss skips
TEACHERS = ("adapter", "published")  # whose full-mode predictions `distill` pulls block mode toward
LORA_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def block_lengths(prompt: Prompt, answer_tokens: int = 0) -> list[int]:
    """The attention blocks of a training sequence: prefix, each passage or separator block, and the
    question with the answer after it (the last block, which sees everything)."""
    return [n for n in (len(prompt.prefix), *map(len, prompt.blocks)) if n] + [len(prompt.question) + answer_tokens]


def block_index(lengths: Sequence[int], device=None) -> torch.Tensor:
    """Each token's block number, for `kvrag.attention.mask`: the blocks are `lengths` long, in order."""
    return torch.repeat_interleave(torch.arange(len(lengths), device=device), torch.tensor(list(lengths), device=device))


@dataclass
class TrainingExample:
    """Token ids, labels (IGNORE outside the answer) and attention blocks of one example."""

    ids: list[int]
    labels: list[int]
    lengths: list[int]  # one block of everything: plain causal attention
    blend: BlendConfig | None = None  # trained in blend mode's attention (`blend_rows`)
    passages: tuple[int, int] = (0, 0)  # where the tokens blend chooses among begin and end

    def mask(self, dtype=torch.float32, device=None, recomputed: torch.Tensor | None = None) -> torch.Tensor:
        """Additive [1, 1, N, N]: each block causal within itself, the last block causal over everything,
        and so are the `recomputed` positions (blend mode's)."""
        positions = torch.arange(len(self.ids), device=device)
        mask = attention.mask(positions, len(self.ids), dtype, blocks=block_index(self.lengths, device))
        if recomputed is not None and len(recomputed):
            mask[0, 0, recomputed] = attention.mask(recomputed, len(self.ids), dtype)[0, 0]
        return mask


@torch.no_grad()
def blend_rows(model, example: TrainingExample) -> torch.Tensor:
    """The positions blend mode recomputes for the example's prompt (kvrag.blend), chosen on layer 1 by
    the model as it stands (dropout off): the passage tokens the question attends to most over their
    block-attention keys, or those whose K or V deviates most between plain and block attention; and
    the block sinks."""
    config, (first, end) = example.blend, example.passages
    training = model.training
    model.eval()
    decoder, device, n = model.get_decoder(), model.device, len(example.ids)
    family = families.family(model.config)
    positions = torch.arange(n, device=device)
    hidden = decoder.embed_tokens(torch.tensor(example.ids, device=device))[None]
    cos, sin = decoder.rotary_emb(hidden, positions[None])
    layer0 = lambda mask: decoder.layers[0](hidden, attention_mask=mask, position_ids=positions[None],  # noqa: E731
                                            position_embeddings=(cos, sin))
    blocked = layer0(example.mask(hidden.dtype, device))  # what block mode cached, and the question's own input
    kept = config.kept(0, end - first)
    if config.select == "attention":
        question = slice(end, next(i for i, label in enumerate(example.labels) if label != IGNORE))
        keys, _ = fresh_kv(family, decoder.layers[1], blocked[:, :end], cos[:, :end], sin[:, :end])
        mass = question_attention(family, decoder.layers[1], blocked[:, question], cos[:, question], sin[:, question],
                                  keys).sum(dim=(0, 1))
        chosen = first + mass[first:end].topk(kept).indices
    else:
        plain = layer0(attention.mask(positions, n, hidden.dtype))
        fresh, cached = (config.compared(*fresh_kv(family, decoder.layers[1], h, cos, sin))[:, :, first:end]
                         for h in (plain, blocked))
        chosen = first + most_deviating(fresh, cached, kept)
    model.train(training)
    starts = [s for s in itertools.accumulate(example.lengths, initial=0) if first <= s < end]  # the blocks' own
    return torch.cat([chosen, sink_positions(starts, config.sink_tokens, end, device)]).unique()


def encode(engine, question: str, passages: Sequence[str], answer: str, *, full_attention: bool = False,
           layout: str = OWN, blend: BlendConfig | None = None) -> TrainingExample:
    """The prompt block mode would answer `question` from, asked in `layout` (kvrag.eval.layouts),
    then `answer` and the end-of-turn token; with `blend`, in blend mode's attention at those settings."""
    if blend is not None and (full_attention or blend.check_layers != (1,)):
        raise ValueError("blend training needs block attention and check_layers=(1,): a token blend leaves alone "
                         f"keeps block KV only on the layers past the first check (got {blend.check_layers})")
    if blend is not None and blend.select == "lookahead":
        raise ValueError("blend training chooses its tokens on layer 1 (select 'deviation' or 'attention'), not by "
                         "lookahead's pass through every layer")
    if engine.block_context != "none":
        raise ValueError(
            f"block fine-tuning needs block_context='none', not {engine.block_context!r}: a block encoded after "
            "other text (a prefix, the text before it in its document) and read at APE's temperature is not what "
            "one pass with the block mask and contiguous positions computes"
        )
    if layout == OWN:
        prompt, _ = engine.build_prompt(question, list(passages))
    else:  # cut as the drop-in path cuts it: text before the first passage is the prefix, between them blocks
        check_layouts([layout])
        prompt, _ = engine.prompt_from_text(*LAYOUTS[layout].render(engine, question, passages))
    eos = engine.tokenizer.eos_token_id
    answer_ids = engine.layout.encode(answer.strip()) + ([eos] if eos is not None else [])
    ids = prompt.ids() + answer_ids
    if len(ids) > engine.context_window:
        raise ValueError(f"a training example needs {len(ids)} tokens, more than the context window ({engine.context_window})")
    labels = [IGNORE] * len(prompt) + answer_ids
    lengths = [len(ids)] if full_attention else block_lengths(prompt, len(answer_ids))
    return TrainingExample(ids, labels, lengths, blend, (len(prompt.prefix), len(prompt) - len(prompt.question)))


def with_unanswerable_share(qa_examples, share: float) -> list:
    """Every answerable question and just enough unanswerable ones to make up `share` of the result.

    The generator asks a quarter of its questions about facts no passage states. Trained on that
    quarter, the default model learns to decline far more often than it should (measured in the
    docs/finetuning.md), so a run chooses how much of the refusal it sees."""
    answerable = [q for q in qa_examples if q.type != "unanswerable"]
    declined = [q for q in qa_examples if q.type == "unanswerable"]
    if not 0.0 <= share < 1.0:
        raise ValueError(f"unanswerable share must be in [0, 1), got {share}")
    wanted = round(share * len(answerable) / (1 - share))
    if wanted > len(declined):
        available = len(declined) / max(1, len(qa_examples))
        raise ValueError(f"unanswerable share {share} needs {wanted} unanswerable questions; the data has "
                         f"{len(declined)} (a share of {available:.2f})")
    kept = set(map(id, answerable + declined[:wanted]))
    return [q for q in qa_examples if id(q) in kept]


def with_short_contexts(qa_examples, share: float, seed: int = 0, most_distractors: int = 3) -> list:
    """A share of the questions, drawn by `seed`, cut to their gold passages and 0 to `most_distractors`
    distractors, in their order.

    The generator never asks over fewer than five passages, while a newcomer's first prompts hold one
    or two."""
    if not 0.0 <= share <= 1.0:
        raise ValueError(f"short-context share must be in [0, 1], got {share}")
    draw = random.Random(f"kvrag-short:{seed}")
    out = []
    for q in qa_examples:
        if draw.random() >= share:
            out.append(q)
            continue
        others = [i for i in range(len(q.passages)) if i not in q.gold]
        kept = sorted([*q.gold, *draw.sample(others, draw.randint(0, min(most_distractors, len(others))))])
        out.append(replace(q, passages=tuple(q.passages[i] for i in kept), gold=tuple(kept.index(g) for g in q.gold)))
    return out


def with_full_mode_answers(qa_examples, results: str | Path) -> list:
    """Each SQuAD question trained toward the first sentence of full mode's answer to it in `results` (a
    `kvrag bench accuracy --squad --split train` answers file) when that sentence holds a gold answer;
    the SQuAD questions without such an answer are left out, the generated ones kept as they are.

    SQuAD's answer is a bare span, which the model never answers with: trained on it, block mode
    learns that style before it learns to read."""
    path = Path(results)
    try:
        first, *rest = path.read_text(encoding="utf-8").splitlines()
        dataset = json.loads(first)["settings"]["dataset"]
        asked = dataset.get("corpus"), dataset.get("split")
        records = [json.loads(line) for line in rest if line.strip()]
        answers = {r["id"]: r["output"] for r in records if r.get("method") == "full"}
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as exc:
        raise ValueError(f"{path} is not a kvrag answers file: {exc!r}") from None
    if asked != ("squad", "train"):
        raise ValueError(f"{path} answers {dataset}; SQuAD's train questions are needed (bench accuracy --squad --split train)")
    out = []
    for q in qa_examples:
        if not q.id.startswith("squad-"):
            out.append(q)
            continue
        said = re.split(r"(?<=[.!?])\s", answers.get(q.id, "").strip(), maxsplit=1)[0]
        if said.endswith((".", "!", "?")) and answer_in_output(said, q.answers):  # a whole sentence, and right
            out.append(replace(q, target=said))
    if len(out) == sum(not q.id.startswith("squad-") for q in qa_examples):
        raise ValueError(f"{path} holds no right full-mode answer to any of these SQuAD questions")
    return out


def training_examples(engine, qa_examples, full_attention_share: float = 0.0, seed: int = 0,
                      layouts: Sequence[str] = (OWN,), blend_share: float = 0.0) -> list[TrainingExample]:
    """Generated questions (kvrag.eval.data) as training examples whose answers are their short sentences;
    a share of them, drawn by `seed`, with plain causal attention, a share of the rest in blend mode's
    attention (the engine's blend settings), each asked in one of `layouts` (kvrag.eval.layouts). The
    layouts and blend draws come from generators of their own, so that the full-attention draws stay
    those of a run without them."""
    check_layouts(layouts)
    draw, pick, blends = random.Random(seed), random.Random(f"kvrag-layouts:{seed}"), random.Random(f"kvrag-blend:{seed}")
    examples = []
    for q in qa_examples:
        full = draw.random() < full_attention_share
        blend = blends.random() < blend_share
        examples.append(encode(engine, q.question, q.passages, q.target, full_attention=full,
                               layout=layouts[0] if len(layouts) == 1 else pick.choice(layouts),
                               blend=engine.blend if blend and not full else None))
    return examples


def loss(model, example: TrainingExample, distill: float = 0.0, teacher: str = "adapter") -> torch.Tensor:
    """Mean cross-entropy of the answer tokens, each predicted from everything before it.

    Only the positions that predict an answer token go through the output layer, which holds a fifth
    of the default model's weights (a 49K-token vocabulary): the prompt's logits would be wasted work.

    `distill` > 0 adds, for a block-attention example, that weight times the KL divergence from the
    same model's plain-attention predictions (no gradient through them) over the question and answer:
    block mode is pulled toward what full mode reads from the same passages, not only toward the gold
    answer. `teacher="published"` takes those predictions with the LoRA adapter off: the published
    weights in full mode, what kvrag's default set-up answers full-mode questions with."""
    device = model.device
    n = len(example.ids)
    ids = torch.tensor([example.ids], device=device)
    positions = torch.arange(n, device=device)[None]
    first = next(i for i, label in enumerate(example.labels) if label != IGNORE)
    distilled = distill > 0 and len(example.lengths) > 1
    start = n - example.lengths[-1] if distilled else first - 1  # first position whose logits are needed
    recomputed = blend_rows(model, example) if example.blend is not None else None
    out = model(input_ids=ids, position_ids=positions, attention_mask=example.mask(model.dtype, device, recomputed),
                logits_to_keep=n - start)
    logits = out.logits[0, :-1].float()  # positions start .. n-2, each predicting the token after it
    labels = torch.tensor(example.labels[first:], device=device)
    value = torch.nn.functional.cross_entropy(logits[first - 1 - start:], labels, ignore_index=IGNORE)
    if distilled:
        value = value + distill * _divergence_from_full_attention(model, ids, positions, logits, teacher)
    return value


def _divergence_from_full_attention(model, ids, positions, logits, teacher: str = "adapter") -> torch.Tensor:
    """Mean KL(full || block) per position of the last block, full mode's predictions held fixed
    (dropout off, so that the target is the model as inference runs it)."""
    if teacher not in TEACHERS:
        raise ValueError(f"teacher must be one of {TEACHERS}, got {teacher!r}")
    training = model.training
    model.eval()
    adapter_off = model.disable_adapter() if teacher == "published" else contextlib.nullcontext()
    with torch.no_grad(), adapter_off:
        causal = attention.mask(positions[0], ids.shape[1], model.dtype)
        target = model(input_ids=ids, position_ids=positions, attention_mask=causal,
                       logits_to_keep=len(logits) + 1).logits[0, :-1]
    model.train(training)
    return torch.nn.functional.kl_div(logits.log_softmax(-1), target.float().log_softmax(-1), log_target=True,
                                      reduction="batchmean")


@dataclass
class TrainConfig:
    """What a run trains and how; saved with the adapter so that it can be reproduced."""

    steps: int = 170
    learning_rate: float = 5e-4
    warmup_steps: int = 20  # then a linear decay to zero at `steps` (transformers' linear schedule)
    accumulate: int = 4  # examples per optimizer step
    lora_r: int = 8
    lora_alpha: int = 16
    lora_dropout: float = 0.05
    full: bool = False  # train every weight instead of LoRA adapters
    full_attention_share: float = 0.0  # share of examples trained with plain causal attention
    save_every: int = 25
    seed: int = 0  # the order examples are drawn in (the CLI also draws the full-attention share with it)
    # seeds torch for the LoRA init and the dropout masks; None leaves torch's generator as the process
    # has it, as in the first runs of the shipped adapter's recipe
    init_seed: int | None = None
    init_adapter: str | None = None  # a saved LoRA adapter (same rank) to continue training from
    distill: float = 0.0  # weight of block mode's divergence from full mode's predictions (`loss`)
    distill_from: str = "adapter"  # whose full-mode predictions: the trained model's or the published weights' (`loss`)
    blend_share: float = 0.0  # share of the block-attention examples trained in blend mode's attention


def _trainable(model, config: TrainConfig):
    if config.full:
        model.requires_grad_(True)
        return model
    from peft import LoraConfig, get_peft_model

    lora = LoraConfig(r=config.lora_r, lora_alpha=config.lora_alpha, lora_dropout=config.lora_dropout,
                      target_modules=list(LORA_TARGETS), task_type="CAUSAL_LM")
    with warnings.catch_warnings():  # peft (0.21) reads transformers' deprecated `is_gradient_checkpointing`
        warnings.filterwarnings("ignore", "`is_gradient_checkpointing` is deprecated", FutureWarning)
        model = get_peft_model(model, lora)
    if config.init_adapter:
        _load_lora_weights(model, Path(config.init_adapter), config)
    return model


def _load_lora_weights(model, adapter: Path, config: TrainConfig) -> None:
    """Start from a saved adapter's weights, trained on at this run's own scale (lora_alpha / r): an
    adapter saved at a weaker scale (the shipped one) continues from what its run learned."""
    from peft import PeftConfig, load_peft_weights, set_peft_model_state_dict

    saved = PeftConfig.from_pretrained(adapter)
    if saved.r != config.lora_r or set(saved.target_modules) != set(LORA_TARGETS):
        raise ValueError(f"{adapter} is a rank-{saved.r} adapter of {sorted(saved.target_modules)}; this run trains "
                         f"rank {config.lora_r} on {sorted(LORA_TARGETS)} (pass --lora-r {saved.r})")
    result = set_peft_model_state_dict(model, load_peft_weights(str(adapter), device=str(model.device)))
    missing = [k for k in result.missing_keys if "lora_" in k]
    if missing or result.unexpected_keys:
        raise ValueError(f"{adapter} does not fit this model: missing {missing[:3]}, unexpected {result.unexpected_keys[:3]}")


def train(engine, examples: Sequence[TrainingExample], out: str | Path, config: TrainConfig | None = None,
          *, progress: bool = True, about: dict | None = None, scale: float | None = None) -> Path:
    """Fine-tune the engine's model on `examples`, saving to `out`: `out/adapter` (or `out/model` with
    `config.full`) and `out/training.json`. A run finding `out/checkpoint` continues from it.

    `scale`: the LoRA scale (lora_alpha / r) the saved adapter is merged at, default the trained one.
    A weaker one keeps the model closer to its published behaviour on text unlike the training data
    (docs/finetuning.md). The engine is unusable afterwards (its weights are being changed);
    load the result in a new one.
    """
    config = config or TrainConfig()
    if not examples:
        raise ValueError("no training examples")
    if config.distill_from not in TEACHERS:
        raise ValueError(f"distill_from must be one of {TEACHERS}, got {config.distill_from!r}")
    if config.distill_from == "published" and config.full:
        raise ValueError("distill_from='published' needs a LoRA adapter to switch off; full=True changes the published weights")
    if scale is not None and (config.full or scale <= 0):
        raise ValueError(f"scale applies to a LoRA adapter and must be > 0, got {scale} (full={config.full})")
    out = Path(out)
    checkpoint = out / "checkpoint"
    if config.init_seed is not None:
        torch.manual_seed(config.init_seed)
    model = _trainable(engine.model, config)
    model.train()
    params = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(params, lr=config.learning_rate, weight_decay=0.0)
    schedule = get_linear_schedule_with_warmup(optimizer, config.warmup_steps, config.steps)
    # this run's own record; the adapter it continues from is named in its config (a recipe file says how it was made)
    state = {"step": 0, "losses": [], "config": asdict(config), "about": dict(about or {})}
    previous = checkpoint.with_name(checkpoint.name + ".old")
    if not checkpoint.exists() and previous.exists():  # stopped between the two renames of `_save`
        previous.rename(checkpoint)
    if (checkpoint / "state.json").exists():
        state = _resume(checkpoint, model, optimizer, schedule, config)
    order = random.Random(config.seed)
    # the example order is a pure function of the seed and the step, so a resumed run sees what an unbroken one would
    draws = [order.randrange(len(examples)) for _ in range(config.steps * config.accumulate)]
    bar = tqdm(total=config.steps, initial=state["step"], desc="kvrag: fine-tuning", unit="step", disable=not progress)
    started = time.perf_counter()
    while state["step"] < config.steps:
        step = state["step"]
        total = 0.0
        for k in range(config.accumulate):
            value = loss(model, examples[draws[step * config.accumulate + k]], config.distill,
                         config.distill_from) / config.accumulate
            value.backward()
            total += value.item()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        optimizer.step()
        schedule.step()
        optimizer.zero_grad(set_to_none=True)
        state["step"] += 1
        state["losses"].append(round(total, 5))
        bar.update()
        bar.set_postfix(loss=f"{sum(state['losses'][-20:]) / len(state['losses'][-20:]):.3f}")
        if state["step"] % config.save_every == 0 or state["step"] == config.steps:
            _save(checkpoint, model, optimizer, schedule, state, config)
    bar.close()
    model.eval()
    if not config.full:  # half the file to ship
        for p in params:
            p.data = p.data.half()
    final = out / ("model" if config.full else "adapter")
    if not config.full:
        scale = scale or config.lora_alpha / config.lora_r
        alpha = scale * config.lora_r
        model.peft_config["default"].lora_alpha = int(alpha) if alpha == int(alpha) else alpha
        state["adapter_scale"] = scale
    model.save_pretrained(final)
    if config.full:
        engine.tokenizer.save_pretrained(final)
    state["seconds_this_run"] = round(time.perf_counter() - started, 1)
    (out / "training.json").write_text(json.dumps(state, indent=1))
    return final


def _save(checkpoint: Path, model, optimizer, schedule, state: dict, config: TrainConfig) -> None:
    """Write the checkpoint beside the old one, then swap, so that a crash leaves one whole checkpoint."""
    fresh = checkpoint.with_name(checkpoint.name + ".new")
    fresh.mkdir(parents=True, exist_ok=True)
    trained = {n: p.detach().cpu() for n, p in model.named_parameters() if p.requires_grad}
    # the random state too: dropout draws from it, so without it a resumed run would drift from an unbroken one
    random_state = {"cpu": torch.get_rng_state()}
    if torch.cuda.is_available():
        random_state["cuda"] = torch.cuda.get_rng_state_all()
    torch.save({"trained": trained, "optimizer": optimizer.state_dict(), "schedule": schedule.state_dict(),
                "random_state": random_state}, fresh / "weights.pt")
    (fresh / "state.json").write_text(json.dumps(state))
    old = checkpoint.with_name(checkpoint.name + ".old")
    if checkpoint.exists():
        checkpoint.rename(old)
    fresh.rename(checkpoint)
    if old.exists():
        shutil.rmtree(old)


def _resume(checkpoint: Path, model, optimizer, schedule, config: TrainConfig) -> dict:
    state = json.loads((checkpoint / "state.json").read_text())
    # a setting added after the checkpoint was written is at its default there, which is what that run did
    if asdict(TrainConfig()) | state["config"] != asdict(config):
        raise ValueError(f"{checkpoint} was written by a run with other settings: {state['config']}")
    saved = torch.load(checkpoint / "weights.pt", map_location=model.device)
    params = dict(model.named_parameters())
    with torch.no_grad():
        for name, value in saved["trained"].items():
            params[name].copy_(value)
    optimizer.load_state_dict(saved["optimizer"])
    schedule.load_state_dict(saved["schedule"])
    random_state = saved.get("random_state", {})  # absent from checkpoints written before it was saved
    if "cpu" in random_state:
        torch.set_rng_state(random_state["cpu"].cpu())
    if "cuda" in random_state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all([s.cpu() for s in random_state["cuda"]])
    return state
