"""The planner bench runs every row in one run and reads its goals off the same medians."""

from __future__ import annotations

import numpy as np
import torch

from bastion_sglang.controller import bench
from bastion_sglang.controller.fast_tree import host_logprobs
from bastion_sglang.controller.tree import build_tree


def test_lazy_heap_baseline_pops_the_heap_order() -> None:
    logprobs, token_ids = bench._draft(1, 16, torch.device("cpu"))
    for budget in (1, 7, 100):
        nodes = bench.lazy_heap(host_logprobs(logprobs[0]), budget)
        tree = build_tree(logprobs[0], token_ids[0], budget)
        assert np.array_equal(nodes.scores, tree.log_scores.numpy())
        assert np.array_equal(nodes.parents, tree.parents.numpy())
        assert np.array_equal(nodes.depths, tree.depths.numpy())


def test_one_run_reports_every_row_and_goal(tmp_path, capsys) -> None:
    out = tmp_path / "bench.json"
    bench.main(["--device", "cpu", "--repeats", "1", "--budgets", "64", "--out", str(out)])
    report = bench.BenchReport.model_validate_json(out.read_text())
    names = {(row.builder, row.batch, row.budget) for row in report.rows}
    for builder in ("lazy_heap", "build_tree", "build_tree_fast"):
        assert (builder, 1, 64) in names
    for batch in bench.BUILDER_BATCHES:
        assert ("build_trees", batch, 64) in names and ("build_trees_host", batch, 64) in names
    for target in bench.ADAPTIVE_TARGETS:
        row = next(row for row in report.rows if row.builder == f"plan_adaptive@{target}")
        assert abs(row.nodes - target) <= target // 4  # the tuned step cost lands n* near its target
    for budget in bench.PLAN_BUDGETS:
        for batch in bench.PLAN_BATCHES:
            assert ("plan_batch", batch, budget) in names
    printed = capsys.readouterr().out
    assert "goal: adaptive planning, n* ~ 32" in printed and "goal: batch plan, B = 32, N_max 256" in printed
