"""`bastion train-drafter --arch dflash2`: the selector stage (`training.selector`) after the shared
regeneration stage of `training.cli`.

The trained DFlash drafter --init-from-drafter is the frozen backbone: it sets the target layers the data
is regenerated with, the block size and the mask token. Training state lives in <data-dir>/runs/<out name>/
(--resume continues it); every checkpoint exports the DFlash2 drafter (bf16 weights, the backbone's and the
selector's) with its card into --out, after measuring the DFlash2 chain and the backbone's DFlash chain on
the held-out blocks.
"""

from __future__ import annotations

import argparse
import logging
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import torch

from bastion_sglang.integration.drafter_config import DrafterConfig, check_drafter_fits
from bastion_sglang.reference.drafter import DFlashDrafter
from bastion_sglang.training.card import DataSummary, describe_initial_drafter, write_card
from bastion_sglang.training.data import TrainingSequence
from bastion_sglang.training.selector import (
    SelectorTrainConfig,
    SelectorTrainer,
    draft_blocks,
    lattice_acceptance,
    stride_anchors,
)
from bastion_sglang.training.train import STATE_JSON_NAME, load_frozen_target

DEFAULT_SELECTOR_LR = 1e-3
"""Peak learning rate of a selector run unless --lr is given."""

logger = logging.getLogger(__name__)


def backbone_config(args: argparse.Namespace, target_config: Mapping[str, Any]) -> DrafterConfig:
    """The config of the DFlash drafter a DFlash2 run trains on; SystemExit naming what does not fit."""
    if args.init_from_drafter is None or args.init_from_target:
        raise SystemExit(
            "error: --arch dflash2 trains a selector on a trained DFlash drafter: pass --init-from-drafter "
            "PATH (and not --init-from-target)"
        )
    if args.precision not in (None, "fp32"):
        raise SystemExit(f"error: --arch dflash2 trains in fp32, got --precision {args.precision}")
    if args.sample_positions or args.distill:
        flag = "--sample-positions samples" if args.sample_positions else "--distill weighs"
        raise SystemExit(f"error: {flag} the DFlash loss; --arch dflash2 trains a selector")
    try:
        config = DrafterConfig.from_json(args.init_from_drafter)
        check_drafter_fits(config, target_config)
    except ValueError as error:
        raise SystemExit(f"error: --init-from-drafter: {error}") from None
    if config.selector is not None or config.variant_features:
        raise SystemExit(
            f"error: --init-from-drafter {args.init_from_drafter} must be a plain DFlash drafter; it has "
            f"{'a selector' if config.selector is not None else list(config.variant_features)}"
        )
    if args.target_layer_ids is not None and tuple(args.target_layer_ids) != config.target_layer_ids:
        raise SystemExit(
            f"error: --target-layer-ids {args.target_layer_ids} differ from the backbone's "
            f"{list(config.target_layer_ids)}; drop the option"
        )
    return config


def run(
    args: argparse.Namespace,
    target: Path,
    data_dir: Path,
    data: DataSummary,
    train_sequences: Sequence[TrainingSequence],
    heldout_sequences: Sequence[TrainingSequence],
) -> int:
    """Train, measure and export (module docstring); returns the exit status."""
    device = torch.device(args.device)
    backbone = DFlashDrafter.from_pretrained(args.init_from_drafter).to(device)
    config = SelectorTrainConfig(
        init_from_drafter=str(args.init_from_drafter),
        rank=args.selector_rank,
        top_k=args.selector_top_k,
        steps=args.steps,
        batch_rows=args.batch_rows,
        anchors_per_sequence=args.anchors,
        loss_decay=args.loss_decay,
        lr=DEFAULT_SELECTOR_LR if args.lr is None else args.lr,
        warmup_steps=args.warmup_steps,
        seed=args.seed,
    )
    drafter_config = backbone.config.model_copy(update={"selector": config.selector()})
    frozen = load_frozen_target(target, device)
    state_dir = data_dir / "runs" / args.out.name
    trainer = SelectorTrainer(
        backbone,
        drafter_config,
        config,
        frozen,
        train_sequences,
        state_dir,
        describe_initial_drafter(args.init_from_drafter),
    )
    if args.resume:
        trainer.resume()
    elif (state_dir / STATE_JSON_NAME).exists():
        raise SystemExit(
            f"error: a training run already exists in {state_dir}; pass --resume to continue it, or remove "
            "that folder to start over"
        )
    anchors = stride_anchors(heldout_sequences, drafter_config.block_size, args.eval_stride)
    heldout = draft_blocks(trainer.backbone, frozen, heldout_sequences, anchors, config.selector())
    mask_token = _mask_token(target, drafter_config.mask_token_id)

    def export(current: SelectorTrainer) -> None:
        report = lattice_acceptance(current.selector, heldout)
        logger.info(
            "step %d: held-out chain acceptance %.3f (DFlash2) and %.3f (its DFlash backbone) over %d blocks",
            current.state.step,
            report.dflash2.mean,
            report.dflash.mean,
            report.dflash2.blocks,
        )
        current.drafter().to(torch.bfloat16).save_pretrained(args.out)
        write_card(
            args.out,
            name=args.out.name,
            license_id=args.license,
            base_model=args.base_model or target.name,
            drafter=drafter_config,
            state=current.state,
            data=data,
            device=str(device),
            acceptance=report.dflash2,
            mask_token=mask_token,
            backbone_acceptance=report.dflash,
        )

    state = trainer.run(checkpoint_seconds=args.checkpoint_minutes * 60, on_checkpoint=export)
    print(f"DFlash2 drafter written to {args.out} after {state.step} steps ({state.seconds / 3600:.2f} h)")
    if state.step < state.config.steps:
        print(f"stopped at step {state.step} of {state.config.steps}: rerun with --resume to go on")
    return 0


def _mask_token(target: Path, mask_token_id: int) -> str:
    """The text of the mask token, for the card."""
    from transformers import AutoTokenizer

    return str(AutoTokenizer.from_pretrained(target).convert_ids_to_tokens(mask_token_id))
