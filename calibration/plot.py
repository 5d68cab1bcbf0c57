"""The calibration plot: measured vs fitted verify latency, one panel per context length (PNG).

Each panel (c cached tokens) shows against the verified tokens s (log scale): the measured medians
(dots), the calibrated fit (`controller.latency`: β_fixed + α_gemm·G + α_narrow·min(s, T*) + α_tok·s +
α_attn·F + α_kv·K; solid) and the bare roofline on the measured peaks (dashed), in milliseconds. A last
panel shows plain decoding against the context: measured L_AR (dots), its fit (solid) and the roofline of
one token (dashed). The title names the device, model,
engine, the RMSE / MAPE of both, and the MAPE with whole widths and whole contexts left out of the fit.
Drawn with matplotlib's object API on an Agg canvas (no global pyplot state).
"""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np
from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure

from bastion_sglang.controller.latency import LatencyModel
from bastion_sglang.controller.profile import CalibrationProfile

PANEL_COLUMNS = 4
PANEL_SIZE = (3.6, 2.8)
"""Inches per panel (width, height)."""
CURVE_POINTS = 64
"""Points of the fitted and roofline curves per panel (log-spaced widths)."""


def _curve_widths(low: int, high: int) -> list[int]:
    """Distinct integer widths, log-spaced from low to high inclusive."""
    values = np.unique(np.round(np.geomspace(low, high, CURVE_POINTS)).astype(np.int64))
    return [int(v) for v in values]


def _percent(value: float | None) -> str:
    return "-" if value is None else f"{value:.1%}"


def plot_profile(profile: CalibrationProfile, path: str | Path) -> Path:
    """Draw `profile` (module docstring) and save it as a PNG at `path`; returns the path."""
    roofline = profile.roofline()
    model = LatencyModel(roofline, profile.fit)  # no buckets, no online correction: the offline fit
    verify = [sample for sample in profile.samples if sample.mode == "verify"]
    decode = sorted((x.c, x.seconds) for x in profile.samples if x.mode == "decode" and x.batch == 1)
    contexts = sorted({sample.c for sample in verify})
    panels = len(contexts) + (1 if decode else 0)
    columns = min(PANEL_COLUMNS, panels)
    rows = math.ceil(panels / columns)
    figure = Figure(figsize=(PANEL_SIZE[0] * columns, PANEL_SIZE[1] * rows + 0.8), layout="constrained")
    FigureCanvasAgg(figure)
    axes = figure.subplots(rows, columns, squeeze=False).ravel()
    for index, context in enumerate(contexts):
        ax = axes[index]
        points = sorted((s.s, s.seconds) for s in verify if s.c == context and s.batch == 1)
        if not points:
            ax.set_visible(False)
            continue
        widths = _curve_widths(points[0][0], points[-1][0])
        fitted = [model.predict(w, context) for w in widths]
        raw = [roofline.verify_seconds(w, context) for w in widths]
        ax.plot(
            [p[0] for p in points], [p[1] * 1e3 for p in points], "o", ms=3.5, color="C0", label="measured"
        )
        ax.plot(widths, [t * 1e3 for t in fitted], "-", color="C1", label="calibrated fit")
        ax.plot(widths, [t * 1e3 for t in raw], "--", color="C2", label="raw roofline")
        ax.set_xscale("log", base=2)
        ax.set_title(f"c = {context}", fontsize=9)
        ax.set_xlabel("verified tokens s", fontsize=8)
        ax.set_ylabel("verify latency (ms)", fontsize=8)
        ax.tick_params(labelsize=7)
        ax.grid(True, alpha=0.3)
        if index == 0:
            ax.legend(fontsize=7)
    if decode:
        ax = axes[len(contexts)]
        curve = _curve_widths(decode[0][0], decode[-1][0]) if decode[0][0] > 0 else [c for c, _ in decode]
        measured_ms = [t * 1e3 for _, t in decode]
        ax.plot([c for c, _ in decode], measured_ms, "o", ms=3.5, color="C0", label="measured")
        ax.plot(curve, [model.predict_plain(c) * 1e3 for c in curve], "-", color="C1", label="fit")
        ax.plot(curve, [roofline.verify_seconds(1, c) * 1e3 for c in curve], "--", color="C2", label="raw")
        ax.set_xscale("log", base=2)
        ax.set_title("plain decode (L_AR)", fontsize=9)
        ax.set_xlabel("cached tokens c", fontsize=8)
        ax.set_ylabel("decode latency (ms)", fontsize=8)
        ax.tick_params(labelsize=7)
        ax.grid(True, alpha=0.3)
    for ax in axes[panels:]:
        ax.set_visible(False)
    meta, report, held = profile.metadata, profile.report, profile.leave_out
    held_out = (
        ""
        if held is None
        else f"; left out: widths MAPE {_percent(held.mape_widths)}, contexts {_percent(held.mape_contexts)}"
    )
    figure.suptitle(
        f"{meta.device_name} · {Path(meta.model_path).name} · {meta.dtype} · {meta.engine}/"
        f"{meta.attention_backend}\nraw roofline RMSE {report.rmse_raw * 1e3:.3f} ms, MAPE "
        f"{report.mape_raw:.1%}; calibrated RMSE {report.rmse_fit * 1e3:.3f} ms, MAPE {report.mape_fit:.1%}"
        f"{held_out}",
        fontsize=10,
    )
    out = Path(path)
    out.parent.mkdir(parents=True, exist_ok=True)
    figure.savefig(out, format="png", dpi=110)
    return out
