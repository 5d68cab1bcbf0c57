"""The acceptance part of `bastion calibrate`: drafter passes on real prompts on the reference engine; the
fit and the held-out report are `acceptance_fit`'s.

Data. The reference engine (Transformers target + the DFlash drafter, the same weights the server loads)
decodes `num_prompts` prompts greedily with a fixed best-first tree of `decode_budget` nodes. Every
speculative step's top-K (cut to the server's K, `topk`) and the tokens the target committed after the
step's root form one `AcceptanceRecord` (`controller.acceptance`); a DFlash2 drafter's step gives a
`LatticeRecord` instead (`controller.lattice_acceptance`: its [D, K, K] transitions and [D, K] candidates,
all K of the selector's candidates, each row a distribution over them). At T = 0 the output is the
target's own, so each record's continuation is the target's greedy continuation after its root.

Prompts and the held-out split: `acceptance_fit`.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from pathlib import Path

import torch
from tqdm.auto import tqdm

from bastion_sglang.calibration.acceptance_fit import (
    AcceptanceResult,
    AcceptanceSettings,
    fit_held_out,
    prompt_token_ids,
)
from bastion_sglang.calibration.identity import model_config_hash
from bastion_sglang.controller.acceptance import AcceptanceRecord, DrafterPass
from bastion_sglang.controller.lattice_acceptance import LatticeRecord
from bastion_sglang.controller.policies import FixedPolicy
from bastion_sglang.controller.roofline import HardwareSpec

logger = logging.getLogger(__name__)

PLANNING_HARDWARE = HardwareSpec(name="acceptance-run", peak_flops=1.0e12, bandwidth=1.0e11)
"""The reference engine needs a latency model; a fixed budget never reads it."""


def records_of_generation(
    prompt_ids: Sequence[int], output: Sequence[int], steps: Sequence, topk: int
) -> list[DrafterPass]:
    """One record per speculative step of one generation: its top-K (first `topk` columns), or its lattice
    (every candidate), and the target's tokens after the step's root. steps: the reference engine's
    StepStats, whose root sits at ctx_len."""
    full = [*prompt_ids, *output]
    records: list[DrafterPass] = []
    for step in steps:
        if step.lattice is not None:
            transitions = step.lattice.transitions[0].detach().to("cpu", torch.float32)
            depth = int(transitions.shape[0])
            continuation = tuple(full[step.ctx_len + 1 : step.ctx_len + 1 + depth])
            token_ids = step.lattice.unary.token_ids[0].detach().to("cpu")
            records.append(LatticeRecord(transitions, token_ids, continuation))
            continue
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
    prompts = prompt_token_ids(target_path, settings)
    per_prompt = decode_passes(
        target_path, draft_path, prompts, device=device, dtype=dtype, settings=settings
    )
    return fit_held_out(per_prompt, model_config_hash(draft_path), settings.report_budgets)


def decode_passes(
    target_path: str | Path,
    draft_path: str | Path,
    prompts: Sequence[Sequence[int]],
    *,
    device: torch.device,
    dtype: torch.dtype,
    settings: AcceptanceSettings,
) -> list[list[DrafterPass]]:
    """Each prompt's drafter passes (`records_of_generation`), in prompt order: the prompts (token ids)
    decoded greedily, `settings.max_new_tokens` tokens each, with a fixed tree of `settings.decode_budget`
    nodes, each pass cut to `settings.topk` candidates per position."""
    from bastion_sglang.reference import ReferenceEngine

    engine = ReferenceEngine(
        target_path, draft_path, device=device, dtype=dtype, hardware=PLANNING_HARDWARE, max_nodes=1024
    )
    policy = FixedPolicy(settings.decode_budget)
    per_prompt = []
    for ids in tqdm(prompts, desc="acceptance", unit="prompt", dynamic_ncols=True):
        result = engine.generate(list(ids), settings.max_new_tokens, policy=policy)
        per_prompt.append(records_of_generation(ids, result.tokens, result.steps, settings.topk))
    return per_prompt
