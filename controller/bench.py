"""Planner overhead in one run: microseconds per call of every way the controller plans a step.

    python -m bastion_sglang.controller.bench [--out controller_bench.json] [--repeats 20] [--device cpu|cuda]
        [--budgets 64 128 256 512 1024]

Rows (D = 15 depths, K = min(budget, 64) candidates per depth: the DFlash block of 16 minus the bonus):
- builders, budgets 64/128/256/512/1024: `lazy_heap` (the plain lazy heap of DDTree's Algorithm 1 on a host
  list: pop the best, push its next sibling and first child; no validation, host arrays out: the baseline),
  `build_tree` (the same heap behind the public API: validated, a DraftTree out), `build_tree_fast` (the
  exact threshold search: the same tree), and for a batch of 1, 8 and 32 the beam (`build_trees`, on the
  device) and the host builder (`build_trees_host`, which `build_trees_auto` takes off CUDA and for small
  CUDA batches, `builds_on_host`);
- fused adaptive planning at N_max = 1024 (`plan_adaptive@n`): the per-token step cost is tuned (bisection)
  so that the adaptive node count n* lands near 8, 32 and 128 on the K = 64 draft; next to it the unfused
  paths to the same tree (`build_tree+choose`, `build_tree_fast+choose`);
- the batch plan (`plan_batch`, adaptive, one common width) at B = 1, 8 and 32 for N_max = 256 and 1024,
  on trees built beforehand, every request at its own context.
Latency: an uncalibrated Qwen3-8B / H100 roofline. Prints a table (median, 10th and 90th percentile over the
repeats; `nodes`: the nodes returned, n* for adaptive plans, the common n for a batch plan), the ratios and
the issue's goals against the medians, and writes JSON. Nothing is asserted: the figures are for reading.
"""

from __future__ import annotations

import argparse
import heapq
import platform
import statistics
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np
import torch
from pydantic import BaseModel

from bastion_sglang.controller.adaptive_plan import plan_adaptive
from bastion_sglang.controller.batched import DraftTreeBatch, build_trees, build_trees_host
from bastion_sglang.controller.fast_tree import HostNodes, build_tree_fast, host_logprobs
from bastion_sglang.controller.latency import LatencyModel
from bastion_sglang.controller.policies import AdaptivePolicy, BatchPlan, plan_batch
from bastion_sglang.controller.profile import StepCosts
from bastion_sglang.controller.roofline import QWEN3_8B, RooflineModel, lookup_gpu
from bastion_sglang.controller.tree import ROOT, DraftTree, build_tree

BUDGETS = (64, 128, 256, 512, 1024)
DEPTHS = 15
WIDTH = 64
"""K at budgets >= 64."""
BUILDER_BATCHES = (1, 8, 32)
COSTS = StepCosts(t_draft=2.5e-3, t_aux=0.5e-3, l_ar=18e-3)
CONTEXT = 1024
ADAPTIVE_BUDGET = 1024
ADAPTIVE_TARGETS = (8, 32, 128)
TOKEN_COST_RANGE = (-12.0, -2.0)
"""log10 of the per-token step cost (seconds) searched for each n* target."""
PLAN_BATCHES = (1, 8, 32)
PLAN_BUDGETS = (256, 1024)
GOAL_BUILDER_RATIO = 4.0
"""Done-when: the exact builder at 1024 nodes this many times faster than the lazy heap (same run)."""
WARMUP_CALLS = 2
WARMUP_SECONDS = 2e-3
"""Warm-up of each case: a cold call of a 50 µs plan costs up to 1.3x a warm one, for about ten calls."""
GOAL_ADAPTIVE_US = 50.0
"""Done-when: fused adaptive planning with n* about 32 at N_max = 1024, microseconds (CPU)."""
GOAL_PLAN_US = 1000.0
"""Done-when: the batch plan at B = 32, N_max = 256, microseconds (CPU)."""

Case = tuple[str, int, Callable[[], object]]
"""(name, batch, the call timed)."""


class BenchRow(BaseModel):
    builder: str
    device: str
    batch: int
    budget: int
    depths: int
    candidates: int
    median_us: float
    p10_us: float
    p90_us: float
    nodes: int | None = None  # nodes the call returns: the tree's size, n* or the batch plan's common n


class BenchReport(BaseModel):
    host: str
    torch_version: str
    device_name: str
    rows: list[BenchRow]


def _timed(fn: Callable[[], object], device: torch.device, repeats: int) -> list[float]:
    """Wall times in microseconds of `repeats` calls (synchronising on CUDA) after a warm-up of at least
    WARMUP_CALLS calls and WARMUP_SECONDS: the first calls after another case run measurably slower."""
    started, calls = time.perf_counter(), 0
    while calls < WARMUP_CALLS or time.perf_counter() - started < WARMUP_SECONDS:
        fn()
        calls += 1
    samples = []
    for _ in range(repeats):
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        start = time.perf_counter()
        fn()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        samples.append((time.perf_counter() - start) * 1e6)
    return samples


def _draft(batch: int, width: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """[batch, DEPTHS, width] float32 top-K log-probs and token ids of random drafter logits (seeded)."""
    generator = torch.Generator().manual_seed(0)
    logits = 3.0 * torch.randn(batch, DEPTHS, 4 * width, generator=generator)
    top = torch.log_softmax(logits, -1).topk(width, -1)
    return top.values.to(device), top.indices.to(device)


def lazy_heap(lattice: np.ndarray, budget: int) -> HostNodes:
    """The plain lazy heap (DDTree's Algorithm 1) on a host list: pop the best, push its next sibling and its
    first child; the first `budget` pops, with no validation. lattice: [D, K] float64 host log-probs, rows
    sorted descending. The baseline of the exact builder (the same nodes as `build_tree`)."""
    rows = lattice.tolist()
    depth_count, width = lattice.shape
    heap: list[tuple[float, int, tuple[int, ...], int, float]] = [(-rows[0][0], 1, (0,), ROOT, rows[0][0])]
    scores: list[float] = []
    parents: list[int] = []
    depths: list[int] = []
    ranks: list[int] = []
    while heap and len(scores) < budget:
        _, depth, path, parent, score = heapq.heappop(heap)
        index = len(scores)
        scores.append(score)
        parents.append(parent)
        depths.append(depth)
        ranks.append(path[-1])
        if path[-1] + 1 < width:
            sibling = (0.0 if parent == ROOT else scores[parent]) + rows[depth - 1][path[-1] + 1]
            heapq.heappush(heap, (-sibling, depth, (*path[:-1], path[-1] + 1), parent, sibling))
        if depth < depth_count:
            child = score + rows[depth][0]
            heapq.heappush(heap, (-child, depth + 1, (*path, 0), index, child))
    return HostNodes(np.array(scores), np.array(parents), np.array(depths), np.array(ranks))


def _nodes(result: object) -> int | None:
    """Nodes a timed call returned: a tree's size, a batch's nodes per row, a plan's widest count."""
    if isinstance(result, DraftTree | HostNodes):
        return len(result)
    if isinstance(result, DraftTreeBatch):
        return result.num_nodes
    if isinstance(result, BatchPlan):
        return max(result.node_counts)
    return None


def _measure(
    cases: list[Case], device: torch.device, repeats: int, budget: int, width: int
) -> list[BenchRow]:
    rows = []
    for name, batch, fn in cases:
        samples = sorted(_timed(fn, device, repeats))
        rows.append(
            BenchRow(
                builder=name,
                device=device.type,
                batch=batch,
                budget=budget,
                depths=DEPTHS,
                candidates=width,
                median_us=statistics.median(samples),
                p10_us=samples[int(0.1 * (len(samples) - 1))],
                p90_us=samples[int(0.9 * (len(samples) - 1))],
                nodes=_nodes(fn()),
            )
        )
    return rows


def _builder_cases(budget: int, device: torch.device) -> list[Case]:
    """The heap, the exact builder, and the beam against the host builder for batches, K = min(budget, 64)."""
    width = min(budget, WIDTH)
    logprobs, token_ids = _draft(1, width, device)
    lp, ids = logprobs[0], token_ids[0]
    cases: list[Case] = [
        ("lazy_heap", 1, lambda: lazy_heap(host_logprobs(lp), budget)),
        ("build_tree", 1, lambda: build_tree(lp, ids, budget)),
        ("build_tree_fast", 1, lambda: build_tree_fast(lp, ids, budget)),
    ]
    for batch in BUILDER_BATCHES:
        lp_b, ids_b = _draft(batch, width, device)
        cases += [
            ("build_trees", batch, lambda lp=lp_b, ids=ids_b: build_trees(lp, ids, budget)),
            ("build_trees_host", batch, lambda lp=lp_b, ids=ids_b: build_trees_host(lp, ids, budget)),
        ]
    return cases


def _costs_for_target(target: int, scores: torch.Tensor, latency: LatencyModel) -> StepCosts:
    """COSTS with the per-token step cost whose adaptive n* on `scores` ([N] best-first log ρ) is nearest to
    `target`: bisection on log10 of the cost over TOKEN_COST_RANGE (n* shrinks as the cost grows)."""
    low, high = TOKEN_COST_RANGE
    tried: list[tuple[int, StepCosts]] = []
    for _ in range(40):
        middle = (low + high) / 2
        costs = StepCosts(
            t_draft=COSTS.t_draft, t_aux=COSTS.t_aux, l_ar=COSTS.l_ar, t_aux_per_token=10.0**middle
        )
        nodes = AdaptivePolicy().choose(scores, CONTEXT, latency, costs)
        tried.append((nodes, costs))
        if nodes > target:
            low = middle
        else:
            high = middle
    return min(tried, key=lambda pair: abs(pair[0] - target))[1]


def _adaptive_cases(device: torch.device, latency: LatencyModel) -> list[Case]:
    """Fused adaptive planning at N_max = ADAPTIVE_BUDGET for each n* target, and the unfused paths to the
    same tree."""
    policy = AdaptivePolicy()
    logprobs, token_ids = _draft(1, WIDTH, device)
    lp, ids = logprobs[0], token_ids[0]
    scores = build_tree(lp, ids, ADAPTIVE_BUDGET).log_scores

    def unfused(build: Callable[..., DraftTree], costs: StepCosts) -> DraftTree:
        tree = build(lp, ids, ADAPTIVE_BUDGET)
        return tree.truncate(policy.choose(tree.log_scores, CONTEXT, latency, costs))

    cases: list[Case] = []
    for target in ADAPTIVE_TARGETS:
        costs = _costs_for_target(target, scores, latency)
        cases += [
            (
                f"plan_adaptive@{target}",
                1,
                lambda c=costs: plan_adaptive(lp, ids, ADAPTIVE_BUDGET, CONTEXT, latency, c),
            ),
            (f"build_tree+choose@{target}", 1, lambda c=costs: unfused(build_tree, c)),
            (f"build_tree_fast+choose@{target}", 1, lambda c=costs: unfused(build_tree_fast, c)),
        ]
    return cases


def _plan_cases(budget: int, device: torch.device, latency: LatencyModel) -> list[Case]:
    """The batch plan (adaptive, one common width) on trees of `budget` nodes built beforehand, each request
    at its own context (CONTEXT apart)."""
    policy = AdaptivePolicy()
    cases: list[Case] = []
    for batch in PLAN_BATCHES:
        trees = build_trees_host(*_draft(batch, min(budget, WIDTH), device), budget)
        contexts = [CONTEXT * (1 + i) for i in range(batch)]
        cases.append(
            (
                "plan_batch",
                batch,
                lambda t=trees, c=contexts: plan_batch(t, c, latency, COSTS, policy),
            )
        )
    return cases


def run(device: torch.device, repeats: int, budgets: tuple[int, ...] = BUDGETS) -> BenchReport:
    latency = LatencyModel(RooflineModel(QWEN3_8B, lookup_gpu("H100 SXM")))
    rows: list[BenchRow] = []
    for budget in budgets:
        rows += _measure(_builder_cases(budget, device), device, repeats, budget, min(budget, WIDTH))
    rows += _measure(_adaptive_cases(device, latency), device, repeats, ADAPTIVE_BUDGET, WIDTH)
    for budget in PLAN_BUDGETS:
        rows += _measure(_plan_cases(budget, device, latency), device, repeats, budget, min(budget, WIDTH))
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else platform.processor() or "cpu"
    return BenchReport(host=platform.node(), torch_version=torch.__version__, device_name=name, rows=rows)


def speedups(report: BenchReport) -> list[str]:
    """Lines comparing medians of the same run: the exact builder over both heaps per budget, the host
    builder against the beam per batch, fused adaptive planning against the unfused paths, and the goals."""
    median = {(row.builder, row.budget, row.batch): row.median_us for row in report.rows}
    budgets = sorted({row.budget for row in report.rows if row.builder == "build_tree_fast"})
    lines = []
    for budget in budgets:
        fast = median[("build_tree_fast", budget, 1)]
        heap, public_heap = median[("lazy_heap", budget, 1)], median[("build_tree", budget, 1)]
        lines.append(
            f"build_tree_fast, budget {budget}: {heap / fast:.1f}x the lazy heap, "
            f"{public_heap / fast:.1f}x build_tree"
        )
        for batch in BUILDER_BATCHES:
            beam, host = median[("build_trees", budget, batch)], median[("build_trees_host", budget, batch)]
            winner = "beam" if beam < host else "host builder"
            lines.append(
                f"  batch {batch}: beam {beam:.0f} µs, host builder {host:.0f} µs: the {winner} wins"
            )
    for target in ADAPTIVE_TARGETS:
        fused = median[(f"plan_adaptive@{target}", ADAPTIVE_BUDGET, 1)]
        heap = median[(f"build_tree+choose@{target}", ADAPTIVE_BUDGET, 1)]
        fast = median[(f"build_tree_fast+choose@{target}", ADAPTIVE_BUDGET, 1)]
        lines.append(
            f"plan_adaptive@{target}: {fused:.0f} µs, {heap / fused:.1f}x build_tree+choose, "
            f"{fast / fused:.1f}x build_tree_fast+choose"
        )
    return lines + goals(report)


def goals(report: BenchReport) -> list[str]:
    """The issue's done-when lines (CPU figures; ratios hold for any device) against this run's medians."""
    median = {(row.builder, row.budget, row.batch): row.median_us for row in report.rows}
    lines = []
    if ("build_tree_fast", 1024, 1) in median:
        fast = median[("build_tree_fast", 1024, 1)]
        for baseline in ("lazy_heap", "build_tree"):
            ratio = median[(baseline, 1024, 1)] / fast
            met = "met" if ratio >= GOAL_BUILDER_RATIO else "not met"
            lines.append(
                f"goal: exact tree of 1024 nodes >= {GOAL_BUILDER_RATIO:.0f}x faster than {baseline}: "
                f"{ratio:.2f}x ({fast:.0f} µs), {met}"
            )
    adaptive = median[("plan_adaptive@32", ADAPTIVE_BUDGET, 1)]
    met = "met" if adaptive <= GOAL_ADAPTIVE_US else "not met"
    lines.append(
        f"goal: adaptive planning, n* ~ 32, N_max 1024 <= {GOAL_ADAPTIVE_US:.0f} µs: {adaptive:.1f} µs, {met}"
    )
    plan = median[("plan_batch", 256, 32)]
    met = "met" if plan <= GOAL_PLAN_US else "not met"
    lines.append(f"goal: batch plan, B = 32, N_max 256 <= {GOAL_PLAN_US:.0f} µs: {plan:.1f} µs, {met}")
    return lines


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--out", type=Path, default=Path("controller_bench.json"), help="JSON output path")
    parser.add_argument("--repeats", type=int, default=20, help="timed calls per case (after 2 warm-ups)")
    parser.add_argument(
        "--device",
        choices=("cpu", "cuda"),
        default="cuda" if torch.cuda.is_available() else "cpu",
        help="device for the tensors (default: cuda when available)",
    )
    parser.add_argument(
        "--budgets",
        type=int,
        nargs="+",
        default=list(BUDGETS),
        help="tree budgets of the builder rows (default: %(default)s)",
    )
    args = parser.parse_args(argv)
    if args.repeats < 1:
        parser.error(f"--repeats must be >= 1, got {args.repeats}")
    if any(budget < 1 for budget in args.budgets):
        parser.error(f"--budgets must be positive, got {args.budgets}")
    if args.device == "cuda" and not torch.cuda.is_available():
        parser.error("--device cuda: no CUDA device is available")
    report = run(torch.device(args.device), args.repeats, tuple(args.budgets))
    print(
        f"{'builder':<30} {'device':<6} {'batch':>5} {'budget':>6} {'K':>3} {'nodes':>5} "
        f"{'median µs':>10} {'p10 µs':>9} {'p90 µs':>9}"
    )
    for row in report.rows:
        nodes = "" if row.nodes is None else str(row.nodes)
        print(
            f"{row.builder:<30} {row.device:<6} {row.batch:>5} {row.budget:>6} {row.candidates:>3} "
            f"{nodes:>5} {row.median_us:>10.1f} {row.p10_us:>9.1f} {row.p90_us:>9.1f}"
        )
    for line in speedups(report):
        print(line)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(report.model_dump_json(indent=2))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
