"""Calibrate a random-weight Qwen3-8B-shaped target on this GPU with `bastion calibrate --engine reference`.

    python benchmarks/calibrate_gpu.py --out results/calibration [--repeats 10] [--scratch DIR]
    python benchmarks/calibrate_gpu.py --out /tmp/calibration-smoke --smoke      # tiny shapes on the CPU
    python benchmarks/calibrate_gpu.py --make-drafter DIR --target-config tools/offline_gpu/models/qwen3-8b

For machines with CUDA but without SGLang (the reference engine measures). Steps:
1. a Qwen3-8B-shaped target with random bf16 weights, made on the device exactly as
   benchmarks/reference_gpu.py makes it (same shape, same constructor: the two benchmarks measure the same
   model), and a random DFlash drafter of the z-lab Qwen3-8B-DFlash-b16 shape (5 layers reading target
   layers 1, 9, 17, 25, 33), both saved in a scratch folder (about 18 GB; deleted afterwards);
2. `bastion calibrate --engine reference` over s in width_grid(1024) (2, 3, 4, 6, 8, ..., 768, 1024) and
   c in 64, 128, ..., 8192 (and a plain decode step at every c), writing profile.json and profile.png into
   --out;
3. errors.json (`CalibrationEvidence`): RMSE and MAPE of the bare roofline on the measured peaks and on the
   datasheet peaks, of the calibrated fit in sample, and the MAPE of fits with each whole width and each
   whole context left out, scored on what was left out (`validate_leave_out`).

`--make-drafter DIR --target-config CONFIG_DIR` only saves the random drafter of step 1 for the target that
CONFIG_DIR's config.json describes (on CUDA when there is one), for SGLang runs of a target without weights
(`--load-format dummy`): `bastion calibrate`, `bastion bench` and `bastion step-anatomy` then measure the
8B-shaped pair with SGLang's own loader, and only the drafter (about 2 GB in bf16) is written.
"""

from __future__ import annotations

import argparse
import gc
import sys
import tempfile
from pathlib import Path

import torch
import transformers
from pydantic import BaseModel, ConfigDict, FiniteFloat
from reference_gpu import QWEN3_8B, TINY, random_target

from bastion_sglang import cli
from bastion_sglang.calibration.identity import device_name
from bastion_sglang.calibration.sweep import context_grid, width_grid
from bastion_sglang.controller.latency import (
    LatencyFit,
    LatencySample,
    LeaveOutReport,
    evaluate_fit,
    validate_leave_out,
)
from bastion_sglang.controller.profile import StepCosts, load_profile
from bastion_sglang.controller.roofline import HardwareSpec, RooflineModel, lookup_gpu
from bastion_sglang.integration.drafter_config import DrafterConfig, default_target_layer_ids
from bastion_sglang.reference import DFlashDrafter

MAX_WIDTH = 1024
MAX_CONTEXT = 8192
DRAFT_LAYERS = 5
"""Layers of the z-lab Qwen3-8B-DFlash-b16 drafter."""
BLOCK_SIZE = 16
SMOKE_MAX_WIDTH = 16
SMOKE_MAX_CONTEXT = 128
SMOKE_DRAFT_LAYERS = 2


class ErrorSummary(BaseModel):
    """Errors of one latency predictor on a set of measured passes."""

    model_config = ConfigDict(frozen=True, strict=True, extra="forbid")

    rmse_ms: FiniteFloat
    mape: FiniteFloat  # fraction


class CalibrationEvidence(BaseModel):
    """errors.json: how well the bare and the calibrated roofline predict the measured verify passes."""

    model_config = ConfigDict(frozen=True, strict=True, extra="forbid")

    device_name: str
    torch_version: str
    transformers_version: str
    model: str
    dtype: str
    widths: list[int]
    contexts: list[int]
    repeats: int
    measured_peaks: HardwareSpec
    datasheet_peaks: HardwareSpec | None  # None: the device has no KNOWN_GPUS entry
    raw_measured_peaks: ErrorSummary
    raw_datasheet_peaks: ErrorSummary | None
    calibrated_in_sample: ErrorSummary
    leave_out: LeaveOutReport  # each whole width, each whole context left out of the fit and predicted
    fit: LatencyFit
    step_costs: StepCosts
    profile: str
    plot: str


def drafter_config_for(config: transformers.PretrainedConfig, layers: int) -> DrafterConfig:
    """The DFlash drafter of `layers` layers and a block of BLOCK_SIZE for a target of this config: the
    target's attention and MLP shape, its vocabulary (mask token: the last id) and DFlash's default feature
    layers (1, 9, 17, 25, 33 for Qwen3-8B's 36 layers with 5 draft layers)."""
    return DrafterConfig(
        hidden_size=config.hidden_size,
        num_hidden_layers=layers,
        num_attention_heads=config.num_attention_heads,
        num_key_value_heads=config.num_key_value_heads,
        head_dim=config.head_dim,
        intermediate_size=config.intermediate_size,
        rms_norm_eps=config.rms_norm_eps,
        rope_theta=float(config.rope_parameters["rope_theta"]),
        vocab_size=config.vocab_size,
        block_size=BLOCK_SIZE,
        num_target_layers=config.num_hidden_layers,
        mask_token_id=config.vocab_size - 1,
        target_layer_ids=default_target_layer_ids(config.num_hidden_layers, layers),
    )


def save_drafter(path: Path, config: DrafterConfig, device: torch.device, dtype: torch.dtype) -> Path:
    """Write a DFlash drafter of `config` with random weights (seed 0) to the folder `path`; returns it."""
    torch.manual_seed(0)
    with torch.device(device):
        drafter = DFlashDrafter(config).to(dtype)
    saved = drafter.save_pretrained(path)
    del drafter
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return saved


def save_pair(folder: Path, device: torch.device, dtype: torch.dtype, smoke: bool) -> tuple[Path, Path]:
    """Write the random target and drafter (module docstring) under `folder`; returns their folders."""
    target = random_target(TINY if smoke else QWEN3_8B, device, dtype)
    config = target.config
    target_path = folder / "target"
    target.save_pretrained(target_path)
    del target
    gc.collect()
    layers = SMOKE_DRAFT_LAYERS if smoke else DRAFT_LAYERS
    return target_path, save_drafter(folder / "draft", drafter_config_for(config, layers), device, dtype)


def make_drafter(path: Path, target_config: Path, layers: int) -> Path:
    """Save the random drafter of `layers` layers for the target whose config.json is in the folder
    `target_config`, in the target's declared dtype, built on CUDA when there is one; returns its folder.
    ValueError naming the folder when it holds no readable config."""
    try:
        config = transformers.AutoConfig.from_pretrained(target_config)
    except (OSError, ValueError) as error:
        raise ValueError(f"--target-config {target_config}: no readable config.json: {error}") from None
    dtype = getattr(config, "dtype", None) or torch.bfloat16
    if isinstance(dtype, str):
        dtype = getattr(torch, dtype)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return save_drafter(path, drafter_config_for(config, layers), device, dtype)


def errors(
    roofline: RooflineModel, fit: LatencyFit, samples: list[LatencySample]
) -> tuple[ErrorSummary, ...]:
    """(bare roofline, fit) errors of `roofline` on `samples`."""
    report = evaluate_fit(roofline, fit, samples)
    return (
        ErrorSummary(rmse_ms=report.rmse_raw * 1e3, mape=report.mape_raw),
        ErrorSummary(rmse_ms=report.rmse_fit * 1e3, mape=report.mape_fit),
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--out", type=Path, help="folder for profile.json/png and errors.json")
    parser.add_argument("--repeats", type=int, default=10, help="timed runs per grid point (median)")
    parser.add_argument(
        "--scratch", type=Path, help="folder for the random model files (default: a temp dir)"
    )
    parser.add_argument("--smoke", action="store_true", help="tiny shapes on the CPU: checks the script")
    parser.add_argument(
        "--make-drafter",
        type=Path,
        metavar="DIR",
        help="only save a random DFlash drafter (block 16) for the target of --target-config into DIR",
    )
    parser.add_argument(
        "--target-config",
        type=Path,
        metavar="DIR",
        help="with --make-drafter: the folder of the target's config.json",
    )
    parser.add_argument(
        "--draft-layers",
        type=int,
        default=DRAFT_LAYERS,
        help=f"with --make-drafter: the drafter's layers (default {DRAFT_LAYERS}, as z-lab's "
        "Qwen3-8B-DFlash-b16)",
    )
    args = parser.parse_args(argv)
    if args.make_drafter is not None:
        if args.target_config is None:
            parser.error("--make-drafter needs --target-config (the folder of the target's config.json)")
        try:
            saved = make_drafter(args.make_drafter, args.target_config, args.draft_layers)
        except ValueError as error:
            parser.error(str(error))
        print(f"wrote the random drafter {saved} for the target {args.target_config}")
        return 0
    if args.out is None:
        parser.error("--out is required (or --make-drafter DIR --target-config DIR)")
    device = torch.device("cpu" if args.smoke else "cuda")
    if device.type == "cuda" and not torch.cuda.is_available():
        parser.error("no CUDA GPU visible; use --smoke for a CPU check")
    dtype = torch.float32 if args.smoke else torch.bfloat16
    widths = width_grid(SMOKE_MAX_WIDTH if args.smoke else MAX_WIDTH)
    contexts = context_grid(SMOKE_MAX_CONTEXT if args.smoke else MAX_CONTEXT)
    args.out.mkdir(parents=True, exist_ok=True)
    profile_path = args.out / "profile.json"
    if args.scratch is not None:
        args.scratch.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=args.scratch) as scratch:
        target_path, draft_path = save_pair(Path(scratch), device, dtype, args.smoke)
        code = cli.main(
            [
                "calibrate",
                "--model-path",
                str(target_path),
                "--draft-model-path",
                str(draft_path),
                "--engine",
                "reference",
                "--device",
                device.type,
                "--dtype",
                str(dtype).removeprefix("torch."),
                "--widths",
                *map(str, widths),
                "--max-context",
                str(contexts[-1]),
                "--repeats",
                str(args.repeats),
                "--out",
                str(profile_path),
            ]
        )
    if code != 0:
        return code
    profile = load_profile(profile_path)
    samples = profile.samples
    name = device_name(device)
    measured = profile.roofline()
    raw_measured, in_sample = errors(measured, profile.fit, samples)
    leave_out = validate_leave_out(measured, samples)
    try:
        datasheet = lookup_gpu(name)
    except ValueError:
        datasheet = None
    raw_datasheet = None
    if datasheet is not None:
        sheet_roofline = RooflineModel(profile.model_shape, datasheet, profile.bytes_per_element)
        raw_datasheet = errors(sheet_roofline, profile.fit, samples)[0]
    evidence = CalibrationEvidence(
        device_name=name,
        torch_version=torch.__version__,
        transformers_version=transformers.__version__,
        model=f"random {'tiny' if args.smoke else 'Qwen3-8B'} shape",
        dtype=profile.metadata.dtype,
        widths=list(widths),
        contexts=list(contexts),
        repeats=args.repeats,
        measured_peaks=profile.hardware,
        datasheet_peaks=datasheet,
        raw_measured_peaks=raw_measured,
        raw_datasheet_peaks=raw_datasheet,
        calibrated_in_sample=in_sample,
        leave_out=leave_out,
        fit=profile.fit,
        step_costs=profile.step_costs,
        profile=str(profile_path),
        plot=str(profile_path.with_suffix(".png")),
    )
    errors_path = args.out / "errors.json"
    errors_path.write_text(evidence.model_dump_json(indent=2) + "\n", encoding="utf-8")
    print(
        f"raw roofline (measured peaks) RMSE {raw_measured.rmse_ms:.3f} ms, MAPE {raw_measured.mape:.1%}; "
        f"calibrated RMSE {in_sample.rmse_ms:.3f} ms, MAPE {in_sample.mape:.1%}; left out: widths MAPE "
        f"{leave_out.mape_widths or 0:.1%}, contexts MAPE {leave_out.mape_contexts or 0:.1%}"
    )
    print(f"wrote {profile_path}, {profile_path.with_suffix('.png')} and {errors_path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
