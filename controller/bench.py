"""Planner overhead: microseconds per plan for the heap (`build_tree`), the exact threshold search
(`build_tree_fast`, the same tree), the beam (`build_trees`) and the adaptive budget choice on an uncalibrated
Qwen3-8B / H100 roofline (`adaptive_choose`: the first drop of Ŝ over one tree; `plan_batch`: one common width
for the batch), per device; then fused adaptive planning (`plan_adaptive`) at N_max = 1024.

    python -m bastion_sglang.controller.bench [--out controller_bench.json] [--repeats 20] [--device cpu|cuda]

Budgets 64/128/256/512/1024 with D = 15 depths and K = min(budget, 64) candidates per depth (the DFlash
block of 16 minus the bonus). Batch 1 and 32 for the beam. Fused planning: the per-token step cost is tuned
(bisection) so that the adaptive node count n* lands near 8, 32 and 128 on the K = 64 draft; each target
times `plan_adaptive` next to today's unfused paths to the same n* (`build_tree+choose` and
`build_tree_fast+choose`), and `predict_many` times the one latency-model call every adaptive plan makes.
Prints a table (median, 10th and 90th percentile over the repeats; `nodes`: the nodes returned, n* for
adaptive plans) and the speedups, and writes JSON. Nothing is asserted: the figures are for reading (goal:
planning well under 2% of a verify pass).
"""

from __future__ import annotations

import argparse
import platform
import statistics
import time
from collections.abc import Callable
from pathlib import Path

import torch
from pydantic import BaseModel

from bastion_sglang.controller.adaptive_plan import plan_adaptive
from bastion_sglang.controller.batched import DraftTreeBatch, build_trees
from bastion_sglang.controller.fast_tree import build_tree_fast
from bastion_sglang.controller.latency import LatencyModel
from bastion_sglang.controller.policies import AdaptivePolicy, BatchPlan, plan_batch
from bastion_sglang.controller.profile import StepCosts
from bastion_sglang.controller.roofline import ModelShape, RooflineModel, lookup_gpu
from bastion_sglang.controller.tree import DraftTree, build_tree

BUDGETS = (64, 128, 256, 512, 1024)
DEPTHS = 15
QWEN3_8B = ModelShape(
    num_layers=36,
    hidden_size=4096,
    num_q_heads=32,
    num_kv_heads=8,
    head_dim=128,
    ffn_size=12288,
    vocab_size=151936,
)
COSTS = StepCosts(t_draft=2.5e-3, t_aux=0.5e-3, l_ar=18e-3)
CONTEXT = 1024
ADAPTIVE_BUDGET = 1024
ADAPTIVE_WIDTH = 64
ADAPTIVE_TARGETS = (8, 32, 128)
TOKEN_COST_RANGE = (-12.0, -2.0)
"""log10 of the per-token step cost (seconds) searched for each n* target."""

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
    nodes: int | None = None  # nodes the call returns: the tree's size, or n* for adaptive plans


class BenchReport(BaseModel):
    host: str
    torch_version: str
    device_name: str
    rows: list[BenchRow]


def _timed(fn: Callable[[], object], device: torch.device, repeats: int) -> list[float]:
    """Wall times in microseconds of `repeats` calls after two warm-up calls (synchronising on CUDA)."""
    for _ in range(2):
        fn()
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
    generator = torch.Generator().manual_seed(0)
    logits = 3.0 * torch.randn(batch, DEPTHS, 4 * width, generator=generator)
    top = torch.log_softmax(logits, -1).topk(width, -1)
    return top.values.to(device), top.indices.to(device)


def _nodes(result: object) -> int | None:
    """Nodes a timed call returned: a tree's size, a batch's nodes per row, a node count, a plan's widest."""
    if isinstance(result, DraftTree):
        return len(result)
    if isinstance(result, DraftTreeBatch):
        return result.num_nodes
    if isinstance(result, BatchPlan):
        return max(result.node_counts)
    if isinstance(result, int):
        return result
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


def _budget_cases(budget: int, device: torch.device, latency: LatencyModel) -> list[Case]:
    """Tree builders and the adaptive choice at one budget, K = min(budget, 64)."""
    policy = AdaptivePolicy()
    width = min(budget, 64)
    logprobs, token_ids = _draft(1, width, device)
    lp, ids = logprobs[0], token_ids[0]
    cases: list[Case] = [
        ("build_tree", 1, lambda: build_tree(lp, ids, budget)),
        ("build_tree_fast", 1, lambda: build_tree_fast(lp, ids, budget)),
    ]
    for batch in (1, 32):
        lp_b, ids_b = _draft(batch, width, device)
        cases.append(("build_trees", batch, lambda lp=lp_b, ids=ids_b: build_trees(lp, ids, budget)))
    scores = build_tree(lp, ids, budget).log_scores
    cases.append(("adaptive_choose", 1, lambda: policy.choose(scores, CONTEXT, latency, COSTS)))
    trees = build_trees(*_draft(32, width, device), budget)
    cases.append(
        (
            "plan_batch",
            32,
            lambda: plan_batch(trees, [CONTEXT] * 32, latency, COSTS, policy, common_width=True),
        )
    )
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
    """Fused adaptive planning at N_max = ADAPTIVE_BUDGET for each n* target, the unfused paths to the same
    tree, and the latency call all of them make."""
    policy = AdaptivePolicy()
    logprobs, token_ids = _draft(1, ADAPTIVE_WIDTH, device)
    lp, ids = logprobs[0], token_ids[0]
    scores = build_tree(lp, ids, ADAPTIVE_BUDGET).log_scores
    widths = torch.arange(2, ADAPTIVE_BUDGET + 2, device=device)
    cases: list[Case] = [("predict_many", 1, lambda: latency.predict_many(widths, CONTEXT))]

    def unfused(build: Callable[..., DraftTree], costs: StepCosts) -> DraftTree:
        tree = build(lp, ids, ADAPTIVE_BUDGET)
        return tree.truncate(policy.choose(tree.log_scores, CONTEXT, latency, costs))

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


def run(device: torch.device, repeats: int) -> BenchReport:
    latency = LatencyModel(RooflineModel(QWEN3_8B, lookup_gpu("H100 SXM")))
    rows: list[BenchRow] = []
    for budget in BUDGETS:
        rows += _measure(_budget_cases(budget, device, latency), device, repeats, budget, min(budget, 64))
    rows += _measure(_adaptive_cases(device, latency), device, repeats, ADAPTIVE_BUDGET, ADAPTIVE_WIDTH)
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else platform.processor() or "cpu"
    return BenchReport(host=platform.node(), torch_version=torch.__version__, device_name=name, rows=rows)


def speedups(report: BenchReport) -> list[str]:
    """Lines comparing medians of the same run: fast builder over the heap per budget, fused adaptive planning
    over the unfused paths per n* target."""
    median = {(row.builder, row.budget, row.batch): row.median_us for row in report.rows}
    lines = [
        f"build_tree_fast vs build_tree, budget {budget}: "
        f"{median[('build_tree', budget, 1)] / median[('build_tree_fast', budget, 1)]:.1f}x"
        for budget in BUDGETS
    ]
    for target in ADAPTIVE_TARGETS:
        fused = median[(f"plan_adaptive@{target}", ADAPTIVE_BUDGET, 1)]
        heap = median[(f"build_tree+choose@{target}", ADAPTIVE_BUDGET, 1)]
        fast = median[(f"build_tree_fast+choose@{target}", ADAPTIVE_BUDGET, 1)]
        lines.append(
            f"plan_adaptive@{target} vs build_tree+choose: {heap / fused:.1f}x, "
            f"vs build_tree_fast+choose: {fast / fused:.1f}x"
        )
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
    args = parser.parse_args(argv)
    if args.repeats < 1:
        parser.error(f"--repeats must be >= 1, got {args.repeats}")
    if args.device == "cuda" and not torch.cuda.is_available():
        parser.error("--device cuda: no CUDA device is available")
    report = run(torch.device(args.device), args.repeats)
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
