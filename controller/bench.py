"""Planner overhead: microseconds per plan for the heap (`build_tree`), the beam (`build_trees`) and the
adaptive budget choice on an uncalibrated Qwen3-8B / H100 roofline (`adaptive_choose`: the first drop of
Ŝ over one tree; `plan_batch`: one common width for the batch), per device.

    python -m bastion_sglang.controller.bench [--out controller_bench.json] [--repeats 20] [--device cpu|cuda]

Budgets 64/128/256/512/1024 with D = 15 depths and K = min(budget, 64) candidates per depth (the DFlash
block of 16 minus the bonus). Batch 1 and 32 for the beam. Prints a table and writes JSON. Nothing is
asserted: the figures are for reading (goal: planning well under 2% of a verify pass).
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

from bastion_sglang.controller.batched import build_trees
from bastion_sglang.controller.latency import LatencyModel
from bastion_sglang.controller.policies import AdaptivePolicy, plan_batch
from bastion_sglang.controller.profile import StepCosts
from bastion_sglang.controller.roofline import ModelShape, RooflineModel, lookup_gpu
from bastion_sglang.controller.tree import build_tree

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


class BenchRow(BaseModel):
    builder: str
    device: str
    batch: int
    budget: int
    depths: int
    candidates: int
    median_us: float
    p90_us: float


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


def run(device: torch.device, repeats: int) -> BenchReport:
    rows: list[BenchRow] = []
    latency = LatencyModel(RooflineModel(QWEN3_8B, lookup_gpu("H100 SXM")))
    policy = AdaptivePolicy()
    for budget in BUDGETS:
        width = min(budget, 64)
        cases: list[tuple[str, int, Callable[[], object]]] = []
        logprobs, token_ids = _draft(1, width, device)
        cases.append(
            ("build_tree", 1, lambda lp=logprobs, ids=token_ids, b=budget: build_tree(lp[0], ids[0], b))
        )
        for batch in (1, 32):
            lp_b, ids_b = _draft(batch, width, device)
            cases.append(("build_trees", batch, lambda lp=lp_b, ids=ids_b, b=budget: build_trees(lp, ids, b)))
        scores = build_tree(logprobs[0], token_ids[0], budget).log_scores
        cases.append(("adaptive_choose", 1, lambda sc=scores: policy.choose(sc, CONTEXT, latency, COSTS)))
        trees = build_trees(*_draft(32, width, device), budget)
        cases.append(
            (
                "plan_batch",
                32,
                lambda t=trees: plan_batch(t, [CONTEXT] * 32, latency, COSTS, policy, common_width=True),
            )
        )
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
                    p90_us=samples[int(0.9 * (len(samples) - 1))],
                )
            )
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else platform.processor() or "cpu"
    return BenchReport(host=platform.node(), torch_version=torch.__version__, device_name=name, rows=rows)


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
        f"{'builder':<16} {'device':<6} {'batch':>5} {'budget':>6} {'K':>3} {'median µs':>10} {'p90 µs':>10}"
    )
    for row in report.rows:
        print(
            f"{row.builder:<16} {row.device:<6} {row.batch:>5} {row.budget:>6} {row.candidates:>3} "
            f"{row.median_us:>10.1f} {row.p90_us:>10.1f}"
        )
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(report.model_dump_json(indent=2))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
