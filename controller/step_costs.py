"""Online step costs: T_draft and the work around the forwards, measured every step and fitted as they grow.

A decode step costs Ĉ = T_draft + T_aux + t_aux_per_token · tokens + T_verify (`StepCosts.cycle_seconds`),
where `tokens` counts the verify tokens of the whole batch. T_aux + t_aux_per_token · tokens is everything on
the host and device outside the two forwards: tree search, mask and layout building, logits processing, the
accept walk, KV compaction. It grows with the tree, so a constant would price wide trees too cheaply. With
KV pages of several tokens the commit also copies the accepted path's KV (at most W - 1 slots per request,
every layer); calibration measures the aux work without that copy, so a paged server raises its prior's
per-token cost by the copy's measured seconds per slot (`StepCostTracker.add_prior_per_token`), a bound per
verify token.
T_draft is one drafter pass over the batch's B blocks: flat in B on a GPU at small batches, close to
proportional to B where the drafter is compute-bound (a CPU: 18 ms at B = 1, 80 ms at B = 8 on the demo
pair), so it is a line in B as well, and the planner prices the batch it plans.

`StepCostTracker` fits both lines, (T_aux, t_aux_per_token) over tokens and (T_draft at B = 0, seconds per
request) over B, by exponentially weighted least squares on recent drafted steps, the slope kept >= 0 (a
negative slope, which noise can produce when x barely varies, falls back to slope 0 and the weighted mean).

The aux line prices no further than its points reach (`StepCosts.aux_token_span`, the most tokens of any
point, the prior's included): a pass with more tokens is priced at that many. Its slope comes from whatever
token counts the steps so far verified, often a narrow range (one request, trees of 4 to 16 nodes), where a
noisy step tilts it steeply; extrapolated to a batch of 8 such trees, it priced every tree above plain
decoding on a loaded 2-core machine (0.5 ms per token fitted at 5..16 tokens, 0.04 ms measured at 128), and
the gate, which measures costs only on drafted steps, then skipped the drafter for most of 512 steps. Priced
at the span, the wider pass is tried when its other costs pay, and its measured step extends the span.
A prior (a profile's measured costs, T_draft measured at B = 1) enters the sums as `prior_weight`
pseudo-steps (aux at 1 and at PRIOR_TOKENS tokens, draft at PRIOR_BATCHES) that decay like measured
ones: with the server's default weight of 1 / ema_alpha pseudo-steps the measurements take over within a
few dozen steps (one drafted step at another batch size sets the draft line's slope), and a tiny ema_alpha
keeps the profile. The prior's seconds are the profile's times the latency model's machine factor
(`LatencyModel.machine_factor`: how fast plain decode steps run against the profile), so a profile measured
while the machine ran slower moves with it before any drafted step is measured (on the CPU demo pair a
start-up profile's 13.7 ms drafter pass where plain steps ran 0.8x the profile, measured 10.9 ms while
drafting). The profile has no drafter timing at B > 1, so the prior's draft line takes its slope from
the target's latency model on this hardware (`draft_seconds_per_request`): a drafter pass over B blocks grows
as a verify pass of the target over B blocks does, flat where passes are bound by weight reads (a GPU at small
batches), close to proportional where they are compute-bound (a CPU). On the CPU demo pair that prices a pass
at B = 8 at 3.2 times the B = 1 profile's 19 ms, against 4.6 times measured (89 ms); a flat prior said 1.0
times, so the first plans at B = 8 took the drafter for nearly free until a drafted step measured it.

Warm-up: the first `warmup_steps` observed steps are left out; the worker and the reference engine leave out
COLD_STEPS. Those pay one-time costs (the first calls into the drafter, the verify path and their
allocations): at tp 2 on CPU the first drafted step took 357 ms against 94-185 ms for the next ones, and
lines set from it priced every speculative plan below plain decoding, so the speculation gate skipped the
drafter with nothing left to correct the estimate (it is measured only on drafted steps).

First-step rule, the one online cost estimate of the worker and the reference engine: every measured step
enters the sums at weight 1 after they decay, so without a prior the first measured step sets both lines
outright (its seconds, slope 0), and step n then weighs 1 / (1 + decay + … + decay^(n-1)), which falls to
1 - decay. With a prior the first measured step is one step against `prior_weight` pseudo-steps. Until then
the costs are the prior's (zeros without one: a drafted step is then priced at its verify pass alone).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING

from bastion_sglang.controller.profile import StepCosts

if TYPE_CHECKING:
    from bastion_sglang.controller.latency import LatencyModel

COLD_STEPS = 1
"""Drafted steps of an engine whose costs are not measured (module docstring, warm-up)."""
PRIOR_TOKENS = 64
"""Token count of the prior's second aux pseudo-step (the first is at 1 token): two points fix its line."""
PRIOR_BATCHES = (1, 2)
"""Batch sizes of the draft prior's two pseudo-steps, on the line through the profile's T_draft (measured at
B = 1) with the prior's seconds per request: its hold on the slope grows with `prior_weight`. A heavy prior (a
tiny ema_alpha) keeps that line at every batch size; with the default weight the first drafted step at another
batch size sets the slope (80 ms at B = 8 over a flat 18 ms prior gives 76 ms)."""
SHAPE_BATCH = 8
"""Batch size at which `draft_seconds_per_request` reads the target's latency model."""


@dataclass
class DecayingLine:
    """y ≈ intercept + slope · x by exponentially weighted least squares, slope >= 0 (module docstring).

    Weighted sums of 1, x, x², y and x·y; `decay` scales them all, `add` puts one weighted point in.
    x_max: the largest x put in so far (0.0 before any point).
    """

    w: float = 0.0
    x: float = 0.0
    xx: float = 0.0
    y: float = 0.0
    xy: float = 0.0
    x_max: float = 0.0  # the largest x of any point put in, whatever its weight now

    def decay(self, factor: float) -> None:
        self.w, self.x, self.xx = factor * self.w, factor * self.x, factor * self.xx
        self.y, self.xy = factor * self.y, factor * self.xy

    def add(self, weight: float, x: float, y: float) -> None:
        self.w += weight
        self.x += weight * x
        self.xx += weight * x * x
        self.y += weight * y
        self.xy += weight * x * y
        self.x_max = max(self.x_max, x)

    def plus(self, other: DecayingLine, weight: float, y_scale: float) -> DecayingLine:
        """This line's points and `other`'s, the latter weighed by `weight` with their y times `y_scale`."""
        return DecayingLine(
            w=self.w + weight * other.w,
            x=self.x + weight * other.x,
            xx=self.xx + weight * other.xx,
            y=self.y + weight * y_scale * other.y,
            xy=self.xy + weight * y_scale * other.xy,
            x_max=max(self.x_max, other.x_max if other.w > 0 else 0.0),
        )

    def shift(self, slope: float) -> None:
        """Add slope · x to the y of every point put in so far (their weights and x unchanged)."""
        self.y += slope * self.x
        self.xy += slope * self.xx

    def fit(self) -> tuple[float, float]:
        """(intercept, slope); (0, 0) before any point. A slope <= 0 gives (weighted mean, 0); an intercept
        < 0 gives the line through the origin at the weighted least-squares slope."""
        if self.w == 0:
            return 0.0, 0.0
        mean_x, mean_y = self.x / self.w, self.y / self.w
        variance = self.xx / self.w - mean_x * mean_x
        if variance <= 1e-9 * max(mean_x * mean_x, 1.0):
            return mean_y, 0.0
        slope = (self.xy / self.w - mean_x * mean_y) / variance
        if slope <= 0:
            return mean_y, 0.0
        intercept = mean_y - slope * mean_x
        if intercept < 0:
            return 0.0, self.xy / self.xx
        return intercept, slope


class StepCostTracker:
    """Running T_draft(B), T_aux and t_aux_per_token (module docstring).

    prior: the profile's StepCosts, or None. decay: weight the running sums keep per step, in (0, 1).
    prior_weight: pseudo-steps the prior counts for, > 0. warmup_steps: first observed steps left out, >= 0.
    prior_draft_per_request: slope of the prior's draft line, seconds per request beyond the first, >= 0
    (`draft_seconds_per_request`; 0: flat).
    """

    def __init__(
        self,
        prior: StepCosts | None = None,
        decay: float = 0.95,
        prior_weight: float = 10.0,
        warmup_steps: int = 0,
        prior_draft_per_request: float = 0.0,
    ) -> None:
        if not 0 < decay < 1:
            raise ValueError(f"decay must be in (0, 1), got {decay!r}")
        if not prior_weight > 0:
            raise ValueError(f"prior_weight must be > 0, got {prior_weight!r}")
        if warmup_steps < 0:
            raise ValueError(f"warmup_steps must be >= 0, got {warmup_steps!r}")
        if not prior_draft_per_request >= 0:
            raise ValueError(f"prior_draft_per_request must be >= 0 seconds, got {prior_draft_per_request!r}")
        self._decay = decay
        self._warmup_left = warmup_steps
        self._steps = 0
        self._aux = DecayingLine()  # measured seconds over verify tokens of the batch
        self._draft = DecayingLine()  # measured seconds over requests in the batch
        self._prior_aux = DecayingLine()  # the prior's pseudo-steps, undecayed
        self._prior_draft = DecayingLine()
        self._prior_left = 1.0  # the weight the prior's pseudo-steps keep: decay ** steps
        if prior is not None:
            for tokens in (1, PRIOR_TOKENS):
                self._prior_aux.add(prior_weight / 2, tokens, prior.t_aux + prior.t_aux_per_token * tokens)
            for batch in PRIOR_BATCHES:
                self._prior_draft.add(
                    prior_weight / 2, batch, prior.t_draft + prior_draft_per_request * (batch - 1)
                )

    def add_prior_per_token(self, seconds: float) -> None:
        """Raise the prior's t_aux_per_token by `seconds` per verify token: work of this server's steps that
        its profile was measured without (a paged tree commit's KV copy, `commit.kv_copy_seconds_per_token`).
        Measured steps include that work already, so only the prior's pseudo-steps take it; call before the
        first measured step (ValueError after it, or for seconds < 0). Without a prior nothing changes: the
        first measured step prices the work.
        """
        if not seconds >= 0:
            raise ValueError(f"seconds must be >= 0 per token, got {seconds!r}")
        if self._steps > 0:
            raise ValueError("the prior's per-token cost can only be raised before the first measured step")
        self._prior_aux.shift(seconds)

    @property
    def steps(self) -> int:
        """Steps measured so far (warm-up steps not counted)."""
        return self._steps

    def observe(self, draft_seconds: float, aux_seconds: float, tokens: int, batch: int = 1) -> None:
        """One drafted step: drafter seconds, seconds outside the forwards, verify tokens of the batch,
        requests in the batch. Left out while warm-up steps remain."""
        if self._warmup_left > 0:
            self._warmup_left -= 1
            return
        for line in (self._aux, self._draft):
            line.decay(self._decay)
        self._prior_left *= self._decay
        self._aux.add(1.0, tokens, aux_seconds)
        self._draft.add(1.0, batch, draft_seconds)
        self._steps += 1

    def _line(self, measured: DecayingLine, prior: DecayingLine, machine: float) -> DecayingLine:
        """The measured points and the prior's, the prior's seconds times `machine` (module docstring)."""
        if not machine > 0:
            raise ValueError(f"machine must be a factor > 0, got {machine!r}")
        return measured.plus(prior, self._prior_left, machine)

    def aux_line(self, machine: float = 1.0) -> tuple[float, float]:
        """(T_aux seconds, t_aux_per_token seconds per token) fitted so far, the prior's seconds times
        `machine`; (0, 0) before any step."""
        return self._line(self._aux, self._prior_aux, machine).fit()

    def draft_seconds(self, batch: int, machine: float = 1.0) -> float:
        """T_draft of a drafter pass over `batch` requests, seconds, the prior's seconds times `machine`; 0
        before any step."""
        intercept, per_request = self._line(self._draft, self._prior_draft, machine).fit()
        return intercept + per_request * batch

    def aux_token_span(self) -> int | None:
        """The most verify tokens of any point of the aux line, the prior's included; None before any."""
        line = self._line(self._aux, self._prior_aux, 1.0)
        return math.ceil(line.x_max) if line.w > 0 else None

    def costs(self, l_ar: float, batch: int = 1, machine: float = 1.0) -> StepCosts:
        """StepCosts for the planner of a batch of `batch` requests; `l_ar`: its plain-decoding seconds;
        machine: the latency model's machine factor, which the prior's seconds are taken times (module
        docstring). The per-token work is priced no further than `aux_token_span` (module docstring)."""
        t_aux, per_token = self.aux_line(machine)
        return StepCosts(
            t_draft=self.draft_seconds(batch, machine),
            t_aux=t_aux,
            l_ar=l_ar,
            t_aux_per_token=per_token,
            aux_token_span=self.aux_token_span(),
        )


def draft_seconds_per_request(
    t_draft: float, latency: LatencyModel, block: int, context: int, batch: int = SHAPE_BATCH
) -> float:
    """Seconds per request beyond the first of a drafter pass that takes `t_draft` seconds at B = 1, as the
    target's verify pass of `block` tokens per request grows from 1 to `batch` requests at `context` cached
    tokens each (module docstring): t_draft · (L(batch) / L(1) - 1) / (batch - 1), >= 0.

    latency: the target's latency model; block: the drafter's block size γ (tokens per request of its pass).
    ValueError unless t_draft >= 0, block >= 1 and batch >= 2.
    """
    if not t_draft >= 0:
        raise ValueError(f"t_draft must be >= 0 seconds, got {t_draft!r}")
    if block < 1 or batch < 2:
        raise ValueError(f"need block >= 1 and batch >= 2, got block {block} and batch {batch}")
    one = latency.predict_batch([block], [context])
    many = latency.predict_batch([block] * batch, [context] * batch)
    return max(t_draft * (many / one - 1.0) / (batch - 1), 0.0)
