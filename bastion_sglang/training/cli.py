"""`bastion train-drafter`: regenerate data with the target, train a DFlash drafter, export it with a card.

Stages (each resumable):
1. Regeneration (`data.regenerate`) of the training split and of the held-out split into --data-dir
   (<data-dir>/train, <data-dir>/heldout); an existing folder with the same settings is continued.
2. Training (`train.Trainer`), with its state in <data-dir>/runs/<out name>/; --resume continues it.
3. Export at every checkpoint: the drafter in the z-lab format (bf16 weights), the held-out chain
   acceptance, and README.md, into --out.

`--arch dflash2` trains a DFlash2 drafter instead: a candidate selector on top of the trained DFlash drafter
--init-from-drafter, whose backbone stays frozen and sets the target layers, block size and mask token
(`selector_cli`).
"""

from __future__ import annotations

import argparse
import json
import logging
from dataclasses import dataclass
from pathlib import Path

import torch

from bastion_sglang.assets import default_cache_dir
from bastion_sglang.assets.prompt_sets import PROMPT_SETS, plan_prompts
from bastion_sglang.integration.drafter_config import (
    DrafterConfig,
    check_drafter_fits,
    default_target_layer_ids,
)
from bastion_sglang.training import selector_cli
from bastion_sglang.training.card import DataSummary, describe_initial_drafter, write_card
from bastion_sglang.training.data import (
    TrainingSequence,
    load_training_sequences,
    regenerate,
    target_fingerprint,
)
from bastion_sglang.training.target_features import TargetFeatures
from bastion_sglang.training.token_data import TokenDataManifest
from bastion_sglang.training.token_train import load_token_training
from bastion_sglang.training.train import (
    STATE_JSON_NAME,
    AcceptancePoint,
    AcceptanceReport,
    InitialDrafter,
    TrainConfig,
    Trainer,
    chain_acceptance,
    drafter_init,
    load_frozen_target,
    target_layer_init,
)

HELP = "Train a DFlash drafter for a target: regenerate data with it, train, export (z-lab format)."
DEFAULT_FEATURE_LAYERS = 5
DEFAULT_LR = 6e-4
"""Peak learning rate of a DFlash run unless --lr is given."""
"""Target layers read by default (DFlash's count for its 5-layer drafters), spread as DFlash does."""

logger = logging.getLogger(__name__)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Options of `bastion train-drafter`."""
    parser.add_argument("--target", type=Path, required=True, help="target model folder (Hugging Face)")
    parser.add_argument("--out", type=Path, required=True, help="drafter folder to write (z-lab format)")
    parser.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    parser.add_argument(
        "--arch",
        choices=["dflash", "dflash2"],
        default="dflash",
        help="dflash: train a DFlash drafter; dflash2: train a candidate selector on the frozen DFlash "
        "drafter --init-from-drafter (default: dflash)",
    )
    parser.add_argument("--selector-rank", type=int, default=32, help="dflash2: rank of the selector")
    parser.add_argument("--selector-top-k", type=int, default=8, help="dflash2: candidates per position")
    parser.add_argument("--batch-rows", type=int, default=4096, help="dflash2: lattice rows per step")
    parser.add_argument("--steps", type=int, default=2000, help="optimiser steps")
    parser.add_argument("--layers", type=int, default=2, help="draft decoder layers")
    parser.add_argument("--block-size", type=int, default=16, help="block: anchor token + block_size-1 masks")
    parser.add_argument(
        "--target-layer-ids",
        type=lambda text: [int(i) for i in text.split(",")],
        default=None,
        help=f"comma-separated target layers to read (default: {DEFAULT_FEATURE_LAYERS} spread over 1..L-3)",
    )
    parser.add_argument(
        "--mask-token-id",
        type=int,
        default=None,
        help="token id filling the masked block positions (default: the tokenizer's mask token)",
    )
    parser.add_argument(
        "--data-dir",
        type=Path,
        default=None,
        help="regenerated data and run state (default: <cache>/drafter-data/<target folder name>)",
    )
    parser.add_argument(
        "--token-data",
        type=Path,
        default=None,
        help="train on the token ids of this committed token-data folder (`training.token_gen`), the "
        "target's features computed from them at each step, instead of regenerating training data",
    )
    parser.add_argument(
        "--validation-sequences",
        type=int,
        default=48,
        help="with --token-data: training-split sequences kept out of training and measured at every "
        "checkpoint, to choose settings on (default 48)",
    )
    parser.add_argument("--resume", action="store_true", help="continue the training run in the data dir")
    parser.add_argument("--data-only", action="store_true", help="stop after regenerating the data")
    parser.add_argument(
        "--prompt-sets",
        type=lambda text: text.split(","),
        default=list(PROMPT_SETS),
        help="comma-separated prompt sets or JSONL files (default: humaneval,mtbench,sharegpt)",
    )
    parser.add_argument("--train-prompts-per-set", type=int, default=1000, help="cap per set, training split")
    parser.add_argument("--heldout-prompts-per-set", type=int, default=16, help="cap per set, held-out split")
    parser.add_argument("--max-new-tokens", type=int, default=256, help="response length cap")
    parser.add_argument("--max-prompt-tokens", type=int, default=512, help="longer prompts are skipped")
    parser.add_argument("--gen-batch-size", type=int, default=32, help="prompts per generation batch")
    parser.add_argument("--gen-dtype", choices=["bfloat16", "float32"], default="bfloat16")
    parser.add_argument("--batch-sequences", type=int, default=4, help="sequences per step")
    parser.add_argument("--anchors", type=int, default=32, help="random anchors (blocks) per sequence")
    parser.add_argument("--loss-decay", type=float, default=7.0, help="γ of the weights exp(-(k-1)/γ)")
    parser.add_argument(
        "--set-mix",
        choices=["natural", "equal"],
        default="natural",
        help="natural: draw training sequences in proportion to each prompt set's size; equal: draw every "
        "set as often (a small set repeats sooner)",
    )
    parser.add_argument(
        "--sample-positions",
        action="store_true",
        help="send block position k through the LM head with probability exp(-(k-1)/γ) instead of "
        "weighting every position: the same expected loss, a fraction of the LM-head cost (dflash only)",
    )
    parser.add_argument(
        "--distill",
        type=float,
        default=0.0,
        metavar="ALPHA",
        help="weight α in [0, 1] of the cross-entropy to the target's next-token distribution at each "
        "position, 1 - α that of the target's token (soft labels; needs --token-data, which runs the "
        "target's last layers and LM head for them; dflash only; default 0: the target's tokens alone)",
    )
    parser.add_argument("--lr", type=float, default=None, help="default: 6e-4 (dflash), 1e-3 (dflash2)")
    parser.add_argument("--warmup-steps", type=int, default=50)
    parser.add_argument(
        "--precision",
        choices=["bf16-mixed", "fp32"],
        default=None,
        help="default: bf16-mixed (dflash2: fp32)",
    )
    parser.add_argument("--seed", type=int, default=0)
    initialisation = parser.add_mutually_exclusive_group()
    initialisation.add_argument(
        "--init-from-target",
        action="store_true",
        help="start the draft layers as copies of the target layers that follow the last feature layer "
        "(and fc as the identity on that layer's features) instead of random weights",
    )
    initialisation.add_argument(
        "--init-from-drafter",
        type=Path,
        default=None,
        metavar="PATH",
        help="start from a trained drafter of the same shape (z-lab folder) and train it further, e.g. on "
        "new data or with a new schedule; its card's history is carried into the new card",
    )
    parser.add_argument(
        "--checkpoint-minutes", type=float, default=10.0, help="wall minutes between checkpoints"
    )
    parser.add_argument("--eval-stride", type=int, default=4, help="anchor stride of the acceptance measure")
    parser.add_argument("--license", default="apache-2.0", help="license of the drafter, for its card")
    parser.add_argument(
        "--base-model", default=None, help="card's base_model (default: the target folder name)"
    )


def resolve_mask_token(target: Path, mask_token_id: int | None) -> tuple[int, str]:
    """(mask id, its token text): the given id, else the tokenizer's mask token; ValueError if neither."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(target)
    if mask_token_id is None:
        if tokenizer.mask_token_id is None:
            raise ValueError(
                f"{target}: the tokenizer has no mask token; pass --mask-token-id with a token the target "
                "never sees in chat use (for SmolLM2: 16, <empty_output>)"
            )
        mask_token_id = int(tokenizer.mask_token_id)
    if not 0 <= mask_token_id < len(tokenizer):
        raise ValueError(
            f"--mask-token-id {mask_token_id} is outside the tokenizer's 0..{len(tokenizer) - 1}"
        )
    return mask_token_id, str(tokenizer.convert_ids_to_tokens(mask_token_id))


def build_drafter_config(
    target_config: dict, *, layers: int, block_size: int, layer_ids: list[int], mask_token_id: int
) -> DrafterConfig:
    """The drafter's config: the target's widths and RoPE, `layers` draft layers, the given ids."""
    rope = target_config.get("rope_parameters") or {}
    rope_theta = target_config.get("rope_theta", rope.get("rope_theta"))
    if rope_theta is None:
        raise ValueError("target config.json has no rope_theta (top level or rope_parameters)")
    heads = int(target_config["num_attention_heads"])
    drafter = DrafterConfig(
        hidden_size=int(target_config["hidden_size"]),
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=int(target_config.get("num_key_value_heads") or heads),
        head_dim=int(target_config.get("head_dim") or target_config["hidden_size"] // heads),
        intermediate_size=int(target_config["intermediate_size"]),
        rms_norm_eps=float(target_config.get("rms_norm_eps", 1e-6)),
        rope_theta=float(rope_theta),
        vocab_size=int(target_config["vocab_size"]),
        block_size=block_size,
        num_target_layers=int(target_config["num_hidden_layers"]),
        mask_token_id=mask_token_id,
        target_layer_ids=tuple(layer_ids),
    )
    check_drafter_fits(drafter, target_config)
    return drafter


def run(args: argparse.Namespace) -> int:
    """Run the three stages (module docstring); returns the exit status."""
    target: Path = args.target.resolve()
    config_path = target / "config.json"
    if not config_path.is_file():
        raise SystemExit(f"error: {config_path} not found; --target must be a Hugging Face model folder")
    target_config = json.loads(config_path.read_text(encoding="utf-8"))
    num_layers = int(target_config["num_hidden_layers"])
    if args.arch == "dflash2":
        backbone = selector_cli.backbone_config(args, target_config)
        layer_ids = list(backbone.target_layer_ids)
    else:
        layer_ids = args.target_layer_ids or list(
            default_target_layer_ids(num_layers, DEFAULT_FEATURE_LAYERS)
        )
    if not 0.0 <= args.distill <= 1.0:
        raise SystemExit(f"error: --distill is a weight in [0, 1], got {args.distill}")
    if args.distill > 0 and args.token_data is None:
        raise SystemExit(
            "error: --distill needs --token-data: the target's distributions are computed from the token "
            "ids at each step, and regenerated training data stores the read layers only"
        )
    if len(set(layer_ids)) != len(layer_ids):
        raise SystemExit(
            f"error: target layer ids {layer_ids} repeat a layer; pass distinct --target-layer-ids"
        )
    data_dir: Path = args.data_dir or default_cache_dir() / "drafter-data" / target.name
    device = torch.device(args.device)
    common = dict(
        target_layer_ids=layer_ids,
        max_new_tokens=args.max_new_tokens,
        max_prompt_tokens=args.max_prompt_tokens,
        batch_size=args.gen_batch_size,
        dtype=args.gen_dtype,
        device=args.device,
    )
    heldout_prompts = plan_prompts(args.prompt_sets, "heldout", args.heldout_prompts_per_set)
    token_training = None
    if args.token_data is not None:
        if args.arch == "dflash2":
            raise SystemExit("error: --token-data trains DFlash drafters only; --arch dflash2 regenerates")
        token_training = _token_training(args, target, layer_ids, device)
    heldout_manifest = regenerate(target, heldout_prompts, data_dir / "heldout", **common)
    heldout_sequences = load_training_sequences(data_dir / "heldout")
    if token_training is not None:
        train_sequences, validation_sequences = token_training.train, token_training.validation
        data_summary = _token_summary(
            args, target, token_training, len(heldout_sequences), heldout_manifest.generation_seconds
        )
    else:
        train_prompts = plan_prompts(args.prompt_sets, "train", args.train_prompts_per_set)
        train_manifest = regenerate(target, train_prompts, data_dir / "train", **common)
        if args.data_only:
            print(f"data ready in {data_dir}")
            return 0
        train_sequences, validation_sequences = load_training_sequences(data_dir / "train"), []
        data_summary = DataSummary(
            target=str(target),
            prompt_sets=[str(s) for s in args.prompt_sets],
            train_sequences=len(train_sequences),
            train_response_tokens=sum(s.num_response_tokens for s in train_manifest.shards),
            heldout_sequences=len(heldout_sequences),
            max_new_tokens=args.max_new_tokens,
            generation_dtype=args.gen_dtype,
            generation_seconds=train_manifest.generation_seconds + heldout_manifest.generation_seconds,
        )
    if args.arch == "dflash2":
        return selector_cli.run(args, target, data_dir, data_summary, train_sequences, heldout_sequences)

    mask_token_id, mask_token = resolve_mask_token(target, args.mask_token_id)
    drafter_config = build_drafter_config(
        target_config,
        layers=args.layers,
        block_size=args.block_size,
        layer_ids=layer_ids,
        mask_token_id=mask_token_id,
    )
    train_config = TrainConfig(
        steps=args.steps,
        batch_sequences=args.batch_sequences,
        anchors_per_sequence=args.anchors,
        loss_decay=args.loss_decay,
        sample_positions=args.sample_positions,
        set_mix=args.set_mix,
        distill=args.distill,
        lr=DEFAULT_LR if args.lr is None else args.lr,
        warmup_steps=args.warmup_steps,
        precision=args.precision or "bf16-mixed",
        seed=args.seed,
        init_from_target=args.init_from_target,
        init_from_drafter=None if args.init_from_drafter is None else str(args.init_from_drafter),
    )
    frozen = load_frozen_target(target, device)
    state_dir = data_dir / "runs" / args.out.name
    initial_weights, initialised_from = initialisation(args, target, drafter_config)
    trainer = Trainer(
        drafter_config,
        train_config,
        frozen,
        train_sequences,
        state_dir,
        device,
        initial_weights,
        initialised_from,
        features=None if token_training is None else token_training.features.fill,
    )
    if args.resume:
        trainer.resume()
    elif (state_dir / STATE_JSON_NAME).exists():
        raise SystemExit(
            f"error: a training run already exists in {state_dir}; pass --resume to continue it, or remove "
            "that folder to start over"
        )

    def measure(current: Trainer) -> tuple[AcceptanceReport, AcceptanceReport | None]:
        """Held-out and validation chain acceptance of the current drafter, recorded in its state."""
        report = chain_acceptance(
            current.drafter,
            frozen,
            heldout_sequences,
            stride=args.eval_stride,
            precision=train_config.precision,
        )
        current.state.acceptance.append(
            AcceptancePoint(step=current.state.step, mean=report.mean, blocks=report.blocks)
        )
        logger.info(
            "step %d: held-out chain acceptance %.3f over %d blocks %s",
            current.state.step,
            report.mean,
            report.blocks,
            {source: round(mean, 3) for source, mean in report.by_source.items()},
        )
        validation = None
        if validation_sequences:
            validation = chain_acceptance(
                current.drafter,
                frozen,
                validation_sequences,
                stride=args.eval_stride,
                precision=train_config.precision,
            )
            current.state.validation.append(
                AcceptancePoint(step=current.state.step, mean=validation.mean, blocks=validation.blocks)
            )
            logger.info(
                "step %d: validation chain acceptance %.3f over %d blocks",
                current.state.step,
                validation.mean,
                validation.blocks,
            )
        return report, validation

    def export(current: Trainer) -> None:
        nonlocal data_summary
        report, validation = measure(current)
        if token_training is not None:
            data = load_token_training(args.token_data, args.validation_sequences)
            if len(data.train) > len(current.sequences):
                logger.info("%s: %d training sequences now", args.token_data, len(data.train))
                current.sequences = data.train  # the chunks generated since: from the next step on
                token_training.train, token_training.manifest = data.train, data.manifest
                data_summary = _token_summary(
                    args, target, token_training, len(heldout_sequences), heldout_manifest.generation_seconds
                )
        export_drafter(current, args.out)
        write_card(
            args.out,
            name=args.out.name,
            license_id=args.license,
            base_model=args.base_model or target.name,
            drafter=drafter_config,
            state=current.state,
            data=data_summary,
            device=str(device),
            acceptance=report,
            mask_token=mask_token,
            validation=validation,
        )

    if trainer.state.step == 0 and initialised_from is not None:
        measure(trainer)  # the starting drafter's figures, at step 0, on the same blocks
    state = trainer.run(checkpoint_seconds=args.checkpoint_minutes * 60, on_checkpoint=export)
    print(f"drafter written to {args.out} after {state.step} steps ({state.seconds / 3600:.2f} h)")
    if state.step < state.config.steps:
        print(f"stopped at step {state.step} of {state.config.steps}: rerun with --resume to go on")
    return 0


def _token_summary(
    args: argparse.Namespace,
    target: Path,
    data: TokenTraining,
    heldout_sequences: int,
    heldout_seconds: float,
) -> DataSummary:
    """The card's data summary of a --token-data run (its current training sequences)."""
    manifest = data.manifest
    return DataSummary(
        target=str(target),
        prompt_sets=list(manifest.prompt_sets),
        train_sequences=len(data.train),
        train_response_tokens=sum(int(t.tokens.shape[0]) - t.prompt_length for t in data.train),
        heldout_sequences=heldout_sequences,
        max_new_tokens=manifest.settings.max_new_tokens,
        generation_dtype=manifest.settings.dtype,
        generation_seconds=manifest.generation_seconds + heldout_seconds,
        token_data=str(args.token_data),
        validation_sequences=len(data.validation),
    )


@dataclass
class TokenTraining:
    """Sequences of --token-data (validation ones with their features computed) and the feature source;
    train and manifest follow the chunks generated while the run goes on (refreshed at checkpoints)."""

    train: list[TrainingSequence]
    validation: list[TrainingSequence]
    manifest: TokenDataManifest
    features: TargetFeatures


def _token_training(
    args: argparse.Namespace, target: Path, layer_ids: list[int], device: torch.device
) -> TokenTraining:
    """Read --token-data (SystemExit naming it when it is unusable or from another target)."""
    try:
        data = load_token_training(args.token_data, args.validation_sequences)
    except ValueError as error:
        raise SystemExit(f"error: --token-data: {error}") from None
    fingerprint = target_fingerprint(target)
    if data.manifest.settings.target_fingerprint != fingerprint:
        raise SystemExit(
            f"error: --token-data {args.token_data} was generated with another target (fingerprint "
            f"{data.manifest.settings.target_fingerprint[:12]}, --target has {fingerprint[:12]})"
        )
    features = TargetFeatures(target, layer_ids, device, teacher=args.distill > 0)
    logger.info(
        "%s: %d training and %d validation sequences (%d chunks)",
        args.token_data,
        len(data.train),
        len(data.validation),
        len(data.manifest.chunks),
    )
    return TokenTraining(data.train, features.fill(data.validation), data.manifest, features)


def initialisation(
    args: argparse.Namespace, target: Path, drafter_config: DrafterConfig
) -> tuple[dict[str, torch.Tensor] | None, InitialDrafter | None]:
    """(initial weights, the trained drafter they come from) for a new run; (None, None) on --resume,
    whose weights come from the saved state. SystemExit naming a drafter that cannot seed this run."""
    if args.resume or not (args.init_from_target or args.init_from_drafter):
        return None, None
    if args.init_from_target:
        return target_layer_init(target, drafter_config), None
    try:
        weights = drafter_init(args.init_from_drafter, drafter_config)
        return weights, describe_initial_drafter(args.init_from_drafter)
    except (OSError, ValueError) as error:
        raise SystemExit(f"error: --init-from-drafter: {error}") from None


def export_drafter(trainer: Trainer, out: Path) -> Path:
    """Save the trainer's drafter into `out` in the z-lab format with bf16 weights; returns the folder."""
    from bastion_sglang.reference.drafter import DFlashDrafter

    copy = DFlashDrafter(trainer.drafter.config)
    copy.load_state_dict(trainer.drafter.state_dict())
    return copy.to(torch.bfloat16).save_pretrained(out)
