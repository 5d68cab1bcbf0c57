"""Running `bastion step-anatomy`: each policy in a fresh process and Engine, counted step by step.

Each policy's Engine (`bench.plan.server_args_for`, without overlap scheduling so that a step's result is
processed before the next step is scheduled) gets an `AnatomyRequest` on its ServerArgs: its scheduler
process counts every decode step (`step_anatomy_hooks`) into a JSON lines file. The Engine answers one
warm-up request, then one batch of each concurrency in turn (the first c prompts, greedy, EOS ignored, so
every request of a batch decodes the same number of tokens), each request named by the run it belongs to
(`request_id`), and a last one-token request (`CLOSING_ID`); steps whose batch holds the warm-up request are
dropped.
"""

from __future__ import annotations

import logging
import multiprocessing
import os
import tempfile
from dataclasses import dataclass
from multiprocessing.context import SpawnContext
from pathlib import Path
from typing import Any

from pydantic import BaseModel, ConfigDict, Field

from bastion_sglang.bench.plan import BenchPlan, BenchPolicy, server_args_for
from bastion_sglang.bench.server import LOG_FORMAT, PROMETHEUS_DIR_ENV, WARMUP_TOKENS
from bastion_sglang.integration.config import StartupMode
from bastion_sglang.step.step_anatomy import StepCounts
from bastion_sglang.step.step_anatomy_hooks import AnatomyRequest, attach_request

logger = logging.getLogger(__name__)

WARMUP_ID = "warmup"
"""Request id of each Engine's warm-up request (its steps are not reported)."""
CLOSING_ID = "closing"
"""Request id of a one-token request sent after the runs: the scheduler answers it only after it has finished
the iteration that wrote the last run's last step, so the Engine is not shut down before that write."""
ENGINE_OVERRIDES = {"disable_overlap_schedule": True}
"""ServerArgs fields every anatomy Engine runs with (`ar` included: SGLang's default overlaps)."""


@dataclass(frozen=True)
class AnatomyPlan:
    """The validated `bastion step-anatomy` command: the bench's plan of Engines and prompts (`prompt_ids`
    holds at least the largest concurrency), the concurrencies run in turn, and the BASTION Engines'
    `--bastion-startup-calibration`; sites: whether each count records its call site."""

    bench: BenchPlan
    concurrencies: tuple[int, ...]
    startup_calibration: StartupMode
    sites: bool = False


class AnatomyStep(BaseModel):
    """One counted decode step of one policy's Engine, in the run of `concurrency` requests."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    policy: str
    concurrency: int = Field(ge=1, description="requests sent together in the run the step belongs to")
    counts: StepCounts


def request_id(concurrency: int, index: int) -> str:
    """The id of request `index` of the run at `concurrency`: 'c8-3'."""
    return f"c{concurrency}-{index}"


def run_of(request: str) -> int | None:
    """The concurrency of the run a request id names (None: the warm-up, or an id not sent here)."""
    head, _, _ = request.partition("-")
    return int(head[1:]) if head.startswith("c") and head[1:].isdigit() else None


def anatomy_server_args(plan: AnatomyPlan, policy: BenchPolicy, records: Path) -> Any:
    """`policy`'s ServerArgs as the bench builds them, without overlap scheduling, with the anatomy request
    and, for BASTION, the plan's start-up calibration mode."""
    from bastion_sglang.registration import attach_config, make_config

    settings = plan.bench.settings
    server_args = server_args_for(plan.bench, policy, ENGINE_OVERRIDES)
    if policy.kind == "bastion":
        config = make_config(
            max_budget=settings.max_budget,
            policy=policy.name,
            overlap=False,
            startup_calibration=plan.startup_calibration,
        )
        attach_config(server_args, config)
    attach_request(server_args, AnatomyRequest(records=records, sites=plan.sites))
    return server_args


def serve_anatomy(plan: AnatomyPlan, policy: BenchPolicy, records: Path, log_level: int) -> None:
    """Body of one policy's process: start its Engine with the anatomy request, warm up, run one batch of
    each concurrency, shut down. An error ends the process with a non-zero status (logged)."""
    import sglang

    os.environ[PROMETHEUS_DIR_ENV] = str(records.parent / "metrics")  # read by the Engine's processes
    Path(os.environ[PROMETHEUS_DIR_ENV]).mkdir(exist_ok=True)
    bench = plan.bench
    engine = None
    try:
        server_args = anatomy_server_args(plan, policy, records)
        engine = sglang.Engine(server_args=server_args)
        logging.basicConfig(level=log_level, format=LOG_FORMAT, force=True)
        logging.getLogger("sglang").setLevel(bench.sglang_log_level.upper())
        greedy = {"temperature": 0.0, "max_new_tokens": WARMUP_TOKENS}
        engine.generate(input_ids=[bench.prompt_ids[0]], sampling_params=[greedy], rid=[WARMUP_ID])
        params = {"temperature": 0.0, "max_new_tokens": bench.settings.max_new_tokens, "ignore_eos": True}
        for concurrency in plan.concurrencies:
            engine.generate(
                input_ids=list(bench.prompt_ids[:concurrency]),
                sampling_params=[params] * concurrency,
                rid=[request_id(concurrency, index) for index in range(concurrency)],
            )
        closing = {"temperature": 0.0, "max_new_tokens": 1}
        engine.generate(input_ids=[bench.prompt_ids[0]], sampling_params=[closing], rid=[CLOSING_ID])
    finally:
        if engine is not None:
            engine.shutdown()


def read_steps(policy: str, records: Path) -> list[AnatomyStep]:
    """The counted steps of `records` that belong to a run (warm-up steps dropped), in order."""
    steps = []
    for line in records.read_text(encoding="utf-8").splitlines():
        counts = StepCounts.model_validate_json(line)
        runs = {run_of(request) for request in counts.requests}
        if len(runs) == 1 and (concurrency := runs.pop()) is not None:
            steps.append(AnatomyStep(policy=policy, concurrency=concurrency, counts=counts))
    return steps


def run_policy(
    context: SpawnContext, plan: AnatomyPlan, policy: BenchPolicy, scratch: Path
) -> list[AnatomyStep]:
    """Run `policy`'s process (`serve_anatomy`) and read its steps; RuntimeError naming the policy when the
    process fails."""
    folder = scratch / f"policy{plan.bench.policies.index(policy)}"
    folder.mkdir()
    records = folder / "steps.jsonl"
    records.touch()
    process = context.Process(
        target=serve_anatomy,
        args=(plan, policy, records, logging.getLogger().getEffectiveLevel()),
        name=f"bastion-step-anatomy-{policy.name.replace(':', '-')}",
    )
    process.start()
    process.join()
    if process.exitcode != 0:
        raise RuntimeError(f"{policy.name}: its process exited with status {process.exitcode} (logged above)")
    steps = read_steps(policy.name, records)
    logger.info("%s: %d decode steps counted", policy.name, len(steps))
    return steps


def run_anatomy(plan: AnatomyPlan) -> list[AnatomyStep]:
    """Every policy of the plan, one after another, each in a fresh process and Engine; their counted steps.

    Raises RuntimeError naming the policy whose process failed."""
    context = multiprocessing.get_context("spawn")
    steps: list[AnatomyStep] = []
    with tempfile.TemporaryDirectory(prefix="bastion-step-anatomy-") as root:
        for policy in plan.bench.policies:
            steps += run_policy(context, plan, policy, Path(root))
    return steps
