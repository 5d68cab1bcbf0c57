"""`bastion bench`: every policy through the real in-process `sglang.Engine`, on the same prompts, repeated.

    bastion bench --model-path T --draft-model-path D --prompts humaneval|mtbench|sharegpt|FILE.jsonl \
        [--policies ar,chain,fixed:1,fixed:2,fixed:4,fixed:8,fixed:16,fixed:64,adaptive] \
        [--temperatures 0,0.7] [--concurrency N] [--repeats R] ...

Policies: `ar` is the Engine without speculation; `chain`, `fixed:N`, `adaptive` and `bucketed` are
`--speculative-algorithm BASTION` with that `--bastion-policy` (and `--max-budget` as N_max); `dflash` is
SGLang's built-in DFLASH worker, unchanged (on the CPU with the bench's stand-ins, `bench.dflash_cpu`, at
T = 0; under `--synthetic-acceptance` accepting by the same keyed draws, `bench.dflash_synthetic`).

How the repeats run: `bench.run`; what each reported number means: `bench.report`; the files written:
`bench.output`.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from bastion_sglang.assets import MissingPackageError
from bastion_sglang.bench.output import format_table, write_outputs
from bastion_sglang.bench.plan import (
    DEFAULT_MAX_BUDGET,
    DEFAULT_POLICIES,
    DEFAULT_PROMPTS,
    DEFAULT_REPEATS,
    MIN_NEW_TOKENS,
    add_model_arguments,
    plan_from_args,
)
from bastion_sglang.bench.run import run_bench

HELP = (
    "Benchmark ar, chain, fixed:N, adaptive, bucketed and dflash through sglang.Engine on the same prompts, "
    "each repeat in fresh Engines: median decode and wall tokens/s with their spread, per-token latency "
    "p50/p90, mean accepted length, mean tree budget, speedup over ar and the best policy in hindsight, "
    "as a table, JSON and PNG."
)


def positive_int(text: str) -> int:
    """argparse type: an integer >= 1 (argparse names the option in its error otherwise)."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not an integer") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {value}")
    return value


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Options of `bastion bench`."""
    parser.add_argument("--model-path", default=None, help="target: model folder or Hugging Face id")
    parser.add_argument(
        "--draft-model-path", default=None, help="DFlash drafter (needed by every policy but ar)"
    )
    parser.add_argument(
        "--prompts",
        default=None,
        help="humaneval, mtbench, sharegpt, several of them comma-separated (taken in turn, one of each, so "
        "--num-prompts mixes them), or a JSONL file of {'prompt': ...} / {'turns': [...]} lines; default "
        f"{DEFAULT_PROMPTS}",
    )
    parser.add_argument(
        "--split",
        choices=["heldout", "train", "all"],
        default=None,
        help="prompt split (default: heldout for a named set, unseen in drafter training; all for a file)",
    )
    parser.add_argument(
        "--policies",
        default=DEFAULT_POLICIES,
        help="comma-separated: ar, chain, fixed:N, adaptive, bucketed, dflash (SGLang's DFLASH worker; on "
        f"the CPU at T = 0 only); default {DEFAULT_POLICIES}",
    )
    parser.add_argument(
        "--control",
        action="store_true",
        help="also run a second ar Engine (ar-control) in every repeat, measured like the others: its "
        "per-repeat ratio to ar is the run's noise floor, how far a paired ratio moves with no difference "
        "in code (needs ar in --policies; never the best in hindsight)",
    )
    parser.add_argument(
        "--repeats",
        type=positive_int,
        default=DEFAULT_REPEATS,
        help=f"rounds, each running every policy in a fresh Engine, in another order per round (a Williams "
        f"design, balanced for position and for the policy each one follows); rows "
        f"report the median over the rounds with min and max (default {DEFAULT_REPEATS})",
    )
    parser.add_argument(
        "--device", choices=["auto", "cpu", "cuda"], default="auto", help="auto: cuda if seen"
    )
    parser.add_argument(
        "--concurrency",
        type=int,
        default=1,
        help="requests in flight (one streamed generate batch); decode tokens/s and token latency are per "
        "request",
    )
    parser.add_argument("--num-prompts", type=int, default=None, help="first N prompts of the split (all)")
    parser.add_argument(
        "--max-new-tokens",
        type=int,
        default=256,
        help=f"completion tokens per request (at least {MIN_NEW_TOKENS}: decode starts after the first)",
    )
    parser.add_argument("--ignore-eos", action="store_true", help="always generate --max-new-tokens tokens")
    parser.add_argument(
        "--temperatures", default="0", help="comma-separated sampling temperatures, e.g. 0,0.7"
    )
    parser.add_argument(
        "--max-budget",
        type=int,
        default=DEFAULT_MAX_BUDGET,
        help=f"--bastion-max-budget of the BASTION Engines (N_max), at least every fixed:N; default "
        f"{DEFAULT_MAX_BUDGET}",
    )
    parser.add_argument(
        "--bastion-overlap-schedule",
        choices=["on", "off"],
        default="off",
        help="--bastion-overlap-schedule of the BASTION Engines: on runs them under SGLang's overlap "
        "scheduler (ar and dflash keep SGLang's own setting); default off",
    )
    parser.add_argument(
        "--schedule",
        choices=["sequential", "interleaved"],
        default="sequential",
        help="sequential: each repeat starts one policy's Engine after the previous one shut down (one "
        "Engine in memory at a time); interleaved: every policy's Engine stays alive through the repeat and "
        "they take turns batch by batch, so drift of the machine over minutes hits every policy alike (needs "
        "memory for all of them at once; size the KV pools with --max-total-tokens). Default sequential",
    )
    parser.add_argument(
        "--attention-backend",
        default=None,
        help="SGLang attention backend (default: torch_native on cpu, triton)",
    )
    parser.add_argument("--dtype", default="auto", help="SGLang --dtype (float32 keeps CPU runs exact)")
    add_model_arguments(parser)
    parser.add_argument(
        "--bastion-profile",
        default=None,
        metavar="PROFILE",
        help="--bastion-profile of the BASTION Engines: plan with this calibration profile (e.g. one "
        "measured on another machine at the same model shape) instead of the store's or a start-up one",
    )
    parser.add_argument(
        "--synthetic-acceptance",
        default=None,
        metavar="FILE",
        help="speed only: the BASTION and dflash Engines accept by this synthetic acceptance profile "
        "(e.g. tools/offline_gpu/profiles/qwen3-8b-dflash-b16-gsm8k.json) instead of by the target, so "
        "trees run at a dummy-weight target's real step costs with a published acceptance; their output "
        "is not the target's",
    )
    parser.add_argument(
        "--mem-fraction-static", type=float, default=None, help="SGLang setting (default 0.2 on cpu)"
    )
    parser.add_argument(
        "--max-total-tokens", type=int, default=None, help="KV pool tokens (default 65536 on cpu)"
    )
    parser.add_argument(
        "--seed",
        type=int,
        default=0,
        help="Engine random seed; request i of repeat r samples with seed + r*N + i (N prompts) at T > 0 and "
        "under --synthetic-acceptance, whose draws it keys: the policies of a repeat meet the same ones",
    )
    parser.add_argument(
        "--out", type=Path, default=Path("bench-results"), help="folder for bench.json and .png"
    )
    parser.add_argument("--sglang-log-level", default="warning", help="log level of the Engines' processes")


def run(args: argparse.Namespace) -> int:
    """Run `bastion bench`: status 2 (naming the bad value) before any Engine starts, 1 if a policy fails."""
    try:
        plan = plan_from_args(args)
    except (ValueError, MissingPackageError) as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    try:
        report = run_bench(plan)
    except RuntimeError as error:
        print(f"error: {error}", file=sys.stderr)
        return 1
    json_path, plot_path = write_outputs(report, plan.out)
    print(format_table(report))
    print(f"\nwrote {json_path} and {plot_path}")
    return 0
