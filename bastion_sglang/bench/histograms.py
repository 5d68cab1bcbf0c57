"""The worker's Prometheus histograms, read from an Engine's multiprocess folder.

A BASTION worker observes into the histograms of `WORKER_METRICS` and, per stage of a decode step, into
`STAGE_METRIC` (what each one samples: `bastion_sglang.step.metrics`). prometheus_client's multiprocess
collector sums every process's files; the growth of `_sum` and `_count` over a temperature's generate
calls is what the report's means are taken over (`bench.report`).
"""

from __future__ import annotations

from pathlib import Path

from pydantic import BaseModel, ConfigDict

TREE_NODES_METRIC = "sglang:bastion_tree_nodes"
"""The worker's histogram of draft nodes verified per request per step (bastion_sglang.step.metrics)."""
EXPECTED_METRIC = "sglang:bastion_expected_accept_length"
EXPECTED_RAW_METRIC = "sglang:bastion_expected_accept_length_raw"
REALISED_METRIC = "sglang:bastion_accept_length"
LATENCY_ERROR_METRIC = "sglang:bastion_verify_relative_error"
ESTIMATED_SPEEDUP_METRIC = "sglang:bastion_speedup_estimated"
REALISED_SPEEDUP_METRIC = "sglang:bastion_speedup_realised"
WORKER_METRICS = (
    TREE_NODES_METRIC,
    EXPECTED_METRIC,
    EXPECTED_RAW_METRIC,
    REALISED_METRIC,
    LATENCY_ERROR_METRIC,
    ESTIMATED_SPEEDUP_METRIC,
    REALISED_SPEEDUP_METRIC,
)
STAGE_METRIC = "sglang:bastion_step_stage_seconds"
STAGE_NAMES = ("draft", "plan", "verify", "accept", "commit", "other")


class HistogramTotals(BaseModel):
    """`_sum` and `_count` of one histogram, summed over its label sets and processes (or their growth)."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    total: float
    count: float

    def minus(self, before: HistogramTotals) -> HistogramTotals:
        """The growth since `before`."""
        return HistogramTotals(total=self.total - before.total, count=self.count - before.count)

    def plus(self, other: HistogramTotals) -> HistogramTotals:
        return HistogramTotals(total=self.total + other.total, count=self.count + other.count)

    def mean(self) -> float | None:
        """total / count; None without samples."""
        return self.total / self.count if self.count > 0 else None


def read_histogram(directory: Path, name: str, stage: str | None = None) -> HistogramTotals:
    """Totals of histogram `name` in a prometheus_client multiprocess directory (zeros when absent);
    stage: only the samples with that `stage` label."""
    from prometheus_client import CollectorRegistry
    from prometheus_client.multiprocess import MultiProcessCollector

    registry = CollectorRegistry()
    MultiProcessCollector(registry, path=str(directory))
    total = count = 0.0
    for family in registry.collect():
        if family.name != name:
            continue
        for sample in family.samples:
            if stage is not None and sample.labels.get("stage") != stage:
                continue
            if sample.name == f"{name}_sum":
                total += sample.value
            elif sample.name == f"{name}_count":
                count += sample.value
    return HistogramTotals(total=total, count=count)


class WorkerTotals(BaseModel):
    """The worker's histogram totals at one moment, or their growth: per metric and per stage."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    metrics: dict[str, HistogramTotals]
    stages: dict[str, HistogramTotals]

    @classmethod
    def read(cls, directory: Path) -> WorkerTotals:
        return cls(
            metrics={name: read_histogram(directory, name) for name in WORKER_METRICS},
            stages={stage: read_histogram(directory, STAGE_METRIC, stage) for stage in STAGE_NAMES},
        )

    def minus(self, before: WorkerTotals) -> WorkerTotals:
        """The growth of every histogram since `before`."""
        return WorkerTotals(
            metrics={name: totals.minus(before.metrics[name]) for name, totals in self.metrics.items()},
            stages={name: totals.minus(before.stages[name]) for name, totals in self.stages.items()},
        )

    def plus(self, other: WorkerTotals) -> WorkerTotals:
        """Both growths pooled (repeats of one policy at one temperature)."""
        return WorkerTotals(
            metrics={name: totals.plus(other.metrics[name]) for name, totals in self.metrics.items()},
            stages={name: totals.plus(other.stages[name]) for name, totals in self.stages.items()},
        )
