"""`bastion step-anatomy`: the torch ops and blocking host syncs of each decode step, per kind and region.

    bastion step-anatomy [--model-path T --draft-model-path D] [--policies ar,adaptive,fixed:16] \
        [--concurrency 1,8] [--max-new-tokens 128] [--device cpu|cuda] [--out step-anatomy-results]

Every policy runs in a fresh process and `sglang.Engine` (`bench.anatomy_run`) whose scheduler process counts
every decode step (`step_anatomy`, `step_anatomy_hooks`): ops and syncs outside the target's and the
drafter's forwards, per region, per step kind (plain for `ar`: SGLang's own decode step; skipped, declined and
speculative for BASTION). Prints one table per batch size (`bench.anatomy_report.format_tables`) and writes
`step_anatomy.json`. Without `--model-path` it runs the demo pair: the target `bastion demo setup` builds and
the committed drafter.
"""

from __future__ import annotations

import argparse
import os
import shlex
import subprocess
import sys
from datetime import UTC, datetime
from pathlib import Path

from bastion_sglang.assets import MissingPackageError
from bastion_sglang.bench.anatomy_report import (
    AnatomyReport,
    AnatomySettings,
    format_sites,
    format_tables,
    summarize,
    write_report,
)
from bastion_sglang.bench.anatomy_run import AnatomyPlan, run_anatomy
from bastion_sglang.bench.plan import (
    DEFAULT_MAX_BUDGET,
    DEFAULT_PROMPTS,
    add_model_arguments,
    plan_from_args,
)
from bastion_sglang.integration.config import STARTUP_MODES

HELP = (
    "Count the torch ops and blocking host syncs of each decode step outside the model forwards, per step "
    "kind (SGLang's plain step for ar; skipped, declined, speculative for BASTION) and region, at each "
    "concurrency; print a table per batch size and write step_anatomy.json."
)
DEFAULT_POLICIES = "ar,adaptive,fixed:16"
"""ar: SGLang's plain decode step; adaptive: skipped steps and, at its probes, declined or speculative ones;
fixed:16: speculative steps every step."""
DEFAULT_CONCURRENCIES = "1,8"
DEFAULT_MAX_NEW_TOKENS = 128
REPOSITORY = Path(__file__).resolve().parents[2]


def concurrency_list(text: str) -> tuple[int, ...]:
    """argparse type: '1,8' -> (1, 8), each an integer >= 1, none repeated."""
    try:
        values = tuple(int(part) for part in text.split(",") if part.strip())
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}") from None
    if not values or min(values) < 1 or len(set(values)) < len(values):
        raise argparse.ArgumentTypeError(f"expected distinct integers >= 1, got {text!r}")
    return values


def default_model_path() -> str | None:
    """The demo target's folder when `bastion demo setup` has built it, else None."""
    from bastion_sglang.demo.target import demo_target_dir, read_manifest

    folder = demo_target_dir()
    return str(folder) if read_manifest(folder) is not None else None


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Options of `bastion step-anatomy`."""
    parser.add_argument(
        "--model-path", default=None, help="target (default: the demo target `bastion demo setup` built)"
    )
    parser.add_argument(
        "--draft-model-path", default=None, help="DFlash drafter (default: the committed demo drafter)"
    )
    parser.add_argument(
        "--prompts",
        default=None,
        help=f"a prompt set or JSONL file, as `bastion bench --prompts` (default {DEFAULT_PROMPTS})",
    )
    parser.add_argument("--split", choices=["heldout", "train", "all"], default=None, help="prompt split")
    parser.add_argument(
        "--policies", default=DEFAULT_POLICIES, help=f"comma-separated (default {DEFAULT_POLICIES})"
    )
    parser.add_argument(
        "--concurrency",
        type=concurrency_list,
        default=concurrency_list(DEFAULT_CONCURRENCIES),
        help=f"batch sizes: one batch of the first c prompts for each c, in turn (default "
        f"{DEFAULT_CONCURRENCIES})",
    )
    parser.add_argument(
        "--max-new-tokens",
        type=int,
        default=DEFAULT_MAX_NEW_TOKENS,
        help=f"tokens per request, EOS ignored (default {DEFAULT_MAX_NEW_TOKENS})",
    )
    parser.add_argument(
        "--max-budget", type=int, default=DEFAULT_MAX_BUDGET, help="N_max of the BASTION Engines"
    )
    parser.add_argument(
        "--startup-calibration",
        choices=STARTUP_MODES,
        default="off",
        help="--bastion-startup-calibration of the BASTION Engines (default off: counts need no timings, and "
        "without an acceptance calibration adaptive's gate probes, so its steps also decline or speculate)",
    )
    parser.add_argument(
        "--device", choices=["auto", "cpu", "cuda"], default="auto", help="auto: cuda if seen"
    )
    parser.add_argument("--attention-backend", default=None, help="SGLang attention backend")
    parser.add_argument("--dtype", default="auto", help="SGLang --dtype")
    add_model_arguments(parser)
    parser.add_argument("--mem-fraction-static", type=float, default=None, help="SGLang setting")
    parser.add_argument("--max-total-tokens", type=int, default=None, help="KV pool tokens")
    parser.add_argument(
        "--out", type=Path, default=Path("step-anatomy-results"), help="folder for step_anatomy.json"
    )
    parser.add_argument("--sglang-log-level", default="warning", help="log level of the Engines' processes")
    parser.add_argument(
        "--sites",
        action="store_true",
        help="also record where each op and sync is issued (file:line of the first frame outside torch) and "
        "print them per policy and step kind; slows the counted steps",
    )


def command_line(args: argparse.Namespace) -> str:
    """The command with every option spelled out (defaults included), as the report records it."""
    parts = ["bastion", "step-anatomy"]
    for name, value in vars(args).items():
        if name in ("command", "handler", "verbose") or value is None or value is False:
            continue
        if value is True:  # a flag
            parts.append(f"--{name.replace('_', '-')}")
            continue
        text = ",".join(str(v) for v in value) if isinstance(value, tuple) else str(value)
        parts += [f"--{name.replace('_', '-')}", text]
    return shlex.join(parts)


def checkout_state() -> tuple[str | None, bool | None]:
    """(commit, whether tracked files differ from it) of the repository this package runs from; (None, None)
    outside a git checkout."""

    def git(*argv: str) -> str | None:
        try:
            done = subprocess.run(
                ["git", "-C", str(REPOSITORY), *argv], capture_output=True, text=True, check=True
            )
        except (OSError, subprocess.CalledProcessError):
            return None
        return done.stdout.strip()

    commit = git("rev-parse", "HEAD")
    if commit is None:
        return None, None
    status = git("status", "--porcelain", "--untracked-files=no")
    return commit, None if status is None else bool(status)


def plan_anatomy(args: argparse.Namespace) -> AnatomyPlan:
    """The bench's plan for these options; ValueError or MissingPackageError naming the bad value."""
    from bastion_sglang.demo.serve import default_drafter

    model_path = args.model_path or default_model_path()
    if model_path is None:
        raise ValueError("--model-path is required when the demo target is not built (`bastion demo setup`)")
    concurrencies = args.concurrency
    bench_args = argparse.Namespace(
        model_path=model_path,
        draft_model_path=args.draft_model_path or str(default_drafter()),
        prompts=args.prompts,
        split=args.split,
        policies=args.policies,
        control=False,
        repeats=1,
        device=args.device,
        concurrency=max(concurrencies),
        num_prompts=max(concurrencies),
        max_new_tokens=args.max_new_tokens,
        ignore_eos=True,
        temperatures="0",
        max_budget=args.max_budget,
        bastion_overlap_schedule="off",
        schedule="sequential",
        attention_backend=args.attention_backend,
        dtype=args.dtype,
        load_format=args.load_format,
        random_prompts=args.random_prompts,
        random_prompt_tokens=args.random_prompt_tokens,
        bastion_profile=None,
        synthetic_acceptance=None,
        mem_fraction_static=args.mem_fraction_static,
        max_total_tokens=args.max_total_tokens,
        seed=0,
        out=args.out,
        sglang_log_level=args.sglang_log_level,
    )
    bench = plan_from_args(bench_args)
    if len(bench.prompt_ids) < max(concurrencies):
        raise ValueError(
            f"--prompts {bench.settings.prompts}: {len(bench.prompt_ids)} prompts, fewer than --concurrency "
            f"{max(concurrencies)}"
        )
    return AnatomyPlan(bench, concurrencies, args.startup_calibration, args.sites)


def run(args: argparse.Namespace) -> int:
    """Run `bastion step-anatomy`: status 2 (naming the bad value) before any Engine starts, 1 if a policy's
    process fails."""
    import torch

    from bastion_sglang.bench.run import package_versions
    from bastion_sglang.calibration.identity import device_name

    try:
        plan = plan_anatomy(args)
    except (ValueError, MissingPackageError) as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    commit, dirty = checkout_state()  # before the Engines start: the code they import
    try:
        steps = run_anatomy(plan)
    except RuntimeError as error:
        print(f"error: {error}", file=sys.stderr)
        return 1
    bench = plan.bench.settings
    settings = AnatomySettings(
        model_path=bench.model_path,
        draft_model_path=bench.draft_model_path,
        prompts=bench.prompts,
        policies=bench.policies,
        concurrencies=plan.concurrencies,
        max_new_tokens=bench.max_new_tokens,
        max_budget=bench.max_budget,
        startup_calibration=plan.startup_calibration,
        device=bench.device,
        attention_backend=bench.attention_backend,
        dtype=bench.dtype,
        load_format=bench.load_format,
        overlap_schedule=False,
    )
    report = AnatomyReport(
        created=datetime.now(UTC).isoformat(timespec="seconds"),
        command=command_line(args),
        commit=commit,
        dirty=dirty,
        device=device_name(torch.device(bench.device)),
        host_cpus=os.cpu_count() or 1,
        versions=package_versions(),
        settings=settings,
        summaries=summarize(steps, bench.policies, plan.concurrencies),
        steps=tuple(steps),
    )
    path = write_report(report, args.out)
    print(format_tables(report))
    sites = format_sites(report)
    if sites:
        print("\n" + sites)
    print(f"\nwrote {path}")
    return 0
