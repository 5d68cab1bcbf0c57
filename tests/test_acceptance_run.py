"""calibrate's acceptance run on the demo pair: records line up with what the verify passes committed."""

from __future__ import annotations

import json
from pathlib import Path
from typing import TYPE_CHECKING

import pytest
import torch

from bastion_sglang.calibration.acceptance_fit import (
    AcceptanceSettings,
    describe_acceptance,
    prompt_token_ids,
)
from bastion_sglang.calibration.acceptance_run import (
    PLANNING_HARDWARE,
    measure_acceptance,
    records_of_generation,
)
from bastion_sglang.calibration.identity import model_config_hash
from bastion_sglang.controller.acceptance import realised_accept_length
from bastion_sglang.controller.tree import build_tree

if TYPE_CHECKING:
    from demo_target import DemoTarget

pytest_plugins = ["demo_target"]

DRAFTER = Path(__file__).resolve().parents[1] / "models" / "smollm2-135m-instruct-dflash"
PROMPTS = [
    "Write a Python function that returns the n-th Fibonacci number.",
    "Explain in two sentences why the sky is blue.",
    "List three uses of a hash map.",
    "Write a haiku about autumn rain.",
    'def is_prime(n):\n    """Return True when n is prime."""',
    "What is the capital of France? Answer in one word, then explain.",
]


@pytest.fixture(scope="module")
def prompt_file(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("prompts") / "prompts.jsonl"
    path.write_text("".join(json.dumps({"prompt": text}) + "\n" for text in PROMPTS), encoding="utf-8")
    return path


@pytest.mark.slow
def test_records_match_the_verify_passes(demo_target: DemoTarget, prompt_file: Path) -> None:
    from bastion_sglang.reference import ReferenceEngine

    settings = AcceptanceSettings(prompt_set=str(prompt_file), num_prompts=3, topk=16, decode_budget=16)
    prompts = prompt_token_ids(demo_target.path, settings)
    assert len(prompts) == 3
    engine = ReferenceEngine(
        demo_target.path, DRAFTER, device="cpu", dtype=torch.float32, hardware=PLANNING_HARDWARE
    )
    checked = 0
    for ids in prompts[:2]:
        result = engine.generate(ids, 24, policy="fixed:16")
        records = records_of_generation(ids, result.tokens, result.steps, topk=16)
        speculative = [step for step in result.steps if step.draft is not None]
        assert len(records) == len(speculative) > 0
        for record, step in zip(records, speculative, strict=True):
            if len(record.continuation) < record.logprobs.shape[0]:
                continue  # cut by the end of the output
            tree = build_tree(record.logprobs, record.token_ids, 16)
            committed = realised_accept_length(
                tree.tokens.tolist(), tree.parents.tolist(), tree.depths.tolist(), record.continuation
            )
            assert committed == step.accepted + 1
            checked += 1
    assert checked > 0


@pytest.mark.slow
@pytest.mark.timeout(1200)
def test_measure_acceptance_fits_and_reports(demo_target: DemoTarget, prompt_file: Path) -> None:
    settings = AcceptanceSettings(
        prompt_set=str(prompt_file), num_prompts=6, max_new_tokens=48, report_budgets=(1, 16)
    )
    result = measure_acceptance(
        demo_target.path, DRAFTER, device=torch.device("cpu"), dtype=torch.float32, settings=settings
    )
    calibration, report = result.calibration, result.report
    assert calibration.drafter_config_hash == model_config_hash(DRAFTER)
    assert not calibration.is_identity
    assert calibration.events[0] > 0 and result.fit_passes > 0
    assert report.budgets == [1, 16] and report.passes > 0
    lines = describe_acceptance(report)
    assert len(lines) == 2 + 2 and "held-out" in lines[0]


def test_acceptance_settings_reject_bad_values() -> None:
    with pytest.raises(ValueError, match="num_prompts must be a positive int"):
        AcceptanceSettings(num_prompts=0)
    with pytest.raises(ValueError, match="at least 3 prompts"):
        AcceptanceSettings(num_prompts=2)


@pytest.mark.slow
def test_calibrated_reference_engine_keeps_the_target_output(demo_target: DemoTarget) -> None:
    from bastion_sglang.controller.acceptance import AcceptanceCalibration
    from bastion_sglang.reference import ReferenceEngine

    calibration = AcceptanceCalibration(slopes=[0.9, 0.6], offsets=[-0.4, -1.2], events=[1, 1])
    engine = ReferenceEngine(
        demo_target.path,
        DRAFTER,
        device="cpu",
        dtype=torch.float32,
        hardware=PLANNING_HARDWARE,
        acceptance=calibration,
    )
    settings = AcceptanceSettings(prompt_set="humaneval", num_prompts=3)
    ids = prompt_token_ids(demo_target.path, settings)[0]
    plain = engine.generate(ids, 32, policy="ar")
    calibrated = engine.generate(ids, 32, policy="fixed:8")
    assert calibrated.tokens == plain.tokens
    raw = ReferenceEngine(
        demo_target.path, DRAFTER, device="cpu", dtype=torch.float32, hardware=PLANNING_HARDWARE
    )
    step = calibrated.steps[0]
    raw_step = raw.generate(ids, 32, policy="fixed:8").steps[0]
    # the map lowers the confident candidates (log q > -1.5) that make up these trees: a smaller Â
    assert step.expected_accept < raw_step.expected_accept
