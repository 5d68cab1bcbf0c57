"""Online step costs: T_draft and the work around the forwards, measured every step and fitted as they grow.

A decode step costs Ĉ = T_draft + T_aux + t_aux_per_token · tokens + T_verify (`StepCosts.cycle_seconds`),
where `tokens` counts the verify tokens of the whole batch. T_aux + t_aux_per_token · tokens is everything on
the host and device outside the two forwards: tree search, mask and layout building, logits processing, the
accept walk, KV compaction. It grows with the tree, so a constant would price wide trees too cheaply.

`StepCostTracker` fits (T_aux, t_aux_per_token) by exponentially weighted least squares on the measured
(tokens, seconds) of recent steps, with the slope kept >= 0 (a negative slope, which noise can produce when
the widths barely vary, falls back to slope 0 and the weighted mean). T_draft is an exponentially weighted
mean. A prior (a profile's measured costs) enters the sums as `prior_weight` pseudo-steps (at 1 and at
PRIOR_TOKENS tokens) that decay like measured ones: with the server's default weight of 1 / ema_alpha
pseudo-steps the measurements take over within a few dozen steps, and a tiny ema_alpha keeps the profile.
"""

from __future__ import annotations

from bastion_sglang.controller.profile import StepCosts

PRIOR_TOKENS = 64
"""Token count of the prior's second pseudo-step (the first is at 1 token): two points fix its line."""


class StepCostTracker:
    """Running T_draft, T_aux and t_aux_per_token (module docstring).

    prior: the profile's StepCosts, or None. decay: weight the running sums keep per step, in (0, 1).
    prior_weight: pseudo-steps the prior counts for, > 0.
    """

    def __init__(
        self, prior: StepCosts | None = None, decay: float = 0.95, prior_weight: float = 10.0
    ) -> None:
        if not 0 < decay < 1:
            raise ValueError(f"decay must be in (0, 1), got {decay!r}")
        if not prior_weight > 0:
            raise ValueError(f"prior_weight must be > 0, got {prior_weight!r}")
        self._decay = decay
        self._steps = 0
        # weighted sums: weight, Σw·x, Σw·x², Σw·y, Σw·x·y, Σw·draft
        self._w = self._x = self._xx = self._y = self._xy = self._draft = 0.0
        if prior is not None:
            half = prior_weight / 2
            for tokens in (1, PRIOR_TOKENS):
                seconds = prior.t_aux + prior.t_aux_per_token * tokens
                self._add(half, prior.t_draft, seconds, tokens)

    def _add(self, weight: float, draft_seconds: float, aux_seconds: float, tokens: int) -> None:
        self._w += weight
        self._x += weight * tokens
        self._xx += weight * tokens * tokens
        self._y += weight * aux_seconds
        self._xy += weight * tokens * aux_seconds
        self._draft += weight * draft_seconds

    @property
    def steps(self) -> int:
        return self._steps

    def observe(self, draft_seconds: float, aux_seconds: float, tokens: int) -> None:
        """One measured step: drafter seconds, seconds outside the forwards, verify tokens of the batch."""
        d = self._decay
        self._w, self._x, self._xx = d * self._w, d * self._x, d * self._xx
        self._y, self._xy, self._draft = d * self._y, d * self._xy, d * self._draft
        self._add(1.0, draft_seconds, aux_seconds, tokens)
        self._steps += 1

    def aux_line(self) -> tuple[float, float]:
        """(T_aux seconds, t_aux_per_token seconds per token) fitted so far; (0, 0) before any step."""
        if self._w == 0:
            return 0.0, 0.0
        mean_x, mean_y = self._x / self._w, self._y / self._w
        variance = self._xx / self._w - mean_x * mean_x
        if variance <= 1e-9 * max(mean_x * mean_x, 1.0):
            return mean_y, 0.0
        slope = (self._xy / self._w - mean_x * mean_y) / variance
        if slope <= 0:
            return mean_y, 0.0
        intercept = mean_y - slope * mean_x
        if intercept < 0:  # the line through the origin at the weighted least-squares slope
            return 0.0, self._xy / self._xx
        return intercept, slope

    def costs(self, l_ar: float) -> StepCosts:
        """StepCosts for the planner with `l_ar`, the plain-decoding seconds of the batch it plans."""
        t_aux, per_token = self.aux_line()
        t_draft = self._draft / self._w if self._w else 0.0
        return StepCosts(t_draft=t_draft, t_aux=t_aux, l_ar=l_ar, t_aux_per_token=per_token)
