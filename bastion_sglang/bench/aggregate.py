"""The report's rows over the repeats, the speedups over `ar`, and the best policy per temperature.

The rules (medians of the rates, pooled totals for the rest, ratios of those for the histogram means) are
defined in `bench.report`.
"""

from __future__ import annotations

import functools
import statistics
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from bastion_sglang.bench.histograms import (
    ESTIMATED_SPEEDUP_METRIC,
    EXPECTED_METRIC,
    EXPECTED_RAW_METRIC,
    LATENCY_ERROR_METRIC,
    REALISED_METRIC,
    REALISED_SPEEDUP_METRIC,
    STAGE_NAMES,
    TREE_NODES_METRIC,
    WorkerTotals,
)
from bastion_sglang.bench.measure import TemperatureRun
from bastion_sglang.bench.plan import CONTROL
from bastion_sglang.bench.report import BenchRow, Spread, StageMs, TemperatureSummary


@dataclass(frozen=True)
class EstimateSummary:
    """What the worker's histogram growth says about the steps it covers (defined in `bench.report`)."""

    mean_budget: float | None
    expected: float | None
    expected_raw: float | None
    realised: float | None
    latency_mape: float | None
    estimated_speedup: float | None
    realised_speedup: float | None
    stage_ms: StageMs | None

    @classmethod
    def of(cls, growth: WorkerTotals) -> EstimateSummary:
        """Σ `_sum` growth / Σ `_count` growth of each histogram; stage means in ms (None: no verify step)."""
        stage_means = {stage: growth.stages[stage].mean() for stage in STAGE_NAMES}
        stage_ms = (
            None
            if stage_means["verify"] is None
            else StageMs(**{stage: 1e3 * (value or 0.0) for stage, value in stage_means.items()})
        )
        return cls(
            mean_budget=growth.metrics[TREE_NODES_METRIC].mean(),
            expected=growth.metrics[EXPECTED_METRIC].mean(),
            expected_raw=growth.metrics[EXPECTED_RAW_METRIC].mean(),
            realised=growth.metrics[REALISED_METRIC].mean(),
            latency_mape=growth.metrics[LATENCY_ERROR_METRIC].mean(),
            estimated_speedup=growth.metrics[ESTIMATED_SPEEDUP_METRIC].mean(),
            realised_speedup=growth.metrics[REALISED_SPEEDUP_METRIC].mean(),
            stage_ms=stage_ms,
        )


def ratio(numerator: float | None, denominator: float | None) -> float | None:
    """numerator / denominator; None when either is missing or the denominator is 0."""
    return None if numerator is None or not denominator else numerator / denominator


def _relative_error(expected: float | None, realised: float | None) -> float | None:
    """expected / realised - 1; None when either is missing or realised is 0."""
    quotient = ratio(expected, realised)
    return None if quotient is None else quotient - 1.0


def _estimate_fields(estimate: EstimateSummary | None) -> dict[str, Any]:
    """The `BenchRow` fields of the controller's estimate (the row's defaults, None, without one)."""
    if estimate is None:
        return {"mean_budget": None}
    return {
        "mean_budget": estimate.mean_budget,
        "mean_expected_accept_length": estimate.expected,
        "mean_expected_accept_length_raw": estimate.expected_raw,
        "realised_accept_length": estimate.realised,
        "accept_error": _relative_error(estimate.expected, estimate.realised),
        "accept_error_raw": _relative_error(estimate.expected_raw, estimate.realised),
        "latency_mape": estimate.latency_mape,
        "estimated_speedup": estimate.estimated_speedup,
        "realised_speedup": estimate.realised_speedup,
        "stage_ms": estimate.stage_ms,
    }


def make_row(policy: str, temperature: float, runs: Sequence[TemperatureRun]) -> BenchRow:
    """The report row of one policy at one temperature from its repeats, in repeat order (`bench.report`:
    medians of the rates, pooled totals for the rest); speedups are filled in by `with_speedups`."""
    per_repeat = tuple(run.measurement for run in runs)
    completion = sum(m.completion_tokens for m in per_repeat)
    passes = [m.verify_passes for m in per_repeat if m.verify_passes is not None]
    verify_passes = sum(passes) if passes else None
    growths = [run.growth for run in runs if run.growth is not None]
    estimate = EstimateSummary.of(functools.reduce(WorkerTotals.plus, growths)) if growths else None
    return BenchRow(
        policy=policy,
        temperature=temperature,
        per_repeat=per_repeat,
        requests=sum(m.requests for m in per_repeat),
        completion_tokens=completion,
        verify_passes=verify_passes,
        decode_tokens_per_second=Spread.of([m.decode_tokens_per_second for m in per_repeat]),
        tokens_per_second=Spread.of([m.tokens_per_second for m in per_repeat]),
        token_latency_p50_ms=statistics.median(m.token_latency_p50_ms for m in per_repeat),
        token_latency_p90_ms=statistics.median(m.token_latency_p90_ms for m in per_repeat),
        mean_accept_length=completion / verify_passes if verify_passes else 1.0,
        speedup=None,
        wall_speedup=None,
        **_estimate_fields(estimate),
    )


def with_speedups(rows: Sequence[BenchRow]) -> tuple[BenchRow, ...]:
    """Rows with `speedup` and `wall_speedup`: their median decode and wall tokens/s over the `ar` row's of
    the same temperature (None where there is none)."""
    decode = {row.temperature: row.decode_tokens_per_second.median for row in rows if row.policy == "ar"}
    wall = {row.temperature: row.tokens_per_second.median for row in rows if row.policy == "ar"}
    return tuple(
        row.model_copy(
            update={
                "speedup": ratio(row.decode_tokens_per_second.median, decode.get(row.temperature)),
                "wall_speedup": ratio(row.tokens_per_second.median, wall.get(row.temperature)),
            }
        )
        for row in rows
    )


def paired_ratios(rates: Sequence[float] | None, baseline: Sequence[float] | None) -> Spread | None:
    """`rates` over `baseline`, repeat by repeat (the same repeats, in order), over the repeats (None: either
    missing, or a baseline rate of 0). Under the interleaved schedule the two ran side by side in every
    repeat, so each ratio is free of the machine's drift between repeats."""
    if rates is None or baseline is None or not all(baseline):
        return None
    return Spread.of([mine / theirs for mine, theirs in zip(rates, baseline, strict=True)])


def summarize_rates(temperature: float, rates: Mapping[str, Sequence[float]]) -> TemperatureSummary:
    """One temperature from each policy's decode tokens/s per repeat (the same repeats, in order): the best
    policy in hindsight by median (the first listed on a tie; never the `--control` Engine), adaptive's median
    over the best's and ar's, its per-repeat ratios to them, and the control's per-repeat ratios to ar."""
    medians = {policy: statistics.median(values) for policy, values in rates.items()}
    best = max((policy for policy in medians if policy != CONTROL.name), key=medians.__getitem__)
    adaptive = rates.get("adaptive")
    return TemperatureSummary(
        temperature=temperature,
        best_policy=best,
        best_decode_tokens_per_second=medians[best],
        adaptive_vs_best=ratio(medians.get("adaptive"), medians[best]),
        adaptive_vs_ar=ratio(medians.get("adaptive"), medians.get("ar")),
        adaptive_vs_best_per_repeat=paired_ratios(adaptive, rates[best]),
        adaptive_vs_ar_per_repeat=paired_ratios(adaptive, rates.get("ar")),
        control_vs_ar_per_repeat=paired_ratios(rates.get(CONTROL.name), rates.get("ar")),
    )


def summarize(rows: Sequence[BenchRow], temperatures: Sequence[float]) -> tuple[TemperatureSummary, ...]:
    """`summarize_rates` per temperature, each row's rates taken from its repeats."""
    return tuple(
        summarize_rates(
            temperature,
            {
                row.policy: [m.decode_tokens_per_second for m in row.per_repeat]
                for row in rows
                if row.temperature == temperature
            },
        )
        for temperature in temperatures
    )
