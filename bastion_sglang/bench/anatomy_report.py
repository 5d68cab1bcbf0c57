"""`step_anatomy.json`: what `bastion step-anatomy` measured, and the tables it prints.

Per batch size B (each of `--concurrency`), policy and step kind (`step_anatomy.STEP_KINDS`), over the steps
of the run at concurrency B whose batch held all B requests (`KindSummary`): for each region of the step
(`REGION_ORDER`) and for their total, the median, min and max per step of
- ops: aten ops that are not views (on CUDA each at most one kernel launch), issued outside the target's and
  the drafter's `ModelRunner.forward`;
- syncs: blocking host reads (`step_anatomy`: on a CPU run every read of a tensor's value into Python, an
  upper bound of the CUDA syncs of the same code).
A region a step did not run counts 0 for it. `forwards`: the median model forwards per step by role.

The table (`format_tables`, one per batch size) sets SGLang's plain decode step (`ar`) beside each BASTION
kind, region by region: a skipped step is SGLang's plain step plus what BASTION adds around it.
"""

from __future__ import annotations

import statistics
from collections.abc import Sequence
from pathlib import Path

from pydantic import BaseModel, ConfigDict, Field

from bastion_sglang.bench.anatomy_run import AnatomyStep
from bastion_sglang.step.step_anatomy import OUTSIDE, STEP_KINDS, StepCounts, StepKind

REPORT_NAME = "step_anatomy.json"
REGION_ORDER = (
    "schedule",
    "run",
    "worker",
    "begin",
    "gate",
    "draft",
    "plan",
    "prepare",
    "verify",
    "sample",
    "accept",
    "commit",
    "observe",
    "result",
    OUTSIDE,
)
"""Regions in the order a step runs them (`step_anatomy_hooks`): SGLang's plain step has schedule, run,
worker, prepare, sample, result; BASTION's has its stages and controller calls in place of prepare and
sample."""


class CountSpread(BaseModel):
    """A count per step over a group of steps."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    median: float = Field(ge=0)
    min: int = Field(ge=0)
    max: int = Field(ge=0)

    @classmethod
    def of(cls, values: Sequence[int]) -> CountSpread:
        return cls(median=float(statistics.median(values)), min=min(values), max=max(values))


class RegionSummary(BaseModel):
    """Ops and syncs per step of one region (or of the whole step)."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    ops: CountSpread
    syncs: CountSpread


class KindSummary(BaseModel):
    """The steps of one kind of one policy at one batch size (module docstring)."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    batch_size: int = Field(ge=1)
    policy: str
    kind: StepKind
    steps: int = Field(ge=1)
    regions: dict[str, RegionSummary] = Field(description="every region any of the steps ran, in step order")
    total: RegionSummary
    sync_kinds: dict[str, float] = Field(description="mean syncs per step by kind (item, tolist, ...)")
    forwards: dict[str, float] = Field(description="median model forwards per step by role")
    sites: dict[str, float] = Field(
        default_factory=dict,
        description="with --sites: mean per step of each 'region: op|sync ... @ call site', largest first",
    )


class AnatomySettings(BaseModel):
    """What the Engines ran."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    model_path: str
    draft_model_path: str | None
    prompts: str
    policies: tuple[str, ...]
    concurrencies: tuple[int, ...] = Field(description="one batch of each, in this order")
    max_new_tokens: int = Field(ge=2, description="per request, EOS ignored")
    max_budget: int = Field(ge=1, description="N_max of the BASTION Engines")
    startup_calibration: str = Field(description="--bastion-startup-calibration of the BASTION Engines")
    device: str
    attention_backend: str
    dtype: str
    load_format: str = Field(default="auto", description="dummy: the target's weights were random")
    overlap_schedule: bool = Field(description="False: each step's result is processed before the next step")


class AnatomyReport(BaseModel):
    """`step_anatomy.json`."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    created: str = Field(description="UTC time, ISO 8601")
    command: str = Field(description="the command line that ran")
    commit: str | None = Field(description="git commit of the checkout the package ran from (None: unknown)")
    dirty: bool | None = Field(description="whether that checkout had uncommitted changes to tracked files")
    device: str
    host_cpus: int = Field(ge=1, description="CPU cores the host showed")
    versions: dict[str, str]
    settings: AnatomySettings
    summaries: tuple[KindSummary, ...]
    steps: tuple[AnatomyStep, ...] = Field(description="every counted step, warm-up left out")


def _region_counts(counts: StepCounts, region: str) -> tuple[int, int]:
    stage = counts.stages.get(region)
    return (0, 0) if stage is None else (stage.ops, stage.sync_count)


def summarize_kind(batch_size: int, policy: str, kind: StepKind, steps: Sequence[StepCounts]) -> KindSummary:
    """The summary of `steps` (at least one), all of `policy`'s `kind` at `batch_size`."""
    seen = {region for step in steps for region in step.stages}
    regions = [region for region in REGION_ORDER if region in seen] + sorted(seen - set(REGION_ORDER))
    summaries = {}
    for region in regions:
        ops, syncs = zip(*(_region_counts(step, region) for step in steps), strict=True)
        summaries[region] = RegionSummary(ops=CountSpread.of(ops), syncs=CountSpread.of(syncs))
    totals_ops = [sum(stage.ops for stage in step.stages.values()) for step in steps]
    totals_syncs = [sum(stage.sync_count for stage in step.stages.values()) for step in steps]
    sync_totals: dict[str, int] = {}
    for step in steps:
        for stage in step.stages.values():
            for name, count in stage.syncs.items():
                sync_totals[name] = sync_totals.get(name, 0) + count
    roles = sorted({role for step in steps for role in step.forwards})
    site_totals: dict[str, int] = {}
    for step in steps:
        for region, stage in step.stages.items():
            for site, count in stage.sites.items():
                key = f"{region}: {site}"
                site_totals[key] = site_totals.get(key, 0) + count
    return KindSummary(
        batch_size=batch_size,
        policy=policy,
        kind=kind,
        steps=len(steps),
        regions=summaries,
        total=RegionSummary(ops=CountSpread.of(totals_ops), syncs=CountSpread.of(totals_syncs)),
        sync_kinds={name: total / len(steps) for name, total in sorted(sync_totals.items())},
        forwards={
            role: float(statistics.median(step.forwards.get(role, 0) for step in steps)) for role in roles
        },
        sites={
            site: total / len(steps)
            for site, total in sorted(site_totals.items(), key=lambda item: (-item[1], item[0]))
        },
    )


def summarize(
    steps: Sequence[AnatomyStep], policies: Sequence[str], concurrencies: Sequence[int]
) -> tuple[KindSummary, ...]:
    """A summary per batch size (each concurrency), policy and kind that has steps whose batch held the run's
    every request; ordered by batch size, policy (as given) and kind (`STEP_KINDS`)."""
    summaries = []
    for concurrency in concurrencies:
        for policy in policies:
            for kind in STEP_KINDS:
                group = [
                    step.counts
                    for step in steps
                    if step.policy == policy
                    and step.concurrency == concurrency
                    and step.counts.batch_size == concurrency
                    and step.counts.kind == kind
                ]
                if group:
                    summaries.append(summarize_kind(concurrency, policy, kind, group))
    return tuple(summaries)


def _cell(summary: RegionSummary | None) -> str:
    """'ops / syncs' medians ('·' for a region the kind does not run)."""
    if summary is None:
        return "·"
    return f"{summary.ops.median:g} / {summary.syncs.median:g}"


def _range(spread: CountSpread) -> str:
    return f"{spread.min}" if spread.min == spread.max else f"{spread.min}–{spread.max}"


def _column(summary: KindSummary) -> str:
    return f"{summary.policy} ({summary.kind})"


def format_tables(report: AnatomyReport) -> str:
    """One markdown table per batch size: a row per region, a column per policy and kind, each cell the
    median ops / syncs per step; then the totals' medians and ranges, the steps and the forwards."""
    blocks = []
    for batch_size in report.settings.concurrencies:
        columns = [s for s in report.summaries if s.batch_size == batch_size]
        if not columns:
            blocks.append(f"Batch {batch_size}: no step ran with all {batch_size} requests.")
            continue
        seen = {region for s in columns for region in s.regions}
        regions = [region for region in REGION_ORDER if region in seen] + sorted(seen - set(REGION_ORDER))
        lines = [
            f"Batch {batch_size}: median aten ops (views excluded) / blocking host syncs per step, outside "
            "the model forwards",
            "",
            "| region | " + " | ".join(_column(s) for s in columns) + " |",
            "|---" * (len(columns) + 1) + "|",
        ]
        for region in regions:
            lines.append(f"| {region} | " + " | ".join(_cell(s.regions.get(region)) for s in columns) + " |")
        lines.append("| **total** | " + " | ".join(f"**{_cell(s.total)}**" for s in columns) + " |")
        lines.append(
            "| total min–max | "
            + " | ".join(f"{_range(s.total.ops)} / {_range(s.total.syncs)}" for s in columns)
            + " |"
        )
        lines.append("| steps | " + " | ".join(str(s.steps) for s in columns) + " |")
        lines.append(
            "| forwards | "
            + " | ".join(", ".join(f"{role} {n:g}" for role, n in s.forwards.items()) for s in columns)
            + " |"
        )
        blocks.append("\n".join(lines))
    return "\n\n".join(blocks)


def format_sites(report: AnatomyReport) -> str:
    """With --sites: per batch size, policy and kind, where each step's ops and syncs were issued (mean per
    step, syncs first, then ops; empty when the run recorded no sites)."""
    blocks = []
    for summary in report.summaries:
        if not summary.sites:
            continue
        ordered = sorted(summary.sites.items(), key=lambda item: (" sync " not in item[0], -item[1]))
        lines = [f"Batch {summary.batch_size}, {_column(summary)}: mean per step, by call site"]
        lines += [f"  {count:6.2f}  {site}" for site, count in ordered]
        blocks.append("\n".join(lines))
    return "\n\n".join(blocks)


def write_report(report: AnatomyReport, out: Path) -> Path:
    """Write `step_anatomy.json` into `out` (created if needed); its path."""
    out.mkdir(parents=True, exist_ok=True)
    path = out / REPORT_NAME
    path.write_text(report.model_dump_json(indent=2) + "\n", encoding="utf-8")
    return path
