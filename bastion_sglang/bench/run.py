"""Running `bastion bench`: every repeat, every policy in a fresh process and Engine.

Repeats: `--repeats R` rounds. In each, every policy gets a fresh Engine in a process of its own (fresh
online latency corrections, caches and allocator), shut down before the next one starts. Round r (from 0)
runs the policies in row r of a Williams design (`plan.repeat_order`), balanced for position and for the
policy each one follows, so neither slow drift of the machine nor a policy that leaves it slower for the next
one always falls on the same policy; each round's order is logged and kept in the report.
Each Engine answers one warm-up request, then runs every temperature on the same prompts: a named set's
held-out split by default (never seen in drafter training), a JSONL file whole, each rendered with the target
tokenizer's chat template, sent in batches of `--concurrency` requests (one `Engine.generate(input_ids=[...],
stream=True)` call per batch).
"""

from __future__ import annotations

import importlib.metadata
import logging
import multiprocessing
import os
import tempfile
import time
from collections import defaultdict
from datetime import UTC, datetime
from multiprocessing.context import SpawnContext
from pathlib import Path

from bastion_sglang.bench.aggregate import make_row, summarize, with_speedups
from bastion_sglang.bench.measure import PolicyRun, TemperatureRun, measure, repeat_measurement
from bastion_sglang.bench.plan import BenchPlan, BenchPolicy, repeat_order, server_args_for
from bastion_sglang.bench.report import BenchReport
from bastion_sglang.bench.streaming import stream_batch

logger = logging.getLogger(__name__)

PROMETHEUS_DIR_ENV = "PROMETHEUS_MULTIPROC_DIR"
RUN_NAME = "run.json"
"""The `PolicyRun` one policy process writes into its scratch folder for the parent."""
WARMUP_TOKENS = 4
"""New tokens of each Engine's warm-up request (one prompt, T = 0), excluded from every measurement."""
LOG_FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"
"""Log format of the policy processes (the `bastion` command's own)."""
VERSIONED_PACKAGES = ("bastion-sglang", "sglang", "torch", "transformers", "prometheus-client")


def run_policy(
    plan: BenchPlan,
    policy: BenchPolicy,
    repeat: int,
    scratch: Path,
    log_level: int,
) -> None:
    """Body of one policy's process in one repeat: start a fresh Engine, warm up, measure every temperature,
    shut down.

    Writes `PolicyRun` to scratch/run.json. The Engine's processes write their Prometheus samples into
    scratch/metrics: prometheus_client's multiprocess mode is configured only by PROMETHEUS_MULTIPROC_DIR,
    which the scheduler process inherits when the Engine starts it. One process per Engine because an
    Engine with metrics registers its tokenizer-side series in its process's default registry, so a second
    one in the same process fails on duplicated series.
    """
    import sglang

    metrics_dir = scratch / "metrics"
    metrics_dir.mkdir(parents=True)
    os.environ[PROMETHEUS_DIR_ENV] = str(metrics_dir)  # read by this process's Engine and its children
    began = time.perf_counter()
    engine = sglang.Engine(server_args=server_args_for(plan, policy))
    # The Engine set this process's root logger to its own level and format; restore the command's.
    logging.basicConfig(level=log_level, format=LOG_FORMAT, force=True)
    logging.getLogger("sglang").setLevel(plan.sglang_log_level.upper())
    prompt_ids = plan.prompt_ids
    runs = []
    try:
        logger.info(
            "%s (repeat %d): engine ready in %.1f s", policy.name, repeat, time.perf_counter() - began
        )
        stream_batch(engine, prompt_ids[:1], [{"temperature": 0.0, "max_new_tokens": WARMUP_TOKENS}])
        for temperature in plan.settings.temperatures:
            label = f"{policy.name} T={temperature:g} repeat {repeat}"
            exported = metrics_dir if policy.kind == "bastion" else None
            measured = measure(engine, prompt_ids, temperature, plan, exported, label)
            record = repeat_measurement(policy, repeat, measured)
            runs.append(TemperatureRun(temperature=temperature, measurement=record, growth=measured.growth))
            logger.info(
                "%s: %.1f decode tokens/s, %.1f wall tokens/s, token latency p50 %.1f ms, p90 %.1f ms",
                label,
                record.decode_tokens_per_second,
                record.tokens_per_second,
                record.token_latency_p50_ms,
                record.token_latency_p90_ms,
            )
    finally:
        engine.shutdown()
    result = PolicyRun(policy=policy.name, repeat=repeat, runs=tuple(runs))
    (scratch / RUN_NAME).write_text(result.model_dump_json(), encoding="utf-8")


def run_policy_process(
    context: SpawnContext, plan: BenchPlan, policy: BenchPolicy, repeat: int, scratch: Path
) -> PolicyRun:
    """Run `run_policy` in a fresh process and read back what it wrote; RuntimeError naming the policy if
    the process fails."""
    scratch.mkdir(parents=True)
    process = context.Process(
        target=run_policy,
        args=(plan, policy, repeat, scratch, logging.getLogger().getEffectiveLevel()),
        name=f"bastion-bench-{policy.name}-{repeat}",
    )
    process.start()
    process.join()
    if process.exitcode != 0:
        raise RuntimeError(
            f"policy {policy.name}, repeat {repeat}: its benchmark process exited with status "
            f"{process.exitcode} (its error is logged above)"
        )
    logger.info("%s (repeat %d): engine shut down", policy.name, repeat)
    return PolicyRun.model_validate_json((scratch / RUN_NAME).read_text(encoding="utf-8"))


def package_versions() -> dict[str, str]:
    """Installed versions of the packages that decide the numbers (absent ones left out)."""
    versions = {}
    for name in VERSIONED_PACKAGES:
        try:
            versions[name] = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            continue
    return versions


def run_bench(plan: BenchPlan) -> BenchReport:
    """Run every repeat: each policy in a fresh process and Engine, in that repeat's order, at every
    temperature; return the report (unwritten).

    Raises RuntimeError naming the policy whose process failed.
    """
    import torch

    from bastion_sglang.calibration.identity import device_name

    settings = plan.settings
    prompt_ids = plan.prompt_ids
    logger.info(
        "%d prompts from %s (%s split), %d to %d tokens templated; %d repeats x %d policies x "
        "%d temperatures, concurrency %d, %d new tokens",
        len(prompt_ids),
        settings.prompts,
        settings.split,
        min(len(ids) for ids in prompt_ids),
        max(len(ids) for ids in prompt_ids),
        settings.repeats,
        len(plan.policies),
        len(settings.temperatures),
        settings.concurrency,
        settings.max_new_tokens,
    )
    context = multiprocessing.get_context("spawn")
    runs: defaultdict[tuple[str, float], list[TemperatureRun]] = defaultdict(list)
    orders = []
    with tempfile.TemporaryDirectory(prefix="bastion-bench-") as root:
        for repeat in range(1, settings.repeats + 1):
            order = repeat_order(plan.policies, repeat - 1)
            orders.append(tuple(policy.name for policy in order))
            logger.info("repeat %d/%d: policy order %s", repeat, settings.repeats, ", ".join(orders[-1]))
            for policy in order:
                scratch = Path(root) / f"repeat{repeat}-policy{plan.policies.index(policy)}"
                for run in run_policy_process(context, plan, policy, repeat, scratch).runs:
                    runs[(policy.name, run.temperature)].append(run)
    rows = with_speedups(
        [
            make_row(policy.name, temperature, runs[(policy.name, temperature)])
            for policy in plan.policies
            for temperature in settings.temperatures
        ]
    )
    return BenchReport(
        created=datetime.now(UTC).isoformat(timespec="seconds"),
        settings=settings,
        device=device_name(torch.device(settings.device)),
        versions=package_versions(),
        repeat_orders=tuple(orders),
        rows=rows,
        summaries=summarize(rows, settings.temperatures),
    )
