"""Fitting and scoring a drafter's acceptance calibration on recorded drafter passes, whichever engine
recorded them: `bastion calibrate`'s reference engine (`acceptance_run`) or a starting server's own forwards
(`startup`).

Prompts: by default the held-out split of ShareGPT, which no drafter training run of this project sees and
no default benchmark uses (`bastion bench` takes MT-Bench and HumanEval held-out prompts). Prompts longer
than `max_prompt_tokens` are skipped.

Split: every third prompt (by position) is held out of the fit; `AcceptanceReport` compares the expected
accept length with the realised one on those prompts' passes, for the raw and the calibrated trees, at
each of `report_budgets`. The calibration stored in the profile is the one fitted on the other prompts.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from bastion_sglang.controller.acceptance import (
    AcceptanceCalibration,
    AcceptanceReport,
    DrafterPass,
    evaluate_acceptance,
    fit_acceptance,
)
from bastion_sglang.integration.config import DEFAULT_TOPK

logger = logging.getLogger(__name__)

HELD_OUT_EVERY = 3
"""Every HELD_OUT_EVERY-th prompt is held out of the fit and scored."""


@dataclass(frozen=True)
class AcceptanceSettings:
    """What the acceptance run decodes and how it is scored."""

    prompt_set: str = "sharegpt"
    num_prompts: int = 48
    max_new_tokens: int = 64
    max_prompt_tokens: int = 512
    topk: int = DEFAULT_TOPK
    decode_budget: int = 16
    report_budgets: tuple[int, ...] = (1, 4, 16, 64)

    def __post_init__(self) -> None:
        for name in ("num_prompts", "max_new_tokens", "max_prompt_tokens", "topk", "decode_budget"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"acceptance settings: {name} must be a positive int, got {value!r}")
        if self.num_prompts < HELD_OUT_EVERY:
            raise ValueError(
                f"--acceptance-prompts {self.num_prompts}: at least {HELD_OUT_EVERY} prompts are needed "
                "(every third is held out of the fit)"
            )


@dataclass(frozen=True)
class AcceptanceResult:
    calibration: AcceptanceCalibration
    report: AcceptanceReport
    fit_passes: int


def prompt_token_ids(model_path: str | Path, settings: AcceptanceSettings) -> list[list[int]]:
    """The first `num_prompts` prompts of the set's held-out split (a JSONL file: all of it), rendered with
    the target tokenizer's chat template, skipping those longer than `max_prompt_tokens`."""
    from transformers import AutoTokenizer

    from bastion_sglang.assets.prompt_sets import chat_prompt_ids, load_prompts

    split = "all" if Path(settings.prompt_set).suffix == ".jsonl" else "heldout"
    prompts = load_prompts(settings.prompt_set, split=split)
    tokenizer = AutoTokenizer.from_pretrained(str(model_path))
    chosen: list[list[int]] = []
    for prompt in prompts:
        ids = chat_prompt_ids(tokenizer, prompt)
        if len(ids) <= settings.max_prompt_tokens:
            chosen.append(ids)
        if len(chosen) == settings.num_prompts:
            break
    if len(chosen) < HELD_OUT_EVERY:
        raise ValueError(
            f"prompt set {settings.prompt_set!r} has {len(chosen)} prompts of at most "
            f"{settings.max_prompt_tokens} tokens; need at least {HELD_OUT_EVERY}"
        )
    return chosen


def fit_held_out(
    per_prompt: Sequence[Sequence[DrafterPass]], drafter_config_hash: str, budgets: Sequence[int]
) -> AcceptanceResult:
    """Fit the calibration on the records of every prompt but each HELD_OUT_EVERY-th (by position) and score
    it on those at `budgets`. per_prompt: each prompt's records (top-K or lattice passes), in prompt order.
    ValueError when the fit
    has too few events (`fit_acceptance`)."""
    fit_records: list[DrafterPass] = []
    held_records: list[DrafterPass] = []
    for index, records in enumerate(per_prompt):
        (held_records if index % HELD_OUT_EVERY == HELD_OUT_EVERY - 1 else fit_records).extend(records)
    depth = fit_records[0].depth if fit_records else 1
    calibration = fit_acceptance(fit_records, depth, drafter_config_hash=drafter_config_hash)
    report = evaluate_acceptance(calibration, held_records, budgets)
    logger.info(
        "acceptance: fitted on %d drafter passes, scored on %d held-out passes",
        len(fit_records),
        report.passes,
    )
    return AcceptanceResult(calibration, report, len(fit_records))


def describe_acceptance(report: AcceptanceReport) -> list[str]:
    """Table lines: per budget, expected vs realised accept length, raw and calibrated, and their errors."""
    lines = [
        f"acceptance on {report.passes} held-out drafter passes (tokens per verify pass, bonus included):",
        "  budget  raw Â  realised  raw err   Â  realised  err",
    ]
    for j, budget in enumerate(report.budgets):
        lines.append(
            f"  {budget:>6}  {report.expected_raw[j]:5.2f}  {report.realised_raw[j]:8.2f}  "
            f"{report.error_raw[j]:+7.1%}  {report.expected[j]:4.2f}  {report.realised[j]:8.2f}  "
            f"{report.error[j]:+5.1%}"
        )
    return lines
