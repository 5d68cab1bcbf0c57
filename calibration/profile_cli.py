"""`bastion profile`: read calibration profiles.

    bastion profile show PATH                  # one profile: identity, fit, errors, grid, step costs
    bastion profile show auto --model-path M --attention-backend B [RUNTIME OPTIONS] [--store DIR]
                                             # the profile the server would pick for that deployment
    bastion profile list [--store DIR]         # every profile of the store, one row each
    bastion profile list --model-path M --attention-backend B [RUNTIME OPTIONS] [--store DIR]
                                             # the same rows, saying which one that server loads and why

RUNTIME OPTIONS describe the server as `calibration.identity` matches it: --draft-model-path, --dtype,
--tp, --engine, --device, --quantization, --kv-cache-dtype, --page-size, --cuda-graphs, --load-format,
--synthetic-acceptance, --sglang-version (default: the installed SGLang's). `show auto` and `list` resolve
exactly as the server does (`lookup.resolve_latency_profile`) and print its reason and warnings.
Exit status 0; 1 when `show auto` finds no profile; 2 for an unreadable profile or a bad argument.
"""

from __future__ import annotations

import argparse
import logging
from pathlib import Path

from bastion_sglang.calibration.identity import (
    KV_DTYPE_NAMES,
    RuntimeIdentity,
    config_dtype,
    detect_device,
    dtype_name,
    installed_version,
    parse_dtype,
    recorded_settings,
)
from bastion_sglang.calibration.lookup import AUTO, ResolvedProfile, resolve_latency_profile
from bastion_sglang.calibration.store import ProfileStore, StoreEntry, plot_path_for
from bastion_sglang.controller.latency import LeaveOutFold, LeaveOutReport
from bastion_sglang.controller.profile import (
    CalibrationProfile,
    MadeBy,
    ProfileError,
    ServingSettings,
    load_profile,
)

logger = logging.getLogger(__name__)

HELP = "Show one calibration profile, the one a deployment would use, or list the profile store."


def _ms(seconds: float) -> str:
    return f"{seconds * 1e3:.3f} ms"


def _range(values: list[int]) -> str:
    return f"{values[0]}..{values[-1]} ({len(values)})" if values else "none"


def _percent(value: float | None) -> str:
    return "-" if value is None else f"{value:.1%}"


def _worst(folds: list[LeaveOutFold], name: str) -> str:
    if not folds:
        return ""
    worst = max(folds, key=lambda fold: fold.mape)
    return f" (worst {name}={worst.held_out}: {worst.mape:.1%})"


def leave_out_summary(report: LeaveOutReport | None) -> str:
    """One line: MAPE with whole widths left out, whole contexts left out, decode contexts left out."""
    if report is None:
        return "held out   not validated"
    return (
        f"held out   widths left out MAPE {_percent(report.mape_widths)}{_worst(report.widths, 's')}; "
        f"contexts left out MAPE {_percent(report.mape_contexts)}{_worst(report.contexts, 'c')}; "
        f"decode contexts left out MAPE {_percent(report.mape_decode_contexts)}"
    )


def leave_out_lines(report: LeaveOutReport | None) -> list[str]:
    """The leave-out validation fold by fold: MAPE of each left-out width and context."""
    if report is None:
        return ["no leave-out validation"]
    lines = []
    for title, name, folds, overall in (
        ("verify, one width left out", "s", report.widths, report.mape_widths),
        ("verify, one context left out", "c", report.contexts, report.mape_contexts),
        ("plain decode, one context left out", "c", report.decode_contexts, report.mape_decode_contexts),
    ):
        if not folds:
            continue
        cells = ", ".join(f"{name}={fold.held_out} {fold.mape:.1%}" for fold in folds)
        lines.append(f"{title}: MAPE {_percent(overall)}; {cells}")
    return lines


MADE_BY_WORDS: dict[MadeBy, str] = {
    "calibrate": "bastion calibrate",
    "startup-quick": "a server's quick start-up calibration",
    "startup-full": "a server's full start-up calibration",
}
"""How `profile show` names each `ProfileMetadata.made_by`."""


def describe_profile(profile: CalibrationProfile, path: Path | None) -> list[str]:
    """Lines summarising a profile: identity, measured peaks, fit, errors, grid, step costs."""
    meta, fit, report, costs = profile.metadata, profile.fit, profile.report, profile.step_costs
    widths = sorted({s.s for s in profile.samples if s.mode == "verify"})
    contexts = sorted({s.c for s in profile.samples if s.mode == "verify"})
    plot = plot_path_for(path) if path is not None and meta.made_by == "calibrate" else None  # start-up: none
    hardware = profile.hardware
    lines = [
        f"profile    {path if path is not None else '(not saved)'}",
        f"device     {meta.device_name} (driver {meta.driver_version or '-'}, "
        f"CUDA {meta.cuda_version or '-'})",
        f"engine     {meta.engine} (sglang {meta.sglang_version or '-'}), "
        f"attention {meta.attention_backend}, tp {meta.tp_size}",
        f"model      {meta.model_path} (config {meta.model_config_hash[:12]}), dtype {meta.dtype}",
        f"created    {meta.created_at.isoformat(timespec='seconds')} by {MADE_BY_WORDS[meta.made_by]}",
        f"serving    {settings_words(profile)}",
        f"drafter    {drafter_words(profile)}",
        f"peaks      {hardware.peak_flops / 1e12:.3f} TFLOP/s, {hardware.bandwidth / 1e9:.1f} GB/s "
        f"(measured), {profile.bytes_per_element:g} bytes/element",
        f"fit        T = {_ms(fit.beta_fixed)} + {fit.alpha_gemm:.4g}·G + "
        f"{fit.alpha_tok * 1e6:.4g} µs·min(T, T*) + {fit.alpha_attn:.4g}·ΣF + {fit.alpha_kv:.4g}·ΣK "
        f"(T* = {profile.roofline().gemm_ridge_tokens():.3g} tokens)",
        "decode     "
        + (
            "not measured (priced as a verify of one token)"
            if fit.decode is None
            else f"L_AR = {_ms(fit.decode.beta)} + {fit.decode.alpha_attn:.4g}·A(1, c)"
        ),
        f"error      raw roofline RMSE {_ms(report.rmse_raw)}, MAPE {report.mape_raw:.1%}; calibrated RMSE "
        f"{_ms(report.rmse_fit)}, MAPE {report.mape_fit:.1%} ({report.num_samples} samples); decode MAPE "
        f"raw {_percent(report.mape_decode_raw)}, fit {_percent(report.mape_decode_fit)} "
        f"({report.num_decode_samples} samples)",
        leave_out_summary(profile.leave_out),
        f"grid       widths {_range(widths)}, contexts {_range(contexts)}, max context {profile.max_context}",
        f"steps      T_draft {_ms(costs.t_draft)}, T_aux {_ms(costs.t_aux)} + "
        f"{costs.t_aux_per_token * 1e6:.4g} µs·tokens, L_AR {_ms(costs.l_ar)}",
    ]
    if plot is not None:
        lines.append(f"plot       {plot if plot.is_file() else f'{plot} (missing)'}")
    return lines


def marks_words(profile: CalibrationProfile) -> str:
    """'dummy-weights, synthetic-acceptance', '-' without marks, or 'unknown' where the settings (which
    carry the marks) were not recorded."""
    recorded = recorded_settings(profile)
    if isinstance(recorded, str):
        return "unknown"
    return ", ".join(recorded.marks) or "-"


def settings_words(profile: CalibrationProfile) -> str:
    """The serving settings a profile was measured under, or why they are not known."""
    recorded = recorded_settings(profile)
    if isinstance(recorded, str):
        return recorded
    inferred = "" if profile.metadata.settings is not None else " (inferred: not recorded)"
    marks = ", ".join(recorded.marks)
    return (
        f"quantization {recorded.quantization or 'none'}, kv cache {recorded.kv_cache_dtype}, page size "
        f"{recorded.page_size}, cuda graphs {'on' if recorded.cuda_graphs else 'off'}, load format "
        f"{recorded.load_format}"
        + (f"; MARKED {marks}: never loaded by a serving runtime" if marks else "")
        + inferred
    )


def drafter_words(profile: CalibrationProfile) -> str:
    """The drafter whose acceptance the profile measured, and whether it holds a map."""
    meta = profile.metadata
    held = "an acceptance map" if profile.acceptance is not None else "no acceptance map"
    if meta.drafter_weights_hash is None:
        return (
            f"not recorded; {held} (applies to no drafter)" if profile.acceptance else f"not recorded; {held}"
        )
    return f"{meta.draft_model_path or '-'} (weights {meta.drafter_weights_hash[:12]}); {held}"


def _table(header: list[str], rows: list[list[str]]) -> list[str]:
    widths = [max(len(row[i]) for row in [header, *rows]) for i in range(len(header))]
    return [
        "  ".join(cell.ljust(width) for cell, width in zip(row, widths, strict=True)).rstrip()
        for row in [header, *rows]
    ]


def list_lines(
    store: ProfileStore, entries: list[StoreEntry], resolved: ResolvedProfile | None = None
) -> list[str]:
    """The `profile list` table (or a line saying the store is empty). resolved: what a given server
    resolves to: its latency profile's row is marked "loads", its acceptance profile's "acceptance", and a
    last line says why."""
    if not entries:
        return [f"no profiles in {store.root}"]
    rows = []
    for entry in entries:
        if entry.profile is None:
            detail = entry.error.detail if entry.error is not None else "unreadable"
            rows.append(["INVALID", *["-"] * 11, f"{entry.path.name}: {detail}"])
            continue
        meta, report = entry.profile.metadata, entry.profile.report
        chosen = []
        if resolved is not None and entry.path == resolved.path:
            chosen.append("loads")
        if resolved is not None and entry.path == resolved.acceptance_path:
            chosen.append("acceptance")
        rows.append(
            [
                meta.created_at.strftime("%Y-%m-%d %H:%M"),
                meta.device_name,
                Path(meta.model_path).name,
                meta.dtype,
                meta.attention_backend,
                str(meta.tp_size),
                meta.engine,
                meta.made_by,
                marks_words(entry.profile),
                Path(meta.draft_model_path).name if meta.draft_model_path else "-",
                f"{report.rmse_fit * 1e3:.3f} ms / {report.mape_fit:.1%}",
                "+".join(chosen) or "-",
                entry.path.name,
            ]
        )
    header = [
        "created",
        "device",
        "model",
        "dtype",
        "attention",
        "tp",
        "engine",
        "made by",
        "marks",
        "drafter",
        "fit RMSE/MAPE",
        "server",
        "file",
    ]
    lines = [f"store {store.root}", *_table(header, rows)]
    if resolved is not None:
        lines.append(f"this server: {resolved.reason}")
    return lines


def _add_runtime_arguments(parser: argparse.ArgumentParser) -> None:
    """The options that describe a server for a lookup (module docstring)."""
    parser.add_argument("--model-path", help="the target model folder (its config.json is hashed)")
    parser.add_argument("--draft-model-path", help="the drafter (its weights are hashed for its acceptance)")
    parser.add_argument("--dtype", help="the target dtype (default: the config's dtype)")
    parser.add_argument("--attention-backend", help="the server's attention backend")
    parser.add_argument("--tp", type=int, default=1, help="tensor-parallel size (default 1)")
    parser.add_argument("--engine", choices=("sglang", "reference"), help="only profiles of this engine")
    parser.add_argument("--device", choices=("cuda", "cpu"), help="the device (default: cuda if present)")
    parser.add_argument("--quantization", help="SGLang's --quantization (default: none)")
    parser.add_argument("--kv-cache-dtype", default="auto", help="SGLang's --kv-cache-dtype (default auto)")
    parser.add_argument("--page-size", type=int, default=1, help="SGLang's --page-size (default 1)")
    parser.add_argument(
        "--cuda-graphs", action="store_true", help="the server replays CUDA graphs (default: eager)"
    )
    parser.add_argument("--load-format", default="auto", help="SGLang's --load-format (default auto)")
    parser.add_argument(
        "--synthetic-acceptance", action="store_true", help="the server rewrites its drafts (a bench)"
    )
    parser.add_argument(
        "--draft-vocab-size",
        type=int,
        help="tokens the server's draft step scores (its --bastion-draft-vocab file's ids; default: all)",
    )
    parser.add_argument("--sglang-version", help="default: the installed SGLang's (engine sglang)")
    parser.add_argument("--store", help="the profile store folder (default: see `bastion calibrate -h`)")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    sub = parser.add_subparsers(dest="profile_command", required=True, metavar="ACTION")
    show = sub.add_parser(
        "show", help="print one profile's summary", description="Print a profile's summary."
    )
    show.add_argument("profile", metavar="PATH|auto", help="a profile file, or 'auto' to look one up")
    _add_runtime_arguments(show)
    listing = sub.add_parser(
        "list",
        help="list the profile store",
        description="List the profile store; with --model-path and --attention-backend, say which profile "
        "that server loads and why.",
    )
    _add_runtime_arguments(listing)


def _auto_identity(args: argparse.Namespace) -> RuntimeIdentity:
    if args.model_path is None or args.attention_backend is None:
        raise ValueError("a lookup needs --model-path and --attention-backend")
    device = detect_device(args.device)
    dtype = parse_dtype(args.dtype) if args.dtype else config_dtype(args.model_path)
    kv = args.kv_cache_dtype
    settings = ServingSettings(
        quantization=args.quantization or None,
        kv_cache_dtype=dtype_name(dtype) if kv == "auto" else KV_DTYPE_NAMES.get(kv, kv),
        page_size=args.page_size,
        cuda_graphs=args.cuda_graphs,
        load_format=args.load_format,
        synthetic_acceptance=args.synthetic_acceptance,
        draft_vocab_size=args.draft_vocab_size,
    )
    sglang = args.sglang_version or (installed_version("sglang") if args.engine != "reference" else None)
    return RuntimeIdentity.for_runtime(
        device=device,
        model_path=args.model_path,
        dtype=dtype,
        attention_backend=args.attention_backend,
        tp_size=args.tp,
        engine=args.engine,
        draft_model_path=args.draft_model_path,
        settings=settings,
        sglang_version=sglang,
    )


def _show(args: argparse.Namespace) -> int:
    if args.profile.strip().lower() != AUTO:
        for line in describe_profile(load_profile(args.profile), Path(args.profile)):
            print(line)
        return 0
    store = ProfileStore.locate(args.store)
    resolved = resolve_latency_profile(AUTO, _auto_identity(args), store)
    for warning in resolved.warnings:
        print(f"warning: {warning}")
    print(f"why        {resolved.reason}")
    if resolved.profile is None:
        return 1
    print(f"source     {resolved.source.value}")
    for line in describe_profile(resolved.profile, resolved.path):
        print(line)
    return 0


def _list(args: argparse.Namespace) -> int:
    store = ProfileStore.locate(args.store)
    resolved = None
    if args.model_path is not None or args.attention_backend is not None:
        resolved = resolve_latency_profile(AUTO, _auto_identity(args), store)
    for line in list_lines(store, store.list_profiles(), resolved):
        print(line)
    return 0


def run(args: argparse.Namespace) -> int:
    try:
        return _show(args) if args.profile_command == "show" else _list(args)
    except (ValueError, ProfileError) as error:
        logger.error("%s", error)
        return 2
