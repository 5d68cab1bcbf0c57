"""plan_adaptive against the unfused path: build the whole tree, take AdaptivePolicy's first drop, cut."""

from __future__ import annotations

import math
import types

import numpy as np
import pytest
import torch
from calibration_profiles import QWEN3_8B
from test_fast_tree import BAD_DRAFTS

from bastion_sglang.controller import adaptive_plan
from bastion_sglang.controller.adaptive_plan import plan_adaptive
from bastion_sglang.controller.fast_tree import HostNodes
from bastion_sglang.controller.latency import LatencyFit, LatencyModel
from bastion_sglang.controller.policies import AdaptivePolicy
from bastion_sglang.controller.profile import StepCosts
from bastion_sglang.controller.roofline import RooflineModel, lookup_gpu
from bastion_sglang.controller.tree import DraftTree, build_tree

BUCKETS = (1, 2, 4, 8, 16, 32, 64, 96, 128, 192, 256, 384, 512, 768, 1024, 1025)
TOKEN_COSTS = (0.0, 1e-6, 1e-5, 3e-5, 1e-4, 1e-3)
"""Per-token step costs, seconds: from no marginal cost (n* near N_max) to a steep one (n* of a few nodes)."""


def latency_models() -> dict[str, LatencyModel]:
    """Uncalibrated rooflines on two GPUs, a calibrated fit, one padded to width buckets (a step cost), and
    one after an observed pass (the online correction moved)."""
    fit = LatencyFit(beta_fixed=4e-3, alpha_gemm=1.4, alpha_tok=0.0, alpha_attn=1.1, alpha_kv=1.5)
    corrected = LatencyModel(RooflineModel(QWEN3_8B, lookup_gpu("A100-SXM4-80GB")))
    corrected.observe(64, 2048, 0.05)
    return {
        "h100": LatencyModel(RooflineModel(QWEN3_8B, lookup_gpu("H100 SXM"))),
        "l4": LatencyModel(RooflineModel(QWEN3_8B, lookup_gpu("L4"))),
        "fit": LatencyModel(RooflineModel(QWEN3_8B, lookup_gpu("H100 SXM")), fit=fit),
        "buckets": LatencyModel(
            RooflineModel(QWEN3_8B, lookup_gpu("H100 SXM")), fit=fit, width_buckets=BUCKETS
        ),
        "corrected": corrected,
    }


def costs(per_token: float) -> StepCosts:
    return StepCosts(t_draft=2.5e-3, t_aux=0.5e-3, l_ar=18e-3, t_aux_per_token=per_token)


def draft(
    seed: int, depth: int = 15, width: int = 64, sharpness: float = 3.0
) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    logits = sharpness * torch.randn(depth, 4 * width, generator=generator, dtype=torch.float64)
    top = torch.log_softmax(logits, -1).topk(width, -1)
    return top.values, top.indices


def unfused(
    logprobs: torch.Tensor,
    token_ids: torch.Tensor,
    budget: int,
    ctx: int,
    model: LatencyModel,
    step: StepCosts,
) -> DraftTree:
    tree = build_tree(logprobs, token_ids, budget)
    return tree.truncate(AdaptivePolicy().choose(tree.log_scores, ctx, model, step))


def assert_same_tree(got: DraftTree, want: DraftTree, context: object = None) -> None:
    assert len(got) == len(want), context
    for field in ("tokens", "parents", "depths", "log_scores"):
        assert getattr(got, field).dtype == getattr(want, field).dtype, (field, context)
        assert torch.equal(getattr(got, field), getattr(want, field)), (field, context)


@pytest.mark.parametrize("name", ["h100", "l4", "fit", "buckets", "corrected"])
@pytest.mark.parametrize("seed", range(4))
def test_matches_full_build_then_first_drop(name: str, seed: int) -> None:
    model = latency_models()[name]
    logprobs, token_ids = draft(seed, sharpness=[3.0, 1.5, 6.0, 3.0][seed])
    sizes = set()
    for per_token in TOKEN_COSTS:
        for budget, ctx in ((1024, 1024), (300, 8192), (64, 64)):
            step = costs(per_token)
            want = unfused(logprobs, token_ids, budget, ctx, model, step)
            assert_same_tree(
                plan_adaptive(logprobs, token_ids, budget, ctx, model, step), want, (per_token, budget)
            )
            sizes.add(len(want))
    assert len(sizes) >= 4  # the costs spread n* from a few nodes to the budget


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_narrow_drafts_match_full_build(dtype: torch.dtype) -> None:
    # The heap phase reads a float32 (or widened half-precision) draft as it is and the chunk phase widens it
    # to float64: both must give build_tree's float64 scores. Half precision also makes exact ties.
    model = latency_models()["fit"]
    logprobs, token_ids = draft(5)
    narrow = logprobs.to(dtype)
    sizes = set()
    for per_token in TOKEN_COSTS:
        want = unfused(narrow, token_ids, 1024, 1024, model, costs(per_token))
        got = plan_adaptive(narrow, token_ids, 1024, 1024, model, costs(per_token))
        assert_same_tree(got, want, per_token)
        sizes.add(len(want))
    assert min(sizes) < adaptive_plan.HEAP_NODES < max(sizes)  # both phases decided


@pytest.mark.parametrize("heap_nodes", [1, 2, 3, 7])
@pytest.mark.parametrize("cost_chunk", [1, 5, 4096])
def test_every_chunk_boundary(monkeypatch: pytest.MonkeyPatch, heap_nodes: int, cost_chunk: int) -> None:
    # A tiny heap phase puts n* on and next to the heap's limit and the chunk boundaries, and asks the latency
    # model for widths many times.
    monkeypatch.setattr(adaptive_plan, "HEAP_NODES", heap_nodes)
    monkeypatch.setattr(adaptive_plan, "COST_CHUNK", cost_chunk)
    model = latency_models()["fit"]
    logprobs, token_ids = draft(11, depth=6, width=8)
    for per_token in (*TOKEN_COSTS, 2e-5, 5e-5, 3e-4):
        for budget in (1, 2, 3, 5, 17, 200):
            want = unfused(logprobs, token_ids, budget, 512, model, costs(per_token))
            got = plan_adaptive(logprobs, token_ids, budget, 512, model, costs(per_token))
            assert_same_tree(got, want, (per_token, budget))


@pytest.mark.parametrize("error", [-1e-3, 1e-3])
def test_the_running_estimate_never_decides(monkeypatch: pytest.MonkeyPatch, error: float) -> None:
    # The heap phase's running Ŝ only says when to check exactly: skewed by a relative error of 0.1 %, it
    # fires early or late, and the answer stays that of the full build.
    skewed = types.SimpleNamespace(exp=lambda x: math.exp(x) * (1.0 + error), inf=math.inf)
    monkeypatch.setattr(adaptive_plan, "math", skewed)
    model = latency_models()["fit"]
    for seed in range(3):
        logprobs, token_ids = draft(seed, sharpness=[3.0, 1.5, 6.0][seed])
        for per_token in (*TOKEN_COSTS, 2e-5, 5e-5, 3e-4):
            want = unfused(logprobs, token_ids, 300, 2048, model, costs(per_token))
            got = plan_adaptive(logprobs, token_ids, 300, 2048, model, costs(per_token))
            assert_same_tree(got, want, (seed, per_token))


def test_ties_and_small_lattices() -> None:
    model = latency_models()["h100"]
    tied = torch.tensor(
        [[-0.5, -0.5, -1.0], [-0.5, -0.5, -0.5], [0.0, -1.0, float("-inf")]], dtype=torch.float64
    )
    token_ids = torch.arange(9).reshape(3, 3)
    for per_token in TOKEN_COSTS:
        for budget in (1, 4, 13, 39, 100):  # 39 = the lattice: the budget caps nothing past it
            want = unfused(tied, token_ids, budget, 100, model, costs(per_token))
            assert_same_tree(
                plan_adaptive(tied, token_ids, budget, 100, model, costs(per_token)), want, budget
            )


@pytest.mark.parametrize(("per_token", "chunks"), [(1e-4, []), (0.0, [256, 1024])])
def test_builds_no_chunk_past_the_drop(
    monkeypatch: pytest.MonkeyPatch, per_token: float, chunks: list[int]
) -> None:
    # A steep per-token cost: the heap phase finds the drop and no chunk is built. No per-token cost: n* lies
    # past a heap phase of 64 nodes and the prefix grows 256, 1024 (= N_max).
    monkeypatch.setattr(adaptive_plan, "HEAP_NODES", 64)
    built: list[int] = []
    real = adaptive_plan.best_first_nodes

    def recording(lattice: np.ndarray, budget: int) -> HostNodes:
        built.append(budget)
        return real(lattice, budget)

    monkeypatch.setattr(adaptive_plan, "best_first_nodes", recording)
    logprobs, token_ids = draft(3)
    model = latency_models()["h100"]
    tree = plan_adaptive(logprobs, token_ids, 1024, 1024, model, costs(per_token))
    assert len(tree) == len(unfused(logprobs, token_ids, 1024, 1024, model, costs(per_token)))
    assert (len(tree) < adaptive_plan.HEAP_NODES) == (not chunks)
    assert built == chunks


def test_zero_budget_plans_nothing() -> None:
    logprobs, token_ids = draft(0)
    tree = plan_adaptive(logprobs.float(), token_ids, 0, 1024, latency_models()["h100"], costs(0.0))
    assert len(tree) == 0
    assert tree.tokens.dtype == torch.int64 and tree.log_scores.dtype == torch.float64
    # like AdaptivePolicy.choose on an empty tree, nothing is asked of the latency model
    assert len(plan_adaptive(logprobs, token_ids, 0, -1, latency_models()["h100"], costs(0.0))) == 0


@pytest.mark.parametrize("chunk", [2, 4096])
def test_latency_errors_raise_as_choose(monkeypatch: pytest.MonkeyPatch, chunk: int) -> None:
    # With chunks of 2 the drop (a steep per-token cost: n* of a few nodes) comes long before width 101,
    # yet the plan raises as `choose` does on the whole tree.
    monkeypatch.setattr(adaptive_plan, "HEAP_NODES", chunk)
    monkeypatch.setattr(adaptive_plan, "COST_CHUNK", chunk)
    narrow = LatencyModel(RooflineModel(QWEN3_8B, lookup_gpu("H100 SXM")), width_buckets=(2, 4, 8, 16))
    logprobs, token_ids = draft(1)
    assert 0 < len(unfused(logprobs, token_ids, 15, 1024, narrow, costs(1e-3))) < 4
    for budget, ctx in ((100, 1024), (8, -5)):  # widths past the largest bucket; a negative context
        with pytest.raises(ValueError) as full:
            unfused(logprobs, token_ids, budget, ctx, narrow, costs(1e-3))
        with pytest.raises(ValueError) as fused:
            plan_adaptive(logprobs, token_ids, budget, ctx, narrow, costs(1e-3))
        assert str(fused.value) == str(full.value)


@pytest.mark.parametrize(("logprobs", "token_ids", "budget"), BAD_DRAFTS)
def test_bad_input_raises_as_build_tree(logprobs: torch.Tensor, token_ids: torch.Tensor, budget: int) -> None:
    with pytest.raises(ValueError) as heap_error:
        build_tree(logprobs, token_ids, budget)
    with pytest.raises(ValueError) as fused_error:
        plan_adaptive(logprobs, token_ids, budget, 1024, latency_models()["h100"], costs(0.0))
    assert str(fused_error.value) == str(heap_error.value)
