"""`bastion calibrate`: measure verify and plain decode latency on this device, fit the latency model, store a
profile.

    bastion calibrate --model-path M --draft-model-path D [--engine sglang|reference] [--device cuda|cpu]
        [--attention-backend B] [--tp N] [--max-context C] [--max-width W] [--widths S ...]
        [--batches B ...] [--repeats R] [--warmup R] [--dtype D] [--store DIR] [--out PATH]

Steps: measure the device's peak matmul FLOP/s and copy bandwidth (printed next to its KNOWN_GPUS entry);
load the engine; measure the verify grid and plain decode at every context (`sweep`), fit the latency model
on the measured peaks, measure T_draft, L_AR, T_aux and t_aux_per_token; print the raw and calibrated
RMSE / MAPE and the MAPE with whole widths and whole contexts left out of the fit; unless --no-acceptance,
calibrate the drafter's acceptance on real prompts (`acceptance_run`) and print expected vs realised accept
length, raw and calibrated, on held-out prompts; write the profile (JSON) into the store, or to --out, and
its plot (PNG, same stem) next to it.

Defaults (each logged when taken) are listed in `EPILOG`, which `--help` prints.
Exit status 0 on success, 2 for a bad argument or an unusable model / profile path.
"""

from __future__ import annotations

import argparse
import importlib.metadata
import importlib.util
import logging
from dataclasses import dataclass
from pathlib import Path

import torch

from bastion_sglang.calibration.acceptance_fit import AcceptanceSettings, describe_acceptance
from bastion_sglang.calibration.acceptance_run import measure_acceptance
from bastion_sglang.calibration.engines import REFERENCE_BACKENDS, open_engine
from bastion_sglang.calibration.fitting import build_profile, now_utc
from bastion_sglang.calibration.identity import (
    Engine,
    config_dtype,
    config_file,
    detect_device,
    device_name,
    driver_version,
    dtype_name,
    installed_version,
    model_config_hash,
    parse_dtype,
    plain_settings,
    weights_hash,
)
from bastion_sglang.calibration.microbench import datasheet_comparison, measure_peaks
from bastion_sglang.calibration.profile_cli import describe_profile, leave_out_lines
from bastion_sglang.calibration.store import ProfileStore, plot_path_for
from bastion_sglang.calibration.sweep import (
    SweepSettings,
    check_widths,
    context_grid,
    measure_step_costs,
    measure_verify_grid,
    width_grid,
)
from bastion_sglang.controller.latency import LatencyModel
from bastion_sglang.controller.profile import CalibrationProfile, ProfileError, ProfileMetadata, save_profile
from bastion_sglang.controller.roofline import ModelShape, RooflineModel
from bastion_sglang.integration.config import CHOSEN_BACKENDS

logger = logging.getLogger(__name__)

HELP = "Measure verify and plain decode latency on this device, fit the latency model, store a profile."

DEFAULT_BATCHES = (2, 4, 8, 16, 32, 64)
"""Requests per verify pass the sglang engine measures besides 1 by default."""
DEFAULT_MAX_WIDTH = 1025
"""Widest verify pass measured by default: the server's largest budget (1024 nodes) plus the root."""
DEFAULT_MAX_CONTEXT = 8192
DEFAULT_REPEATS = 10
DEFAULT_WARMUP = 3
EPILOG = """defaults (each logged when taken):
- --device: cuda when torch sees a GPU, else cpu.
- --engine: sglang on CUDA when SGLang is installed, else reference. SGLang on the CPU is measured only
  when asked for (--engine sglang --device cpu): torch_native attention with BASTION's CPU stand-ins, as
  a CPU server runs them.
- --attention-backend: sdpa (reference), triton (sglang on CUDA: a backend BASTION's tree masks need),
  torch_native (sglang on CPU: the only one there).
- --dtype: the dtype the target's config.json declares (an error when it declares none).
- --max-width: 1025, the widest verify pass the server accepts (--bastion-max-budget 1024, plus the root).
- --batches: 2 4 8 16 32 64 with --engine sglang (a server verifies many requests' trees in one pass); the
  reference engine measures one request.
- the store: --store, else $BASTION_PROFILE_STORE, else ~/.cache/bastion-sglang/profiles.
"""


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model-path", required=True, help="target model folder (Hugging Face format)")
    parser.add_argument("--draft-model-path", required=True, help="DFlash drafter folder (z-lab format)")
    parser.add_argument("--engine", choices=("sglang", "reference"), help="measurement back end (see below)")
    parser.add_argument("--device", choices=("cuda", "cpu"), help="default: cuda when a GPU is visible")
    parser.add_argument(
        "--attention-backend",
        help="sglang: triton | flashinfer | torch_native; reference: sdpa | eager (default: see below)",
    )
    parser.add_argument("--tp", type=int, default=1, help="tensor-parallel size (calibration measures 1)")
    parser.add_argument(
        "--max-context",
        type=int,
        default=DEFAULT_MAX_CONTEXT,
        help=f"largest cached context, tokens; default {DEFAULT_MAX_CONTEXT}",
    )
    parser.add_argument(
        "--max-width",
        type=int,
        default=DEFAULT_MAX_WIDTH,
        help=f"widest verify pass, tokens (N_max + 1); default {DEFAULT_MAX_WIDTH}",
    )
    parser.add_argument(
        "--widths", type=int, nargs="+", help="explicit verify widths (overrides --max-width)"
    )
    parser.add_argument(
        "--batches",
        type=int,
        nargs="+",
        help="requests per verify pass to measure besides 1, at the smallest context (--engine sglang; "
        "widths up to 2048 tokens a pass); default 2 4 8 16 32 64 with --engine sglang, none with reference",
    )
    parser.add_argument(
        "--repeats",
        type=int,
        default=DEFAULT_REPEATS,
        help=f"timed runs per point, median taken; default {DEFAULT_REPEATS}",
    )
    parser.add_argument(
        "--warmup", type=int, default=DEFAULT_WARMUP, help=f"untimed runs per point; default {DEFAULT_WARMUP}"
    )
    parser.add_argument("--dtype", help="target dtype, e.g. bfloat16 (default: the config's dtype)")
    parser.add_argument(
        "--load-format",
        choices=("auto", "dummy"),
        default="auto",
        help="SGLang --load-format of the target (--engine sglang): dummy gives it random weights from its "
        "config.json alone, so a model's step costs are measured at its shape without its weights (the "
        "profile's model config hash is the real model's); needs --no-acceptance. Default auto",
    )
    parser.add_argument(
        "--store", help="profile store folder (default: $BASTION_PROFILE_STORE or ~/.cache/...)"
    )
    parser.add_argument("--out", help="write the profile here instead of into the store (PNG next to it)")
    acceptance = parser.add_argument_group(
        "acceptance calibration",
        "The drafter decodes real prompts on the reference engine (T = 0); its path probabilities are mapped "
        "to the acceptance the target realises (per depth), fitted on two thirds of the prompts and scored "
        "on the rest. The server plans with the calibrated values.",
    )
    acceptance.add_argument(
        "--acceptance-prompts",
        default=AcceptanceSettings.prompt_set,
        help="prompt set (sharegpt, mtbench, humaneval: their held-out split) or a JSONL file; "
        f"default {AcceptanceSettings.prompt_set}",
    )
    acceptance.add_argument(
        "--acceptance-num-prompts",
        type=int,
        default=AcceptanceSettings.num_prompts,
        help=f"prompts decoded; default {AcceptanceSettings.num_prompts}",
    )
    acceptance.add_argument(
        "--acceptance-max-new-tokens",
        type=int,
        default=AcceptanceSettings.max_new_tokens,
        help=f"tokens decoded per prompt; default {AcceptanceSettings.max_new_tokens}",
    )
    acceptance.add_argument(
        "--no-acceptance", action="store_true", help="skip the acceptance calibration (latency only)"
    )
    parser.epilog = EPILOG
    parser.formatter_class = argparse.RawDescriptionHelpFormatter


def sglang_installed() -> bool:
    """Whether the sglang package can be imported here."""
    return importlib.util.find_spec("sglang") is not None


def choose_engine(requested: Engine | None, device: torch.device) -> Engine:
    """The engine to measure with (module docstring); logs the choice and why."""
    if requested is not None:
        if requested == "sglang" and not sglang_installed():
            raise ValueError(
                "--engine sglang, but SGLang is not installed (pip install 'bastion-sglang[sglang]')"
            )
        return requested
    if device.type == "cuda" and sglang_installed():
        logger.info("engine: sglang (CUDA device and SGLang installed)")
        return "sglang"
    why = "SGLang is not installed" if device.type == "cuda" else "the device is the CPU"
    logger.info("engine: reference (%s; pass --engine to choose)", why)
    return "reference"


def choose_attention_backend(requested: str | None, engine: Engine, device: torch.device) -> str:
    """The attention backend (module docstring); logs a default when taken."""
    if requested is not None:
        if engine == "reference" and requested not in REFERENCE_BACKENDS:
            raise ValueError(
                f"--attention-backend {requested!r} is not a reference-engine backend; use "
                f"{' or '.join(REFERENCE_BACKENDS)} (or --engine sglang)"
            )
        return requested
    kind = "cuda" if device.type == "cuda" else "cpu"
    backend = "sdpa" if engine == "reference" else CHOSEN_BACKENDS[kind]
    logger.info("attention backend: %s (the %s default on %s)", backend, engine, device.type)
    return backend


@dataclass(frozen=True)
class CalibrationPlan:
    """Everything one calibration run needs, resolved from the command line."""

    model_path: str
    draft_model_path: str
    engine: Engine
    device: torch.device
    dtype: torch.dtype
    attention_backend: str
    tp_size: int
    settings: SweepSettings
    out: Path | None  # the profile's path when given (--out), else None: a file of `store`
    store: ProfileStore | None  # where the profile goes without --out
    acceptance: AcceptanceSettings | None = None  # None: no acceptance calibration
    load_format: str = "auto"  # SGLang's; dummy: random target weights (sglang engine only)

    @property
    def max_context(self) -> int:
        return self.settings.contexts[-1]


def _local_or_hub(path: str) -> str:
    """An existing local path made absolute (profiles name the model wherever they are read), else as given
    (a hub id)."""
    local = Path(path).expanduser()
    return str(local.resolve()) if local.exists() else path


def plan_from_args(args: argparse.Namespace) -> CalibrationPlan:
    """Validate the arguments and take the defaults (module docstring)."""
    config_file(args.model_path)  # the target must be readable before anything is measured
    config_file(args.draft_model_path)
    if importlib.util.find_spec("matplotlib") is None:
        raise ValueError("the calibration plot needs matplotlib: pip install 'bastion-sglang[plot]'")
    if args.tp != 1:
        raise ValueError(f"--tp {args.tp}: calibration measures tensor-parallel size 1 only")
    device = detect_device(args.device)
    engine = choose_engine(args.engine, device)
    backend = choose_attention_backend(args.attention_backend, engine, device)
    if args.dtype is not None:
        dtype = parse_dtype(args.dtype)
    else:
        dtype = config_dtype(args.model_path)
        logger.info("dtype: %s (declared by the target's config.json)", dtype_name(dtype))
    if args.load_format != "auto":
        if engine != "sglang":
            raise ValueError(f"--load-format {args.load_format} needs --engine sglang (SGLang's loader)")
        if not args.no_acceptance:
            raise ValueError(
                f"--load-format {args.load_format}: the acceptance calibration decodes real prompts with the "
                "target's weights; add --no-acceptance"
            )
    widths = check_widths(args.widths) if args.widths else width_grid(args.max_width)
    settings = SweepSettings(
        widths=widths,
        contexts=context_grid(args.max_context),
        warmup=args.warmup,
        repeats=args.repeats,
        batches=batch_sizes(args.batches, engine),
    )
    out = Path(args.out) if args.out else None
    acceptance = (
        None
        if args.no_acceptance
        else AcceptanceSettings(
            prompt_set=args.acceptance_prompts,
            num_prompts=args.acceptance_num_prompts,
            max_new_tokens=args.acceptance_max_new_tokens,
        )
    )
    return CalibrationPlan(
        model_path=_local_or_hub(args.model_path),
        draft_model_path=_local_or_hub(args.draft_model_path),
        engine=engine,
        device=device,
        dtype=dtype,
        attention_backend=backend,
        tp_size=args.tp,
        settings=settings,
        out=out,
        store=None if out is not None else ProfileStore.locate(args.store),
        acceptance=acceptance,
        load_format=args.load_format,
    )


def batch_sizes(asked: list[int] | None, engine: Engine) -> tuple[int, ...]:
    """The grid's batch sizes: 1 and --batches (default DEFAULT_BATCHES with the sglang engine, none with the
    reference engine, which measures one request). ValueError for a batch < 1 or batches on the reference
    engine."""
    if asked is None:
        return (1, *DEFAULT_BATCHES) if engine == "sglang" else (1,)
    if any(b < 1 for b in asked):
        raise ValueError(f"--batches must be ints >= 1, got {asked}")
    batches = tuple(sorted({1, *asked}))
    if engine != "sglang" and batches != (1,):
        raise ValueError(
            f"--batches {' '.join(map(str, asked))} needs --engine sglang (the reference engine "
            "measures one request)"
        )
    return batches


@dataclass(frozen=True)
class CalibrationResult:
    """What a calibration run wrote."""

    profile: CalibrationProfile
    profile_path: Path
    plot_path: Path


def calibrate(plan: CalibrationPlan) -> CalibrationResult:
    """Measure, fit and write the profile and its plot as `plan` says (module docstring)."""
    settings = plan.settings
    name = device_name(plan.device)
    logger.info("measuring peak matmul FLOP/s and copy bandwidth of %s", name)
    peaks = measure_peaks(plan.device, plan.dtype, name)
    for line in datasheet_comparison(peaks):
        print(line)
    hardware = peaks.hardware_spec()
    shape = ModelShape.from_hf_config(config_file(plan.model_path))
    element_bytes = plan.dtype.itemsize
    logger.info(
        "loading the %s engine: target %s%s, drafter %s (%s, %s attention)",
        plan.engine,
        plan.model_path,
        " (random weights: --load-format dummy)" if plan.load_format == "dummy" else "",
        plan.draft_model_path,
        dtype_name(plan.dtype),
        plan.attention_backend,
    )
    engine = open_engine(
        plan.engine,
        target_path=plan.model_path,
        draft_path=plan.draft_model_path,
        device=plan.device,
        dtype=plan.dtype,
        attention_backend=plan.attention_backend,
        max_context=plan.max_context,
        max_width=settings.widths[-1],
        max_batch=settings.batches[-1],
        load_format=plan.load_format,
    )
    logger.info(
        "verify grid: widths %s × contexts %s, batches %s, %d warm-up and %d timed runs per point",
        list(settings.widths),
        list(settings.contexts),
        list(settings.batches),
        settings.warmup,
        settings.repeats,
    )
    try:
        draft_vocab_size = engine.draft_vocab_size
        samples = measure_verify_grid(engine, settings)
        fitted = LatencyModel(RooflineModel(shape, hardware, element_bytes)).fit(samples)
        logger.info("measuring T_draft, L_AR and T_aux at context %d", settings.mid_context)
        steps = measure_step_costs(engine, settings, fitted)
        logger.info(
            "T_aux timed with the adaptive policy choosing %d draft nodes: %s",
            steps.aux_nodes,
            ", ".join(
                f"W={w} {t * 1e3:.3f} ms" for w, t in zip(steps.aux_widths, steps.aux_seconds, strict=True)
            ),
        )
    finally:
        engine.close()
    metadata = ProfileMetadata(
        device_name=name,
        driver_version=driver_version(plan.device),
        cuda_version=torch.version.cuda if plan.device.type == "cuda" else None,
        sglang_version=installed_version("sglang") if plan.engine == "sglang" else None,
        engine=plan.engine,
        model_path=plan.model_path,
        model_config_hash=model_config_hash(plan.model_path),
        dtype=dtype_name(plan.dtype),
        attention_backend=plan.attention_backend,
        tp_size=plan.tp_size,
        created_at=now_utc(),
        settings=plain_settings(dtype_name(plan.dtype)).model_copy(
            update={"load_format": plan.load_format, "draft_vocab_size": draft_vocab_size}
        ),
        draft_model_path=plan.draft_model_path if plan.acceptance is not None else None,
        drafter_weights_hash=weights_hash(plan.draft_model_path) if plan.acceptance is not None else None,
    )
    profile = build_profile(
        metadata=metadata,
        shape=shape,
        hardware=hardware,
        bytes_per_element=float(element_bytes),
        samples=samples,
        step_costs=steps.costs,
        max_context=plan.max_context,
    )
    if plan.acceptance is not None:
        profile = with_acceptance(profile, plan, plan.acceptance)
    if plan.out is not None:
        path = plan.out
    elif plan.store is not None:
        path = plan.store.path_for(profile)
    else:
        raise ValueError("a calibration plan needs --out or a profile store")
    save_profile(profile, path)
    from bastion_sglang.calibration.plot import plot_profile  # matplotlib: imported only to draw

    plot = plot_profile(profile, plot_path_for(path))
    logger.info("wrote %s and %s", path, plot)
    return CalibrationResult(profile, path, plot)


def with_acceptance(
    profile: CalibrationProfile, plan: CalibrationPlan, settings: AcceptanceSettings
) -> CalibrationProfile:
    """`profile` with the acceptance calibration measured and fitted as `settings` say; unchanged, with a
    warning that says why, when the drafter and prompts cannot give one (no tokenizer, too few matches)."""
    logger.info(
        "acceptance calibration: %d prompts of %s, %d new tokens each, on the reference engine",
        settings.num_prompts,
        settings.prompt_set,
        settings.max_new_tokens,
    )
    try:
        result = measure_acceptance(
            plan.model_path,
            plan.draft_model_path,
            device=plan.device,
            dtype=plan.dtype,
            settings=settings,
        )
    except (ValueError, OSError) as error:
        logger.warning(
            "no acceptance calibration in this profile (the server will plan with the raw drafter "
            "probabilities, corrected online): %s",
            error,
        )
        return profile
    for line in describe_acceptance(result.report):
        print(line)
    return profile.model_copy(update={"acceptance": result.calibration, "acceptance_report": result.report})


def run(args: argparse.Namespace) -> int:
    try:
        plan = plan_from_args(args)
        result = calibrate(plan)
    except (ValueError, ProfileError) as error:
        logger.error("%s", error)
        return 2
    for line in describe_profile(result.profile, result.profile_path):
        print(line)
    for line in leave_out_lines(result.profile.leave_out):
        print(line)
    return 0
