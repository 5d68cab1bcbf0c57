"""Planning time of the DFlash2 lattice builder against the [D, K] builders, on the host.

    python benchmarks/lattice_planning.py --out lattice_planning.json [--repeats 400] [--budgets 16 64 256]
        [--threads 1]

Cases, D = 16 slots, seeded random inputs, every budget:
- `build_lattice_tree`, K = 8 (DFlash's default topk): [D, K, K] selector log-probs, `selector_logprobs` of
  random scores;
- `build_tree_fast` and `build_tree`, K = 8, on the same lattice read as independent positions (row [e, 0]
  of each slot, sorted: draft "lattice rows"), so that the trees have a like shape;
- `build_tree_fast`, K = 8 and K = 32, on the top-K log-probs of random logits over VOCAB tokens (draft
  "logits"): far less confident rows than the lattice's (a softmax over K candidates), so a tree of the same
  budget is shallow and the threshold search of `build_tree_fast` prunes most of the [D, K] lattice;
- `selector_logprobs` (scores to log-probs, once a step, no budget).
Each case is warmed up, then the cases are timed in turns, one call each per round, so that a noisy stretch
falls on all of them. Prints the median, 10th and 90th percentile microseconds per call and, per budget, the
ratio of the lattice builder's median to `build_tree_fast`'s at K = 8 on either draft (the goal: at most
GOAL_RATIO), and writes them as JSON. Nothing is asserted: the figures are for reading.
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import subprocess
import time
from collections.abc import Callable
from pathlib import Path

import torch
from pydantic import BaseModel

from bastion_sglang.controller.fast_tree import build_tree_fast
from bastion_sglang.controller.lattice_tree import build_lattice_tree, selector_logprobs
from bastion_sglang.controller.tree import build_tree

DEPTHS = 16
WIDTH = 8
"""K of the lattice and of the [D, K] draft it is compared with (BastionConfig's default topk)."""
WIDE = 32
"""K of the wider [D, K] draft."""
VOCAB = 1000
"""Tokens of the random logits of the "logits" drafts."""
BUDGETS = (16, 64, 256)
GOAL_RATIO = 2.0
WARMUP_CALLS = 20


class Row(BaseModel):
    case: str
    draft: str  # "lattice" ([D, K, K]), "lattice rows" or "logits" ([D, K]), "scores" (selector_logprobs)
    budget: int | None  # None: selector_logprobs, which builds no tree
    candidates: int
    median_us: float
    p10_us: float
    p90_us: float
    nodes: int | None


class Report(BaseModel):
    processor: str
    cpu_count: int | None
    torch_threads: int
    torch_version: str
    commit: str | None
    depths: int
    repeats: int
    rows: list[Row]
    lattice_over_fast: dict[str, dict[int, float]]  # [D, K] draft -> budget -> the ratio of medians at K = 8


Case = tuple[str, str, int | None, int, Callable[[], object]]
"""(name, draft, budget, K, the call timed)."""


def logits_draft(generator: torch.Generator, width: int) -> tuple[torch.Tensor, torch.Tensor]:
    """[D, K] float32 top-K log-probs of random logits over VOCAB tokens, and their token ids."""
    top = torch.log_softmax(3.0 * torch.randn(DEPTHS, VOCAB, generator=generator), -1).topk(width, -1)
    return top.values, top.indices


def cases(budgets: list[int], seed: int) -> list[Case]:
    """Every case of the module docstring on seeded inputs; selector scores have row [0, p] one row, as
    SGLang's."""
    generator = torch.Generator().manual_seed(seed)
    scores = 3.0 * torch.randn(DEPTHS, WIDTH, WIDTH, generator=generator)
    scores[0] = scores[0, 0].clone()
    token_ids = torch.argsort(torch.rand(DEPTHS, VOCAB, generator=generator), -1)[:, :WIDTH]
    lattice = selector_logprobs(scores)
    rows, order = lattice[:, 0].sort(-1, descending=True)
    row_ids = token_ids.gather(1, order)
    narrow, narrow_ids = logits_draft(generator, WIDTH)
    wide, wide_ids = logits_draft(generator, WIDE)
    out: list[Case] = [("selector_logprobs", "scores", None, WIDTH, lambda: selector_logprobs(scores))]
    for n in budgets:
        out += [
            (
                "build_lattice_tree",
                "lattice",
                n,
                WIDTH,
                lambda n=n: build_lattice_tree(lattice, token_ids, n),
            ),
            ("build_tree_fast", "lattice rows", n, WIDTH, lambda n=n: build_tree_fast(rows, row_ids, n)),
            ("build_tree", "lattice rows", n, WIDTH, lambda n=n: build_tree(rows, row_ids, n)),
            ("build_tree_fast", "logits", n, WIDTH, lambda n=n: build_tree_fast(narrow, narrow_ids, n)),
            ("build_tree_fast", "logits", n, WIDE, lambda n=n: build_tree_fast(wide, wide_ids, n)),
        ]
    return out


def measure(timed: list[Case], repeats: int) -> list[Row]:
    """Microseconds per call of every case: WARMUP_CALLS each, then `repeats` rounds of one call per case."""
    for *_, call in timed:
        for _ in range(WARMUP_CALLS):
            call()
    samples: list[list[float]] = [[] for _ in timed]
    for _ in range(repeats):
        for case, (*_, call) in enumerate(timed):
            start = time.perf_counter()
            call()
            samples[case].append((time.perf_counter() - start) * 1e6)
    rows = []
    for (name, draft, budget, width, call), times in zip(timed, samples, strict=True):
        times.sort()
        result = call()
        rows.append(
            Row(
                case=name,
                draft=draft,
                budget=budget,
                candidates=width,
                median_us=statistics.median(times),
                p10_us=times[int(0.1 * (len(times) - 1))],
                p90_us=times[int(0.9 * (len(times) - 1))],
                nodes=len(result) if budget is not None else None,  # type: ignore[arg-type]
            )
        )
    return rows


def commit() -> str | None:
    """The checkout's commit, None outside a git checkout."""
    found = subprocess.run(
        ["git", "rev-parse", "--short", "HEAD"],
        cwd=Path(__file__).parent,
        capture_output=True,
        text=True,
        check=False,
    )
    return found.stdout.strip() or None


def report(rows: list[Row], repeats: int) -> Report:
    def median(name: str, draft: str, budget: int) -> float:
        key = (name, draft, budget, WIDTH)
        return next(r.median_us for r in rows if (r.case, r.draft, r.budget, r.candidates) == key)

    budgets = sorted({r.budget for r in rows if r.budget is not None})
    return Report(
        processor=platform.processor() or platform.machine(),
        cpu_count=os.cpu_count(),
        torch_threads=torch.get_num_threads(),
        torch_version=torch.__version__,
        commit=commit(),
        depths=DEPTHS,
        repeats=repeats,
        rows=rows,
        lattice_over_fast={
            draft: {
                n: median("build_lattice_tree", "lattice", n) / median("build_tree_fast", draft, n)
                for n in budgets
            }
            for draft in ("lattice rows", "logits")
        },
    )


def print_report(result: Report) -> None:
    print(
        f"{result.processor}, {result.cpu_count} CPUs, torch {result.torch_version} ({result.torch_threads} "
        f"threads), commit {result.commit}; D = {result.depths}, {result.repeats} rounds"
    )
    heading = ("case", "draft", "K", "budget", "nodes", "median µs", "p10", "p90")
    print("{:<20} {:<13} {:>3} {:>6} {:>5} {:>10} {:>8} {:>8}".format(*heading))
    for r in result.rows:
        budget = "-" if r.budget is None else str(r.budget)
        nodes = "-" if r.nodes is None else str(r.nodes)
        print(
            f"{r.case:<20} {r.draft:<13} {r.candidates:>3} {budget:>6} {nodes:>5} {r.median_us:>10.1f} "
            f"{r.p10_us:>8.1f} {r.p90_us:>8.1f}"
        )
    for draft, ratios in result.lattice_over_fast.items():
        for budget, ratio in ratios.items():
            verdict = "within" if ratio <= GOAL_RATIO else "over"
            print(
                f"budget {budget}: build_lattice_tree / build_tree_fast on {draft!r} (K = {WIDTH}) = "
                f"{ratio:.2f} ({verdict} {GOAL_RATIO}x)"
            )


def main(argv: list[str] | None = None) -> None:
    formatter = argparse.RawDescriptionHelpFormatter
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=formatter)
    parser.add_argument("--out", type=Path, required=True, help="JSON report to write")
    parser.add_argument("--repeats", type=int, default=400, help="timed rounds (one call per case each)")
    parser.add_argument("--budgets", type=int, nargs="+", default=list(BUDGETS))
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--threads", type=int, default=1, help="torch intra-op threads (the timed calls are small)"
    )
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    result = report(measure(cases(args.budgets, args.seed), args.repeats), args.repeats)
    print_report(result)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(result.model_dump_json(indent=2) + "\n", encoding="utf-8")


if __name__ == "__main__":
    main()
