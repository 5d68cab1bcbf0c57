"""Online step costs: T_draft and the work around the forwards, measured every step and fitted as they grow.

A decode step costs Ĉ = T_draft + T_aux + t_aux_per_token · tokens + T_verify (`StepCosts.cycle_seconds`),
where `tokens` counts the verify tokens of the whole batch. T_aux + t_aux_per_token · tokens is everything on
the host and device outside the two forwards: tree search, mask and layout building, logits processing, the
accept walk, KV compaction. It grows with the tree, so a constant would price wide trees too cheaply.

`StepCostTracker` fits (T_aux, t_aux_per_token) by exponentially weighted least squares on the measured
(tokens, seconds) of recent steps, with the slope kept >= 0 (a negative slope, which noise can produce when
the widths barely vary, falls back to slope 0 and the weighted mean). T_draft is an exponentially weighted
mean. Before `warmup` steps, or with no spread in the widths yet, the prior (a profile's measured costs)
is used for what cannot be fitted; without a prior the running values are used from the first step.
"""

from __future__ import annotations

from bastion_sglang.controller.profile import StepCosts


class StepCostTracker:
    """Running T_draft, T_aux and t_aux_per_token (module docstring).

    prior: the profile's StepCosts, or None. decay: weight the running sums keep per step, in (0, 1).
    warmup: steps measured before the running values replace the prior.
    """

    def __init__(self, prior: StepCosts | None = None, decay: float = 0.95, warmup: int = 8) -> None:
        if not 0 < decay < 1:
            raise ValueError(f"decay must be in (0, 1), got {decay!r}")
        self._prior = prior
        self._decay = decay
        self._warmup = warmup
        self._steps = 0
        # weighted sums: weight, Σw·x, Σw·x², Σw·y, Σw·x·y, Σw·draft
        self._w = self._x = self._xx = self._y = self._xy = self._draft = 0.0

    @property
    def steps(self) -> int:
        return self._steps

    def observe(self, draft_seconds: float, aux_seconds: float, tokens: int) -> None:
        """One measured step: drafter seconds, seconds outside the forwards, verify tokens of the batch."""
        d = self._decay
        self._w = d * self._w + 1.0
        self._x = d * self._x + tokens
        self._xx = d * self._xx + tokens * tokens
        self._y = d * self._y + aux_seconds
        self._xy = d * self._xy + tokens * aux_seconds
        self._draft = d * self._draft + draft_seconds
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
        prior = self._prior
        if prior is not None and self._steps < self._warmup:
            return StepCosts(
                t_draft=prior.t_draft, t_aux=prior.t_aux, l_ar=l_ar, t_aux_per_token=prior.t_aux_per_token
            )
        t_aux, per_token = self.aux_line()
        t_draft = self._draft / self._w if self._w else 0.0
        return StepCosts(t_draft=t_draft, t_aux=t_aux, l_ar=l_ar, t_aux_per_token=per_token)
