"""`bastion compare-drafters`: chain acceptance of several drafters on the same sequences, none of which any
of them trained on.

A drafter measured on sequences it trained on reads high: it has memorised them. Comparing a drafter
with one fine-tuned from it on the first's training sequences therefore favours the first. This command
takes the sequences of a token-data folder (`training.token_data`, in chunk order) and leaves out:

- each prompt set's first `--skip-first-per-set` N prompts of the training split, which a drafter
  trained with `--train-prompts-per-set N` (regenerated data, `plan_prompts`) answered and trained on;
- every sequence that a `--token-data` training run drew (`--unseen-by RUN`, the run's folder under
  `<data-dir>/runs/`): its `state.json` holds its settings and step, from which `train.step_sequences`
  draws its batches again, over the training split of `--token-data` with `--validation-sequences` set
  apart, as the run had them.

Of what is left it measures the first `--sequences` with every drafter (`train.chain_acceptance`, fp32,
the same blocks for each) and prints one row a drafter (with `--draft-vocab FILE`, two: over the whole
vocabulary and over the draft vocabulary's tokens, as the draft step serves it); `--out` writes the
comparison as JSON (`DrafterComparison`).
"""

from __future__ import annotations

import argparse
import json
import logging
from collections.abc import Sequence
from pathlib import Path

import torch
from pydantic import BaseModel, ConfigDict, Field

from bastion_sglang.assets.prompt_sets import load_prompts
from bastion_sglang.integration.draft_vocab import resolve_draft_vocabulary
from bastion_sglang.integration.drafter_config import DrafterConfig, check_drafter_fits
from bastion_sglang.reference.drafter import DFlashDrafter
from bastion_sglang.training.data import TrainingSequence
from bastion_sglang.training.target_features import TargetFeatures
from bastion_sglang.training.token_train import load_token_training
from bastion_sglang.training.train import (
    STATE_JSON_NAME,
    AcceptanceReport,
    chain_acceptance,
    load_frozen_target,
    read_training_state,
    step_sequences,
)

HELP = "Measure several drafters' chain acceptance on the same token-data sequences that none of them saw."

logger = logging.getLogger(__name__)


class DrafterScore(BaseModel):
    """One drafter's chain acceptance on the compared sequences."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    drafter: str = Field(description="the drafter folder, as given")
    draft_vocab: str | None = Field(default=None, description="the draft vocabulary file; None: every token")
    acceptance: AcceptanceReport


class DrafterComparison(BaseModel):
    """What `bastion compare-drafters --out` writes."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    token_data: str
    sequence_keys: list[str] = Field(description="the measured sequences, in chunk order")
    skip_first_per_set: int
    unseen_by: list[str] = Field(description="run folders whose drawn sequences were left out")
    stride: int = Field(description="anchor stride of the measure")
    scores: list[DrafterScore]


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Options of `bastion compare-drafters`."""
    parser.add_argument("--target", type=Path, required=True, help="target model folder (Hugging Face)")
    parser.add_argument("--token-data", type=Path, required=True, help="token-data folder of the target")
    parser.add_argument(
        "--drafter", type=Path, action="append", required=True, help="a drafter folder (z-lab); repeat"
    )
    parser.add_argument(
        "--skip-first-per-set",
        type=int,
        default=0,
        metavar="N",
        help="leave out each prompt set's first N training-split prompts (what a drafter trained with "
        "--train-prompts-per-set N saw)",
    )
    parser.add_argument(
        "--unseen-by",
        type=Path,
        action="append",
        default=[],
        metavar="RUN",
        help="a --token-data training run's folder (<data-dir>/runs/<name>): leave out every sequence it "
        "drew; repeat",
    )
    parser.add_argument(
        "--validation-sequences",
        type=int,
        default=48,
        help="the --validation-sequences the --unseen-by runs set apart (default 48, train-drafter's)",
    )
    parser.add_argument("--sequences", type=int, default=48, help="sequences to measure (default 48)")
    parser.add_argument("--stride", type=int, default=4, help="anchor stride of the measure (default 4)")
    parser.add_argument(
        "--draft-vocab",
        type=Path,
        default=None,
        metavar="FILE",
        help="a draft_vocab.json: measure every drafter over the whole vocabulary and over its tokens",
    )
    parser.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    parser.add_argument("--out", type=Path, default=None, help="write the comparison here (JSON)")


def drawn_keys(run: Path, train: list[TrainingSequence]) -> set[str]:
    """Keys of every sequence the run in folder `run` drew in its steps so far, over its training list
    `train` (ValueError naming the file when its state cannot be read)."""
    state = read_training_state(run / STATE_JSON_NAME, "no training state; --unseen-by takes a run folder")
    return {s.key for step in range(state.step) for s in step_sequences(train, state.config, step)}


def first_prompt_keys(prompt_sets: Sequence[str], count: int) -> set[str]:
    """Keys of the first `count` training-split prompts (file order) of each prompt set (names or JSONL
    paths, as the token-data manifest lists them)."""
    if count <= 0:
        return set()
    return {prompt.key for name in prompt_sets for prompt in load_prompts(name, "train")[:count]}


def unseen_sequences(args: argparse.Namespace) -> list[TrainingSequence]:
    """The first `args.sequences` sequences of --token-data that pass the filters (module docstring)."""
    data = load_token_training(args.token_data, args.validation_sequences)
    by_key = {s.key: s for s in [*data.train, *data.validation]}
    ordered = [by_key[key] for key in data.manifest.done_keys if key in by_key]
    seen = first_prompt_keys(data.manifest.prompt_sets, args.skip_first_per_set)
    for run in args.unseen_by:
        seen |= drawn_keys(run, data.train)
    left = [s for s in ordered if s.key not in seen]
    if len(left) < args.sequences:
        raise ValueError(
            f"{len(left)} of {len(ordered)} sequences of {args.token_data} are unseen by every drafter, "
            f"fewer than --sequences {args.sequences}"
        )
    return left[: args.sequences]


def run(args: argparse.Namespace) -> int:
    """Measure every --drafter on the unseen sequences; print a row each and write --out."""
    try:
        target_config = json.loads((args.target / "config.json").read_text(encoding="utf-8"))
        sequences = unseen_sequences(args)
    except (OSError, ValueError) as error:
        raise SystemExit(f"error: {error}") from None
    configs = []
    for path in args.drafter:
        try:
            configs.append(DrafterConfig.from_json(path))
            check_drafter_fits(configs[-1], target_config)
        except (OSError, ValueError) as error:
            raise SystemExit(f"error: --drafter {path}: {error}") from None
    layer_ids = {tuple(config.target_layer_ids) for config in configs}
    if len(layer_ids) != 1:
        raise SystemExit(
            f"error: the drafters read different target layers {sorted(layer_ids)}; compare drafters of "
            "one feature set"
        )
    device = torch.device(args.device)
    vocabularies: list[tuple[str | None, torch.Tensor | None]] = [(None, None)]
    if args.draft_vocab is not None:
        try:
            vocabulary, _ = resolve_draft_vocabulary(
                args.draft_vocab, None, int(target_config["vocab_size"]), topk=1
            )
        except ValueError as error:
            raise SystemExit(f"error: --draft-vocab: {error}") from None
        assert vocabulary is not None  # a file is named: resolved or refused
        ids = torch.tensor(vocabulary.token_ids, dtype=torch.int64, device=device)
        vocabularies.append((str(args.draft_vocab), ids))
    features = TargetFeatures(args.target, next(iter(layer_ids)), device).fill(sequences)
    frozen = load_frozen_target(args.target, device)
    scores = []
    for path in args.drafter:
        drafter = DFlashDrafter.from_pretrained(path, device=device).eval()
        for name, ids in vocabularies:
            report = chain_acceptance(
                drafter, frozen, features, stride=args.stride, precision="fp32", draft_vocab=ids
            )
            scores.append(DrafterScore(drafter=str(path), draft_vocab=name, acceptance=report))
            by_set = ", ".join(f"{set_} {mean:.3f}" for set_, mean in sorted(report.by_source.items()))
            over = "" if name is None else f", over {name}"
            print(f"{report.mean:.3f} over {report.blocks} blocks ({by_set})  {path}{over}")
    comparison = DrafterComparison(
        token_data=str(args.token_data),
        sequence_keys=[s.key for s in sequences],
        skip_first_per_set=args.skip_first_per_set,
        unseen_by=[str(run) for run in args.unseen_by],
        stride=args.stride,
        scores=scores,
    )
    if args.out is not None:
        args.out.write_text(comparison.model_dump_json(indent=1) + "\n", encoding="utf-8")
        logger.info("wrote %s", args.out)
    return 0
