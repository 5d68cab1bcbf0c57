"""The vectorised batch planner against one latency call per candidate plan (the scalar `predict_batch`)."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from calibration_profiles import QWEN3_8B
from planner_reference import brute_speedup

from bastion_sglang.controller import (
    AdaptivePolicy,
    BucketedAdaptivePolicy,
    ChainPolicy,
    FixedPolicy,
    build_trees,
    plan_batch,
)
from bastion_sglang.controller.adaptive_plan import plan_adaptive
from bastion_sglang.controller.batch_objective import BatchObjective, first_drop
from bastion_sglang.controller.latency import FIXED_TABLE_TOKENS, LatencyFit, LatencyModel
from bastion_sglang.controller.profile import StepCosts
from bastion_sglang.controller.roofline import RooflineModel, lookup_gpu
from bastion_sglang.controller.verify_passes import VerifyPasses

BUCKETS = (2, 4, 8, 16, 32, 64, 96, 128, 192, 257)
COSTS = StepCosts(t_draft=2.5e-3, t_aux=0.5e-3, l_ar=18e-3, t_aux_per_token=2e-6)
FIT = LatencyFit(beta_fixed=4e-3, alpha_gemm=1.4, alpha_tok=3e-5, alpha_attn=1.1, alpha_kv=1.5)


def models() -> dict[str, LatencyModel]:
    """Uncalibrated and calibrated, padded and not, fresh and after observed passes, bf16 and a fractional
    element size."""
    h100 = RooflineModel(QWEN3_8B, lookup_gpu("H100 SXM"))
    corrected = LatencyModel(RooflineModel(QWEN3_8B, lookup_gpu("L4")), width_buckets=BUCKETS)
    corrected.observe(40, 3000, 0.2)
    corrected.observe(100, 500, 0.4)
    calibrated = LatencyModel(h100, fit=FIT)
    calibrated.observe_batch([9, 9, 9], [100, 2000, 50], 0.03)
    return {
        "roofline": LatencyModel(h100),
        "calibrated": calibrated,
        "buckets": LatencyModel(h100, fit=FIT, width_buckets=BUCKETS),
        "corrected": corrected,
        "fp8": LatencyModel(RooflineModel(QWEN3_8B, lookup_gpu("H100 SXM"), bytes_per_element=1.5), fit=FIT),
    }


def batch_trees(batch: int, budget: int, seed: int, sharpness: float = 3.0):
    generator = torch.Generator().manual_seed(seed)
    logits = sharpness * torch.randn(batch, 15, 256, generator=generator, dtype=torch.float64)
    top = torch.log_softmax(logits, -1).topk(32, -1)
    return build_trees(top.values, top.indices, budget)


def contexts_for(batch: int, seed: int) -> list[int]:
    return torch.randint(0, 5000, (batch,), generator=torch.Generator().manual_seed(seed)).tolist()


@pytest.mark.parametrize("name", list(models()))
def test_predict_passes_is_predict_batch_bit_for_bit(name: str) -> None:
    model = models()[name]
    generator = torch.Generator().manual_seed(7)
    for batch in (1, 3, 32):
        contexts = np.array(contexts_for(batch, batch), dtype=np.int64)
        widths = np.arange(1, 258, dtype=np.int64)
        common = model.predict_passes(VerifyPasses.common(model.padded_widths(widths), contexts))
        for s, seconds in zip(widths.tolist(), common.tolist(), strict=True):
            assert seconds == model.predict_batch([s] * batch, contexts.tolist()), (batch, s)
        if model.width_buckets is None:
            ragged = torch.randint(1, 258, (20, batch), generator=generator).numpy()
            values = model.predict_passes(VerifyPasses.ragged(ragged, contexts))
            for row, seconds in zip(ragged.tolist(), values.tolist(), strict=True):
                assert seconds == model.predict_batch(row, contexts.tolist()), (batch, row)


@pytest.mark.parametrize("name", list(models()))
def test_predict_widths_is_predict_batch_bit_for_bit(name: str) -> None:
    # the table of token-only parts covers widths up to FIXED_TABLE_TOKENS; past it the general path
    model = models()[name]
    top = model.width_buckets[-1] if model.width_buckets is not None else FIXED_TABLE_TOKENS + 40
    for low, high in ((1, 300), (FIXED_TABLE_TOKENS - 20, FIXED_TABLE_TOKENS + 1), (top - 30, top + 1)):
        widths = model.padded_widths(np.arange(max(low, 1), min(high, top + 1), dtype=np.int64))
        for c in (0, 777, 30000):
            values = model.predict_widths(widths, c)
            for s, seconds in zip(widths.tolist(), values.tolist(), strict=True):
                assert seconds == model.predict_batch([s], [c]), (s, c)


def test_padded_widths_pad_up_and_raise_past_the_buckets() -> None:
    model = models()["buckets"]
    assert model.padded_widths(np.array([1, 2, 3, 200, 257])).tolist() == [2, 2, 4, 257, 257]
    with pytest.raises(ValueError, match=r"s = 258 exceeds the largest width bucket"):
        model.padded_widths(np.array([5, 258, 3]))


@pytest.mark.parametrize("name", list(models()))
@pytest.mark.parametrize("batch", [1, 4, 32])
def test_common_adaptive_is_the_first_drop_or_the_peak_of_one_call_per_width(name: str, batch: int) -> None:
    """Convex costs: the first drop of Ŝ; step costs (width buckets): the maximum of Ŝ over every n."""
    model = models()[name]
    for seed in range(3):
        trees = batch_trees(batch, 256, seed, sharpness=[1.0, 3.0, 8.0][seed])
        contexts = contexts_for(batch, seed)
        plan = plan_batch(trees, contexts, model, COSTS, AdaptivePolicy())
        brute = np.array([brute_speedup(trees, [n] * batch, contexts, model, COSTS) for n in range(1, 257)])
        n = (first_drop(brute) if model.width_buckets is None else int(brute.argmax())) + 1
        assert plan.node_counts == (n,) * batch and plan.width == n + 1, (seed, name)
        assert plan.estimated_speedup == pytest.approx(brute[n - 1], rel=1e-13)
        assert plan.estimated_verify_seconds == model.predict_batch([n + 1] * batch, contexts)


def greedy_reference(trees, contexts: list[int], model: LatencyModel, scale: list[float]) -> list[int]:
    """The greedy ragged walk, one `predict_batch` call per step, stopped at Ŝ's first drop (or, with width
    buckets, at its maximum along the whole walk)."""
    batch, available = trees.log_scores.shape
    gains = torch.exp(trees.log_scores) * torch.tensor(scale, dtype=torch.float64)[:, None]
    order = torch.argsort(gains.reshape(-1), descending=True, stable=True).tolist()
    counts = [0] * batch
    walk = [(list(counts), brute_speedup(trees, counts, contexts, model, COSTS, scale))]
    for flat in order:
        counts[flat // available] += 1
        value = brute_speedup(trees, counts, contexts, model, COSTS, scale)
        if model.width_buckets is None and value < walk[-1][1]:
            break
        walk.append((list(counts), value))
    if model.width_buckets is None:
        return walk[-1][0]
    return max(walk, key=lambda step: step[1])[0]  # the first maximiser


@pytest.mark.parametrize("name", ["calibrated", "buckets", "corrected"])
@pytest.mark.parametrize("seed", range(3))
def test_ragged_walk_matches_one_call_per_step(name: str, seed: int) -> None:
    model = models()[name]
    trees = batch_trees(4, 64, seed, sharpness=[2.0, 4.0, 8.0][seed])
    contexts = contexts_for(4, seed)
    scale = [0.5, 1.0, 1.5, 0.8]
    plan = plan_batch(trees, contexts, model, COSTS, AdaptivePolicy(), common_width=False, accept_scale=scale)
    want = greedy_reference(trees, contexts, model, scale)
    assert list(plan.node_counts) == want
    assert plan.estimated_speedup == pytest.approx(brute_speedup(trees, want, contexts, model, COSTS, scale))
    assert plan.estimated_verify_seconds == model.predict_batch([n + 1 for n in want], contexts)


@pytest.mark.parametrize("name", list(models()))
def test_one_request_plans_agree(name: str) -> None:
    """At B = 1 the batch planner, the policy's `choose` and the fused adaptive planner give the same n."""
    model = models()[name]
    bucketed = BucketedAdaptivePolicy(BUCKETS)
    for seed in range(4):
        generator = torch.Generator().manual_seed(seed)
        logits = [1.0, 3.0, 6.0, 12.0][seed] * torch.randn(
            1, 15, 256, generator=generator, dtype=torch.float64
        )
        top = torch.log_softmax(logits, -1).topk(32, -1)
        trees = build_trees(top.values, top.indices, 256)
        for ctx in (0, 700, 6000):
            for policy in (AdaptivePolicy(), bucketed, FixedPolicy(20), ChainPolicy()):
                if policy is bucketed and model.width_buckets != BUCKETS:
                    continue
                n = plan_batch(trees, [ctx], model, COSTS, policy).node_counts[0]
                assert n == policy.choose(trees.log_scores[0], ctx, model, COSTS), (policy, seed, ctx)
            fused = plan_adaptive(top.values[0], top.indices[0], 256, ctx, model, COSTS)
            assert len(fused) == plan_batch(trees, [ctx], model, COSTS, AdaptivePolicy()).node_counts[0]


def test_identical_requests_plan_like_one_when_the_pass_scales_with_the_batch() -> None:
    """B copies of one request, on a latency model whose pass costs B times one request's (no fixed term, no
    weight floor, no token term capped at the ridge; the per-token cost in the step costs), share the single
    request's adaptive n."""
    linear = LatencyFit(beta_fixed=0.0, alpha_gemm=0.0, alpha_tok=0.0, alpha_attn=1.0, alpha_kv=1.0)
    model = LatencyModel(RooflineModel(QWEN3_8B, lookup_gpu("H100 SXM")), fit=linear)
    costs = StepCosts(t_draft=0.0, t_aux=0.0, l_ar=18e-3, t_aux_per_token=1e-7)
    for seed in range(3):
        one = build_trees(*one_draft(seed), 128)
        many = build_trees(*(t.expand(6, -1, -1) for t in one_draft(seed)), 128)
        single = plan_batch(one, [900], model, costs, AdaptivePolicy()).node_counts[0]
        assert 1 < single < 128
        assert plan_batch(many, [900] * 6, model, costs, AdaptivePolicy()).node_counts == (single,) * 6


def one_draft(seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    logits = 3.0 * torch.randn(1, 15, 256, generator=generator, dtype=torch.float64)
    top = torch.log_softmax(logits, -1).topk(32, -1)
    return top.values, top.indices


def test_objective_checks_its_inputs() -> None:
    trees = batch_trees(2, 8, 0)
    model = models()["roofline"]
    with pytest.raises(ValueError, match="ctx_lens has 3 entries for a batch of 2"):
        BatchObjective.from_log_scores(trees.log_scores, [1, 2, 3], model, COSTS)
    with pytest.raises(ValueError, match=r"c \(cached context tokens\) must be an int >= 0, got -4"):
        BatchObjective.from_log_scores(trees.log_scores, [1, -4], model, COSTS)
    with pytest.raises(ValueError, match="accept_scale needs 2 positive factors"):
        BatchObjective.from_log_scores(trees.log_scores, [1, 4], model, COSTS, accept_scale=[1.0, -1.0])
    narrow = LatencyModel(model.roofline, width_buckets=(2, 4))
    with pytest.raises(ValueError, match="s = 9 exceeds the largest width bucket"):
        plan_batch(trees, [1, 4], narrow, COSTS, AdaptivePolicy())
