"""SpeculationGate: skip the drafter while speculation does not pay, re-probe with exponential backoff."""

from __future__ import annotations

import itertools
from collections.abc import Callable

import pytest
import torch

from bastion_sglang.controller import AdaptivePolicy, ChainPolicy, FixedPolicy, build_trees, plan_batch
from bastion_sglang.controller.batch_objective import PAYING_SPEEDUP
from bastion_sglang.controller.gate import (
    OWN_TEXT_STEPS,
    STRETCH_SPEEDUP,
    STRETCH_STEPS,
    DraftedStep,
    DraftEvidence,
    SpeculationCeiling,
    SpeculationGate,
    horizon_gain,
    reachable_accept,
    speculation_ceiling,
)
from bastion_sglang.controller.latency import LatencyFit, LatencyModel
from bastion_sglang.controller.profile import StepCosts
from bastion_sglang.controller.roofline import QWEN3_8B, RooflineModel, lookup_gpu


def drafted_steps(
    gate: SpeculationGate,
    speedup: float,
    steps: int,
    ceiling: Callable[[], SpeculationCeiling] | None = None,
) -> list[bool]:
    """Run `steps` decode steps whose drafted plans all estimate `speedup`; which steps drafted."""
    drafted = []
    for _ in range(steps):
        draft = gate.should_draft(ceiling)
        drafted.append(draft)
        if draft:
            gate.record(speedup)
    return drafted


def test_speculating_gate_drafts_every_step() -> None:
    gate = SpeculationGate()
    assert all(drafted_steps(gate, 1.5, 20)) and not gate.skipping and gate.skipped_share == 0.0


def test_backoff_doubles_up_to_the_cap() -> None:
    gate = SpeculationGate(min_backoff=1, max_backoff=4)
    drafted = drafted_steps(gate, 0.8, 20)
    # probe, skip 1, probe, skip 2, probe, skip 4, probe, skip 4, ...
    assert drafted[:13] == [
        True,
        False,
        True,
        False,
        False,
        True,
        False,
        False,
        False,
        False,
        True,
        False,
        False,
    ]
    assert gate.skipping
    assert gate.skipped_share == pytest.approx(drafted.count(False) / 20)


def test_a_gain_within_the_estimates_error_does_not_count_as_paying() -> None:
    """A plan estimated to beat plain decoding by less than PAYING_SPEEDUP backs the gate off, and a probe
    above it resumes speculation; so does a ceiling or a bound on either side of it."""
    gate = SpeculationGate(min_backoff=2, max_backoff=8)
    gate.record(PAYING_SPEEDUP - 0.01)
    assert not gate.should_draft() and gate.skipping
    while not gate.should_draft(Ceiling(PAYING_SPEEDUP + 0.01)):
        pass
    gate.record(PAYING_SPEEDUP + 0.01)
    assert not gate.skipping
    narrow = SpeculationCeiling(speedup=PAYING_SPEEDUP - 0.01, refresh_steps=1.0)
    assert not SpeculationGate().should_draft(bound=narrow)
    wide = SpeculationCeiling(speedup=PAYING_SPEEDUP + 0.01, refresh_steps=1.0)
    assert SpeculationGate().should_draft(bound=wide)


def test_a_paying_probe_resumes_speculation() -> None:
    gate = SpeculationGate(min_backoff=2, max_backoff=8)
    drafted_steps(gate, 0.5, 30)
    assert gate.skipping
    while not gate.should_draft():
        pass
    gate.record(1.2)
    assert not gate.skipping
    assert all(drafted_steps(gate, 1.2, 10))


def test_a_stretch_goes_on_while_its_mean_estimate_beats_plain_decoding() -> None:
    """A speculating stretch goes on while the mean of its last four estimates is above 1 (STRETCH_SPEEDUP),
    below the PAYING_SPEEDUP a probe must beat: steps at 0.95 after four at 1.3 keep it going through the
    means 1.21, 1.125 and 1.0375, and the fourth in a row ends it (0.95)."""
    assert STRETCH_SPEEDUP < PAYING_SPEEDUP
    gate = SpeculationGate()
    assert all(drafted_steps(gate, 1.3, 5))
    assert drafted_steps(gate, 0.95, 4) == [True] * 4 and gate.skipping
    assert not gate.should_draft()


def test_a_probe_is_judged_on_its_own_estimate_and_starts_a_new_stretch() -> None:
    """A probe at 1.3 after steps at 0.5 resumes speculation on its own estimate, which is not part of the
    stretch it opens: after it, steps at 1.2 and 0.9 go on (mean 1.05) and a second 0.9 ends the stretch (1.0;
    with the probe's 1.3 counted it would be 1.075). A probe at 1.02, above plain decoding but not by
    PAYING_SPEEDUP, opens nothing."""
    gate = SpeculationGate(min_backoff=1, max_backoff=4)
    drafted_steps(gate, 0.5, 10)
    while not gate.should_draft():
        pass
    gate.record(1.02)
    assert gate.skipping
    while not gate.should_draft():
        pass
    gate.record(1.3)
    assert not gate.skipping
    assert drafted_steps(gate, 1.2, 1) == [True]
    assert drafted_steps(gate, 0.9, 2) == [True, True] and gate.skipping


def test_bad_backoff_is_refused() -> None:
    with pytest.raises(ValueError, match="min_backoff <= max_backoff"):
        SpeculationGate(min_backoff=4, max_backoff=2)
    with pytest.raises(ValueError, match="max_backoff <= max_refresh"):
        SpeculationGate(min_backoff=1, max_backoff=8, max_refresh=4)
    with pytest.raises(ValueError, match="0 < probe_share <= 1"):
        SpeculationGate(probe_share=0.0)
    with pytest.raises(ValueError, match="stretch_steps >= 1"):
        SpeculationGate(stretch_steps=0)


class Ceiling:
    """A ceiling that counts how often the gate asked for it: a plan of speedup `value` in a batch whose
    refresh probe costs `refresh_steps` plain steps."""

    def __init__(self, value: float, refresh_steps: float = 1.0) -> None:
        self.bound, self.calls = SpeculationCeiling(speedup=value, refresh_steps=refresh_steps), 0

    def __call__(self) -> SpeculationCeiling:
        self.calls += 1
        return self.bound


CHEAP_PROBES = 1.0
"""probe_share of the gates below whose refreshes follow the doubling interval alone: a refresh of at most
one step divided by 1 never exceeds it."""


def test_a_ceiling_at_most_one_skips_probes_until_a_refresh_is_due() -> None:
    gate = SpeculationGate(min_backoff=1, max_backoff=8, probe_share=CHEAP_PROBES)
    assert gate.should_draft()  # no drafted step yet: no ceiling known
    gate.record(0.6)  # the plan did not pay: back off 1 step
    low = Ceiling(0.5)
    drafted = [gate.should_draft(low) for _ in range(12)]
    # skip 1 (the backoff: the ceiling is not asked), then the ceiling vetoes the probes the backoff would
    # run, until 8 steps passed without drafting: a refresh probe
    assert drafted == [False] * 8 + [True] + [False] * 3
    # each veto doubles the backoff, cut short where the refresh falls due: asked at steps 1, 3 and 7 (skips
    # of 2, 4 and 1), at the refresh (8), and at 9 (a veto; the refresh probe's plan is not recorded here)
    assert low.calls == 5


def test_a_vetoing_ceiling_is_asked_once_per_backoff_period() -> None:
    gate = SpeculationGate(min_backoff=1, max_backoff=8, max_refresh=1024, probe_share=CHEAP_PROBES)
    assert [step for step, draft in enumerate(drafted_steps(gate, 0.5, 40)) if draft][-1] == 37
    low = Ceiling(0.5)
    asks = []
    for step in range(40, 100):
        calls = low.calls
        draft = gate.should_draft(low)
        if draft:
            gate.record(0.5)
        if low.calls > calls:
            asks.append((step, draft))
    # 8 skipped steps after each failed probe and each veto; refreshes after 8, 16, then 32 steps without
    # drafting (the doubling interval), each at an ask
    assert asks == [(46, True), (55, False), (63, True), (72, False), (80, False), (88, False), (96, True)]


def test_failed_refreshes_stretch_the_refresh_interval_up_to_max_refresh() -> None:
    gate = SpeculationGate(min_backoff=1, max_backoff=4, max_refresh=16, probe_share=CHEAP_PROBES)
    assert gate.should_draft()  # no drafted step yet: no ceiling known
    gate.record(0.6)
    drafted = drafted_steps(gate, 0.6, 120, Ceiling(0.5))
    probes = [step for step, draft in enumerate(drafted) if draft]
    # the first refresh after 4 steps without drafting, then 8, then 16 at most
    assert probes[0] == 4
    assert [later - earlier - 1 for earlier, later in itertools.pairwise(probes)] == [8] + [16] * 6
    # a refresh that finds speculation paying brings the interval back to max_backoff: when the next plan
    # fails, refreshes come after 4 steps without drafting again, then 8
    while not gate.should_draft(Ceiling(0.5)):
        pass
    gate.record(1.2)
    assert not gate.skipping
    probes = [step for step, draft in enumerate(drafted_steps(gate, 0.6, 40, Ceiling(0.5))) if draft]
    assert [later - earlier - 1 for earlier, later in itertools.pairwise(probes)][:2] == [4, 8]


def test_a_refresh_above_plain_decoding_keeps_the_refresh_interval() -> None:
    """A refresh estimated above plain decoding (STRETCH_SPEEDUP) but not by PAYING_SPEEDUP opens nothing and
    keeps the refresh interval; one at most STRETCH_SPEEDUP doubles it."""
    between = (STRETCH_SPEEDUP + PAYING_SPEEDUP) / 2

    def refresh_gaps(refresh_estimate: float) -> list[int]:
        gate = SpeculationGate(min_backoff=1, max_backoff=4, max_refresh=16, probe_share=CHEAP_PROBES)
        assert gate.should_draft()
        gate.record(0.6)
        drafted = drafted_steps(gate, refresh_estimate, 60, Ceiling(0.5))
        probes = [step for step, draft in enumerate(drafted) if draft]
        return [later - earlier - 1 for earlier, later in itertools.pairwise(probes)]

    assert refresh_gaps(between)[:4] == [4, 4, 4, 4]
    assert refresh_gaps(STRETCH_SPEEDUP)[:3] == [8, 16, 16]


def test_a_speculating_gate_does_not_ask_the_ceiling() -> None:
    """While the plans pay, each step's plan decides: the ceiling is neither asked nor able to veto."""
    low = Ceiling(0.5)
    assert all(drafted_steps(SpeculationGate(), 1.5, 20, low))
    assert low.calls == 0


def test_a_ceiling_above_one_keeps_the_backoff_schedule() -> None:
    high = Ceiling(1.2)
    with_ceiling = drafted_steps(SpeculationGate(min_backoff=1, max_backoff=4), 0.8, 13, high)
    assert with_ceiling == drafted_steps(SpeculationGate(min_backoff=1, max_backoff=4), 0.8, 13)
    # asked before each probe the backoff allows (steps 2, 5 and 10), not at step 0: the gate was speculating
    assert high.calls == 3


def test_refreshes_wait_until_their_expected_cost_is_the_probe_share() -> None:
    """A refresh costing 1.5 plain steps: with probe_share 1 % the first refresh waits 150 steps without
    drafting, not max_backoff = 8, and the doubling interval takes over once it is longer; max_refresh bounds
    both. A refresh that costs less than max_backoff · probe_share keeps the doubling interval."""
    dear = Ceiling(0.5, refresh_steps=1.5)

    def probes_after_a_failed_plan(gate: SpeculationGate) -> list[int]:
        assert gate.should_draft()  # no drafted step yet: no ceiling known
        gate.record(0.5)
        return [step for step, draft in enumerate(drafted_steps(gate, 0.5, 800, dear)) if draft]

    probes = probes_after_a_failed_plan(
        SpeculationGate(min_backoff=1, max_backoff=8, max_refresh=512, probe_share=0.01)
    )
    # 150 steps without drafting before each: a veto's backoff (doubling to 8) stops where the refresh is due
    assert probes[:4] == [150, 301, 452, 603]
    capped = SpeculationGate(min_backoff=1, max_backoff=8, max_refresh=64, probe_share=0.01)
    assert probes_after_a_failed_plan(capped)[:3] == [64, 129, 194]
    cheap = Ceiling(0.5, refresh_steps=0.015)  # 2 steps at 1 %, under max_backoff
    gate = SpeculationGate(min_backoff=1, max_backoff=8, max_refresh=512, probe_share=0.01)
    assert gate.refresh_interval(cheap.bound) == 8


def test_backoff_probes_verify_and_refresh_probes_only_redraft() -> None:
    """A probe the backoff runs (the ceiling says the batch could pay) must verify its tree; a refresh probe
    (ceiling at most 1) leaves the choice to its plan, as every step does while speculating."""
    gate = SpeculationGate(min_backoff=1, max_backoff=4, max_refresh=8, probe_share=CHEAP_PROBES)
    assert gate.should_draft() and not gate.verifies_probe  # speculating: the plan decides
    gate.record(0.6)
    assert not gate.should_draft(Ceiling(1.2))  # the backoff's one skipped step
    assert gate.should_draft(Ceiling(1.2)) and gate.verifies_probe  # a backoff probe
    gate.record(0.6)
    low = Ceiling(0.5)
    drafted = [gate.should_draft(low) for _ in range(5)]
    assert drafted == [False] * 4 + [True]  # a refresh after max_backoff steps without drafting
    assert not gate.verifies_probe
    gate.record(0.6)
    assert gate.should_draft(Ceiling(1.2)) is False and gate.skipping
    while not gate.should_draft(Ceiling(1.2)):
        pass
    assert gate.verifies_probe  # the next backoff probe verifies again
    gate.record(1.3)
    assert gate.should_draft(Ceiling(1.3)) and not gate.verifies_probe  # speculating again


def test_the_ceiling_is_adaptives_plan_and_bounds_every_plan_of_the_same_trees() -> None:
    """Re-priced for the batch the trees were drafted for, the ceiling is the speculative speedup adaptive
    reports (the best common width), and no policy's best speculative plan exceeds it, at every batch size."""
    fit = LatencyFit(beta_fixed=4e-3, alpha_gemm=1.4, alpha_tok=0.0, alpha_attn=1.1, alpha_kv=1.5)
    model = LatencyModel(RooflineModel(QWEN3_8B, lookup_gpu("H100 SXM")), fit=fit)
    generator = torch.Generator().manual_seed(3)
    for batch in (1, 4, 16):
        logits = 3 * torch.randn(batch, 15, 256, generator=generator, dtype=torch.float64)
        top = torch.log_softmax(logits, -1).topk(16, -1)
        trees = build_trees(top.values, top.indices, 64)
        contexts = [100 * (i + 1) for i in range(batch)]
        scale = [0.5 + 0.1 * i for i in range(batch)]
        for t_draft in (1e-3, 5e-2):
            costs = StepCosts(t_draft=t_draft, t_aux=5e-4, l_ar=0.02, t_aux_per_token=1e-6)
            plans = [
                plan_batch(trees, contexts, model, costs, policy, accept_scale=scale)
                for policy in (AdaptivePolicy(), FixedPolicy(1), FixedPolicy(64), ChainPolicy())
            ]
            ceiling = speculation_ceiling(plans[0].accept_curve, contexts, model, costs).speedup
            assert plans[0].speculative_speedup == pytest.approx(ceiling, rel=1e-12), (batch, t_draft)
            for plan in plans:
                assert plan.accept_curve == plans[0].accept_curve  # the whole tree, whatever the policy
                assert plan.speculative_speedup <= ceiling * (1 + 1e-12), (batch, t_draft, plan)


def test_the_ceiling_reprices_the_curve_for_the_batch_at_hand() -> None:
    """The same Â curve against a dearer drafter or a larger batch's costs gives a lower ceiling; a curve
    without a node or an empty batch is refused."""
    model = LatencyModel(RooflineModel(QWEN3_8B, lookup_gpu("H100 SXM")))
    curve = (1.0, 1.8, 2.4, 2.7)
    cheap = StepCosts(t_draft=1e-3, t_aux=0.0, l_ar=model.predict_plain_batch([100]))
    dear = StepCosts(t_draft=5e-2, t_aux=0.0, l_ar=cheap.l_ar)
    high = speculation_ceiling(curve, [100], model, cheap)
    assert high.speedup > 1.0
    low = speculation_ceiling(curve, [100], model, dear)
    assert low.speedup < high.speedup
    assert low.refresh_steps == pytest.approx(5e-2 / cheap.l_ar) and low.refresh_steps > high.refresh_steps
    first_node = 1.8 * cheap.l_ar / cheap.cycle_seconds(model.predict_batch([2], [100]), 2)
    one_node = speculation_ceiling(curve[:2], [100], model, cheap)
    assert one_node.speedup == pytest.approx(first_node, rel=1e-12)
    with pytest.raises(ValueError, match="N >= 1"):
        speculation_ceiling((1.0,), [100], model, cheap)
    with pytest.raises(ValueError, match="at least one request"):
        speculation_ceiling(curve, [], model, cheap)


def test_the_plan_reports_the_mean_corrected_accept_curve() -> None:
    """accept_curve[n] = mean_i (1 + c_i · Σ_{j<=n} ρ_ij), n = 0..N, also when the policy declines."""
    logprobs = torch.log(torch.tensor([[[0.5, 0.25]], [[0.1, 0.1]]], dtype=torch.float64))
    trees = build_trees(logprobs, torch.tensor([[[1, 2]], [[1, 2]]]), 2)
    model = LatencyModel(RooflineModel(QWEN3_8B, lookup_gpu("H100 SXM")))
    expected = (1.0, ((1 + 0.5) + (1 + 2 * 0.1)) / 2, ((1 + 0.75) + (1 + 2 * 0.2)) / 2)
    cheap = StepCosts(t_draft=1e-4, t_aux=0.0, l_ar=0.02)
    speculating = plan_batch(trees, [10, 10], model, cheap, FixedPolicy(1), accept_scale=[1.0, 2.0])
    assert speculating.speculates and speculating.accept_curve == pytest.approx(expected)
    costly = StepCosts(t_draft=10.0, t_aux=0.0, l_ar=0.02)
    declined = plan_batch(
        trees, [10, 10], model, costly, AdaptivePolicy(), accept_scale=[1.0, 2.0], allow_plain=True
    )
    assert not declined.speculates and declined.accept_curve == pytest.approx(expected)


def test_horizon_gain_bounds_every_node_below_the_horizon() -> None:
    """Trees planned within a horizon h < D: the bound is at least c_i · ρ of the best node of the whole
    lattice below depth h (brute force over every node), and is exactly c_i · ρ of the best node at depth h
    when that node made the tree; at h = D there is nothing below."""
    generator = torch.Generator().manual_seed(5)
    depth, branching, horizon = 5, 3, 2
    for budget, scale in ((4, 1.0), (12, 0.5), (2, 2.0), (1, 1.0)):
        for _ in range(20):
            logits = 2 * torch.randn(1, depth, 64, generator=generator, dtype=torch.float64)
            top = torch.log_softmax(logits, -1).topk(branching, -1)
            whole = build_trees(top.values, top.indices, 3 + 9 + 27 + 81 + 243)  # every node of the lattice
            below = whole.log_scores[whole.depths > horizon].max().exp().item()
            trees = build_trees(top.values[:, :horizon], top.indices[:, :horizon], budget)
            gain = horizon_gain(trees, horizon, depth, [scale])
            assert gain >= scale * below * (1 - 1e-12)
            at_horizon = trees.log_scores[trees.depths == horizon]
            if at_horizon.numel():
                assert gain == pytest.approx(scale * at_horizon.max().exp().item(), rel=1e-12)
            else:
                assert gain == pytest.approx(scale * trees.log_scores[0, -1].exp().item(), rel=1e-12)
            assert horizon_gain(trees, horizon, horizon, [scale]) == 0.0


def test_horizon_gain_is_the_mean_over_requests() -> None:
    logprobs = torch.log(
        torch.tensor([[[0.5, 0.25], [0.5, 0.5]], [[0.1, 0.1], [1.0, 0.0]]], dtype=torch.float64)
    )
    trees = build_trees(logprobs, torch.tensor([[[1, 2], [3, 4]], [[1, 2], [3, 4]]]), 3)
    assert horizon_gain(trees, 2, 15, [1.0, 2.0]) == pytest.approx((0.25 + 2 * 0.1) / 2)


def test_reachable_accept_adds_what_nodes_below_the_horizon_could_give() -> None:
    """max over m <= n of Â(m) + (n - m) · g, at most 1 + n; the curve itself when g = 0."""
    curve = (1.0, 1.9, 2.0, 2.05)
    assert reachable_accept(curve, 0.0).tolist() == pytest.approx(curve)
    assert reachable_accept(curve, 0.5).tolist() == pytest.approx([1.0, 1.9, 2.4, 2.9])
    assert reachable_accept(curve, 1.0).tolist() == pytest.approx([1.0, 2.0, 3.0, 4.0])


def test_a_curve_held_back_by_the_horizon_raises_the_ceiling() -> None:
    """A curve capped at depth 2 (Â stays at 3) prices speculation below plain decoding when the drafter costs
    3 plain steps; with what a chain of deeper accepted nodes could add, the ceiling is above one."""
    model = LatencyModel(RooflineModel(QWEN3_8B, lookup_gpu("H100 SXM")))
    l_ar = model.predict_plain_batch([100] * 8)
    costs = StepCosts(t_draft=3 * l_ar, t_aux=0.0, l_ar=l_ar)
    capped = (1.0, 2.0, 3.0) + (3.0,) * 13
    assert speculation_ceiling(capped, [100] * 8, model, costs).speedup < 1.0
    raised = reachable_accept(capped, 1.0)
    assert speculation_ceiling(raised, [100] * 8, model, costs).speedup > 1.0


def test_a_drafted_step_covers_only_its_own_requests() -> None:
    step = DraftedStep((1.0, 2.0), 0.0, frozenset({"a", "b"}))
    assert step.covers(["a"]) and step.covers(["b", "a"]) and step.covers([])
    assert not step.covers(["a", "c"])


def test_a_drafted_steps_curve_reaches_past_its_own_nodes_by_its_deeper_gain() -> None:
    """Past its N a step's raised curve adds deeper_gain per node (flat when 0), never above 1 + n."""
    assert DraftedStep((1.0, 1.5), 0.0, frozenset()).reachable(3).tolist() == [1.0, 1.5, 1.5, 1.5]
    assert DraftedStep((1.0, 1.5), 0.5, frozenset()).reachable(3).tolist() == [1.0, 1.5, 2.0, 2.5]
    assert DraftedStep((1.0, 2.0), 1.0, frozenset()).reachable(2).tolist() == [1.0, 2.0, 3.0]
    assert DraftedStep((1.0, 1.9, 2.0), 0.5, frozenset()).reachable(1).tolist() == [1.0, 1.9]


def test_evidence_prices_a_covered_batch_on_its_own_steps_and_new_requests_on_the_recent_mean() -> None:
    evidence = DraftEvidence(capacity=3, own_steps=2)
    assert evidence.curve_for(["a"]) is None and not evidence.informed  # nothing drafted yet
    evidence.record(DraftedStep((1.0, 1.9, 2.7), 0.0, frozenset({"a"})))
    assert evidence.curve_for(["a"]) is None and not evidence.informed  # one step is no evidence yet
    evidence.record(DraftedStep((1.0, 2.0), 0.5, frozenset({"b"})))
    evidence.record(DraftedStep((1.0, 1.0, 1.0), 0.0, frozenset({"a", "b"})))
    assert evidence.informed
    # the only step of both requests, and the recent steps' mean in place of the second own step
    both = [1.0, (1.0 + (1.9 + 2.0 + 1.0) / 3) / 2, (1.0 + (2.7 + 2.5 + 1.0) / 3) / 2]
    assert evidence.curve_for(["b", "a"]).tolist() == pytest.approx(both)
    # "a" alone: its own last two steps, the one between them for "b" left out
    assert evidence.curve_for(["a"]).tolist() == pytest.approx([1.0, (1.9 + 1.0) / 2, (2.7 + 1.0) / 2])
    mean = [1.0, (1.9 + 2.0 + 1.0) / 3, (2.7 + 2.5 + 1.0) / 3]
    assert evidence.curve_for(["a", "c"]).tolist() == pytest.approx(mean)  # "c": the recent steps' mean
    evidence.record(DraftedStep((1.0, 1.8, 2.4), 0.0, frozenset({"d"})))  # the first step is forgotten
    assert evidence.curve_for(["c"]).tolist() == pytest.approx([1.0, 4.8 / 3, 5.9 / 3])
    for capacity, own_steps in ((0, 1), (4, 0), (3, 4)):
        with pytest.raises(ValueError, match="1 <= own_steps <= capacity"):
            DraftEvidence(capacity=capacity, own_steps=own_steps)


def test_one_step_that_did_not_pay_does_not_veto_its_own_text() -> None:
    """Twenty drafted steps of one request estimated well above plain decoding, then steps that were not: the
    request's own batch is still priced above plain decoding (the mean of its last OWN_TEXT_STEPS steps)
    after one such step and after the STRETCH_STEPS that end a speculating stretch, so the gate's next probe
    runs; OWN_TEXT_STEPS such steps in a row price it below."""
    model = LatencyModel(RooflineModel(QWEN3_8B, lookup_gpu("H100 SXM")))
    l_ar = model.predict_plain_batch([300])
    costs = StepCosts(t_draft=0.2 * l_ar, t_aux=0.0, l_ar=l_ar)
    evidence = DraftEvidence()
    paying = (1.0, 1.6, 2.0, 2.2, 2.3)
    for _ in range(20):
        evidence.record(DraftedStep(paying, 0.0, frozenset({"a"})))
    assert speculation_ceiling(evidence.curve_for(["a"]), [300], model, costs).speedup > 1.3
    dip = (1.0, 1.05, 1.08, 1.1, 1.11)
    evidence.record(DraftedStep(dip, 0.0, frozenset({"a"})))
    assert speculation_ceiling(dip, [300], model, costs).speedup < PAYING_SPEEDUP
    assert speculation_ceiling(evidence.curve_for(["a"]), [300], model, costs).speedup > PAYING_SPEEDUP
    for _ in range(STRETCH_STEPS - 1):
        evidence.record(DraftedStep(dip, 0.0, frozenset({"a"})))
    assert speculation_ceiling(evidence.curve_for(["a"]), [300], model, costs).speedup > PAYING_SPEEDUP
    for _ in range(OWN_TEXT_STEPS - STRETCH_STEPS):
        evidence.record(DraftedStep(dip, 0.0, frozenset({"a"})))
    assert speculation_ceiling(evidence.curve_for(["a"]), [300], model, costs).speedup < PAYING_SPEEDUP


def test_one_requests_unpredictable_tail_does_not_veto_the_next_requests() -> None:
    """Eight drafted steps of text predicted 15 deep, then OWN_TEXT_STEPS of one request's tail the drafter
    cannot predict: that request's own batch is priced below plain decoding, a batch of new requests above
    it."""
    model = LatencyModel(RooflineModel(QWEN3_8B, lookup_gpu("H100 SXM")))
    l_ar = model.predict_plain_batch([300] * 8)
    costs = StepCosts(t_draft=l_ar, t_aux=0.0, l_ar=l_ar)
    evidence = DraftEvidence(capacity=16)
    predicted = tuple(float(min(n, 15)) + 1.0 for n in range(17))
    for _ in range(8):
        evidence.record(DraftedStep(predicted, 0.0, frozenset({"old"})))
    for _ in range(OWN_TEXT_STEPS):
        evidence.record(DraftedStep((1.0,) + (1.02,) * 16, 0.0, frozenset({"old"})))
    assert speculation_ceiling(evidence.curve_for(["old"]), [300], model, costs).speedup < 1.0
    fresh = evidence.curve_for([f"new{i}" for i in range(8)])
    assert speculation_ceiling(fresh, [300] * 8, model, costs).speedup > 1.0


def test_evidence_is_priced_at_the_correction_of_the_day() -> None:
    """A curve planned at c = 0.25 is priced at the correction asked for: its drafted part times c / 0.25,
    never above 1 + n. A ceiling priced at a decline's pessimistic c kept vetoing probes after the correction
    had forgotten it."""
    evidence = DraftEvidence(capacity=2, own_steps=1)
    evidence.record(DraftedStep((1.0, 1.2, 1.3), 0.0, frozenset({"a"}), scale=0.25))
    assert evidence.curve_for(["a"], 0.25).tolist() == pytest.approx([1.0, 1.2, 1.3])
    assert evidence.curve_for(["a"], 0.5).tolist() == pytest.approx([1.0, 1.4, 1.6])
    assert evidence.curve_for(["a"], 1.0).tolist() == pytest.approx([1.0, 1.8, 2.2])
    assert evidence.curve_for(["a"], 4.0).tolist() == pytest.approx([1.0, 2.0, 3.0])  # capped at 1 + n
    evidence.record(DraftedStep((1.0, 1.5), 0.0, frozenset({"b"}), scale=1.0))
    assert evidence.curve_for(["c"], 1.0).tolist() == pytest.approx([1.0, (1.8 + 1.5) / 2, (2.2 + 1.5) / 2])
    with pytest.raises(ValueError, match="correction must be > 0"):
        evidence.record(DraftedStep((1.0, 1.5), 0.0, frozenset({"b"}), scale=0.0))
