"""Acceptance of the demo DFlash2 drafter's lattice trees against its own chain and the DFlash chain of the
drafter it was trained from, on the reference engine.

    python benchmarks/dflash2_acceptance.py --out dflash2_acceptance.json [--prompts-per-set 4]
        [--max-new-tokens 64] [--target PATH] [--dflash DIR] [--dflash2 DIR]

The demo target (`bastion demo setup --print-path`) decodes the first --prompts-per-set held-out prompts of
each demo prompt set (humaneval, mtbench, sharegpt; never trained on) greedily in fp32 on the CPU, once per
row:
- DFlash2 (`models/smollm2-135m-instruct-dflash2`): best-first lattice trees of 16 and of 64 nodes
  (`fixed:16`, `fixed:64`) and DFlash2's own greedy walk (`chain`);
- DFlash (`models/smollm2-135m-instruct-dflash`, the DFlash2 drafter's frozen backbone): its chain, and its
  trees of 16 and 64 nodes over independent positions, for reference: with 8 candidates per position (the
  lattice's K, and the worker's default --bastion-topk) and with up to 64 (the reference engine's default).
τ is the mean accepted length (`GenerationResult.mean_accept_length`): accepted drafts + the bonus per
verify pass, summed over the prompts' steps. Fixed budgets and the chain never decline, so τ depends on the
drafts alone, not on this machine's timings. Every row must emit the same tokens (greedy, lossless); the
script stops otherwise. Prints the table and writes it as JSON. Only acceptance is measured: no speed.
"""

from __future__ import annotations

import argparse
import os
import platform
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path

import torch
from pydantic import BaseModel
from transformers import AutoTokenizer

from bastion_sglang.assets.prompt_sets import PROMPT_SETS, chat_prompt_ids, plan_prompts
from bastion_sglang.controller.policies import BudgetPolicy, ChainPolicy, FixedPolicy
from bastion_sglang.controller.roofline import CPU_HARDWARE
from bastion_sglang.demo.drafters import assemble_dflash2
from bastion_sglang.demo.target import demo_target_dir
from bastion_sglang.reference import ReferenceEngine

ROOT = Path(__file__).resolve().parents[1]
DFLASH = ROOT / "models" / "smollm2-135m-instruct-dflash"
DFLASH2 = ROOT / "models" / "smollm2-135m-instruct-dflash2"
"""The demo DFlash2 drafter's parts: its selector over DFLASH's backbone (`demo_drafters`)."""
CANDIDATES = 8
"""Candidates per position of the K-capped DFlash rows: the DFlash2 drafter's selector_top_k."""


@dataclass(frozen=True)
class CappedFixedPolicy(FixedPolicy):
    """fixed:N over at most `cap` candidates per position (as the worker's --bastion-topk caps them)."""

    cap: int = CANDIDATES

    @property
    def topk_cap(self) -> int | None:
        return self.cap


ROWS: tuple[tuple[str, str, BudgetPolicy, str], ...] = (
    ("DFlash2", "fixed:16", FixedPolicy(16), "lattice tree, 16 nodes (K = 8)"),
    ("DFlash2", "fixed:64", FixedPolicy(64), "lattice tree, 64 nodes (K = 8)"),
    ("DFlash2", "chain", ChainPolicy(), "DFlash2 chain (greedy walk)"),
    ("DFlash", "chain", ChainPolicy(), "DFlash chain"),
    ("DFlash", "fixed:16", CappedFixedPolicy(16), "DFlash tree, 16 nodes, K = 8"),
    ("DFlash", "fixed:64", CappedFixedPolicy(64), "DFlash tree, 64 nodes, K = 8"),
    ("DFlash", "fixed:16", FixedPolicy(16), "DFlash tree, 16 nodes, K = 16"),
    ("DFlash", "fixed:64", FixedPolicy(64), "DFlash tree, 64 nodes, K = 64"),
)
"""(drafter, policy name, policy, label) of each measured row."""


class Row(BaseModel):
    drafter: str
    policy: str
    label: str
    tau: float  # tokens committed per verify pass, bonus included
    steps: int  # verify passes over every prompt
    tokens: int  # tokens committed by those passes
    seconds: float  # wall time of the row (CPU, fp32; not a speed figure)


class Report(BaseModel):
    device: str
    processor: str
    cpu_count: int | None
    torch_version: str
    commit: str | None
    prompts: dict[str, int]  # prompts per set
    max_new_tokens: int
    rows: list[Row]


def commit() -> str | None:
    """The checkout's commit, None outside a git checkout."""
    found = subprocess.run(
        ["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True, check=False
    )
    return found.stdout.strip() or None


def measure(args: argparse.Namespace) -> Report:
    tokenizer = AutoTokenizer.from_pretrained(args.target)
    prompts = plan_prompts(list(PROMPT_SETS), "heldout", args.prompts_per_set)
    ids = [chat_prompt_ids(tokenizer, prompt) for prompt in prompts]
    engines = {
        name: ReferenceEngine(
            args.target, path, device="cpu", dtype=torch.float32, hardware=CPU_HARDWARE, max_nodes=64
        )
        for name, path in (("DFlash2", args.dflash2), ("DFlash", args.dflash))
    }
    rows, outputs = [], None
    for drafter, name, policy, label in ROWS:
        began = time.perf_counter()
        results = [engines[drafter].generate(p, args.max_new_tokens, policy=policy) for p in ids]
        tokens = [r.tokens for r in results]
        if outputs is None:
            outputs = tokens
        elif tokens != outputs:
            raise SystemExit(f"{drafter} {label} emitted other tokens than the first row: not lossless")
        steps = [step for r in results for step in r.steps]
        committed = sum(step.accepted + 1 for step in steps)
        row = Row(
            drafter=drafter,
            policy=name,
            label=label,
            tau=committed / len(steps),
            steps=len(steps),
            tokens=committed,
            seconds=time.perf_counter() - began,
        )
        print(f"{label}: tau {row.tau:.3f} ({row.tokens} tokens, {row.steps} verify passes)", flush=True)
        rows.append(row)
    return Report(
        device=args.device_label,
        processor=platform.processor() or platform.machine(),
        cpu_count=os.cpu_count(),
        torch_version=torch.__version__,
        commit=commit(),
        prompts={
            name: sum(1 for p in prompts if p.source == name)
            for name in dict.fromkeys(p.source for p in prompts)
        },
        max_new_tokens=args.max_new_tokens,
        rows=rows,
    )


def print_table(report: Report) -> None:
    sets = ", ".join(f"{count} {name}" for name, count in report.prompts.items())
    print(
        f"\n{report.device} ({report.processor}, {report.cpu_count} CPUs), torch {report.torch_version}, "
        f"commit {report.commit}; held-out prompts: {sets}; greedy, {report.max_new_tokens} new tokens, fp32"
    )
    print("| drafter | policy | what | τ (tokens per verify pass) | verify passes |")
    print("|---|---|---|---|---|")
    for row in report.rows:
        print(f"| {row.drafter} | `{row.policy}` | {row.label} | {row.tau:.3f} | {row.steps} |")


def main(argv: list[str] | None = None) -> None:
    formatter = argparse.RawDescriptionHelpFormatter
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=formatter)
    parser.add_argument("--out", type=Path, required=True, help="JSON report to write")
    parser.add_argument("--prompts-per-set", type=int, default=4)
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--target", type=Path, default=None, help="default: the demo target's folder")
    parser.add_argument("--dflash", type=Path, default=DFLASH)
    parser.add_argument(
        "--dflash2", type=Path, help="a complete DFlash2 checkpoint (default: the demo one, assembled)"
    )
    parser.add_argument("--device-label", default="2-core CPU", help="the machine, in words, for the report")
    parser.add_argument("--threads", type=int, default=2, help="torch intra-op threads")
    args = parser.parse_args(argv)
    if args.target is None:
        args.target = demo_target_dir()
    if args.dflash2 is None:
        args.dflash2 = assemble_dflash2(DFLASH2, DFLASH)
    torch.set_num_threads(args.threads)
    report = measure(args)
    print_table(report)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(report.model_dump_json(indent=2) + "\n", encoding="utf-8")


if __name__ == "__main__":
    main()
