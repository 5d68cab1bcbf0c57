"""Budget policies and batch planning against brute force over every budget."""

from __future__ import annotations

import itertools

import pytest
import torch
from planner_reference import brute_speedup

from bastion_sglang.controller import (
    AdaptivePolicy,
    BucketedAdaptivePolicy,
    ChainPolicy,
    FixedPolicy,
    build_tree,
    build_trees,
    parse_policy,
    plan_batch,
)
from bastion_sglang.controller.batch_objective import PAYING_SPEEDUP, first_drop
from bastion_sglang.controller.batched import DraftTreeBatch
from bastion_sglang.controller.latency import LatencyFit, LatencyModel
from bastion_sglang.controller.policies import expected_accept_curve, speedup_curve
from bastion_sglang.controller.profile import StepCosts
from bastion_sglang.controller.roofline import QWEN3_8B, HardwareSpec, RooflineModel

H100 = HardwareSpec(name="H100 SXM", peak_flops=989e12, bandwidth=3.35e12)
COSTS = StepCosts(t_draft=2.5e-3, t_aux=0.5e-3, l_ar=18e-3)
BUCKETS = (1, 2, 4, 8, 16, 32, 64, 96, 128, 192, 256, 384, 512, 768, 1024, 1025)


def latency(buckets: tuple[int, ...] | None = None, alpha_tok: float = 0.0) -> LatencyModel:
    # A calibrated fit with a fixed term and no narrow-pass token term keeps Ĉ convex in s.
    fit = LatencyFit(beta_fixed=4e-3, alpha_gemm=1.4, alpha_tok=alpha_tok, alpha_attn=1.1, alpha_kv=1.5)
    return LatencyModel(RooflineModel(QWEN3_8B, H100), fit=fit, width_buckets=buckets)


def draft_scores(seed: int, budget: int = 1024, sharpness: float = 3.0) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    logits = sharpness * torch.randn(15, 512, generator=generator, dtype=torch.float64)
    top = torch.log_softmax(logits, -1).topk(64, -1)
    return build_tree(top.values, top.indices, budget).log_scores


def speedups(log_scores: torch.Tensor, ctx: int, model: LatencyModel) -> torch.Tensor:
    """Ŝ(n) for n = 1..N computed one budget at a time with `predict` (independent of the policy code)."""
    accept = expected_accept_curve(log_scores)
    values = [
        float(accept[n]) * COSTS.l_ar / (COSTS.t_draft + COSTS.t_aux + model.predict(n + 1, ctx))
        for n in range(1, log_scores.shape[0] + 1)
    ]
    return torch.tensor(values, dtype=torch.float64)


@pytest.mark.parametrize("seed", range(6))
@pytest.mark.parametrize("ctx", [64, 1024, 8192])
def test_first_drop_is_the_argmax_under_concave_accept_and_convex_cost(seed: int, ctx: int) -> None:
    scores = draft_scores(seed, sharpness=1.0 + seed)
    model = latency()
    brute = speedups(scores, ctx, model)
    assert torch.allclose(speedup_curve(scores, ctx, model, COSTS), brute, rtol=1e-12)
    n = AdaptivePolicy().choose(scores, ctx, model, COSTS)
    assert 1 <= n <= scores.shape[0]
    assert float(brute[n - 1]) == pytest.approx(float(brute.max()), rel=1e-12)


@pytest.mark.parametrize("seed", range(8))
@pytest.mark.parametrize("ctx", [64, 2048])
def test_adaptive_and_bucketed_take_the_maximum_on_step_costs(seed: int, ctx: int) -> None:
    scores = draft_scores(100 + seed, sharpness=0.5 + seed)
    model = latency(BUCKETS)
    brute = speedups(scores, ctx, model)
    adaptive = AdaptivePolicy().choose(scores, ctx, model, COSTS)
    bucketed = BucketedAdaptivePolicy(BUCKETS[1:]).choose(scores, ctx, model, COSTS)
    assert adaptive == int(brute.argmax()) + 1
    assert float(brute[bucketed - 1]) == pytest.approx(float(brute.max()), rel=1e-12)
    assert bucketed + 1 in BUCKETS or bucketed == scores.shape[0]


def test_the_first_drop_stops_early_on_step_costs() -> None:
    """A step cost is not convex: Ŝ's first drop can lie inside a cheap plateau that a later bucket beats,
    which is why the adaptive policy takes the maximum there."""
    model = latency(BUCKETS)
    early = 0
    for seed in range(20):
        scores = draft_scores(200 + seed, sharpness=0.5 + seed / 4)
        brute = speedups(scores, 1024, model)
        stop = first_drop(brute.numpy())
        early += float(brute.max()) > float(brute[stop]) * (1 + 1e-9)
        assert AdaptivePolicy().choose(scores, 1024, model, COSTS) == int(brute.argmax()) + 1
    assert early > 0


def test_fixed_and_chain() -> None:
    scores = draft_scores(3, budget=40)
    model = latency()
    assert FixedPolicy(16).choose(scores, 100, model, COSTS) == 16
    assert FixedPolicy(400).choose(scores, 100, model, COSTS) == 40
    chain = ChainPolicy()
    assert chain.topk_cap == 1
    generator = torch.Generator().manual_seed(0)
    top = torch.log_softmax(torch.randn(15, 100, generator=generator), -1).topk(8, -1)
    tree = build_tree(top.values[:, : chain.topk_cap], top.indices[:, : chain.topk_cap], 1024)
    assert chain.choose(tree.log_scores, 100, model, COSTS) == 15
    assert tree.tokens.tolist() == top.indices[:, 0].tolist()  # the drafter's argmax at every depth
    assert tree.parents.tolist() == [-1, *range(14)]


@pytest.mark.parametrize(
    ("spec", "expected"),
    [
        ("adaptive", AdaptivePolicy()),
        ("chain", ChainPolicy()),
        ("fixed:64", FixedPolicy(64)),
        (" Fixed:8 ", FixedPolicy(8)),
        ("bucketed", BucketedAdaptivePolicy((16, 32))),
        ("ar", None),
    ],
)
def test_parse_policy(spec: str, expected: object) -> None:
    assert parse_policy(spec, width_buckets=(16, 32)) == expected


@pytest.mark.parametrize(
    ("spec", "buckets", "message"),
    [
        ("fixed:0", None, "positive integer"),
        ("fixed:x", None, "positive integer"),
        ("greedy", None, "unknown policy 'greedy'"),
        ("bucketed", None, "needs width buckets"),
        ("bucketed", (32, 16), "sorted, unique"),
    ],
)
def test_parse_policy_errors(spec: str, buckets: tuple[int, ...] | None, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        parse_policy(spec, width_buckets=buckets)


def batch_trees(batch: int, budget: int, seed: int):
    generator = torch.Generator().manual_seed(seed)
    logits = (1.0 + 3 * torch.rand(batch, 1, 1, generator=generator)) * torch.randn(
        batch, 15, 256, generator=generator
    )
    top = torch.log_softmax(logits, -1).topk(32, -1)
    return build_trees(top.values, top.indices, budget)


@pytest.mark.parametrize("seed", range(3))
def test_plan_batch_accept_scale_is_the_best_width_for_the_scaled_accept(seed: int) -> None:
    trees = batch_trees(3, 128, seed)
    contexts = [100, 900, 40]
    scale = [0.5, 1.0, 2.0]
    model = latency()
    plan = plan_batch(trees, contexts, model, COSTS, AdaptivePolicy(), accept_scale=scale)
    brute = [brute_speedup(trees, [n] * 3, contexts, model, COSTS, scale) for n in range(1, 129)]
    assert plan.estimated_speedup == pytest.approx(max(brute), rel=1e-12)
    n = plan.node_counts[0]
    gains = torch.exp(trees.log_scores)
    for i in range(3):
        assert plan.expected_drafted[i] == pytest.approx(float(gains[i, :n].sum()), rel=1e-12)
        assert plan.expected_accept[i] == pytest.approx(1.0 + scale[i] * plan.expected_drafted[i], rel=1e-12)
    # a smaller correction never buys a larger tree
    halved = plan_batch(trees, contexts, model, COSTS, AdaptivePolicy(), accept_scale=[0.25] * 3)
    assert halved.node_counts[0] <= plan_batch(trees, contexts, model, COSTS, AdaptivePolicy()).node_counts[0]
    with pytest.raises(ValueError, match="accept_scale needs 3 positive factors"):
        plan_batch(trees, contexts, model, COSTS, AdaptivePolicy(), accept_scale=[1.0, 0.0, 1.0])


@pytest.mark.parametrize("seed", range(4))
def test_plan_batch_common_width_is_the_best_common_width(seed: int) -> None:
    trees = batch_trees(4, 256, seed)
    contexts = [100, 900, 3000, 40]
    model = latency()
    plan = plan_batch(trees, contexts, model, COSTS, AdaptivePolicy(), common_width=True)
    assert len(set(plan.node_counts)) == 1
    assert plan.width == plan.node_counts[0] + 1
    brute = [brute_speedup(trees, [n] * 4, contexts, model, COSTS) for n in range(1, 257)]
    assert plan.estimated_speedup == pytest.approx(max(brute), rel=1e-12)
    assert plan.estimated_verify_seconds == pytest.approx(model.predict_batch([plan.width] * 4, contexts))


def test_plan_batch_fixed_chain_bucketed() -> None:
    trees = batch_trees(3, 64, 9)
    model = latency(BUCKETS)
    contexts = [10, 20, 30]
    assert plan_batch(trees, contexts, model, COSTS, FixedPolicy(16)).node_counts == (16, 16, 16)
    assert plan_batch(trees, contexts, model, COSTS, ChainPolicy()).width == 65
    bucketed = plan_batch(trees, contexts, model, COSTS, BucketedAdaptivePolicy(BUCKETS[1:]))
    candidates = sorted({min(w - 1, 64) for w in BUCKETS[1:]})
    brute = {n: brute_speedup(trees, [n] * 3, contexts, model, COSTS) for n in candidates}
    assert bucketed.estimated_speedup == pytest.approx(max(brute.values()), rel=1e-12)


def test_plan_batch_ragged_hands_out_nodes_by_score() -> None:
    trees = batch_trees(3, 128, 4)
    contexts = [64, 64, 64]
    model = latency(alpha_tok=2e-4)  # each token costs: the greedy walk stops before taking every node
    plan = plan_batch(trees, contexts, model, COSTS, AdaptivePolicy(), common_width=False)
    chosen = [float(trees.log_scores[i, n - 1]) for i, n in enumerate(plan.node_counts) if n > 0]
    left = [float(trees.log_scores[i, n]) for i, n in enumerate(plan.node_counts) if n < 128]
    assert min(chosen) >= max(left)
    assert plan.width == max(plan.node_counts) + 1
    # The greedy walk stopped at a drop: one more node by score does not help.
    best_next = max(range(3), key=lambda i: float(trees.log_scores[i, plan.node_counts[i]]))
    more = list(plan.node_counts)
    more[best_next] += 1
    assert brute_speedup(trees, more, contexts, model, COSTS) < plan.estimated_speedup


def mixed_trees(budget: int):
    """Row 0: a drafter that knows the text (one token carries almost all mass at every depth); row 1: a
    hopeless one (flat over 4096 tokens)."""
    confident = torch.full((15, 4096), -40.0, dtype=torch.float64)
    confident[:, 0] = 0.0
    flat = torch.zeros(15, 4096, dtype=torch.float64)
    logits = torch.stack([confident, flat])
    top = torch.log_softmax(logits, -1).topk(32, -1)
    return build_trees(top.values, top.indices, budget)


def test_ragged_plan_gives_a_hopeless_request_no_node_while_another_speculates() -> None:
    trees = mixed_trees(64)
    contexts = [256, 256]
    model = latency(alpha_tok=2e-4)
    ragged = plan_batch(trees, contexts, model, COSTS, AdaptivePolicy(), common_width=False, allow_plain=True)
    assert ragged.node_counts[1] == 0 and ragged.node_counts[0] >= 8
    assert ragged.expected_accept[0] > 8.0 and ragged.expected_accept[1] == 1.0
    # every other allocation that moves a node between the rows is worse
    for counts in ([ragged.node_counts[0] - 1, 1], [ragged.node_counts[0] + 1, 0]):
        assert brute_speedup(trees, counts, contexts, model, COSTS) < ragged.estimated_speedup
    # with one padded width (SGLang's verify) both rows get the same n: nodes up to the width are free
    common = plan_batch(trees, contexts, model, COSTS, AdaptivePolicy(), allow_plain=True)
    assert common.node_counts[0] == common.node_counts[1] > 0


def test_plan_batch_rejects_mismatched_contexts() -> None:
    trees = batch_trees(2, 8, 0)
    with pytest.raises(ValueError, match="ctx_lens has 3 entries for a batch of 2"):
        plan_batch(trees, [1, 2, 3], latency(), COSTS, AdaptivePolicy())


def test_brute_force_helpers_agree_on_tiny_case() -> None:
    """The common-width optimum equals an exhaustive search over all equal allocations of a tiny batch."""
    trees = batch_trees(2, 6, 1)
    model = latency()
    plan = plan_batch(trees, [32, 32], model, COSTS, AdaptivePolicy())
    best = max(
        (brute_speedup(trees, [a, b], [32, 32], model, COSTS), a)
        for a, b in itertools.product(range(1, 7), repeat=2)
        if a == b
    )
    assert plan.node_counts == (best[1], best[1])


def test_plan_batch_declines_when_no_tree_pays() -> None:
    trees = batch_trees(2, 64, 0)
    model = latency()
    slow_draft = StepCosts(t_draft=1.0, t_aux=0.5e-3, l_ar=18e-3)  # a drafter pass costs 50 plain steps
    plan = plan_batch(trees, [100, 100], model, slow_draft, AdaptivePolicy(), allow_plain=True)
    assert plan.node_counts == (0, 0) and plan.width == 1 and not plan.speculates
    assert plan.estimated_speedup == 1.0 and plan.expected_accept == (1.0, 1.0)
    assert 0 < plan.speculative_speedup < 1.0
    # the same plan without the option speculates, at the speculative speedup it reported
    forced = plan_batch(trees, [100, 100], model, slow_draft, AdaptivePolicy())
    assert forced.speculates and forced.estimated_speedup == pytest.approx(plan.speculative_speedup)
    # fixed and chain budgets never decline
    fixed = plan_batch(trees, [100, 100], model, slow_draft, FixedPolicy(4), allow_plain=True)
    assert fixed.node_counts == (4, 4)


def draft_seconds_for(
    target: float, trees: DraftTreeBatch, contexts: list[int], model: LatencyModel
) -> float:
    """The drafter pass (seconds) at which adaptive's best plan for `trees` reads Ŝ = target (bisection:
    Ŝ falls as the pass grows)."""
    low, high = 0.0, 1.0
    for _ in range(60):
        middle = (low + high) / 2
        costs = StepCosts(t_draft=middle, t_aux=0.5e-3, l_ar=18e-3)
        speedup = plan_batch(trees, contexts, model, costs, AdaptivePolicy()).estimated_speedup
        low, high = (middle, high) if speedup > target else (low, middle)
    return low


@pytest.mark.parametrize("target", [1.01, PAYING_SPEEDUP - 0.01])
def test_plan_batch_declines_a_gain_within_the_estimates_error(target: float) -> None:
    """A best plan that beats plain decoding by less than PAYING_SPEEDUP is declined; one just above it is
    not."""
    trees, contexts, model = batch_trees(2, 64, 0), [100, 100], latency()
    assert PAYING_SPEEDUP == 1.05
    costs = StepCosts(t_draft=draft_seconds_for(target, trees, contexts, model), t_aux=0.5e-3, l_ar=18e-3)
    plan = plan_batch(trees, contexts, model, costs, AdaptivePolicy(), allow_plain=True)
    assert not plan.speculates and plan.speculative_speedup == pytest.approx(target, abs=1e-6)
    above = StepCosts(
        t_draft=draft_seconds_for(PAYING_SPEEDUP + 0.01, trees, contexts, model), t_aux=0.5e-3, l_ar=18e-3
    )
    assert plan_batch(trees, contexts, model, above, AdaptivePolicy(), allow_plain=True).speculates


def test_plan_batch_keeps_speculating_when_it_pays() -> None:
    trees = batch_trees(2, 64, 0)
    plan = plan_batch(trees, [100, 100], latency(), COSTS, AdaptivePolicy(), allow_plain=True)
    assert plan.speculates and plan.estimated_speedup == plan.speculative_speedup > 1.0


def test_tree_budget_per_policy() -> None:
    bucketed = BucketedAdaptivePolicy(BUCKETS[1:])
    assert AdaptivePolicy().tree_budget(1024, 15, None) == 1024
    assert AdaptivePolicy().tree_budget(1024, 15, 257) == bucketed.tree_budget(1024, 15, 257) == 256
    assert FixedPolicy(40).tree_budget(8, 15, 64) == 40  # a fixed budget is what it says, whatever N_max
    assert ChainPolicy().tree_budget(1024, 15, 16) == 15
    with pytest.raises(ValueError, match="verifies up to 41 tokens, beyond the largest width bucket 32"):
        FixedPolicy(40).tree_budget(64, 15, 32)
    with pytest.raises(ValueError, match="verifies up to 16 tokens, beyond the largest width bucket 8"):
        ChainPolicy().tree_budget(64, 15, 8)


def test_check_config_per_policy() -> None:
    buckets = (2, 4, 8, 16, 33)
    for policy in (AdaptivePolicy(), ChainPolicy(), FixedPolicy(32), BucketedAdaptivePolicy(buckets)):
        policy.check_config(32, buckets)
    with pytest.raises(ValueError, match="policy fixed:33 verifies more nodes than max_budget 32"):
        FixedPolicy(33).check_config(32, buckets)
    with pytest.raises(ValueError, match=r"the bucketed policy's buckets \(2, 4\) differ from width_buckets"):
        BucketedAdaptivePolicy((2, 4)).check_config(32, buckets)
