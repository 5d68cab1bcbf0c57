"""The batch planner's objective, evaluated for many candidate plans at once (BASTION eqs. 3, 6, 7).

Terms. A plan gives request i of a batch of B the first n_i nodes of its best-first tree (node scores
log ρ_i1 >= log ρ_i2 >= ...). It is expected to commit Â_i(n_i) = 1 + c_i·Σ_{j<=n_i} ρ_ij tokens for request i
(c_i: the online acceptance correction, 1 without one) and costs one cycle Ĉ = `StepCosts.cycle_seconds` of
a verify pass over the batch, priced by `LatencyModel.predict_passes` (padded to the width bucket where the
engine pads). Its estimated speedup over plain decoding, whose step of the whole batch commits B tokens in
L_AR seconds, is Ŝ = Σ_i Â_i(n_i) · L_AR / (B · Ĉ).

`BatchObjective` holds the host arrays of one batch and evaluates Ŝ for M plans with one latency prediction
over all of them: every common n (`common`), given per-request counts (`ragged`), or every step of the greedy
walk that hands nodes out by ρ across requests (`greedy_walk`). For B = 1 and a common n these are the
values of the single-request curve Ŝ(n) = Â(n) · L_AR / Ĉ(n), bit for bit.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np
import torch

from bastion_sglang.controller.verify_passes import VerifyPasses, check_contexts

if TYPE_CHECKING:
    from bastion_sglang.controller.latency import LatencyModel
    from bastion_sglang.controller.profile import StepCosts


PAYING_SPEEDUP = 1.05
"""The estimated speedup over plain decoding that speculation must exceed before a policy that may decline
speculates, and before the speculation gate drafts. Not 1: the planner's Ŝ is the largest of many noisy
estimates (one per candidate budget), so it reads high where speculation barely pays. On the CPU demo pair
under synthetic acceptance (MT-Bench profile, c = 32, docs/benchmarks.md), adaptive's chosen plans read
Ŝ 1.03 and realised 0.99 per step, and the steps it drafted cost it against plain decoding; adaptive's Ŝ
read 6-8 % over the realised speedup at c = 8 too. A plan that gains less than 5 % is within that error."""


def accept_curves(
    log_scores: np.ndarray, accept_scale: np.ndarray | None = None
) -> tuple[np.ndarray, np.ndarray]:
    """(drafted, accept), both [B, N + 1] float64: drafted[i, n] = Σ_{j<=n} ρ_ij (a running sum, left to
    right), accept[i, n] = Â_i(n) = 1 + c_i·drafted[i, n].

    log_scores: [B, N] float64 best-first log ρ per request; accept_scale: [B, 1] float64 factors c_i, None
    for c_i = 1 (the same values: multiplying by 1 is exact).
    """
    gains = np.exp(log_scores)
    drafted = np.zeros((gains.shape[0], gains.shape[1] + 1), dtype=np.float64)
    np.cumsum(gains, axis=1, out=drafted[:, 1:])
    return drafted, 1.0 + (drafted if accept_scale is None else drafted * accept_scale)


def first_drop(values: np.ndarray) -> int:
    """Index of the first i with values[i + 1] < values[i], or the last index if values never drop.

    values: [M] float64 host array, M >= 1.
    """
    if values.shape[0] == 1:
        return 0
    drops = values[1:] < values[:-1]
    first = int(drops.argmax())  # also 0 when nothing drops: the flag tells the two apart
    return first if drops[first] else values.shape[0] - 1


def adaptive_stop(speedup: np.ndarray, stepped: bool) -> int:
    """Index of the Ŝ value [M] the adaptive rule stops at: its first drop (`first_drop`) when Ĉ is convex in
    the width, so Ŝ is unimodal and its first drop is its maximum (Proposition 2.4); its first maximiser when
    `stepped`, i.e. the latency model pads passes to width buckets: Ĉ is then a step function, Ŝ drops at
    every bucket edge and rises again inside the next bucket, and the first drop would stop at the first
    edge."""
    return int(np.argmax(speedup)) if stepped else first_drop(speedup)


@dataclass(frozen=True)
class PlanEstimates:
    """Estimates of M candidate plans of one batch."""

    speedup: np.ndarray  # [M] float64: Ŝ = Σ_i Â_i · L_AR / (B · Ĉ)
    verify_seconds: np.ndarray  # [M] float64: predicted seconds of the verify pass


@dataclass(frozen=True)
class BatchObjective:
    """Ŝ of candidate plans for one batch (module docstring). Build it with `from_log_scores`."""

    log_scores: np.ndarray  # [B, N] float64: best-first log ρ_ij per request
    accept_scale: np.ndarray  # [B, 1] float64: the acceptance factors c_i
    drafted: np.ndarray  # [B, N + 1] float64: Σ_{j<=n} ρ_ij, n = 0..N, before the acceptance correction
    accept: np.ndarray  # [B, N + 1] float64: Â_i(n) = 1 + c_i·drafted[i, n]
    contexts: np.ndarray  # [B] int64: cached tokens per request
    latency: LatencyModel
    costs: StepCosts

    @classmethod
    def from_log_scores(
        cls,
        log_scores: torch.Tensor | np.ndarray,
        contexts: Sequence[int],
        latency: LatencyModel,
        costs: StepCosts,
        accept_scale: Sequence[float] | None = None,
    ) -> BatchObjective:
        """log_scores: [B, N] best-first log ρ per request (any device: copied to the host once);
        contexts: [B] cached tokens per request; accept_scale: [B] positive factors c_i (None: all 1).
        ValueError when the lengths disagree, a factor is not > 0 or a context is not an int >= 0."""
        if isinstance(log_scores, torch.Tensor):
            log_scores = log_scores.detach().to(device="cpu", dtype=torch.float64).numpy()  # host sync
        batch = log_scores.shape[0]
        if len(contexts) != batch:
            raise ValueError(f"ctx_lens has {len(contexts)} entries for a batch of {batch}")
        if accept_scale is None:
            scale = np.ones((batch, 1), dtype=np.float64)
        elif len(accept_scale) != batch or any(not c > 0 for c in accept_scale):
            raise ValueError(f"accept_scale needs {batch} positive factors, got {list(accept_scale)!r}")
        else:
            scale = np.array(accept_scale, dtype=np.float64).reshape(batch, 1)
        log_scores = log_scores.astype(np.float64, copy=False)
        drafted, accept = accept_curves(log_scores, scale)
        return cls(log_scores, scale, drafted, accept, check_contexts(contexts), latency, costs)

    @property
    def batch_size(self) -> int:
        return int(self.accept.shape[0])

    @property
    def available(self) -> int:
        """N, the nodes each request's tree holds."""
        return int(self.accept.shape[1]) - 1

    def common(self, nodes: np.ndarray) -> PlanEstimates:
        """Plan m: every request verifies nodes[m] nodes (a pass of nodes[m] + 1 tokens per request, padded).

        nodes: [M] int64 in 0..N. ValueError when a width exceeds the latency model's largest bucket.
        """
        committed = self.accept[:, nodes].sum(axis=0)
        return common_width_estimates(committed, nodes, self.contexts, self.latency, self.costs)

    def ragged(self, counts: np.ndarray) -> PlanEstimates:
        """Plan m: request i verifies counts[m, i] nodes; with width buckets every request of the pass is
        padded to the bucket of the widest (as `LatencyModel.predict_batch` pads).

        counts: [M, B] int64 in 0..N.
        """
        widths = counts + 1
        buckets = self.latency.width_buckets
        if buckets is None:
            passes = VerifyPasses.ragged(widths, self.contexts)
        else:
            passes = VerifyPasses.common(self.latency.padded_widths(widths.max(axis=1)), self.contexts)
        committed = np.take_along_axis(self.accept, counts.T, axis=1).sum(axis=0)
        return self._estimates(committed, passes, widths.sum(axis=1))

    def greedy_walk(self) -> np.ndarray:
        """Per-request counts [B] int64 of the greedy ragged plan: nodes are handed out one at a time by
        corrected gain c_i·ρ_ij across requests (row-major on ties), from n = 0 for every request, until Ŝ
        first drops (exact for a sum of concave Â_i at any total), or where it peaks when the latency model
        has width buckets (`adaptive_stop`; requests are then padded to the widest). Every step of the walk
        is evaluated at once."""
        batch, available = self.log_scores.shape
        if available == 0:
            return np.zeros(batch, dtype=np.int64)
        gains = np.exp(self.log_scores) * self.accept_scale  # [B, N]: c_i·ρ_ij, each node's gain in Â
        # a stable sort of the negated gains keeps each row's (non-increasing) order and row-major ties
        order = np.argsort(-gains.reshape(-1), kind="stable")
        rows, ranks = np.divmod(order, available)  # step k gives row rows[k] its node ranks[k] (0-based)
        steps = self.accept[rows, ranks + 1] - self.accept[rows, ranks]
        committed = np.concatenate(([float(batch)], batch + np.cumsum(steps)))
        taken = np.arange(rows.shape[0] + 1)
        if self.latency.width_buckets is None:
            cached = int(self.contexts.sum())
            pair_steps = self.contexts[rows] + 2 * ranks + 3  # (s+1)(c+s+1) - s(c+s) at s = rank + 1
            passes = VerifyPasses(
                tokens=batch + taken,
                attention_pairs=cached + batch + np.concatenate(([0], np.cumsum(pair_steps))),
                kv_tokens=cached + 2 * batch + 2 * taken,
            )
        else:
            widest = np.maximum.accumulate(np.concatenate(([1], ranks + 2)))
            passes = VerifyPasses.common(self.latency.padded_widths(widest), self.contexts)
        walk = self._estimates(committed, passes, batch + taken)
        stop = adaptive_stop(walk.speedup, stepped=self.latency.width_buckets is not None)
        return np.bincount(rows[:stop], minlength=batch).astype(np.int64)

    def _estimates(self, committed: np.ndarray, passes: VerifyPasses, tokens: np.ndarray) -> PlanEstimates:
        """Ŝ of M plans of this batch (`plan_estimates`)."""
        return plan_estimates(committed, passes, tokens, self.batch_size, self.latency, self.costs)


def plan_estimates(
    committed: np.ndarray,
    passes: VerifyPasses,
    tokens: np.ndarray,
    batch: int,
    latency: LatencyModel,
    costs: StepCosts,
) -> PlanEstimates:
    """Ŝ of M plans of a batch of `batch` requests. committed: [M] Σ_i Â_i; passes: their verify passes;
    tokens: [M] int64 tokens the batch verifies, padding excluded (the per-token step cost's count)."""
    verify = latency.predict_passes(passes)
    cycle = costs.cycle_seconds(verify, tokens)
    return PlanEstimates(committed * costs.l_ar / (batch * cycle), verify)


def common_width_estimates(
    committed: np.ndarray, nodes: np.ndarray, contexts: np.ndarray, latency: LatencyModel, costs: StepCosts
) -> PlanEstimates:
    """Ŝ of M plans in which every request of the batch verifies nodes[m] nodes (a pass of nodes[m] + 1 tokens
    per request, padded to the latency model's bucket). committed: [M] Σ_i Â_i of each plan; nodes: [M]
    int64 >= 0; contexts: [B] int64 cached tokens per request. ValueError when a width exceeds the latency
    model's largest bucket."""
    batch = contexts.shape[0]
    widths = nodes + 1
    passes = VerifyPasses.common(latency.padded_widths(widths), contexts)
    return plan_estimates(committed, passes, batch * widths, batch, latency, costs)
