"""Whether a decode step drafts: skip the drafter while speculation does not pay, re-probe with backoff.

A drafted step's plan reports `BatchPlan.speculative_speedup`, the estimated speedup over plain decoding of
the best speculative plan for that batch (drafter pass included, calibrated Â and latency). A stretch of
speculation opens on a step whose estimate beats `batch_objective.PAYING_SPEEDUP` (1.05: beyond the estimate's
own error of plain decoding) and goes on while the mean of its last `stretch_steps` (4) estimates stays above
`STRETCH_SPEEDUP` (1.0, plain decoding); below it the next steps skip the drafter and decode plainly (speedup
exactly 1 by definition). Drafting at an estimate between the two costs nothing in expectation and keeps the
evidence fresh, where skipping gives up what the text pays until a probe finds it again: on the CPU demo pair
at c = 1 with real weights, `fixed:4`, drafting at every step, read 0.99 to 1.16x plain decoding's decode
tokens/s in three bench runs, where a gate whose stretches ended at 1.05 read 0.95 to 1.06x, drafting at a
third of the steps or fewer. One step's estimate swings with the text at hand: on the CPU demo pair at c = 1
and T = 0.7, the drafted step after one at most PAYING_SPEEDUP read above it in 26 of 47 cases (1.12 on
average), and judged alone each such step had cost a skipped step, a forced probe and often a backoff of tens
of steps. A step whose own plan does not pay still decodes plainly (its plan declines); only the steps after
it follow the stretch's mean. After `backoff` skipped steps one step drafts again (a probe, judged on its own
estimate); if speculation still does not pay, the backoff doubles, up to `max_backoff`; as soon as a probe's
best plan beats plain decoding by that margin, every step drafts again, a new stretch starts with the step
after the probe and the backoff returns to `min_backoff`. The probe's own estimate is not part of the stretch:
it is made at an acceptance correction that forgot its evidence over the skipped steps, and the step after it
is the first planned with the probe's verified evidence (on the CPU test pair a drafter that never matched
probed at 1.8 to 2.2 and its next steps read 0.83; counted in the stretch, each probe kept it drafting for
four steps). A batch that shrinks, or text the drafter predicts well, is therefore picked up within
`max_backoff` steps. Such a backoff probe verifies its tree whatever its estimate (`verifies_probe`), so the
acceptance correction sees fresh evidence. (The correction also forgets its evidence over decode steps that
verify nothing, `AcceptanceTracker`, so a pessimistic one cannot keep speculation off for good.)

A probe costs a drafter pass, which grows with the batch (on a CPU 80 ms at B = 8 against 18 ms at B = 1, more
than a plain step). So before drafting, the caller may pass a `ceiling`: the estimated speedup of the best
speculative plan this batch would get if its text were like the recent drafted steps' (`DraftEvidence`: the
mean Â curve of the last eight drafted steps of its own requests when the last drafted step drafted for every
request of the batch, else the mean curve of the recent drafted steps; none before eight drafted steps, so the
first probes of a fresh engine run: its first step, one prompt's opening, had vetoed them for 64 steps and
more on the CPU demo pair; `speculation_ceiling` re-prices it at this batch's contexts and step costs). While
the ceiling is at most PAYING_SPEEDUP, a probe the backoff asks for is skipped too and counts as a failed
probe: the backoff doubles and the ceiling is asked again after it (pricing a curve cost 0.23 ms of host time
per step on the CPU demo pair, 1 % of a plain step, when it was asked at every step of a backoff stuck at
min_backoff). Only a refresh probe still runs (the text may have become easier), once the steps without
drafting reach the refresh interval; a vetoed probe's backoff never runs past that point. While speculating
the ceiling is not asked: the stretch's own plans decide. Where the draft horizon held the trees back (h < D,
`controller.horizon`), the curve is raised to what nodes below the horizon could add (`horizon_gain`,
`reachable_accept`): after a decline the horizon is two positions, and a curve capped at depth 2 kept the gate
closed for 50 steps on text the drafter predicted 15 tokens deep. A probe itself scores every position
(`probing`, `DraftHorizon.open`), so the curve it leaves needs no raise: raised from two positions, such
curves put the ceiling of fresh requests at 1.1 to 1.6 where their probes' plans read 0.6 to 0.8.

A refresh probe only re-drafts: its plan verifies a tree when the fresh estimate pays and otherwise decodes
plainly, so it costs the drafter pass and the planning, `SpeculationCeiling.refresh_steps` plain steps.
(Verifying the declined tree as well cost about twice that on the 2-core CPU at B = 8.) The refresh interval
starts at `max_backoff`, doubles with each refresh whose estimate is at most STRETCH_SPEEDUP (one that does
not beat PAYING_SPEEDUP but would not lose keeps the interval; refreshes at 1.00 to 1.02 had stretched it to
256 steps on the CPU demo pair), up to `max_refresh`, and returns to `max_backoff` after any probe that pays.
It is also never shorter than refresh_steps / `probe_share`, which keeps the expected cost of refreshes at
`probe_share` of the decode time (1 %) as far as `max_refresh` allows: where a drafter pass costs 0.9 plain
steps (the CPU at B = 8) refreshes wait at least 90 steps instead of 64; where probes are cheap (a GPU, one
request) `max_backoff` decides. When the batch shrinks the drafter gets cheaper, the ceiling rises above
PAYING_SPEEDUP and the backoff's probes run again.
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import numpy as np
import torch

from bastion_sglang.controller.batch_objective import PAYING_SPEEDUP, common_width_estimates
from bastion_sglang.controller.verify_passes import check_contexts

if TYPE_CHECKING:
    from bastion_sglang.controller.batched import DraftTreeBatch
    from bastion_sglang.controller.latency import LatencyModel
    from bastion_sglang.controller.profile import StepCosts


STRETCH_STEPS = 4
"""Drafted steps of a speculating stretch whose mean estimated speedup decides whether it goes on."""
STRETCH_SPEEDUP = 1.0
"""The mean estimated speedup a speculating stretch must keep above to go on: plain decoding's, below the
PAYING_SPEEDUP a probe must beat to open one (module docstring)."""


@dataclass(frozen=True)
class SpeculationCeiling:
    """The best speculative plan of the batch at hand if its text is like the last drafted step's
    (`speculation_ceiling`): its estimated speedup Ŝ over plain decoding, and refresh_steps, what a refresh
    probe of this batch costs in plain decode steps: (T_draft + T_aux) / L_AR at its step costs."""

    speedup: float
    refresh_steps: float


@dataclass
class SpeculationGate:
    """The module docstring's state machine. min_backoff / max_backoff: steps skipped after a failed probe;
    max_refresh: the longest interval, in steps without drafting, between refresh probes; probe_share: the
    share of decode time refresh probes may cost in expectation, as far as max_refresh allows."""

    min_backoff: int = 1
    max_backoff: int = 64
    max_refresh: int = 256
    probe_share: float = 0.01
    stretch_steps: int = STRETCH_STEPS
    _stretch: deque[float] = field(default_factory=deque, init=False)
    _backoff: int = field(default=0, init=False)
    _skip_remaining: int = field(default=0, init=False)
    _skipped: int = field(default=0, init=False)
    _steps: int = field(default=0, init=False)
    _since_draft: int = field(default=0, init=False)
    _refresh_after: int = field(default=0, init=False)
    _refreshing: bool = field(default=False, init=False)
    _speculating: bool = field(default=False, init=False)

    def __post_init__(self) -> None:
        if not 1 <= self.min_backoff <= self.max_backoff <= self.max_refresh:
            raise ValueError(
                "need 1 <= min_backoff <= max_backoff <= max_refresh, got "
                f"{self.min_backoff}, {self.max_backoff} and {self.max_refresh}"
            )
        if not 0.0 < self.probe_share <= 1.0:
            raise ValueError(f"need 0 < probe_share <= 1, got {self.probe_share}")
        if self.stretch_steps < 1:
            raise ValueError(f"need stretch_steps >= 1, got {self.stretch_steps}")
        self._stretch = deque(maxlen=self.stretch_steps)
        self._refresh_after = self.max_backoff

    def should_draft(
        self,
        ceiling: Callable[[], SpeculationCeiling] | None = None,
        bound: SpeculationCeiling | None = None,
    ) -> bool:
        """Called once at the start of every decode step: True to draft (speculate or probe), else skip.
        ceiling: returns the best speculative plan this step could get (module docstring), called only when
        the backing-off gate would probe; None: none known. A ceiling that vetoes the probe doubles the
        backoff as a failed probe does, so it is asked ever more rarely, not at every step: it prices the
        batch's whole curve. bound: the best plan ANY tree could give this batch (`StepController`'s
        start-up bound from the acceptance calibration); at most PAYING_SPEEDUP, the step skips the drafter
        whatever the backoff, probes included, and only a refresh probe runs once `refresh_interval` steps
        went by without drafting (the online correction may have lifted the bound by then)."""
        self._steps += 1
        if bound is not None and bound.speedup <= PAYING_SPEEDUP:
            if self._since_draft >= self.refresh_interval(bound):
                self._refreshing = True
                self._since_draft = 0
                return True
            self._skipped += 1
            self._since_draft += 1
            return False
        if self._skip_remaining > 0:
            self._skip_remaining -= 1
        else:
            bound = None if ceiling is None or not self.skipping else ceiling()
            until_refresh = 0 if bound is None else self.refresh_interval(bound) - self._since_draft
            if bound is None or until_refresh <= 0 or bound.speedup > PAYING_SPEEDUP:
                self._refreshing = bound is not None and until_refresh <= 0
                self._since_draft = 0
                return True
            self._back_off()  # vetoed: a failed probe, but never past the refresh
            self._skip_remaining = min(self._backoff, until_refresh) - 1
        self._skipped += 1
        self._since_draft += 1
        return False

    def record(self, speculative_speedup: float) -> None:
        """After a drafted step's plan: the estimated speedup of its best speculative plan. A probe (and the
        gate's first drafted step) opens a stretch when its own estimate beats PAYING_SPEEDUP; a step of a
        speculating stretch keeps it going while the mean of the stretch's last `stretch_steps` estimates
        beats STRETCH_SPEEDUP (module docstring)."""
        if self.probing or not self._speculating:
            self._stretch.clear()
            pays = speculative_speedup > PAYING_SPEEDUP
        else:
            self._stretch.append(speculative_speedup)
            pays = sum(self._stretch) / len(self._stretch) > STRETCH_SPEEDUP
        self._speculating = pays
        if pays:
            self._backoff = 0
            self._refresh_after = self.max_backoff
            return
        self._stretch.clear()
        if self._refreshing and speculative_speedup <= STRETCH_SPEEDUP:
            self._refresh_after = min(2 * self._refresh_after, self.max_refresh)
        self._back_off()
        self._skip_remaining = self._backoff

    def _back_off(self) -> None:
        """A probe found speculation unprofitable: min_backoff after speculating, else double, up to max."""
        self._backoff = self.min_backoff if self._backoff == 0 else min(2 * self._backoff, self.max_backoff)

    def refresh_interval(self, bound: SpeculationCeiling) -> int:
        """Steps without drafting before a refresh probe of a batch whose best plan is `bound`: the doubling
        interval, or refresh_steps / probe_share when that is longer, at most max_refresh."""
        priced = math.ceil(bound.refresh_steps / self.probe_share)
        return min(self.max_refresh, max(self._refresh_after, priced))

    @property
    def verifies_probe(self) -> bool:
        """Whether the step the gate just let draft must verify a tree whatever its plan's estimate: a
        backoff probe. False for a refresh probe (it decodes plainly unless the fresh plan pays) and while
        speculating (the plan decides)."""
        return self.skipping and not self._refreshing

    @property
    def probing(self) -> bool:
        """Whether the step the gate just let draft is a probe (backoff or refresh), not a step of steady
        speculation: the drafter then scores every position (`DraftHorizon.open`)."""
        return self.skipping or self._refreshing

    @property
    def skipping(self) -> bool:
        """Whether the last probe found speculation unprofitable (the gate is backing off)."""
        return self._backoff > 0

    @property
    def skipped_share(self) -> float:
        """Share of decode steps so far that skipped the drafter."""
        return self._skipped / self._steps if self._steps else 0.0


@dataclass(frozen=True)
class DraftedStep:
    """What one drafted step said about its batch's text, for `speculation_ceiling`.

    accept_curve: `BatchPlan.accept_curve`, [N + 1] mean over its requests of the corrected Â(n), n = 0..N;
    deeper_gain: `horizon_gain` of its trees (0 when the drafter scored every position); requests: the ids
    of its requests (`covers`); scale: the mean online acceptance correction c its curve and gain were
    priced with (> 0), so that `DraftEvidence` can price them again at the correction of the day."""

    accept_curve: tuple[float, ...]
    deeper_gain: float
    requests: frozenset[str]
    scale: float = 1.0

    def covers(self, requests: Iterable[str]) -> bool:
        """Whether every one of `requests` was in the drafted step."""
        return self.requests.issuperset(requests)

    def reachable(self, nodes: int) -> np.ndarray:
        """[nodes + 1] `reachable_accept` of the step's curve, n = 0..nodes; past the curve's own N a node
        adds deeper_gain at most (or nothing when 0), never beyond 1 + n."""
        curve = reachable_accept(self.accept_curve, self.deeper_gain)
        extra = np.arange(1, nodes + 2 - curve.shape[0], dtype=np.float64)
        longer = np.concatenate([curve, curve[-1] + extra * self.deeper_gain])[: nodes + 1]
        return np.minimum(longer, 1.0 + np.arange(nodes + 1, dtype=np.float64))


RECENT_DRAFTED_STEPS = 16
"""Drafted steps whose curves `DraftEvidence` averages for requests the last drafted step did not cover."""
OWN_TEXT_STEPS = 2 * STRETCH_STEPS
"""Drafted steps of a batch's own requests whose curves `DraftEvidence` averages for that batch: the last
STRETCH_STEPS, which ended its stretch, and as many before them."""


class DraftEvidence:
    """The Â curve a batch's ceiling prices (`speculation_ceiling`), from the recent drafted steps.

    Curves are priced at the online acceptance correction c of the step that asks (`curve_for`'s scale), not
    at the one their steps were planned with: the drafted part Â - 1 of a step planned at c' is taken times
    c / c'. The correction forgets its evidence over steps that verify nothing and returns towards 1
    (`acceptance.AcceptanceTracker`), and a ceiling priced at the c' of a decline did not: one step planned
    at a pessimistic c' vetoed the gate's probes until its refresh, 64 steps and more.

    A batch whose requests were all in the last drafted step gets the mean of the raised curves (raised to
    what nodes below the draft horizon could add, `reachable_accept`) of the last `own_steps` (8) drafted
    steps that drafted for all of them: its own text, as recently seen. Twice the gate's `stretch_steps`: a
    stretch of speculation ends when the mean estimate of its last `stretch_steps` steps falls to the bar, so
    those steps read below it by selection. Priced on them alone (a traced run of the CPU demo pair at c = 1,
    T = 0.7), the ceiling vetoed the first backoff probe after 8 of 13 stretches, each veto keeping the
    drafter off until a refresh 64 to 256 steps later, while backoff probes that did run opened stretches of
    20 to 90 steps estimated at 1.1 to 1.5. Where fewer than `own_steps` such steps are known (a request
    drafted once so far), the recent steps' mean stands in for each missing one. One step's curve swings with
    the text at hand, and the ceiling re-prices it until a probe drafts again: priced on the last step alone,
    one step that did not pay inside a stretch that did (on the CPU demo pair at c = 1, T = 0.7, a step at
    0.88 after twenty at 1.2 to 1.6) vetoed every probe until the refresh, 64 steps without drafting. A batch
    with a request the last drafted step did not draft for (a request that just arrived, or a batch whose
    make-up changed since) gets the mean of the last `capacity` drafted steps' raised curves: a request is
    expected to read like the recent ones. Without that expectation every new request was a probe (a drafter
    pass and a verified tree): on the 2-core CPU demo pair at concurrency 1, with 64-token requests, about one
    probe per request, 2-3 % of decode time where speculation never paid. The mean over several steps, not the
    last one, keeps one request's unpredictable tail from vetoing the requests after it (on the CPU test pair
    the last steps of one request past its oracle's reference had kept the next batch of 8 fresh requests from
    drafting for 100 to 120 steps). Nothing is known before `own_steps` drafted steps (None): a fresh engine's
    first step alone, its first prompt's opening, is no evidence of the text to come.
    """

    def __init__(self, capacity: int = RECENT_DRAFTED_STEPS, own_steps: int = OWN_TEXT_STEPS) -> None:
        if not 1 <= own_steps <= capacity:
            raise ValueError(f"need 1 <= own_steps <= capacity, got {own_steps} and {capacity}")
        self._steps: deque[DraftedStep] = deque(maxlen=capacity)
        self._own_steps = own_steps
        self._mean: np.ndarray | None = None  # the recent steps' mean, computed when first asked

    def record(self, step: DraftedStep) -> None:
        """A drafted step's evidence (the oldest beyond `capacity` is forgotten)."""
        if not step.scale > 0:
            raise ValueError(f"a drafted step's correction must be > 0, got {step.scale!r}")
        self._steps.append(step)
        self._mean = None

    @property
    def informed(self) -> bool:
        """Whether `own_steps` drafted steps were recorded; before that `curve_for` is None."""
        return len(self._steps) >= self._own_steps

    def curve_for(self, requests: Iterable[str], scale: float = 1.0) -> np.ndarray | None:
        """[N + 1] the raised Â curve for a batch of `requests` (ids) at the online correction `scale`, N the
        longest curve of the recent steps, never above 1 + n; None before `own_steps` drafted steps."""
        if not self.informed:
            return None
        nodes = max(len(step.accept_curve) for step in self._steps) - 1
        if self._mean is None:
            self._mean = np.mean([_per_unit_correction(step, nodes) for step in self._steps], axis=0)
        unit = self._mean
        wanted = frozenset(requests)
        if self._steps[-1].covers(wanted):
            own = [step for step in reversed(self._steps) if step.covers(wanted)][: self._own_steps]
            missing = self._own_steps - len(own)
            unit = (sum(_per_unit_correction(step, nodes) for step in own) + missing * unit) / self._own_steps
        return np.minimum(1.0 + scale * (unit - 1.0), 1.0 + np.arange(unit.shape[0], dtype=np.float64))


def _per_unit_correction(step: DraftedStep, nodes: int) -> np.ndarray:
    """[nodes + 1] the step's raised curve (`DraftedStep.reachable`) with its drafted part at correction 1."""
    return 1.0 + (step.reachable(nodes) - 1.0) / step.scale


def horizon_gain(trees: DraftTreeBatch, horizon: int, depth: int, accept_scale: Sequence[float]) -> float:
    """Mean over requests of c_i · ρ_i(h): a bound on the corrected gain of any node below the horizon h.

    A node's ρ never grows along its path, so a node below depth h gains at most what the best node at
    depth h does, c_i · its ρ; when no node at depth h made request i's best-first tree, every one of them
    ranks below the tree's last node, whose ρ bounds them instead. 0.0 when h = D (nothing below).
    trees: [B, N] best-first trees within the horizon (N >= 1); horizon: h; depth: D, positions the drafter
    proposes; accept_scale: [B] c_i."""
    if horizon >= depth:
        return 0.0
    host = trees.on_host()
    scores = host.log_scores
    at_horizon = torch.where(host.depths == horizon, scores, torch.full_like(scores, -math.inf)).amax(dim=1)
    bound = torch.where(torch.isinf(at_horizon), scores[:, -1], at_horizon)  # [B] log ρ
    scale = torch.tensor(list(accept_scale), dtype=torch.float64)
    return float((scale * torch.exp(bound)).mean())


def reachable_accept(accept_curve: Sequence[float], deeper_gain: float) -> np.ndarray:
    """[N + 1] the most Â(n) trees of n nodes could reach when nodes below the horizon add up to
    `deeper_gain` each: max over m <= n of Â(m) + (n - m) · deeper_gain (m nodes within the horizon, the rest
    deeper), never above 1 + n. Equal to `accept_curve` when deeper_gain is 0."""
    curve = np.asarray(accept_curve, dtype=np.float64)
    nodes = np.arange(curve.shape[0], dtype=np.float64)
    best = np.maximum.accumulate(curve - nodes * deeper_gain) + nodes * deeper_gain
    return np.minimum(best, 1.0 + nodes)


def speculation_ceiling(
    accept_curve: Sequence[float],
    contexts: Sequence[int],
    latency: LatencyModel,
    costs: StepCosts,
) -> SpeculationCeiling:
    """The best speculative plan of this batch if its text reads as `accept_curve` says: the highest
    Â(n) · L_AR / Ĉ(n) over n >= 1, every request verifying n nodes (SGLang's common width), and what a
    refresh probe of this batch costs (`SpeculationCeiling`).

    accept_curve: [N + 1] mean over requests of the corrected Â(n), n = 0..N (N >= 1): a drafted step's
    `BatchPlan.accept_curve`, or `DraftEvidence.curve_for` the batch (raised to what trees the horizon held
    back could reach); contexts: [B] cached tokens per request now; costs: this step's StepCosts (T_draft
    priced at this batch size). Ĉ(n) is priced as `plan_batch` prices a common width, so for the same
    trees, contexts and costs this is the speculative speedup `plan_batch` reports for the adaptive policy
    (the first drop of a unimodal curve; with width buckets, the maximum itself) and bounds every policy's:
    both price through `batch_objective.common_width_estimates`, one latency prediction over the N
    candidate widths. ValueError for an empty batch or a curve without a node.
    """
    if not contexts:
        raise ValueError("speculation_ceiling needs a batch of at least one request")
    if len(accept_curve) < 2:
        raise ValueError(f"speculation_ceiling needs Â(n) for n = 0..N with N >= 1, got {list(accept_curve)}")
    nodes = np.arange(1, len(accept_curve), dtype=np.int64)
    committed = len(contexts) * np.asarray(accept_curve, dtype=np.float64)[1:]  # Σ_i Â_i(n) at the mean
    estimates = common_width_estimates(committed, nodes, check_contexts(contexts), latency, costs)
    return SpeculationCeiling(
        speedup=float(estimates.speedup.max()), refresh_steps=(costs.t_draft + costs.t_aux) / costs.l_ar
    )
