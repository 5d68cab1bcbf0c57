"""The acceptance part of `bastion calibrate`: drafter passes on real prompts, the fit, the held-out report.

Data. The reference engine (Transformers target + the DFlash drafter, the same weights the server loads)
decodes `num_prompts` prompts greedily with a fixed best-first tree of `decode_budget` nodes. Every
speculative step's top-K (cut to the server's K, `topk`) and the tokens the target committed after the
step's root form one `AcceptanceRecord` (`controller.acceptance`). At T = 0 the output is the target's own,
so each record's continuation is the target's greedy continuation after its root.

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

import torch
from tqdm.auto import tqdm

from bastion_sglang.calibration.identity import model_config_hash
from bastion_sglang.config import DEFAULT_TOPK
from bastion_sglang.controller.acceptance import (
    AcceptanceCalibration,
    AcceptanceRecord,
    AcceptanceReport,
    evaluate_acceptance,
    fit_acceptance,
)
from bastion_sglang.controller.policies import FixedPolicy
from bastion_sglang.controller.roofline import HardwareSpec

logger = logging.getLogger(__name__)

HELD_OUT_EVERY = 3
"""Every HELD_OUT_EVERY-th prompt is held out of the fit and scored."""
PLANNING_HARDWARE = HardwareSpec(name="acceptance-run", peak_flops=1.0e12, bandwidth=1.0e11)
"""The reference engine needs a latency model; a fixed budget never reads it."""


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

    from bastion_sglang.prompt_sets import chat_prompt_ids, load_prompts

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


def records_of_generation(
    prompt_ids: Sequence[int], output: Sequence[int], steps: Sequence, topk: int
) -> list[AcceptanceRecord]:
    """One record per speculative step of one generation: its top-K (first `topk` columns) and the target's
    tokens after the step's root. steps: the reference engine's StepStats, whose root sits at ctx_len."""
    full = [*prompt_ids, *output]
    records = []
    for step in steps:
        if step.draft is None:
            continue
        logprobs = step.draft.logprobs[0, :, :topk].detach().to("cpu", torch.float32)
        token_ids = step.draft.token_ids[0, :, :topk].detach().to("cpu")
        depth = int(logprobs.shape[0])
        continuation = tuple(full[step.ctx_len + 1 : step.ctx_len + 1 + depth])
        records.append(AcceptanceRecord(logprobs, token_ids, continuation))
    return records


def measure_acceptance(
    target_path: str | Path,
    draft_path: str | Path,
    *,
    device: torch.device,
    dtype: torch.dtype,
    settings: AcceptanceSettings,
) -> AcceptanceResult:
    """Decode the prompts, fit the calibration on two thirds of them, score it on the rest (module doc)."""
    from bastion_sglang.reference import ReferenceEngine

    prompts = prompt_token_ids(target_path, settings)
    engine = ReferenceEngine(
        target_path, draft_path, device=device, dtype=dtype, hardware=PLANNING_HARDWARE, max_nodes=1024
    )
    policy = FixedPolicy(settings.decode_budget)
    fit_records: list[AcceptanceRecord] = []
    held_records: list[AcceptanceRecord] = []
    for index, ids in enumerate(tqdm(prompts, desc="acceptance", unit="prompt", dynamic_ncols=True)):
        result = engine.generate(ids, settings.max_new_tokens, policy=policy)
        records = records_of_generation(ids, result.tokens, result.steps, settings.topk)
        (held_records if index % HELD_OUT_EVERY == HELD_OUT_EVERY - 1 else fit_records).extend(records)
    depth = int(fit_records[0].logprobs.shape[0]) if fit_records else 1
    calibration = fit_acceptance(fit_records, depth, drafter_config_hash=model_config_hash(draft_path))
    report = evaluate_acceptance(calibration, held_records, settings.report_budgets)
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
