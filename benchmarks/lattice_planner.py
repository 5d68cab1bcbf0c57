"""Planning time of DFlash2 lattice trees for a batch on the host: `build_lattice_trees` end to end, its two
node searches alone, and the Python heap it is tested against.

    python benchmarks/lattice_planner.py --out lattice_planner.json [--batch 32] [--budgets 32 64 256]
        [--scales 1 3 6] [--repeats 30] [--threads 1]

Cases: B lattices of D = 16 slots and K = 8 candidates (DFlash's default topk), selector log-probs of random
scores times `scale` (1: flat rows, bushy trees; 6: peaked rows, deep trees), slot 0's rows one row as
SGLang's; every budget. Per case, in turns, one call each per round, after a warm-up and a check that all
return the same nodes:
- `build_lattice_trees` (what the worker calls: the capped lattice to the host, the node search, the
  stacked trees), whose search is the compiled heap of `controller.lattice_heap` where Numba imports;
- the compiled heap alone (`best_first_by_compiled_heap` on the host lattice);
- the numpy threshold search alone (`lattice_batched.best_first_batch`: the search where Numba is missing);
- `build_lattice_trees_by_heap` (the Python heap, row by row). Both are measured in process CPU time
(`time.process_time`), which a busy shared host disturbs less than wall time, and in wall time. Prints the
median, 10th and 90th percentile milliseconds per call, and writes them as JSON. Nothing is asserted: the
figures are for reading; the goal is GOAL_MS per `build_lattice_trees` call at B = 32 and 256 nodes.
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

import numpy as np
import torch
from pydantic import BaseModel

from bastion_sglang.controller.lattice_batched import best_first_batch
from bastion_sglang.controller.lattice_heap import best_first_by_compiled_heap
from bastion_sglang.controller.lattice_tree import (
    build_lattice_trees,
    build_lattice_trees_by_heap,
    selector_logprobs,
)

DEPTHS = 16
WIDTH = 8
VOCAB = 1000
"""Token ids are drawn from this many, distinct within a slot."""
GOAL_MS = 1.0
WARMUP_CALLS = 3


class Timing(BaseModel):
    median_ms: float
    p10_ms: float
    p90_ms: float


class Row(BaseModel):
    """One case: process CPU time per call of each builder, and wall time of the end-to-end ones."""

    scale: float
    budget: int
    trees_cpu: Timing
    compiled_heap_cpu: Timing
    numpy_search_cpu: Timing
    python_heap_cpu: Timing
    trees_wall: Timing
    python_heap_wall: Timing


class Report(BaseModel):
    processor: str
    cpu_count: int | None
    load_average: tuple[float, float, float]
    torch_threads: int
    torch_version: str
    commit: str | None
    batch: int
    depths: int
    width: int
    repeats: int
    rows: list[Row]


def lattices(batch: int, scale: float, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """[B, D, K, K] float32 selector log-probs of scores scaled by `scale`, and [B, D, K] int64 ids."""
    generator = torch.Generator().manual_seed(seed)
    lattice = selector_logprobs(scale * torch.randn(batch, DEPTHS, WIDTH, WIDTH, generator=generator))
    lattice[:, 0] = lattice[:, 0, :1].clone()
    ids = torch.argsort(torch.rand(batch, DEPTHS, VOCAB, generator=generator), -1)[..., :WIDTH]
    return lattice, ids


def timing(samples: list[float]) -> Timing:
    ordered = sorted(samples)
    return Timing(
        median_ms=statistics.median(ordered) * 1e3,
        p10_ms=ordered[int(0.1 * (len(ordered) - 1))] * 1e3,
        p90_ms=ordered[int(0.9 * (len(ordered) - 1))] * 1e3,
    )


def measure(calls: list[Callable[[], object]], repeats: int) -> list[tuple[list[float], list[float]]]:
    """(process CPU seconds, wall seconds) per call of each of `calls`, timed in turns, `repeats` rounds."""
    for call in calls:
        for _ in range(WARMUP_CALLS):
            call()
    samples: list[tuple[list[float], list[float]]] = [([], []) for _ in calls]
    for _ in range(repeats):
        for call, (cpu, wall) in zip(calls, samples, strict=True):
            start_cpu, start_wall = time.process_time(), time.perf_counter()
            call()
            cpu.append(time.process_time() - start_cpu)
            wall.append(time.perf_counter() - start_wall)
    return samples


def case(batch: int, scale: float, budget: int, repeats: int, seed: int) -> Row:
    lattice, ids = lattices(batch, scale, seed)
    values = lattice.to(torch.float64).numpy()
    trees, heap = build_lattice_trees(lattice, ids, budget), build_lattice_trees_by_heap(lattice, ids, budget)
    for field in ("tokens", "parents", "depths", "log_scores"):
        if not torch.equal(getattr(trees, field), getattr(heap, field)):
            raise RuntimeError(f"the trees differ from the heap's in {field} (scale {scale}, {budget})")
    compiled, searched = (
        best_first_by_compiled_heap(values, None, budget),
        best_first_batch(values, None, budget),
    )
    for field in ("scores", "parents", "depths", "candidates"):
        if not np.array_equal(getattr(compiled, field), getattr(searched, field)):
            raise RuntimeError(f"the two searches differ in {field} (scale {scale}, {budget})")
    (trees_cpu, trees_wall), (compiled_cpu, _), (numpy_cpu, _), (heap_cpu, heap_wall) = measure(
        [
            lambda: build_lattice_trees(lattice, ids, budget),
            lambda: best_first_by_compiled_heap(values, None, budget),
            lambda: best_first_batch(values, None, budget),
            lambda: build_lattice_trees_by_heap(lattice, ids, budget),
        ],
        repeats,
    )
    return Row(
        scale=scale,
        budget=budget,
        trees_cpu=timing(trees_cpu),
        compiled_heap_cpu=timing(compiled_cpu),
        numpy_search_cpu=timing(numpy_cpu),
        python_heap_cpu=timing(heap_cpu),
        trees_wall=timing(trees_wall),
        python_heap_wall=timing(heap_wall),
    )


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


def print_report(result: Report) -> None:
    print(
        f"{result.processor}, {result.cpu_count} CPUs, load {result.load_average}, "
        f"torch {result.torch_version} ({result.torch_threads} threads), commit {result.commit}; "
        f"B = {result.batch}, D = {result.depths}, K = {result.width}, {result.repeats} rounds"
    )
    heading = ("scale", "budget", "trees", "compiled heap", "numpy search", "python heap", "trees wall")
    print("{:>5} {:>6} {:>20} {:>20} {:>20} {:>20} {:>10}".format(*heading))

    def cell(value: Timing) -> str:
        return f"{value.median_ms:.3f} ({value.p10_ms:.2f}-{value.p90_ms:.2f})"

    for r in result.rows:
        cells = (
            cell(r.trees_cpu),
            cell(r.compiled_heap_cpu),
            cell(r.numpy_search_cpu),
            cell(r.python_heap_cpu),
        )
        print(
            f"{r.scale:>5} {r.budget:>6} "
            + " ".join(f"{c:>20}" for c in cells)
            + f" {r.trees_wall.median_ms:>10.3f}"
        )
    print(
        f"CPU ms per call, median (p10-p90); goal: {GOAL_MS} ms per build_lattice_trees at B = 32, 256 nodes"
    )


def main(argv: list[str] | None = None) -> None:
    formatter = argparse.RawDescriptionHelpFormatter
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=formatter)
    parser.add_argument("--out", type=Path, required=True, help="JSON report to write")
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--budgets", type=int, nargs="+", default=[32, 64, 256])
    parser.add_argument("--scales", type=float, nargs="+", default=[1.0, 3.0, 6.0])
    parser.add_argument("--repeats", type=int, default=30, help="timed rounds (one call per builder each)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--threads", type=int, default=1, help="torch intra-op threads")
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    rows = [
        case(args.batch, scale, budget, args.repeats, args.seed)
        for scale in args.scales
        for budget in args.budgets
    ]
    result = Report(
        processor=platform.processor() or platform.machine(),
        cpu_count=os.cpu_count(),
        load_average=os.getloadavg(),
        torch_threads=torch.get_num_threads(),
        torch_version=torch.__version__,
        commit=commit(),
        batch=args.batch,
        depths=DEPTHS,
        width=WIDTH,
        repeats=args.repeats,
        rows=rows,
    )
    print_report(result)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(result.model_dump_json(indent=2) + "\n", encoding="utf-8")


if __name__ == "__main__":
    main()
