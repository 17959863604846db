"""`kvrag finetune`: block fine-tuning of a LoRA adapter (or every weight) on generated questions, its options
given on the command line or in a JSON recipe (`--config`). The training code (kvrag.train) is imported inside
the command; the defaults shown for its options are written here and checked against it by tests/test_cli.py."""

import argparse
import json
from pathlib import Path

from kvrag.errors import KVRagError

from . import common
from .bench import BENCH_LAYOUTS, prompt_layouts

TRAIN_DEFAULTS = {"steps": 170, "learning_rate": 5e-4, "accumulate": 4, "lora_r": 8, "save_every": 25, "distill": 0.0,
                  "distill_from": "adapter", "blend_share": 0.0}
"""kvrag.train.finetune.TrainConfig's defaults for the settings `finetune` exposes."""
TRAIN_TEACHERS = ("adapter", "published")
"""kvrag.train.finetune.TEACHERS: whose full-mode predictions `finetune --distill` pulls toward."""
BLEND_SELECT = ("deviation", "attention")
"""kvrag.BlendConfig.select's choices that training takes (`finetune --blend-select`)."""

FINETUNE_NOTES = ("name", "before", "about")
"""Keys of a `finetune --config` file or run that are notes for readers, not options."""


def read_config(path: str, run: str | None) -> dict:
    """The options `finetune --config FILE [--run NAME]` reads: FILE is a JSON object of the command's options,
    named as on the command line without the dashes ({"steps": 120, "init-adapter": "runs/a/adapter"}), or
    {"runs": [{"name": ..., options...}, ...]}, runs of which --run names one (a file of one run needs none)."""
    try:
        recipe = json.loads(Path(path).read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:
        raise KVRagError(f"--config {path}: {exc}") from None
    if not isinstance(recipe, dict):
        raise KVRagError(f"--config {path}: a JSON object of options, or of runs, is needed")
    if "runs" not in recipe:
        if run is not None:
            raise KVRagError(f"--run {run}: {path} holds one set of options, not runs")
        chosen = recipe
    else:
        runs = recipe["runs"]
        names = [r.get("name") for r in runs if isinstance(r, dict)]
        if len(names) != len(runs) or None in names:
            raise KVRagError(f"--config {path}: every run is an object with a 'name'")
        if run is None and len(runs) != 1:
            raise KVRagError(f"{path} holds {len(runs)} runs: name one with --run ({', '.join(names)})")
        chosen = runs[0] if run is None else next((r for r in runs if r["name"] == run), None)
        if chosen is None:
            raise KVRagError(f"{path} has no run {run!r}; its runs: {', '.join(names)}")
    return {key: value for key, value in chosen.items() if key not in FINETUNE_NOTES}


def config_defaults(parser: argparse.ArgumentParser, options: dict) -> dict:
    """`finetune --config`'s options (named as on the command line, with dashes or underscores) as defaults of
    `parser`'s arguments, checked as the command line checks them."""
    skipped = {*common.MODEL_OPTIONS, "--config", "--run", "-h", "--help"}
    actions = {}
    for action in parser._actions:
        if not set(action.option_strings) & skipped:
            for name in [s[2:] for s in action.option_strings if s.startswith("--")] or [action.dest]:
                actions[name] = actions[name.replace("-", "_")] = action
    defaults = {}
    for key, value in options.items():
        action, flag = actions.get(key), f"--config: {key}"
        if action is None:
            raise KVRagError(f"--config: {key!r} is not an option of `kvrag finetune`")
        if isinstance(action, argparse._StoreTrueAction):
            if not isinstance(value, bool):
                raise KVRagError(f"{flag} is true or false, got {value!r}")
        elif action.type in (int, float):
            if isinstance(value, bool) or not isinstance(value, (int, float)) or value != action.type(value):
                raise KVRagError(f"{flag} is {'a whole number' if action.type is int else 'a number'}, got {value!r}")
            value = action.type(value)
        elif value is not None and not isinstance(value, str):
            raise KVRagError(f"{flag} is a string, got {value!r}")
        if action.choices and value not in action.choices:
            raise KVRagError(f"{flag} is one of {', '.join(map(str, action.choices))}, got {value!r}")
        defaults[action.dest] = value
    return defaults


def train_config(args):
    """The kvrag.train.finetune.TrainConfig of `finetune`'s options, as its training.json records it."""
    from kvrag.train.finetune import TrainConfig

    return TrainConfig(steps=args.steps, learning_rate=args.lr, accumulate=args.accumulate, lora_r=args.lora_r,
                       lora_alpha=2 * args.lora_r, full=args.full, full_attention_share=args.full_attention_share,
                       save_every=args.save_every, seed=args.seed, init_seed=args.init_seed,
                       init_adapter=args.init_adapter, distill=args.distill, distill_from=args.distill_from,
                       blend_share=args.blend_share)


def cmd_finetune(args):
    if not args.out:
        raise KVRagError("finetune needs OUT, the directory to train into (or an 'out' in --config)")
    from kvrag.eval import data, squad
    from kvrag.train.finetune import train, training_examples, with_full_mode_answers, with_short_contexts, with_unanswerable_share

    config = train_config(args)
    if args.adapter == "auto":  # train from the published weights, not from the shipped adapter
        args.adapter = "none"
    if args.block_context == "auto":  # what the adapter will be used in
        args.block_context = "none"
    if args.dtype == "auto":  # LoRA weights and their optimiser state train in float32, on a GPU too
        args.dtype = "float32"
    if not 0.0 <= args.squad_share <= 1.0:
        raise KVRagError(f"--squad-share must be between 0 and 1, got {args.squad_share}")
    from_squad = round(args.squad_share * args.questions)
    dataset = {"split": "train", "n": args.questions - from_squad, "passages": args.passages, "noise": args.noise,
               "seed": args.seed, "prose": args.prose}
    questions = with_unanswerable_share(data.generate(**dataset), args.unanswerable_share) if dataset["n"] else []
    squad_passages = args.squad_passages or args.passages
    if from_squad:  # hand-written text, answered by its SQuAD span or in full mode's words
        questions += squad.questions("train", from_squad, squad_passages, args.seed)
        if args.squad_answers:
            questions = with_full_mode_answers(questions, args.squad_answers)
            from_squad = sum(q.id.startswith("squad-") for q in questions)
    questions = with_short_contexts(questions, args.short_share, args.seed)
    layouts = prompt_layouts(args.prompts)
    from kvrag import BlendConfig

    engine = common.engine(args, blend=BlendConfig(select=args.blend_select))
    examples = training_examples(engine, questions, config.full_attention_share, config.seed, layouts, config.blend_share)
    print(f"fine-tuning on {len(examples)} train questions x {args.passages} passages "
          f"({f'{from_squad} from SQuAD x {squad_passages} paragraphs, ' if from_squad else ''}{args.unanswerable_share:.0%} of the generated unanswerable), "
          f"{'every weight' if args.full else f'LoRA r={args.lora_r}'}, {args.steps} steps of {args.accumulate} examples")
    about = {"dataset": dataset, "unanswerable_share": args.unanswerable_share, "model": args.model or "default"}
    if args.short_share:
        about["short_share"] = args.short_share
    if from_squad:
        about["squad"] = from_squad
        if args.squad_passages:
            about["squad_passages"] = args.squad_passages
        if args.squad_answers:
            about["squad_answers"] = Path(args.squad_answers).name
    if layouts != ["kvrag"]:
        about["layouts"] = layouts
    if args.blend_share:
        about["blend_select"] = args.blend_select
    final = train(engine, examples, args.out, config, about=about, scale=args.adapter_scale)
    print(f"saved {final}; use it with KVEngine.from_pretrained(..., adapter={str(final)!r})")


def register(sub, config: dict | None = None) -> None:
    """`config`: options of `finetune --config`, which become the command's defaults."""
    p = common.command(sub, "finetune", "block fine-tuning on generated questions (LoRA adapter by default)")
    p.add_argument("out", nargs="?", help="directory for checkpoints and the result; a rerun resumes from its "
                                          "checkpoint (default: --config's 'out')")
    p.add_argument("--questions", type=int, default=1200, help="generated train-split questions")
    p.add_argument("--passages", type=int, default=10, help="passages per question")
    p.add_argument("--noise", type=float, default=0.5, help="share of distractors drawn from any entity; the rest are hard")
    p.add_argument("--prose", type=float, default=0.5,
                   help="share of train-split passages rewritten as connected prose, with questions in other words")
    p.add_argument("--prompts", default="kvrag",
                   help=f"comma-separated prompt layouts the examples are asked in, one drawn per example, or 'all': "
                   f"{', '.join(BENCH_LAYOUTS)}")
    p.add_argument("--unanswerable-share", type=float, default=0.05,
                   help="share of questions no passage answers (at most 0.25, what the generator makes)")
    p.add_argument("--squad-share", type=float, default=0.0,
                   help="share of the questions taken from SQuAD v1.1's train file instead (hand-written, on "
                        "Wikipedia; the answer is its span), each with --passages paragraphs of its article")
    p.add_argument("--squad-passages", type=int,
                   help="paragraphs per SQuAD question, 2-30: shorter prompts, more of them an hour (default: --passages)")
    p.add_argument("--squad-answers", metavar="FILE",
                   help="answers of `bench accuracy --squad --split train --methods full`: each SQuAD question is trained "
                        "toward the first sentence of its answer there if that holds a gold answer, and left out "
                        "otherwise (default: toward the bare answer span)")
    p.add_argument("--short-share", type=float, default=0.0,
                   help="share of questions cut to their gold passages and 0-3 distractors, so short prompts are seen too")
    p.add_argument("--steps", type=int, default=TRAIN_DEFAULTS["steps"], help="optimizer steps")
    p.add_argument("--accumulate", type=int, default=TRAIN_DEFAULTS["accumulate"], help="examples per optimizer step")
    p.add_argument("--lr", type=float, default=TRAIN_DEFAULTS["learning_rate"], help="peak learning rate")
    p.add_argument("--lora-r", type=int, default=TRAIN_DEFAULTS["lora_r"], help="LoRA rank (alpha is twice the rank)")
    p.add_argument("--full", action="store_true", help="train every weight instead of a LoRA adapter")
    p.add_argument("--full-attention-share", type=float, default=0.25,
                   help="share of examples trained with plain causal attention, so that full mode stays good")
    p.add_argument("--save-every", type=int, default=TRAIN_DEFAULTS["save_every"], help="steps between checkpoints")
    p.add_argument("--adapter-scale", type=float,
                   help="LoRA scale (alpha/r) to save the adapter at (default: the trained one; the shipped "
                        "adapter's is in its recipe.json)")
    p.add_argument("--seed", type=int, default=0, help="the generated train world and the order of its examples")
    p.add_argument("--init-seed", type=int,
                   help="seed for the LoRA initialisation and dropout (default: torch's generator as the process "
                        "starts it)")
    p.add_argument("--init-adapter", help="LoRA adapter directory to continue training from, e.g. the shipped one; "
                                          "it is trained on at this run's scale, 2 by default (default: a fresh one)")
    p.add_argument("--distill", type=float, default=TRAIN_DEFAULTS["distill"],
                   help="weight of a term pulling block mode's predictions toward full mode's (same model, same "
                        "passages) on the question and answer; 0: off")
    p.add_argument("--distill-from", choices=TRAIN_TEACHERS, default=TRAIN_DEFAULTS["distill_from"],
                   help="whose full-mode predictions --distill pulls toward: the model being trained, or the "
                        "published weights (adapter off)")
    p.add_argument("--blend-share", type=float, default=TRAIN_DEFAULTS["blend_share"],
                   help="share of the block-attention examples trained in blend mode's attention (the 15%% of "
                        "passage tokens blend recomputes see across passages), so that blend mode is tuned too")
    p.add_argument("--blend-select", choices=BLEND_SELECT, default=BLEND_SELECT[0],
                   help="how those examples choose the tokens blend recomputes: as the engine does by default "
                        "(CacheBlend's deviation) or by the question's attention (BlendConfig.select)")
    p.add_argument("--config", metavar="FILE",
                   help="JSON file of these options, named without the dashes, or {\"runs\": [{\"name\": ..., "
                        "options...}, ...]}; the options given here override the file's (default: none)")
    p.add_argument("--run", metavar="NAME", help="which of --config's runs to train (default: its only one)")
    p.set_defaults(func=cmd_finetune)
    if config is not None:
        p.set_defaults(**config_defaults(p, config))
