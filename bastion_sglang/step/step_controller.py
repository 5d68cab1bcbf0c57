"""The decode step's decisions and observations, shared by the SGLang worker and the reference engine.

A decode step asks the controller, in order (`docs/architecture.md`, "One decode step"):
1. `begin`: the step's contexts, sampling modes and host time since the last decode step (`StepStart`);
2. `draft_horizon`: whether the drafter runs (the gate, with the ceiling priced from the recent drafted
   steps' evidence) and how many positions its LM head scores (the draft horizon; 0: skip the drafter);
3. `plan`: the calibrated best-first trees and the batch plan (`plan_batch`) on the drafter's top-K, or
   `plain` for a step without a draft;
4. `record`: the plan's pending acceptance record, the speedup ledger's entry, the horizon's observation
   and the plan's metrics;
5. `end` (or `end_timed` with times the caller measured itself): the measured stage seconds feed the
   latency model's online correction and the step-cost tracker; `verified` takes the realised accepted
   counts.

No SGLang and no models here: the controller owns the gate, the draft horizon, the drafted steps' evidence,
the acceptance and step-cost trackers, the pending plans and the metrics it writes, and prices everything
with a `LatencyModel` it is given.
"""

from __future__ import annotations

import functools
import time
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Protocol

import numpy as np
import torch

from bastion_sglang.controller.acceptance import (
    CALIBRATED_PRIOR_WEIGHT,
    AcceptanceCalibration,
    AcceptanceTracker,
    best_accept_curve,
    node_log_scores,
)
from bastion_sglang.controller.batched import DraftTreeBatch, build_trees_auto_unchecked
from bastion_sglang.controller.depth_acceptance import (
    CALIBRATED_POOLED_PRIOR_WEIGHT,
    POOLED_PRIOR_WEIGHT,
    OnlineDepthMap,
    depth_reach,
    shift_logprobs,
)
from bastion_sglang.controller.gate import (
    DraftedStep,
    DraftEvidence,
    SpeculationCeiling,
    SpeculationGate,
    horizon_gain,
    speculation_ceiling,
)
from bastion_sglang.controller.horizon import DraftHorizon
from bastion_sglang.controller.latency import LatencyModel
from bastion_sglang.controller.policies import BatchPlan, BudgetPolicy, plain_plan, plan_batch
from bastion_sglang.controller.profile import StepCosts
from bastion_sglang.controller.step_costs import StepCostTracker
from bastion_sglang.kernels.types import DraftLattice, DraftTopK
from bastion_sglang.step.timing import StageTimer, StageTimes, TimedStep


class StepMetrics(Protocol):
    """Where the controller writes what it decided and observed (`metrics.BastionMetrics` on a server)."""

    def observe_plan(
        self,
        node_counts: Sequence[int],
        expected_accept: Sequence[float],
        expected_accept_raw: Sequence[float],
        estimated_speedup: float,
        calibrated: bool,
        mode: str = "speculative",
    ) -> None: ...

    def observe_verify(
        self, estimated_seconds: float, observed_seconds: float, ema_factor: float
    ) -> None: ...

    def observe_stages(self, times: StageTimes, other_seconds: float | None) -> None: ...

    def observe_realised_speedup(self, speedup: float) -> None: ...

    def observe_acceptance(
        self, calibration_error: float, greedy_correction: float, sampled_correction: float
    ) -> None: ...

    def observe_accepted(self, accepted_drafts: Sequence[int]) -> None: ...

    def end_step(self) -> None: ...


BOUND_REPRICE_STEPS = 256
"""Decode steps a batch size's start-up bound (`StepController.pay_bound`) is reused before it is priced again
at the step costs and online corrections of the day."""

PENDING_STEPS = 4
"""Decode steps whose accepted counts may be outstanding at once: one without overlap scheduling, two with
it (SGLang processes a step's result after launching the next); more means a result never came back, and the
oldest plans are dropped."""


@dataclass
class _StepEntry:
    l_ar: float
    batch: int
    seconds: float | None = None
    tokens: int | None = None


class SpeedupLedger:
    """Joins what the realised speedup of a decode step needs, which arrives in any order: the plan (L_AR, the
    plain-decoding seconds of the batch, and B), the measured step seconds (one step late on CUDA) and the
    tokens committed (once SGLang has them on the host). Realised speedup = tokens · L_AR / (B · seconds),
    returned by whichever call completes the step; entries older than `keep` steps are dropped."""

    def __init__(self, keep: int = 4) -> None:
        self._entries: dict[int, _StepEntry] = {}
        self._keep = keep

    def plan(self, step: int, l_ar: float, batch: int) -> None:
        self._entries[step] = _StepEntry(l_ar, batch)
        for old in [key for key in self._entries if key <= step - self._keep]:
            del self._entries[old]

    def timed(self, step: int, seconds: float) -> float | None:
        entry = self._entries.get(step)
        if entry is None:
            return None
        entry.seconds = seconds
        return self._complete(step, entry)

    def committed(self, step: int, tokens: int) -> float | None:
        entry = self._entries.get(step)
        if entry is None:
            return None
        entry.tokens = tokens
        return self._complete(step, entry)

    def _complete(self, step: int, entry: _StepEntry) -> float | None:
        if entry.seconds is None or entry.tokens is None or entry.seconds <= 0:
            return None
        del self._entries[step]
        return entry.tokens * entry.l_ar / (entry.batch * entry.seconds)


@dataclass(frozen=True)
class PendingStep:
    """A decode step's plan, waiting for its accepted counts (`StepController.verified`)."""

    index: int  # decode steps of this controller before it
    expected_drafted: list[float]  # [B] the plan's calibrated expected accepted drafts per request
    greedy: list[bool]  # [B] whether each request decodes greedily
    scales: list[float]  # [B] acceptance corrections the plan used
    reach: np.ndarray | None = None  # [B, D] float64 base-map probability of reaching each depth (None: none)


@dataclass(frozen=True)
class StepRecord:
    """What a decode step's measured times are matched with (one step late on CUDA)."""

    index: int  # decode steps of this controller before it
    widths: list[int]  # [B] verify width per request (the padded W_v)
    contexts: list[int]  # [B] cached tokens per request
    estimated_verify_seconds: float  # the plan's prediction for the verify pass
    other_seconds: float | None  # host seconds since the previous decode step ended (None: none just before)
    drafted: bool  # whether the drafter ran


@dataclass(frozen=True)
class StepStart:
    """What one decode step's decisions read."""

    index: int  # decode steps of this controller before it
    contexts: list[int]  # [B] committed tokens per request (host)
    greedy: list[bool]  # [B] whether each request decodes greedily
    requests: frozenset[str]  # the batch's request ids
    l_ar: float  # seconds of a plain decode step of this batch now (the latency model's prediction)
    other_seconds: float | None  # host seconds since the previous decode step ended (None: none just before)
    costs: Callable[[], StepCosts]  # the planner's step costs, priced once when first asked

    @property
    def batch_size(self) -> int:
        return len(self.contexts)


@dataclass(frozen=True)
class StepPlan:
    """A drafted step's decision: the calibrated trees, the batch plan and the corrections it used."""

    plan: BatchPlan
    trees: DraftTreeBatch | None  # None: this rank does not plan (it takes the leader's rows)
    top: DraftTopK  # [B, h, K] the drafter's candidates
    scales: list[float]  # [B] acceptance corrections
    lattice: DraftLattice | None = None  # [B, D, K, K] a DFlash2 draft's lattice (`top` is its unary top-K)
    # [B, D] float64 per request the base map's probability that its verified nodes reach depth d, for the
    # online depth map (`controller.depth_acceptance`); None: not learnt from (a lattice's plan)
    reach: np.ndarray | None = None

    @property
    def mode(self) -> str:
        """The step kind the metrics count: speculative, or declined (drafted, then verified no node)."""
        return "speculative" if self.plan.speculates else "declined"


class StepController:
    """One engine's (or one reference request's) decode-step controller (module docstring).

    latency: the verify-latency model the plans are priced with (observed here every step); costs: the
    step-cost tracker (T_draft, T_aux; observed on drafted steps); fixed_costs: step costs used as they are
    instead (L_AR included), e.g. a benchmark's; policy: the budget policy; budget: nodes of the best-first
    tree built per request; horizon: the draft horizon (`DraftHorizon.full` where the drafter scores every
    position); acceptance: the drafter's calibration (None: raw drafter probabilities); branching: K, the
    drafter's candidates per position; device: where the stage timer records; metrics: the Prometheus sink
    (None: none).

    Where speculation can pay at all. With a calibration, `best_accept_curve` bounds the Â of any tree the
    drafter could propose; priced for a batch (`speculation_ceiling` at its contexts and step costs, the
    drafted part scaled by the online correction, which lifts the bound when the drafter proves better than
    calibrated), it bounds every plan's speedup. A batch size whose bound is at most 1 never drafts but for
    the gate's rare refresh probes (`SpeculationGate.should_draft`). Without a calibration there is no bound
    and the gate probes as it does for any batch.
    """

    def __init__(
        self,
        *,
        latency: LatencyModel,
        costs: StepCostTracker,
        policy: BudgetPolicy,
        budget: int,
        horizon: DraftHorizon,
        acceptance: AcceptanceCalibration | None,
        branching: int,
        device: torch.device,
        metrics: StepMetrics | None = None,
        fixed_costs: StepCosts | None = None,
    ) -> None:
        self.latency = latency
        self.costs = costs
        self.policy = policy
        self.budget = budget
        self.horizon = horizon
        self.acceptance = acceptance
        self.metrics = metrics
        self.fixed_costs = fixed_costs
        self.gate = SpeculationGate()
        self._branching = branching
        calibrated = acceptance is not None  # a fitted map is evidence the first steps must not overrule
        pooled_prior = CALIBRATED_POOLED_PRIOR_WEIGHT if calibrated else POOLED_PRIOR_WEIGHT
        self.depth_map = OnlineDepthMap(horizon.depth, pooled_prior_weight=pooled_prior)
        self._bounds: dict[tuple[int, int], tuple[int, SpeculationCeiling]] = {}  # (B, context bucket)
        self.evidence = DraftEvidence()  # what the recent drafted steps said of their text
        self.acceptance_tracker = AcceptanceTracker(
            depth=horizon.depth, prior_weight=CALIBRATED_PRIOR_WEIGHT if calibrated else 0.0
        )
        self.timer: StageTimer[StepRecord] = StageTimer(device)
        self._pending: deque[PendingStep] = deque(maxlen=PENDING_STEPS)  # oldest first
        self._speedups = SpeedupLedger()
        self._step_index = 0
        self._last_end: float | None = None  # host clock at the end of the last decode step

    def after_prefill(self) -> None:
        """A prefill ran: the next decode step does not follow a decode step."""
        self._last_end = None

    def step_costs(self, contexts: Sequence[int]) -> StepCosts:
        """Per-step costs for the planner: the fixed costs if given, else the tracker's measured stages (the
        profile's costs, at the latency model's machine factor, until they warm up) and L_AR, the latency
        model's plain decode step of the whole batch as Ŝ compares it with verify passes
        (`LatencyModel.predict_plain_batch_as_of_verify`)."""
        if self.fixed_costs is not None:
            return self.fixed_costs
        l_ar = self.latency.predict_plain_batch_as_of_verify(contexts)
        return self.costs.costs(l_ar=l_ar, batch=len(contexts), machine=self.latency.machine_factor)

    def begin(self, contexts: list[int], greedy: list[bool], requests: Sequence[str]) -> StepStart:
        """Open a decode step over a batch: contexts [B] committed tokens, greedy [B], requests [B] ids."""
        now = time.perf_counter()
        return StepStart(
            index=self._step_index,
            contexts=contexts,
            greedy=greedy,
            requests=frozenset(requests),
            l_ar=self.latency.predict_plain_batch(contexts),
            other_seconds=None if self._last_end is None else now - self._last_end,
            # priced once, and only when a ceiling or a plan needs them (most skipped steps do not)
            costs=functools.cache(functools.partial(self.step_costs, contexts)),
        )

    def draft_horizon(self, step: StepStart, decides: bool) -> int:
        """Positions the drafter's LM head scores this step; 0: skip the drafter. decides: whether this rank
        runs the gate (the leader under TP; other ranks take its horizon). Policies that never decline
        always draft; a probe of the gate scores every position (`DraftHorizon.open`)."""
        if self.policy.may_decline and decides:
            ceiling = functools.partial(self._ceiling, step) if self.evidence.informed else None
            if not self.gate.should_draft(ceiling, self.pay_bound(step)):
                return 0
            if self.gate.probing:
                self.horizon.open()
        return self.horizon.horizon

    def _ceiling(self, step: StepStart) -> SpeculationCeiling:
        """The gate's ceiling for this batch: the recent drafted steps' curve (`DraftEvidence.curve_for`)
        at today's acceptance correction, priced at the batch's contexts and step costs."""
        scales = self.acceptance_scales(step.greedy)
        curve = self.evidence.curve_for(step.requests, sum(scales) / len(scales))
        assert curve is not None  # asked only once the evidence is informed
        return speculation_ceiling(curve, step.contexts, self.latency, step.costs())

    def pay_bound(self, step: StepStart) -> SpeculationCeiling | None:
        """The best speedup any tree could give this batch (class docstring), priced once per batch size and
        context bucket (a power of two) every BOUND_REPRICE_STEPS steps; None without a calibration."""
        if self.acceptance is None:
            return None
        key = (step.batch_size, max(step.contexts).bit_length())
        cached = self._bounds.get(key)
        if cached is not None and step.index - cached[0] < BOUND_REPRICE_STEPS:
            return cached[1]
        scale = max(self.acceptance_scales(step.greedy))
        mapped = self.acceptance.shifted(self.depth_map.shifts)
        accept_bound = best_accept_curve(mapped, self.horizon.depth, self._branching, self.budget)
        curve = 1.0 + scale * (accept_bound - 1.0)
        bound = speculation_ceiling(curve, step.contexts, self.latency, step.costs())
        self._bounds[key] = (step.index, bound)
        return bound

    def acceptance_scales(self, greedy: Sequence[bool]) -> list[float]:
        """[B] the online acceptance correction c per request (`AcceptanceTracker.correction`), taken
        against the online depth map as it is now."""
        return self.acceptance_tracker.corrections(greedy, self.depth_map.reach_scale)

    def plan(self, step: StepStart, top: DraftTopK) -> StepPlan:
        """The calibrated best-first trees of `top` ([B, h, K] log-probs and ids) and the batch plan; the
        gate and the evidence record the plan's speculative speedup and accept curve. Calibrated: by the
        acceptance map (raw drafter log-probs without one), then by the online depth map's shifts."""
        base = top.logprobs if self.acceptance is None else self.acceptance.apply(top.logprobs)
        planned = shift_logprobs(base, self.depth_map.shifts) if self.depth_map.active else base
        # the raw log-probs are scored beside calibrated trees, for the raw Â metric
        raw = None if planned is top.logprobs else top.logprobs
        trees = build_trees_auto_unchecked(planned, top.token_ids, self.budget, raw=raw)
        scales = self.acceptance_scales(step.greedy)
        plan = self.plan_trees(step, trees, int(top.logprobs.shape[1]), scales)
        return StepPlan(plan, trees, top, scales, reach=self._base_reach(trees, base, top, plan.node_counts))

    def plan_trees(
        self, step: StepStart, trees: DraftTreeBatch, drafted: int, scales: list[float]
    ) -> BatchPlan:
        """The batch plan of this step's best-first trees (top-K or lattice) with the acceptance corrections
        `scales` ([B]); the gate and the evidence record its speculative speedup and accept curve. drafted:
        the positions the drafter scored (the horizon the trees were built within)."""
        plan = plan_batch(
            trees,
            step.contexts,
            self.latency,
            step.costs(),
            self.policy,
            accept_scale=scales,
            # a backoff probe verifies its tree whatever the estimate, so the acceptance correction sees
            # fresh evidence and speculation can resume; a refresh probe only re-drafts
            allow_plain=not self.gate.verifies_probe,
        )
        self.gate.record(plan.speculative_speedup)
        gain = horizon_gain(trees, drafted, self.horizon.depth, scales)
        self.evidence.record(DraftedStep(plan.accept_curve, gain, step.requests, sum(scales) / len(scales)))
        return plan

    def _base_reach(
        self, trees: DraftTreeBatch, base: torch.Tensor, top: DraftTopK, counts: Sequence[int]
    ) -> np.ndarray:
        """[B, D] the base map's probability that each request's verified nodes reach depth d
        (`depth_acceptance.depth_reach`): the trees' own scores while the depth map shifts nothing, else
        their nodes scored again under the base log-probs `base` [B, h, K] (copied to the host: the trees'
        host copy is there already)."""
        host = trees.on_host()
        scores = host.log_scores
        if self.depth_map.active and host.num_nodes > 0:
            scores = node_log_scores(host.tokens, host.parents, host.depths, base.cpu(), top.token_ids.cpu())
        return depth_reach(host.depths.numpy(), scores.numpy(), counts, self.horizon.depth)

    def plain(self, step: StepStart, top: DraftTopK) -> StepPlan:
        """A drafted step this rank does not plan (a follower under TP): plain decoding until the leader's
        rows arrive."""
        return StepPlan(plain_plan(step.batch_size, step.l_ar), None, top, [1.0] * step.batch_size)

    def record(self, step: StepStart, planned: StepPlan | None, deepest: int | None = None) -> None:
        """Keep what the step's result and times are matched with: its pending acceptance record, the
        speedup ledger's entry, the plan's metrics. planned: None for a step that skipped the drafter;
        deepest: the deepest node the verify rows hold (the horizon observes it; None: not the leader's)."""
        bs = step.batch_size
        if deepest is not None:
            self.horizon.observe(deepest)
        if planned is None:
            self._pending.append(PendingStep(step.index, [0.0] * bs, step.greedy, [1.0] * bs))
        else:
            expected = list(planned.plan.expected_drafted)
            pending = PendingStep(step.index, expected, step.greedy, planned.scales, planned.reach)
            self._pending.append(pending)
        self._speedups.plan(step.index, step.l_ar, bs)
        if self.metrics is None:
            return
        if planned is None:
            ones = [1.0] * bs
            self.metrics.observe_plan([0] * bs, ones, ones, 1.0, self.latency.calibrated, "skipped")
            return
        plan = planned.plan
        raw = [1.0] * bs if planned.trees is None else self._raw_expected_accept(planned, plan.node_counts)
        self.metrics.observe_plan(
            plan.node_counts,
            plan.expected_accept,
            raw,
            plan.estimated_speedup,
            self.latency.calibrated,
            planned.mode,
        )

    def _raw_expected_accept(self, planned: StepPlan, counts: Sequence[int]) -> list[float]:
        """Raw Â per request of the planned trees: 1 + Σ of the drafter's uncalibrated path probabilities
        (a lattice's: its raw transitions along each node's path), read on the trees' host copy: their own
        scores without a calibration, else the raw scores the plan kept beside them
        (`DraftTreeBatch.raw_log_scores`). No device read beyond the plan's one copy of the trees."""
        host = planned.trees.on_host()
        scores = host.log_scores if host.raw_log_scores is None else host.raw_log_scores
        gains = torch.exp(scores).cumsum(1)  # [B, N] on the host
        return [1.0 + (float(gains[i, n - 1]) if n > 0 else 0.0) for i, n in enumerate(counts)]

    def end(self, record: StepRecord) -> None:
        """Close the decode step `record` describes: the stage timer's times (this step's on the CPU, the
        previous step's on CUDA) to the latency model, step costs and metrics."""
        self._close(self.timer.finish_step(record))

    def end_timed(self, record: StepRecord, times: StageTimes) -> None:
        """`end` with the step's times measured by the caller's own timer."""
        self._close(TimedStep(record, times))

    def _close(self, finished: TimedStep[StepRecord] | None) -> None:
        self._observe(finished)
        if self.metrics is not None:
            self.metrics.end_step()
        self._step_index += 1
        self._last_end = time.perf_counter()

    def _observe(self, finished: TimedStep[StepRecord] | None) -> None:
        """Feed a finished step's measured seconds to the latency model's online correction, the step-cost
        tracker and the metrics. finished: the step's record and its stage times, or None."""
        if finished is None:
            return
        record, times = finished.record, finished.times
        step_seconds = times.draft + times.verify + times.aux + (record.other_seconds or 0.0)
        self._report_speedup(self._speedups.timed(record.index, step_seconds))
        if self.metrics is not None:
            self.metrics.observe_stages(times, record.other_seconds)
        if times.verify > 0:
            if max(record.widths) == 1:
                self.latency.observe_plain_batch(record.contexts, times.verify)
            else:
                self.latency.observe_batch(record.widths, record.contexts, times.verify)
            if self.metrics is not None:
                self.metrics.observe_verify(
                    record.estimated_verify_seconds, times.verify, self.latency.ema_factor
                )
        if record.drafted:
            self.costs.observe(times.draft, times.aux, sum(record.widths), len(record.widths))

    def verified(self, accepted_drafts: list[int]) -> None:
        """A decode step's accepted draft counts [B] are known: the realised accept lengths.

        Results come back in launch order, one per decode step (under overlap scheduling after the next step
        was launched); each is matched with the oldest pending plan.
        """
        if self._pending:
            pending = self._pending.popleft()
            tracker = self.acceptance_tracker
            tracker.observe(
                pending.expected_drafted, accepted_drafts, pending.greedy, pending.scales, pending.reach
            )
            if pending.reach is not None:
                self.depth_map.observe(pending.reach, accepted_drafts)
            if self.metrics is not None:
                self.metrics.observe_acceptance(
                    tracker.calibration_error, *self.acceptance_scales([True, False])
                )
            committed = sum(accepted_drafts) + len(accepted_drafts)
            self._report_speedup(self._speedups.committed(pending.index, committed))
        if self.metrics is not None:
            self.metrics.observe_accepted(accepted_drafts)

    def _report_speedup(self, speedup: float | None) -> None:
        if speedup is not None and self.metrics is not None:
            self.metrics.observe_realised_speedup(speedup)
