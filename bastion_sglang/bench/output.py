"""The report's outputs: `bench.json`, `bench.png` and the tables on stdout.

Outputs in `--out`: `bench.json` (`BenchReport`), `bench.png` (median decode tokens/s with min-max error bars,
and τ, per policy, grouped by temperature), and the tables and per-temperature summary on stdout.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

from bastion_sglang.bench.histograms import STAGE_NAMES
from bastion_sglang.bench.report import BenchReport, BenchRow, TemperatureSummary

REPORT_NAME = "bench.json"
PLOT_NAME = "bench.png"


def _number(value: float | None, digits: int) -> str:
    return "-" if value is None else f"{value:.{digits}f}"


def _percent(value: float | None) -> str:
    return "-" if value is None else f"{100 * value:+.1f}%"


def _rate_table(rows: Sequence[BenchRow]) -> list[str]:
    """Median decode tokens/s with min and max, median wall tokens/s, token latency, speedup, τ, budget."""
    header = (
        f"{'policy':<12} {'T':>5} {'decode/s':>9} {'min':>8} {'max':>8} {'wall/s':>8} {'p50_ms':>7} "
        f"{'p90_ms':>7} {'speedup':>8} {'tau':>6} {'budget':>7} {'tokens':>8}"
    )
    lines = [header, "-" * len(header)]
    for row in rows:
        decode = row.decode_tokens_per_second
        lines.append(
            f"{row.policy:<12} {row.temperature:>5g} {decode.median:>9.1f} {decode.min:>8.1f} "
            f"{decode.max:>8.1f} {row.tokens_per_second.median:>8.1f} {row.token_latency_p50_ms:>7.2f} "
            f"{row.token_latency_p90_ms:>7.2f} {_number(row.speedup, 2):>8} {row.mean_accept_length:>6.2f} "
            f"{_number(row.mean_budget, 1):>7} {row.completion_tokens:>8d}"
        )
    return lines


def _estimate_table(rows: Sequence[BenchRow]) -> list[str]:
    """The controller's estimate against what happened, for the rows that have one (none: no lines)."""
    estimated = [row for row in rows if row.mean_expected_accept_length is not None]
    if not estimated:
        return []
    header = (
        f"{'policy':<12} {'T':>5} {'Â':>6} {'Â raw':>6} {'real':>6} {'err':>7} {'raw err':>8} "
        f"{'lat MAPE':>9} {'Ŝ':>6} {'S real':>6}"
    )
    lines = ["", "controller estimate per request per step", header, "-" * len(header)]
    for row in estimated:
        mape = "-" if row.latency_mape is None else f"{100 * row.latency_mape:.1f}%"
        lines.append(
            f"{row.policy:<12} {row.temperature:>5g} {_number(row.mean_expected_accept_length, 2):>6} "
            f"{_number(row.mean_expected_accept_length_raw, 2):>6} "
            f"{_number(row.realised_accept_length, 2):>6} {_percent(row.accept_error):>7} "
            f"{_percent(row.accept_error_raw):>8} {mape:>9} {_number(row.estimated_speedup, 2):>6} "
            f"{_number(row.realised_speedup, 2):>6}"
        )
    return lines


def _stage_table(rows: Sequence[BenchRow]) -> list[str]:
    """Mean ms per decode step of each stage, for the rows that have them (none: no lines)."""
    staged = [(row, row.stage_ms) for row in rows if row.stage_ms is not None]
    if not staged:
        return []
    header = f"{'policy':<12} {'T':>5} " + " ".join(f"{name:>8}" for name in STAGE_NAMES)
    lines = ["", "ms per decode step", header, "-" * len(header)]
    for row, stages in staged:
        values = " ".join(f"{getattr(stages, name):>8.2f}" for name in STAGE_NAMES)
        lines.append(f"{row.policy:<12} {row.temperature:>5g} {values}")
    return lines


def summary_line(summary: TemperatureSummary) -> str:
    """'T=0: best fixed:4 (16.1 tok/s); adaptive 0.97x best, 0.98x ar; per repeat 0.96x best (0.91-1.02),
    0.97x ar (0.93-1.01); noise floor: ar-control 1.00x ar per repeat (0.98-1.03)' (the adaptive parts when it
    ran, the noise floor with `--control`)."""
    rate = summary.best_decode_tokens_per_second
    line = f"T={summary.temperature:g}: best {summary.best_policy} ({rate:.1f} tok/s)"
    ratios = [
        f"{ratio:.2f}x {name}"
        for name, ratio in (("best", summary.adaptive_vs_best), ("ar", summary.adaptive_vs_ar))
        if ratio is not None
    ]
    paired = [
        f"{spread.median:.2f}x {name} ({spread.min:.2f}-{spread.max:.2f})"
        for name, spread in (
            ("best", summary.adaptive_vs_best_per_repeat),
            ("ar", summary.adaptive_vs_ar_per_repeat),
        )
        if spread is not None
    ]
    control = summary.control_vs_ar_per_repeat
    noise = ""
    if control is not None:
        spread = f"({control.min:.2f}-{control.max:.2f})"
        noise = f"; noise floor: ar-control {control.median:.2f}x ar per repeat {spread}"
    if not ratios:
        return line + noise
    per_repeat = f"; per repeat {', '.join(paired)}" if paired else ""
    return f"{line}; adaptive {', '.join(ratios)}{per_repeat}{noise}"


def format_table(report: BenchReport) -> str:
    """The rows as fixed-width text tables (one line per policy × temperature), then the best policy in
    hindsight per temperature."""
    rows = report.rows
    lines = [
        *_rate_table(rows),
        *_estimate_table(rows),
        *_stage_table(rows),
        "",
        f"best in hindsight by median decode tokens/s over {report.settings.repeats} repeats",
        *(summary_line(summary) for summary in report.summaries),
    ]
    return "\n".join(lines)


def plot_report(report: BenchReport, path: Path) -> Path:
    """Bar charts of median decode tokens/s with min-max error bars (top) and τ (bottom): one group per
    temperature, one bar per policy (PNG)."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    policies = list(report.settings.policies)
    temperatures = list(report.settings.temperatures)
    by_key = {(row.policy, row.temperature): row for row in report.rows}
    figure = Figure(figsize=(max(6.0, 1.2 * len(policies) * len(temperatures) + 2), 7), layout="constrained")
    FigureCanvasAgg(figure)
    top, bottom = figure.subplots(2, 1, sharex=True)
    width = 0.8 / len(policies)
    for i, policy in enumerate(policies):
        xs = [t + (i - (len(policies) - 1) / 2) * width for t in range(len(temperatures))]
        rates = [by_key[(policy, temperature)].decode_tokens_per_second for temperature in temperatures]
        medians = [rate.median for rate in rates]
        spread = [[rate.median - rate.min for rate in rates], [rate.max - rate.median for rate in rates]]
        top.bar(xs, medians, width, yerr=spread, capsize=3, label=policy)
        taus = [by_key[(policy, temperature)].mean_accept_length for temperature in temperatures]
        bottom.bar(xs, taus, width, label=policy)
    top.set_ylabel("decode tokens/s (median, min-max)")
    bottom.set_ylabel("mean accepted length τ")
    bottom.set_xticks(range(len(temperatures)), [f"T = {t:g}" for t in temperatures])
    top.legend(ncols=min(len(policies), 4), fontsize="small")
    settings = report.settings
    top.set_title(
        f"{Path(settings.model_path).name} on {report.device}: {settings.num_prompts} "
        f"{Path(settings.prompts).name} prompts, concurrency {settings.concurrency}, "
        f"{settings.repeats} repeats",
        fontsize="medium",
    )
    path.parent.mkdir(parents=True, exist_ok=True)
    figure.savefig(path, dpi=120)
    return path


def write_outputs(report: BenchReport, out: Path) -> tuple[Path, Path]:
    """Write `bench.json` and `bench.png` into `out`; returns their paths."""
    out.mkdir(parents=True, exist_ok=True)
    json_path = out / REPORT_NAME
    json_path.write_text(report.model_dump_json(indent=2) + "\n", encoding="utf-8")
    return json_path, plot_report(report, out / PLOT_NAME)
