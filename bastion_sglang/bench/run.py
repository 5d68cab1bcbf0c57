"""Running `bastion bench`: every repeat, every policy in a fresh process and Engine.

Repeats: `--repeats R` rounds. In each, every policy gets a fresh Engine in a process of its own
(`bench.server`: fresh online latency corrections, caches and allocator). Round r (from 0) takes the policies
in row r of a Williams design (`plan.repeat_order`), balanced for position and for the policy each one
follows; each round's order is logged and kept in the report. Two schedules (`--schedule`):
- sequential: one Engine at a time, each policy's started after the previous one shut down, in the round's
  order. Drift of the machine over minutes (other tenants, clocks) falls on whichever policy runs then; the
  order design spreads it over the policies but does not cancel it.
- interleaved: every policy's Engine alive through the round, taking turns batch by batch (the round's b-th
  batch, counted over its temperatures, in the round's order rotated by b), the idle ones asleep
  (`sleep_on_idle`), so such drift hits every policy alike. Needs memory for every Engine at once.
Each Engine answers one warm-up request as it starts; once every Engine of the round (or the one of a
sequential run) is up, each streams a warm-up batch (`warm_up`), unmeasured, so the first measured batch
neither runs at a batch size its Engine has not run nor right after an Engine started beside it (without
it, the first batch of each of three rounds at c = 8 on the 2-core CPU ran 1 %, 7 % and 18 % slower than
the same batch of the policy after it, whichever policy went first). Then every temperature runs on the
same prompts: a named set's held-out split by default (never seen in drafter training), a JSONL file
whole, each rendered with the target tokenizer's chat template, sent in batches of `--concurrency`
requests (one `Engine.generate(input_ids=[...], stream=True)` call per batch).
"""

from __future__ import annotations

import importlib.metadata
import logging
import multiprocessing
import tempfile
from collections import defaultdict
from collections.abc import Sequence
from datetime import UTC, datetime
from multiprocessing.context import SpawnContext
from pathlib import Path
from typing import Any, TypeVar

from tqdm import tqdm

from bastion_sglang.bench.aggregate import make_row, summarize, with_speedups
from bastion_sglang.bench.measure import Measurement, TemperatureRun, sampling_params
from bastion_sglang.bench.plan import BenchPlan, BenchPolicy, BenchSettings, repeat_order
from bastion_sglang.bench.report import BenchReport
from bastion_sglang.bench.server import PolicyServer

logger = logging.getLogger(__name__)

Item = TypeVar("Item")
WARMUP_BATCH_TOKENS = 16
"""New tokens per request of the warm-up batch (`warm_up`), EOS ignored."""
VERSIONED_PACKAGES = ("bastion-sglang", "sglang", "torch", "transformers", "prometheus-client")


def batch_bounds(prompts: int, concurrency: int) -> list[tuple[int, int]]:
    """[start, end) of each batch of `concurrency` prompts, in order (the last one may be smaller)."""
    return [(start, min(start + concurrency, prompts)) for start in range(0, prompts, concurrency)]


def rotated(items: Sequence[Item], shift: int) -> list[Item]:
    """items rotated left by `shift` (the round's b-th batch, counted over its temperatures, starts at its
    b-th policy, mod their number)."""
    shift %= len(items)
    return [*items[shift:], *items[:shift]]


def run_group(
    context: SpawnContext, plan: BenchPlan, group: Sequence[BenchPolicy], repeat: int, scratch: Path
) -> dict[tuple[str, float], TemperatureRun]:
    """Start a fresh Engine for each policy of `group`, run every temperature with the group's Engines taking
    turns batch by batch, shut them down; per (policy, temperature): its run.

    RuntimeError naming the policy whose process failed (the others are shut down first).
    """
    settings = plan.settings
    servers: list[PolicyServer] = []
    runs = {}
    turn = 0  # batches run so far: the next one starts at the group's policy number `turn` (mod its size)
    try:
        for policy in group:
            folder = scratch / f"repeat{repeat}-policy{plan.policies.index(policy)}"
            label = f"{policy.name} (repeat {repeat})"
            servers.append(PolicyServer.start(context, plan, policy, label, folder))
        warm_up(plan, servers, repeat)
        for temperature in settings.temperatures:
            params = sampling_params(settings, temperature, repeat)
            measurements = {s.policy.name: Measurement.begin(s.policy, s.metrics_dir) for s in servers}
            desc = f"{group[0].name if len(group) == 1 else 'all'} T={temperature:g} repeat {repeat}"
            with tqdm(total=len(params) * len(servers), desc=desc, unit="req", leave=False) as bar:
                for start, end in batch_bounds(len(params), settings.concurrency):
                    batch_params = tuple(params[start:end])
                    for server in rotated(servers, turn):
                        measurements[server.policy.name].add(server.stream(start, end, batch_params))
                        bar.update(end - start)
                    turn += 1
            for server in servers:
                run = measurements[server.policy.name].finish(repeat, temperature)
                runs[(server.policy.name, temperature)] = run
                record = run.measurement
                logger.info(
                    "%s T=%g repeat %d: %.1f decode tokens/s, %.1f wall tokens/s, token latency p50 %.1f ms, "
                    "p90 %.1f ms",
                    server.policy.name,
                    temperature,
                    repeat,
                    record.decode_tokens_per_second,
                    record.tokens_per_second,
                    record.token_latency_p50_ms,
                    record.token_latency_p90_ms,
                )
    except BaseException:
        for server in servers:
            server.abandon()
        raise
    for server in servers:
        server.close()
    return runs


def warm_up_params(settings: BenchSettings, temperature: float, repeat: int) -> tuple[dict[str, Any], ...]:
    """Per prompt: the warm-up's sampling parameters at `temperature` before repeat `repeat` (`warm_up`):
    those of repeat R + r, with `WARMUP_BATCH_TOKENS` new tokens and EOS ignored."""
    return tuple(
        {**request, "max_new_tokens": WARMUP_BATCH_TOKENS, "ignore_eos": True}
        for request in sampling_params(settings, temperature, settings.repeats + repeat)
    )


def warm_up(plan: BenchPlan, servers: Sequence[PolicyServer], repeat: int) -> None:
    """Each server, in turn, streams the first batch of the plan's prompts once per temperature with
    `WARMUP_BATCH_TOKENS` new tokens each (EOS ignored); nothing of it is measured. Seeded requests of the
    warm-up of repeat r (1..R) take the seeds of repeat R + r, apart from every measured one: the warm-up's
    steps feed the controller's online corrections, and with one warm-up draw for every Engine of every
    repeat (under synthetic acceptance, the same continuation) each run began from the same lucky or unlucky
    start."""
    settings = plan.settings
    end = min(settings.concurrency, len(plan.prompt_ids))
    for temperature in settings.temperatures:
        params = warm_up_params(settings, temperature, repeat)[:end]
        for server in servers:
            server.stream(0, end, params)
    for server in servers:
        logger.info(
            "%s: warmed up (%d requests x %d temperatures, %d new tokens each)",
            server.label,
            end,
            len(settings.temperatures),
            WARMUP_BATCH_TOKENS,
        )


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
    """Run every repeat on the plan's schedule, each policy in a fresh process and Engine, at every
    temperature; return the report (unwritten).

    Raises RuntimeError naming the policy whose process failed.
    """
    import torch

    from bastion_sglang.calibration.identity import device_name

    settings = plan.settings
    prompt_ids = plan.prompt_ids
    logger.info(
        "%d prompts from %s (%s split), %d to %d tokens templated; %d repeats x %d policies x "
        "%d temperatures, concurrency %d, %d new tokens, %s schedule",
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
        settings.schedule,
    )
    context = multiprocessing.get_context("spawn")
    runs: defaultdict[tuple[str, float], list[TemperatureRun]] = defaultdict(list)
    orders = []
    with tempfile.TemporaryDirectory(prefix="bastion-bench-") as root:
        for repeat in range(1, settings.repeats + 1):
            order = repeat_order(plan.policies, repeat - 1)
            orders.append(tuple(policy.name for policy in order))
            logger.info("repeat %d/%d: policy order %s", repeat, settings.repeats, ", ".join(orders[-1]))
            groups = [order] if settings.schedule == "interleaved" else [(policy,) for policy in order]
            for group in groups:
                for key, run in run_group(context, plan, group, repeat, Path(root)).items():
                    runs[key].append(run)
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
