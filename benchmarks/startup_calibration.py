"""What a server's start-up calibration costs and how good it is, against `bastion calibrate`, on one device.

    python benchmarks/startup_calibration.py --calibrate-profile P.json --out startup.json [--mode quick]
        [--model-path M] [--draft-model-path D] [--held-out-prompts mtbench] [--held-out-num 24]
        [--cuda-graphs]

Steps (the demo pair by default, fp32, the CPU's torch_native backend or triton on CUDA):
1. Start-up time: an `sglang.Engine` with `--bastion-startup-calibration off`, then one with the mode over an
   empty profile store, then one more over the store it filled; seconds from the constructor's call to its
   return (the server is ready), each once, in that order. Added: the second minus the first; the third
   shows a reuse adds no sweep.
2. Latency: the start-up profile's model predicts every verify and plain decode sample of the given
   `bastion calibrate` profile (a separate, wider grid); its MAPE there against the calibrate profile's own
   leave-one-width-out and leave-one-context-out MAPE (the bound: at most 1.5 times), and split by what the
   start-up measured (`latency_splits`): samples at widths and contexts it measured, at a measured width
   but another context, at a measured context but another width, and at neither (plain decode: measured
   contexts or not). Like with like: `bastion calibrate` times verify passes eagerly, so the servers run
   eagerly too (on CUDA as well) unless --cuda-graphs is given, and a start-up profile measured on graph
   replays is not scored against an eager one (the report says so instead).
3. Acceptance: the reference engine decodes held-out prompts of another prompt set than the start-up's
   (greedy, fixed trees of 16 nodes); every drafter pass is scored with the start-up's acceptance map, and
   with the calibrate profile's when it has one: expected against realised accept length at 1, 4, 16 and
   64 nodes.
Prints the figures and writes them as JSON. Nothing is asserted: the figures are for reading, and they are
as noisy as the machine they ran on (say what else ran).
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import subprocess
import tempfile
import time
from pathlib import Path

import torch
from pydantic import BaseModel

from bastion_sglang.calibration.acceptance_fit import AcceptanceSettings, prompt_token_ids
from bastion_sglang.calibration.acceptance_run import PLANNING_HARDWARE, records_of_generation
from bastion_sglang.calibration.store import STORE_ENV, ProfileStore
from bastion_sglang.controller.acceptance import AcceptanceCalibration, AcceptanceRecord, evaluate_acceptance
from bastion_sglang.controller.policies import FixedPolicy
from bastion_sglang.controller.profile import CalibrationProfile, load_profile
from bastion_sglang.integration.config import CHOSEN_BACKENDS

REPOSITORY = Path(__file__).resolve().parents[1]
DEMO_DRAFTER = REPOSITORY / "models" / "smollm2-135m-instruct-dflash"
BUDGETS = (1, 4, 16, 64)


class StartTimes(BaseModel):
    off_seconds: float
    calibrating_seconds: float
    reusing_seconds: float
    added_seconds: float


class LatencySplit(BaseModel):
    """The start-up fit's MAPE on the calibrate samples of one kind (`latency_splits`)."""

    mode: str  # verify or decode
    kind: str  # measured, width measured, context measured, neither measured
    samples: int
    mape: float | None  # None without samples


class LatencyQuality(BaseModel):
    compared: str  # "eager vs eager", "graphs vs graphs", or why nothing was compared
    startup_mape_on_calibrate_grid: float | None
    startup_decode_mape_on_calibrate_grid: float | None
    calibrate_leave_width_out_mape: float | None
    calibrate_leave_context_out_mape: float | None
    ratio_to_worst_leave_out: float | None
    calibrate_samples: int
    splits: list[LatencySplit]


class AcceptanceRow(BaseModel):
    budget: int
    startup_expected: float
    startup_realised: float
    startup_error: float
    calibrate_expected: float | None
    calibrate_realised: float | None
    calibrate_error: float | None


class Report(BaseModel):
    commit: str | None
    device: str
    mode: str
    command: str
    startup_profile: str
    times: StartTimes
    latency: LatencyQuality
    acceptance_passes: int
    acceptance: list[AcceptanceRow]


def engine_ready_seconds(model: str, drafter: str, mode: str, device: str, cuda_graphs: bool) -> float:
    """Seconds an `sglang.Engine` of the pair takes to start with start-up calibration `mode` (CUDA graphs
    only on CUDA with `cuda_graphs`)."""
    import sglang
    from sglang.srt.plugins import load_plugins
    from sglang.srt.server_args import ServerArgs

    from bastion_sglang.registration import attach_config, make_config

    load_plugins()
    server_args = ServerArgs(
        model_path=model,
        speculative_algorithm="BASTION",
        speculative_draft_model_path=drafter,
        device=device,
        attention_backend=CHOSEN_BACKENDS[device],
        dtype="float32",
        disable_cuda_graph=device == "cpu" or not cuda_graphs,
        max_total_tokens=16384,
        mem_fraction_static=0.1 if device == "cpu" else None,
        random_seed=0,
        log_level="warning",
    )
    attach_config(server_args, make_config(startup_calibration=mode))  # type: ignore[arg-type]
    started = time.perf_counter()
    engine = sglang.Engine(server_args=server_args)
    seconds = time.perf_counter() - started
    engine.shutdown()
    return seconds


def mape(pairs: list[tuple[float, float]]) -> float:
    """Mean |predicted - observed| / observed over (predicted, observed) pairs, a fraction."""
    return statistics.fmean(abs(p - o) / o for p, o in pairs)


def latency_splits(startup: CalibrationProfile, calibrate: CalibrationProfile) -> list[LatencySplit]:
    """The start-up fit's MAPE on the calibrate profile's samples, split by what the start-up measured:
    verify samples at a (width, context) both of its grid, at one of its widths but another context, at one
    of its contexts but another width, at neither; plain decode samples at its contexts or not."""
    model = startup.latency_model()
    widths = {x.s for x in startup.samples if x.mode == "verify"}
    contexts = {x.c for x in startup.samples if x.mode == "verify"}
    decode_contexts = {x.c for x in startup.samples if x.mode == "decode"}
    groups: dict[tuple[str, str], list[tuple[float, float]]] = {
        key: []
        for key in (
            ("verify", "measured"),
            ("verify", "width measured"),
            ("verify", "context measured"),
            ("verify", "neither measured"),
            ("decode", "measured"),
            ("decode", "neither measured"),
        )
    }
    for x in calibrate.samples:
        if x.mode == "decode":
            kind = "measured" if x.c in decode_contexts else "neither measured"
            groups["decode", kind].append((model.predict_plain(x.c), x.seconds))
            continue
        kind = {
            (True, True): "measured",
            (True, False): "width measured",
            (False, True): "context measured",
            (False, False): "neither measured",
        }[x.s in widths, x.c in contexts]
        groups["verify", kind].append((model.predict(x.s, x.c), x.seconds))
    return [
        LatencySplit(mode=mode, kind=kind, samples=len(pairs), mape=mape(pairs) if pairs else None)
        for (mode, kind), pairs in groups.items()
    ]


def graphs_words(profile: CalibrationProfile) -> str:
    """'graphs' or 'eager': how a profile's verify passes ran ('eager' where it records no settings:
    `bastion calibrate` and the reference engine time eagerly)."""
    settings = profile.metadata.settings
    return "graphs" if settings is not None and settings.cuda_graphs else "eager"


def latency_quality(startup: CalibrationProfile, calibrate: CalibrationProfile) -> LatencyQuality:
    leave = calibrate.leave_out
    widths = None if leave is None else leave.mape_widths
    contexts = None if leave is None else leave.mape_contexts
    verify_samples = len([x for x in calibrate.samples if x.mode == "verify"])
    ours, theirs = graphs_words(startup), graphs_words(calibrate)
    if ours != theirs:
        return LatencyQuality(
            compared=f"not compared: the start-up timed {ours} passes, the calibrate profile {theirs}",
            startup_mape_on_calibrate_grid=None,
            startup_decode_mape_on_calibrate_grid=None,
            calibrate_leave_width_out_mape=widths,
            calibrate_leave_context_out_mape=contexts,
            ratio_to_worst_leave_out=None,
            calibrate_samples=verify_samples,
            splits=[],
        )
    model = startup.latency_model()
    verify = [(model.predict(x.s, x.c), x.seconds) for x in calibrate.samples if x.mode == "verify"]
    decode = [(model.predict_plain(x.c), x.seconds) for x in calibrate.samples if x.mode == "decode"]
    worst = max((v for v in (widths, contexts) if v is not None), default=None)
    overall = mape(verify)
    return LatencyQuality(
        compared=f"{ours} vs {theirs}",
        startup_mape_on_calibrate_grid=overall,
        startup_decode_mape_on_calibrate_grid=mape(decode) if decode else None,
        calibrate_leave_width_out_mape=widths,
        calibrate_leave_context_out_mape=contexts,
        ratio_to_worst_leave_out=None if not worst else overall / worst,
        calibrate_samples=verify_samples,
        splits=latency_splits(startup, calibrate),
    )


def held_out_records(model: str, drafter: str, prompt_set: str, count: int) -> list[AcceptanceRecord]:
    """Drafter passes of the reference engine's greedy decoding (fixed trees of 16 nodes) on held-out
    prompts of `prompt_set`."""
    from bastion_sglang.reference import ReferenceEngine

    settings = AcceptanceSettings(prompt_set=prompt_set, num_prompts=count, max_new_tokens=64)
    engine = ReferenceEngine(
        model, drafter, device=torch.device("cpu"), dtype=torch.float32, hardware=PLANNING_HARDWARE
    )
    records = []
    for ids in prompt_token_ids(model, settings):
        result = engine.generate(ids, settings.max_new_tokens, policy=FixedPolicy(16))
        records += records_of_generation(ids, result.tokens, result.steps, settings.topk)
    return records


def acceptance_rows(
    records: list[AcceptanceRecord],
    startup: AcceptanceCalibration,
    calibrate: AcceptanceCalibration | None,
) -> list[AcceptanceRow]:
    ours = evaluate_acceptance(startup, records, BUDGETS)
    theirs = None if calibrate is None else evaluate_acceptance(calibrate, records, BUDGETS)
    return [
        AcceptanceRow(
            budget=budget,
            startup_expected=ours.expected[j],
            startup_realised=ours.realised[j],
            startup_error=ours.error[j],
            calibrate_expected=None if theirs is None else theirs.expected[j],
            calibrate_realised=None if theirs is None else theirs.realised[j],
            calibrate_error=None if theirs is None else theirs.error[j],
        )
        for j, budget in enumerate(BUDGETS)
    ]


def git_commit() -> str | None:
    result = subprocess.run(
        ["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, check=False
    )
    return result.stdout.strip() or None


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--calibrate-profile", required=True, help="a `bastion calibrate` profile of the pair"
    )
    parser.add_argument("--out", required=True, help="JSON report path")
    parser.add_argument("--mode", choices=("quick", "full"), default="quick")
    parser.add_argument("--model-path", help="target folder (default: the demo target)")
    parser.add_argument("--draft-model-path", default=str(DEMO_DRAFTER))
    parser.add_argument("--held-out-prompts", default="mtbench", help="prompt set scored for acceptance")
    parser.add_argument("--held-out-num", type=int, default=24)
    parser.add_argument(
        "--cuda-graphs",
        action="store_true",
        help="servers replay CUDA graphs (their latency is then not compared with calibrate's eager grid)",
    )
    args = parser.parse_args()
    if args.model_path is None:
        from bastion_sglang.demo.target import setup_demo_target

        args.model_path = str(setup_demo_target(None).path)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    calibrate = load_profile(args.calibrate_profile)
    with tempfile.TemporaryDirectory() as folder:
        store = ProfileStore(Path(folder) / "store")
        os.environ[STORE_ENV] = str(store.root)
        off, calibrating, reusing = (
            engine_ready_seconds(args.model_path, args.draft_model_path, mode, device, args.cuda_graphs)
            for mode in ("off", args.mode, args.mode)
        )
        entries = store.list_profiles()
        if len(entries) != 1 or entries[0].profile is None:
            raise SystemExit(f"expected one start-up profile in {store.root}, found {len(entries)}")
        startup, startup_path = entries[0].profile, entries[0].path.name
    times = StartTimes(
        off_seconds=off,
        calibrating_seconds=calibrating,
        reusing_seconds=reusing,
        added_seconds=calibrating - off,
    )
    latency = latency_quality(startup, calibrate)
    if startup.acceptance is None:
        raise SystemExit("the start-up profile has no acceptance map (see the server's log)")
    records = held_out_records(
        args.model_path, args.draft_model_path, args.held_out_prompts, args.held_out_num
    )
    rows = acceptance_rows(records, startup.acceptance, calibrate.acceptance)
    report = Report(
        commit=git_commit(),
        device=torch.cuda.get_device_name() if device == "cuda" else f"CPU {platform.processor() or 'x86'}",
        mode=args.mode,
        command=" ".join(["python", "benchmarks/startup_calibration.py", *os.sys.argv[1:]]),
        startup_profile=startup_path,
        times=times,
        latency=latency,
        acceptance_passes=len([r for r in records if len(r.continuation) >= r.logprobs.shape[0]]),
        acceptance=rows,
    )
    print(
        f"start-up: off {off:.1f} s, {args.mode} over an empty store {calibrating:.1f} s "
        f"(+{times.added_seconds:.1f} s), reusing the stored profile {reusing:.1f} s"
    )
    if latency.startup_mape_on_calibrate_grid is None:
        print(f"latency: {latency.compared}")
    else:
        print(
            f"latency ({latency.compared}): start-up fit MAPE {latency.startup_mape_on_calibrate_grid:.1%} "
            f"on calibrate's {latency.calibrate_samples} verify samples; calibrate's own leave-out MAPE "
            f"widths {latency.calibrate_leave_width_out_mape}, contexts "
            f"{latency.calibrate_leave_context_out_mape}; ratio to the worse "
            f"{latency.ratio_to_worst_leave_out}"
        )
    for split in latency.splits:
        error = "-" if split.mape is None else f"{split.mape:.1%}"
        print(f"  {split.mode} at {split.kind} by the start-up: MAPE {error} over {split.samples} samples")
    print(f"acceptance on {report.acceptance_passes} held-out passes ({args.held_out_prompts}):")
    for row in rows:
        theirs = "" if row.calibrate_error is None else f", calibrate's map {row.calibrate_error:+.1%}"
        print(
            f"  {row.budget:>3} nodes: start-up Â {row.startup_expected:.2f} vs realised "
            f"{row.startup_realised:.2f} ({row.startup_error:+.1%}){theirs}"
        )
    Path(args.out).write_text(report.model_dump_json(indent=2) + "\n")


if __name__ == "__main__":
    main()
