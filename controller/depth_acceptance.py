"""The acceptance map, learnt online per depth from the accepted lengths a server sees anyway.

Terms. The planner scores a node at depth d by its path probability under the acceptance map it starts with
(the start-up or offline fit, `acceptance.AcceptanceCalibration`, or the drafter's raw probabilities without
one): the base score ρ_n. A verify pass of a request's first n nodes reaches depth d (accepts at least d
draft tokens) exactly when one of its nodes at depth d is accepted, and at most one is, so under the base map

    P(reach d) = Σ_{verified nodes n at depth d} ρ_n,

and the realised event is 1[accepted drafts ≥ d]. Over the recent steps (sums forgotten at `decay` per
observed step) the reach ratio r_d = Σ realised / Σ predicted says how far the base map is off at depth d as
a whole, and c_d = r_d / r_{d-1} (r_0 = 1) how far its conditional factor at depth d is off: the online map
multiplies each depth's conditional by c_d, i.e. adds log c_d to the calibrated log-probabilities of depth d
(`shift_logprobs`, capped at probability 1 as the base map is), which keeps every sorted row sorted, so the
best-first trees built on the shifted values stay exact for the scores the planner sums.

Priors, so no depth is frozen, and pooled, so no depth is noisy alone. Each depth's ratio is a posterior mean
with `prior_weight` pseudo-events at what the depth above and the pooled conditional c̄ predict, r_d = (R_d +
k·r_{d-1}·c̄) / (P_d + k), and c̄ is the one conditional factor that, applied at every depth, accounts for the
realised reaches of all depths together: Σ_d P_d·c̄^d + k'·c̄ = Σ_d R_d + k' (k' = `POOLED_PRIOR_WEIGHT`
pseudo-events at c̄ = 1, so a map with no events is the base map). A depth with no events takes c̄, which
every verified depth informs (a drafter found three times better than mapped at depths 1 to 5 is taken to be
at depth 6 too, until depth 6 says otherwise), so a map fitted where trees were shallow does not keep the
deeper depths at its guess. A depth with a few events leans on c̄, not on its own handful: with the prior at
the depth above's own conditional instead, one unlucky run of misses at a deep depth (a few predicted reaches,
each about 0.86 likely, none realised) marked it well below its truth, the trees then stopped above it and saw
no events to correct it (`benchmarks/controller_synthetic.py`, synthetic GSM8K at B = 1, the demo pair's
latency profile, 4 seeds: depths 13 to 15 at 0.57 to 0.86 where the truth was 0.93, Â 8 % below the trees'
true expected length, adaptive at 12 nodes where 16 paid). The ratio is measured against the BASE scores
(computed beside the shifted ones), so the estimate is open loop: what the online map did to the trees does
not feed back into it.

What it does not see. Events come only from depths the trees reach; a depth priced too low to be verified
keeps the start-up map times the pooled conditional until a probe or a deeper tree verifies it (the gate's
probes verify whole trees).
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np
import torch

DEFAULT_DECAY = 0.98
"""Weight the sums keep per observed step (about 50 steps of memory)."""
DEFAULT_PRIOR_WEIGHT = 32.0
"""Pseudo-events (in predicted reaches) of each depth at the depth above's ratio times c̄. A step reaches a
shallow depth about once per request, so at concurrency 1 a depth's own events outweigh the prior after
about 30 steps, and a deep depth with a handful leans on c̄, which moves with every verified depth's events.
Over 60 steps of the step controller alone (`benchmarks/controller_synthetic.py`, synthetic GSM8K and
MT-Bench at B = 1, the demo pair's start-up latency profile, 8 seeds), adaptive's priced speedup over the
best fixed budget's was, with the prior at the depth above's own conditional (no c̄): 0.976x (GSM8K) and
0.995x (MT-Bench) at 8 pseudo-events, 0.980x and 1.002x at 32; with c̄: 0.982x and 1.000x at 8, 0.993x and
0.996x at 32, 0.996x and 0.999x at 64. With one pseudo-event and no c̄, one short accept at the start shifted
depths 5 to 8 by -0.5 to -1.9 and the trees stopped above them for good."""
POOLED_PRIOR_WEIGHT = 8.0
"""Pseudo-events at c̄ = 1 over raw drafter probabilities: c̄ weighs every depth's events, so a few steps move
it."""
CALIBRATED_POOLED_PRIOR_WEIGHT = 32.0
"""Pseudo-events at c̄ = 1 over a fitted acceptance map (hundreds of drafter passes): one step of a 15-node
chain predicts about six reaches, and with 8 one short accept moved c̄ from 1 to 0.87, which halves a
chain's deep nodes. At 64, a map fitted on text three times harder than the served one held its trees at 6.4
nodes where 8 paid after 60 steps (`tests/test_depth_acceptance.py`)."""
SHIFT_BOUNDS = (math.log(1e-3), math.log(100.0))
"""Range of log c_d, the per-depth shift of the calibrated log-probabilities (and of log c̄)."""
POOLED_ITERATIONS = 40
"""Bisection steps for log c̄ over SHIFT_BOUNDS (an interval of 11.5 halved 40 times: 1e-11)."""


class OnlineDepthMap:
    """Per-depth online correction of an acceptance map (module docstring). depth: D, the drafter's
    positions."""

    def __init__(
        self,
        depth: int,
        decay: float = DEFAULT_DECAY,
        prior_weight: float = DEFAULT_PRIOR_WEIGHT,
        pooled_prior_weight: float = POOLED_PRIOR_WEIGHT,
    ) -> None:
        if depth < 1:
            raise ValueError(f"the drafter must propose at least one position, got depth {depth}")
        if not 0 < decay < 1:
            raise ValueError(f"decay must be in (0, 1), got {decay!r}")
        if not prior_weight > 0:
            raise ValueError(f"prior_weight must be > 0, got {prior_weight!r}")
        if not pooled_prior_weight > 0:
            raise ValueError(f"pooled_prior_weight must be > 0, got {pooled_prior_weight!r}")
        self.depth = depth
        self._decay = decay
        self._prior = prior_weight
        self._pooled_prior = pooled_prior_weight
        self._predicted = np.zeros(depth, dtype=np.float64)  # [D] Σ predicted reaches of depth d
        self._reached = np.zeros(depth, dtype=np.float64)  # [D] Σ realised reaches of depth d
        self._shifts = np.zeros(depth, dtype=np.float64)

    @property
    def shifts(self) -> np.ndarray:
        """[D] float64 log c_d, d = 1..D (0 at a depth without events)."""
        return self._shifts

    @property
    def reach_scale(self) -> np.ndarray:
        """[D] float64 r_d = Π_{j <= d} c_j, the factor the shifts put on the base map's probability of
        reaching depth d (exact where no shifted factor is capped at probability 1, an upper bound where one
        is): what `acceptance.AcceptanceTracker` weighs the base map's predicted reaches with."""
        return np.exp(np.cumsum(self._shifts))

    @property
    def active(self) -> bool:
        """Whether any depth is shifted (else the planner's scores are the base map's)."""
        return bool(self._shifts.any())

    def pooled_conditional(self) -> float:
        """c̄ (module docstring): the one conditional factor at every depth that turns the base map's predicted
        reaches into the realised ones, with `pooled_prior_weight` pseudo-events at 1; within
        exp(SHIFT_BOUNDS)."""
        powers = np.arange(1, self.depth + 1, dtype=np.float64)
        realised = float(self._reached.sum()) + self._pooled_prior

        def excess(log_c: float) -> float:  # increasing in log_c
            c = math.exp(log_c)
            return float(self._predicted @ np.exp(powers * log_c)) + self._pooled_prior * c - realised

        low, high = SHIFT_BOUNDS
        if excess(low) >= 0:
            return math.exp(low)
        if excess(high) <= 0:
            return math.exp(high)
        for _ in range(POOLED_ITERATIONS):
            middle = 0.5 * (low + high)
            low, high = (middle, high) if excess(middle) < 0 else (low, middle)
        return math.exp(0.5 * (low + high))

    def reach_ratios(self) -> np.ndarray:
        """[D] float64 r_d = realised / predicted reaches of depth d under the base map, with the prior."""
        pooled = self.pooled_conditional()
        ratios = np.empty(self.depth, dtype=np.float64)
        previous = 1.0
        for d in range(self.depth):
            prior = self._prior * previous * pooled
            previous = (self._reached[d] + prior) / (self._predicted[d] + self._prior)
            ratios[d] = previous
        return ratios

    def observe(self, predicted_reach: np.ndarray, accepted: Sequence[int]) -> None:
        """One verified step. predicted_reach: [B, D] float64, per request the base map's probability of
        reaching depth d (`depth_reach`; a request that verified no node has a row of zeros and says
        nothing); accepted: [B] accepted draft tokens per request."""
        if predicted_reach.shape != (len(accepted), self.depth):
            raise ValueError(
                f"predicted_reach must be [{len(accepted)}, {self.depth}], got {predicted_reach.shape}"
            )
        verified = predicted_reach.sum(axis=1) > 0  # [B]
        depths = np.arange(1, self.depth + 1)
        reached = (np.asarray(accepted, dtype=np.int64)[:, None] >= depths[None, :]) & verified[:, None]
        self._predicted = self._decay * self._predicted + predicted_reach.sum(axis=0)
        self._reached = self._decay * self._reached + reached.sum(axis=0)
        ratios = self.reach_ratios()
        conditional = ratios / np.concatenate(([1.0], ratios[:-1]))
        self._shifts = np.clip(np.log(conditional), *SHIFT_BOUNDS)


def shift_logprobs(logprobs: torch.Tensor, shifts: np.ndarray) -> torch.Tensor:
    """[B, h, K] calibrated log-probabilities with depth d's shift log c_d added, capped at 0 (probability 1):
    each row stays sorted. shifts: [D] float64 with D >= h (`OnlineDepthMap.shifts`)."""
    horizon = int(logprobs.shape[-2])
    shift = torch.from_numpy(shifts[:horizon]).to(dtype=logprobs.dtype, device=logprobs.device)
    return torch.clamp(logprobs + shift[:, None], max=0.0)


def depth_reach(depths: np.ndarray, log_scores: np.ndarray, counts: Sequence[int], depth: int) -> np.ndarray:
    """[B, D] float64: per request the summed probability ρ of its first counts[i] nodes at each depth
    d = 1..D, i.e. the probability of reaching depth d under those scores. depths: [B, N] int64 1..D;
    log_scores: [B, N] float64 log ρ of the same nodes; counts: [B] verified nodes per request (the
    best-first prefix)."""
    batch, nodes = depths.shape
    verified = np.arange(nodes)[None, :] < np.asarray(counts, dtype=np.int64)[:, None]  # [B, N]
    rows = np.broadcast_to(np.arange(batch)[:, None], (batch, nodes))
    reach = np.zeros((batch, depth), dtype=np.float64)
    np.add.at(reach, (rows[verified], depths[verified] - 1), np.exp(log_scores[verified]))
    return reach
