"""Acceptance calibration: from the drafter's top-K log-probabilities to realised acceptance.

Terms. The drafter gives, per depth d = 1..D, the log-probabilities x = log q_d(r) of its top-K tokens. A
tree node at depth d with ranks (r_1, .., r_d) is accepted when every token on its path equals the target's
token at that depth (at T = 0 the target's argmax; at T > 0 the target's sample). Its probability is

    P(node accepted) = Π_j P(token r_j matches at depth j | the path before j matched).

The raw estimate takes each factor to be q_j(r_j). Block-diffusion drafters are over-confident, more so
deeper, so the raw Â = 1 + Σ ρ over-predicts what a verify pass commits.

The map (fitted per depth, monotone). Each conditional factor is modelled as

    log g_d(x) = min(0, a_d · x + b_d),   a_d > 0,

a temperature (a_d) and an offset (b_d) on the log scale, capped at probability 1. Per depth the map is
non-decreasing in x, so applying it to every entry of a sorted top-K row keeps the row sorted: the tree
search (`build_tree` / `build_trees`) run on the CALIBRATED log-probabilities is exact for the calibrated
path scores log ρ̃ = Σ_j log g_j(q_j(r_j)), which are the values the planner sums (Â = 1 + Σ ρ̃).

Fitting. An `AcceptanceRecord` is one drafter pass whose target continuation is known (the tokens the
target committed after the root). For depth d, every candidate r of the top-K row gives one Bernoulli event,
y = 1 when its token equals the target's token at depth d, provided the target's tokens at depths 1..d-1
are all among the top-K candidates of their rows (the target's path is a node of the lattice, so the event
is the conditional factor above). (a_d, b_d) maximise the Bernoulli log-likelihood of these events. A depth
with fewer than `min_positive` matching events shares the parameters fitted on it and every deeper depth
pooled (deep events are rare).

Lattices (DFlash2). A `LatticeRecord` (`lattice_acceptance`) is one pass of a DFlash2 drafter: its
transitions [D, K, K] (row p of slot e: log q(candidate c of slot e | candidate p of slot e-1)), candidates
[D, K] and the target's continuation. Its events are the ones above with the row replaced by the parent's
transition row: at depth d, with the target's tokens at depths 1..d-1 candidates of their slots and p the
candidate index of the target's token at depth d-1 (0 at depth 1), every candidate c of slot d gives
x = transitions[d-1, p, c], y = (its token == the target's token at depth d). The conditional factor a
lattice node's path multiplies is that same quantity, so the same per-depth maps are fitted by the same
code (`conditional_events` reads each record's `events`), stored in the same profile field, and applied to
every parent row of a depth alike (`AcceptanceCalibration.apply` on [B, D, K, K]): each row stays sorted and
`build_lattice_trees` on calibrated transitions is exact for the calibrated path scores. Where every row of
a slot is the same, a lattice's events are those of the equivalent top-K draft. `best_accept_curve` bounds
calibrated lattice trees too: its caps hold for any row that is a distribution, here one per parent.

Online correction. `AcceptanceTracker` keeps exponentially forgotten sums of the predicted drafted part
(Â - 1) and of the realised accepted drafts, separately for greedy and sampled requests, and the planner
scales the drafted part by their ratio c: Â = 1 + c·Σ ρ̃. A constant factor does not change which nodes are
best, so the tree stays exact. Beside an online depth map (`depth_acceptance.OnlineDepthMap`) the tracker
corrects what the map leaves, not what it already corrects: the predicted part is kept per depth under the
base map (Σ ρ̃ = Σ_d P(reach d)), and c is taken against Σ_d r_d · P(reach d), the recent steps' prediction
under the map as it is NOW (r_d: its reach factor at depth d). Summed against each step's own shifted
prediction instead, c went on correcting what the map had since learnt: in the first steps both moved down
together, and on the CPU demo pair at concurrency 8 one such doubly pessimistic step put Ŝ at 0.94 where
the chain paid 1.6x to 1.75x (docs/benchmarks.md), and the gate stopped drafting for the rest of the run.
"""

from __future__ import annotations

import math
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Protocol

import numpy as np
import torch
from pydantic import BaseModel, ConfigDict, Field, FiniteFloat, model_validator
from scipy.optimize import minimize

from bastion_sglang.controller.fast_tree import host_draft
from bastion_sglang.controller.tree import DraftTree, build_tree

MIN_POSITIVE_EVENTS = 30
"""Matching events a depth needs for parameters of its own (else it is pooled with the deeper depths)."""
PROBABILITY_CAP = 1.0 - 1e-6
"""Probabilities are capped below 1 inside the likelihood, so a mismatch at a capped point stays finite."""
SLOPE_BOUNDS = (0.05, 20.0)
"""Range of a_d searched by the fit."""
OFFSET_BOUNDS = (-20.0, 5.0)
"""Range of b_d searched by the fit."""


class AcceptanceCalibration(BaseModel):
    """Per-depth monotone maps log g_d(x) = min(0, a_d·x + b_d) (module docstring); depths beyond the
    fitted ones use the last depth's map."""

    model_config = ConfigDict(frozen=True, strict=True, extra="forbid")

    slopes: list[FiniteFloat] = Field(min_length=1, description="a_d per depth d = 1.., dimensionless")
    offsets: list[FiniteFloat] = Field(min_length=1, description="b_d per depth d = 1.., log-probability")
    events: list[int] = Field(description="Bernoulli events per depth the fit saw (0: identity/pooled)")
    drafter_config_hash: str | None = Field(
        default=None, description="config_hash of the drafter the map was fitted for"
    )

    @model_validator(mode="after")
    def _consistent(self) -> AcceptanceCalibration:
        if not len(self.slopes) == len(self.offsets) == len(self.events):
            raise ValueError(
                f"slopes, offsets and events need one entry per depth, got {len(self.slopes)}, "
                f"{len(self.offsets)} and {len(self.events)}"
            )
        bad = [a for a in self.slopes if a <= 0]
        if bad:
            raise ValueError(f"slopes must be > 0 (a monotone map), got {bad}")
        return self

    @classmethod
    def identity(cls, depths: int = 1) -> AcceptanceCalibration:
        """a = 1, b = 0 at every depth: the raw drafter probabilities."""
        return cls(slopes=[1.0] * depths, offsets=[0.0] * depths, events=[0] * depths)

    @property
    def is_identity(self) -> bool:
        return all(a == 1.0 for a in self.slopes) and all(b == 0.0 for b in self.offsets)

    def depth_parameters(self, depths: int) -> tuple[list[float], list[float]]:
        """(a_d, b_d) for d = 1..depths, the last fitted depth repeated beyond the fitted ones."""
        count = len(self.slopes)
        index = [min(d, count - 1) for d in range(depths)]
        return [self.slopes[i] for i in index], [self.offsets[i] for i in index]

    def shifted(self, shifts: np.ndarray) -> AcceptanceCalibration:
        """This map with log c_d added to each depth's offset (`depth_acceptance.OnlineDepthMap.shifts`, [D]
        float64): the map the planner applies once the online depth map has learnt c."""
        if not shifts.any():
            return self
        slopes, offsets = self.depth_parameters(max(len(self.slopes), shifts.shape[0]))
        moved = [b + (float(shifts[d]) if d < shifts.shape[0] else 0.0) for d, b in enumerate(offsets)]
        events = [*self.events, *[0] * (len(slopes) - len(self.events))]
        return self.model_copy(update={"slopes": slopes, "offsets": moved, "events": events})

    def apply(self, logprobs: torch.Tensor) -> torch.Tensor:
        """Calibrated log-probabilities, same shape, dtype and device, every value <= 0 and sorted rows kept
        sorted (the map is non-decreasing per depth).

        logprobs: raw top-K log q, [D, K] or [B, D, K] (depth: dim -2); or a batch of lattice transitions
        [B, D, K, K] (depth: dim 1), every parent row [b, d, p] of depth d + 1 mapped by that depth's map.
        """
        if logprobs.dim() == 4:
            depths = int(logprobs.shape[1])
            shape: tuple[int, ...] = (depths, 1, 1)
        elif 2 <= logprobs.dim() <= 3:
            depths = int(logprobs.shape[-2])
            shape = (depths, 1)
        else:
            raise ValueError(
                f"logprobs must be [D, K], [B, D, K] or lattice transitions [B, D, K, K], got shape "
                f"{tuple(logprobs.shape)}"
            )
        slopes, offsets = self.depth_parameters(depths)
        a = torch.tensor(slopes, dtype=logprobs.dtype, device=logprobs.device).view(shape)
        b = torch.tensor(offsets, dtype=logprobs.dtype, device=logprobs.device).view(shape)
        return torch.clamp(logprobs * a + b, max=0.0)


class DrafterPass(Protocol):
    """A recorded drafter pass the fit and the report read: an `AcceptanceRecord` (top-K) or a
    `lattice_acceptance.LatticeRecord` (DFlash2 lattice)."""

    continuation: tuple[int, ...]

    @property
    def depth(self) -> int:
        """D, the positions drafted."""
        ...

    def events(self, depths: int) -> Iterator[tuple[np.ndarray, np.ndarray]]:
        """Per depth d = 1, 2, .. (at most `depths`, stopping where the target's path leaves the lattice):
        (x, y), the [K] raw log-probabilities of the candidates of the conditional factor at depth d and
        their [K] 0/1 outcomes, float64 (module docstring)."""
        ...

    def tree(self, calibration: AcceptanceCalibration | None, budget: int) -> DraftTree:
        """The best-first tree of `budget` nodes on the pass's calibrated (None: raw) log-probabilities."""
        ...


@dataclass(frozen=True)
class AcceptanceRecord:
    """One drafter pass and what the target committed after its root.

    logprobs: [D, K] raw top-K log-probabilities, rows sorted descending; token_ids: [D, K] their tokens;
    continuation: the target's tokens at depths 1..m (m <= D; fewer when the output ended).
    """

    logprobs: torch.Tensor
    token_ids: torch.Tensor
    continuation: tuple[int, ...]

    @property
    def depth(self) -> int:
        return int(self.logprobs.shape[0])

    def events(self, depths: int) -> Iterator[tuple[np.ndarray, np.ndarray]]:
        """`DrafterPass.events`: depth d reads row d - 1 of the top-K (read to the host in one copy)."""
        lp, ids = host_draft(self.logprobs, self.token_ids)
        for d, target in enumerate(self.continuation[: min(depths, lp.shape[0])]):
            match = ids[d] == target
            yield lp[d], match.astype(np.float64)
            if not match.any():
                return  # the target's path leaves the lattice: deeper events are not conditional ones

    def tree(self, calibration: AcceptanceCalibration | None, budget: int) -> DraftTree:
        logprobs = self.logprobs if calibration is None else calibration.apply(self.logprobs)
        return build_tree(logprobs, self.token_ids, budget)


def conditional_events(records: Sequence[DrafterPass], depths: int) -> list[tuple[np.ndarray, np.ndarray]]:
    """Per depth d = 1..depths: (x, y), the raw log-probabilities of the candidates whose conditional event
    is observed (the target's path before d lies in the lattice) and the 0/1 outcomes. [n_d] float64 each.
    records: top-K (`AcceptanceRecord`) or lattice (`LatticeRecord`) passes, or both."""
    xs: list[list[np.ndarray]] = [[] for _ in range(depths)]
    ys: list[list[np.ndarray]] = [[] for _ in range(depths)]
    for record in records:
        for d, (x, y) in enumerate(record.events(depths)):
            xs[d].append(x)
            ys[d].append(y)
    return [
        (np.concatenate(x) if x else np.empty(0), np.concatenate(y) if y else np.empty(0))
        for x, y in zip(xs, ys, strict=True)
    ]


def _negative_log_likelihood(params: np.ndarray, x: np.ndarray, y: np.ndarray) -> tuple[float, np.ndarray]:
    """Bernoulli NLL of p = exp(min(0, a·x + b)) (capped) and its gradient in (a, b)."""
    a, b = params
    z = np.minimum(a * x + b, 0.0)
    p = np.minimum(np.exp(z), PROBABILITY_CAP)
    inside = (a * x + b < 0.0) & (np.exp(z) < PROBABILITY_CAP)
    loss = -np.sum(y * np.log(p) + (1.0 - y) * np.log1p(-p))
    # d loss / d z = -(y - p) / (1 - p) where the map is not capped, else 0
    dz = np.where(inside, -(y - p) / (1.0 - p), 0.0)
    return float(loss), np.array([np.sum(dz * x), np.sum(dz)])


def fit_depth(x: np.ndarray, y: np.ndarray) -> tuple[float, float]:
    """(a, b) maximising the Bernoulli likelihood of outcomes y [n] at raw log-probabilities x [n]."""
    if x.shape != y.shape or x.ndim != 1 or x.size == 0:
        raise ValueError(f"x and y must be equal non-empty 1-D arrays, got {x.shape} and {y.shape}")
    finite = np.isfinite(x)
    x, y = np.maximum(x[finite], -50.0), y[finite]
    best = minimize(
        _negative_log_likelihood,
        np.array((1.0, 0.0)),
        args=(x, y),
        jac=True,
        method="L-BFGS-B",
        bounds=[SLOPE_BOUNDS, OFFSET_BOUNDS],
    )
    for start in ((0.5, -0.5), (2.0, 0.0)):
        result = minimize(
            _negative_log_likelihood,
            np.array(start),
            args=(x, y),
            jac=True,
            method="L-BFGS-B",
            bounds=[SLOPE_BOUNDS, OFFSET_BOUNDS],
        )
        if result.fun < best.fun:
            best = result
    return float(best.x[0]), float(best.x[1])


def fit_acceptance(
    records: Sequence[DrafterPass],
    depths: int,
    min_positive: int = MIN_POSITIVE_EVENTS,
    drafter_config_hash: str | None = None,
) -> AcceptanceCalibration:
    """Fit the per-depth maps on `records` (module docstring), top-K or lattice passes. Raises ValueError
    when depth 1 has fewer than `min_positive` matching events (too little data to calibrate anything)."""
    if isinstance(depths, bool) or not isinstance(depths, int) or depths < 1:
        raise ValueError(f"depths must be a positive int, got {depths!r}")
    events = conditional_events(records, depths)
    positives = [int(y.sum()) for _, y in events]
    if positives[0] < min_positive:
        raise ValueError(
            f"acceptance calibration needs at least {min_positive} matching events at depth 1, got "
            f"{positives[0]} from {len(records)} drafter passes; use more prompts or longer outputs"
        )
    slopes, offsets, counts = [], [], []
    for d in range(depths):
        if positives[d] >= min_positive and sum(positives[d + 1 :]) >= min_positive:
            x, y = events[d]
        else:  # pool this depth with every deeper one
            x = np.concatenate([events[j][0] for j in range(d, depths)])
            y = np.concatenate([events[j][1] for j in range(d, depths)])
            if y.sum() < min_positive:
                slopes.append(slopes[-1])
                offsets.append(offsets[-1])
                counts.append(0)
                continue
        a, b = fit_depth(x, y)
        slopes.append(a)
        offsets.append(b)
        counts.append(int(x.size))
    return AcceptanceCalibration(
        slopes=slopes, offsets=offsets, events=counts, drafter_config_hash=drafter_config_hash
    )


CALIBRATED_PRIOR_WEIGHT = 32.0
"""`AcceptanceTracker.prior_weight` where the planner starts from a fitted acceptance map (start-up or
offline, hundreds of drafter passes): about six steps of a 15-node chain's predicted drafted tokens on
GSM8K-like text, forgotten at the tracker's decay. Without it the first steps' bare ratio overruled the
map: on the CPU demo pair under synthetic GSM8K acceptance at concurrency 1, with a start-up map whose
first plan read Â 6.64 against a true 6.57, four short accepts in a row (3, 3, 2 and 3 tokens) took the
scalar to 0.76 and, with the depth map, Â to 2.65 by the fourth step; it stayed under the truth for about
30 steps."""


class AcceptanceTracker:
    """Online correction of the calibrated Â from realised accept lengths (module docstring).

    decay: weight the running sums keep per observed step, in (0, 1). The correction is 1 until
    `min_predicted` drafted tokens were predicted for that mode (the sums forgotten below it return it to 1),
    and stays in [lower, upper]: near 0 for a drafter whose trees are never accepted, so the planner stops
    buying them within a step or two. (A posterior mean with a few pseudo-tokens at 1 instead could not go
    below prior / (recent predicted tokens): it kept a never-matching drafter speculating on most steps where
    a verify pass costs about a plain step.) depth: D, the positions a step's per-depth predictions
    (`observe`'s reach) cover; 0 when none are given. prior_weight: predicted drafted tokens the sums start
    with at c = 1, forgotten like observed ones: evidence for a calibrated map (`CALIBRATED_PRIOR_WEIGHT`),
    0 for raw drafter probabilities (the bare ratio above).
    """

    GREEDY, SAMPLED = 0, 1

    def __init__(
        self,
        decay: float = 0.95,
        min_predicted: float = 8.0,
        lower: float = 1e-3,
        upper: float = 4.0,
        depth: int = 0,
        prior_weight: float = 0.0,
    ) -> None:
        if not 0 < decay < 1:
            raise ValueError(f"decay must be in (0, 1), got {decay!r}")
        if depth < 0:
            raise ValueError(f"depth must be >= 0, got {depth}")
        if not 0 <= prior_weight < math.inf:
            raise ValueError(f"prior_weight must be finite and >= 0, got {prior_weight!r}")
        self._decay = decay
        self._min_predicted = min_predicted
        self._bounds = (lower, upper)
        # [mode, 1 + D]: column 0 the predicted drafted part not split by depth (and the prior's), column d
        # the base map's predicted reaches of depth d
        self._predicted = np.zeros((2, depth + 1), dtype=np.float64)
        self._predicted[:, 0] = prior_weight
        self._realised = [prior_weight, prior_weight]
        self._expected_total = 0.0
        self._realised_total = 0.0

    def correction(self, greedy: bool, reach_scale: np.ndarray | None = None) -> float:
        """c for a greedy or a sampled request: realised / predicted drafted tokens, clipped. reach_scale:
        [D] float64 r_d, the online depth map's factor on the base map's reach of depth d now
        (`OnlineDepthMap.reach_scale`); None: 1 at every depth."""
        mode = self.GREEDY if greedy else self.SAMPLED
        row = self._predicted[mode]
        if row.sum() < self._min_predicted:
            return 1.0
        predicted = row[0] + (row[1:].sum() if reach_scale is None else float(row[1:] @ reach_scale))
        lower, upper = self._bounds
        return float(min(max(self._realised[mode] / predicted, lower), upper))

    def corrections(self, greedy: Sequence[bool], reach_scale: np.ndarray | None = None) -> list[float]:
        """[B] `correction` per request."""
        return [self.correction(g, reach_scale) for g in greedy]

    def observe(
        self,
        predicted_drafted: Sequence[float],
        accepted: Sequence[int],
        greedy: Sequence[bool],
        corrections: Sequence[float],
        reach: np.ndarray | None = None,
    ) -> None:
        """One step: per request the calibrated drafted part Σ ρ̃ of its verified tree (before the online
        correction), the accepted draft nodes, whether it decodes greedily, and the correction it was
        planned with (for the calibration-error statistic). reach: [B, D] float64, per request the base
        map's probability of reaching depth d (`depth_acceptance.depth_reach`); when given, a request's
        prediction is kept per depth, else as one sum."""
        decay = self._decay
        self._predicted *= decay
        self._realised = [decay * value for value in self._realised]
        self._expected_total *= decay
        self._realised_total *= decay
        if reach is not None and reach.shape != (len(accepted), self._predicted.shape[1] - 1):
            raise ValueError(
                f"reach must be [{len(accepted)}, {self._predicted.shape[1] - 1}], got {reach.shape}"
            )
        for i, (drafted, hits, is_greedy, c) in enumerate(
            zip(predicted_drafted, accepted, greedy, corrections, strict=True)
        ):
            if drafted <= 0.0:
                continue  # a request that verified no node says nothing about the drafter
            mode = self.GREEDY if is_greedy else self.SAMPLED
            if reach is None:
                self._predicted[mode, 0] += drafted
            else:
                self._predicted[mode, 1:] += reach[i]
            self._realised[mode] += hits
            self._expected_total += 1.0 + c * drafted
            self._realised_total += 1.0 + hits

    @property
    def calibration_error(self) -> float:
        """|Σ expected - Σ realised| / Σ realised accept length over recent request-steps (forgotten at the
        decay rate), fraction; 0 before any observation."""
        if self._realised_total <= 0:
            return 0.0
        return abs(self._expected_total - self._realised_total) / self._realised_total


def realised_accept_length(
    tokens: Sequence[int], parents: Sequence[int], depths: Sequence[int], continuation: Sequence[int]
) -> int:
    """Tokens a tree commits against a known target continuation: 1 + the depth of its deepest node whose
    whole path matches `continuation` (depth d compared with continuation[d - 1]). Nodes in best-first
    order, parents before children, ROOT = -1."""
    matched = [False] * len(tokens)
    best = 0
    for i, (token, parent, depth) in enumerate(zip(tokens, parents, depths, strict=True)):
        if depth > len(continuation) or token != continuation[depth - 1]:
            continue
        if parent >= 0 and not matched[parent]:
            continue
        matched[i] = True
        best = max(best, depth)
    return 1 + best


class AcceptanceReport(BaseModel):
    """Expected vs realised accept length on held-out drafter passes, raw and calibrated, per budget."""

    model_config = ConfigDict(frozen=True, strict=True, extra="forbid")

    passes: int = Field(ge=0)
    budgets: list[int]
    realised: list[FiniteFloat] = Field(description="mean tokens committed per pass, calibrated trees")
    expected: list[FiniteFloat] = Field(description="mean calibrated Â per pass")
    realised_raw: list[FiniteFloat] = Field(description="mean tokens committed per pass, raw trees")
    expected_raw: list[FiniteFloat] = Field(description="mean raw Â per pass")

    @property
    def error(self) -> list[float]:
        """expected / realised - 1 per budget, calibrated (signed fraction)."""
        return [e / r - 1.0 for e, r in zip(self.expected, self.realised, strict=True)]

    @property
    def error_raw(self) -> list[float]:
        return [e / r - 1.0 for e, r in zip(self.expected_raw, self.realised_raw, strict=True)]


def evaluate_acceptance(
    calibration: AcceptanceCalibration, records: Sequence[DrafterPass], budgets: Sequence[int]
) -> AcceptanceReport:
    """Build the best-first tree of every record at every budget, on raw and on calibrated log-probs (a
    lattice's trees: `build_lattice_tree`, every child kept), and compare 1 + Σ ρ with what the known
    continuation commits. Records whose continuation is shorter than the drafter's depth are skipped (their
    realised length is cut by the end of the output)."""
    full = [r for r in records if len(r.continuation) >= r.depth]
    if not full:
        raise ValueError(
            f"none of the {len(records)} records has a continuation as long as the drafter's depth"
        )
    sums = {key: [0.0] * len(budgets) for key in ("realised", "expected", "realised_raw", "expected_raw")}
    for record in full:
        for suffix, mapping in (("", calibration), ("_raw", None)):
            for j, budget in enumerate(budgets):
                tree = record.tree(mapping, budget)
                sums["expected" + suffix][j] += 1.0 + float(torch.exp(tree.log_scores).sum())
                sums["realised" + suffix][j] += realised_accept_length(
                    tree.tokens.tolist(), tree.parents.tolist(), tree.depths.tolist(), record.continuation
                )
    means = {key: [v / len(full) for v in values] for key, values in sums.items()}
    return AcceptanceReport(passes=len(full), budgets=list(budgets), **means)


def node_log_scores(
    tokens: torch.Tensor,
    parents: torch.Tensor,
    depths: torch.Tensor,
    logprobs: torch.Tensor,
    token_ids: torch.Tensor,
) -> torch.Tensor:
    """Path scores of a batch of trees under other top-K log-probabilities (e.g. the raw ones of a tree
    built on calibrated values): Σ over each node's path of logprobs at the node's token.

    tokens, parents, depths: [B, N] int64 (a `DraftTreeBatch`, parents before children); logprobs: [B, D, K];
    token_ids: [B, D, K], distinct tokens per row, containing every node's token at its depth.
    Returns [B, N] float64. No host sync.
    """
    batch, nodes = tokens.shape
    if nodes == 0:
        return torch.zeros((batch, 0), dtype=torch.float64, device=tokens.device)
    width = token_ids.shape[-1]
    rows = (depths - 1).clamp(min=0)[:, :, None].expand(batch, nodes, width)
    match = token_ids.gather(1, rows) == tokens[:, :, None]  # [B, N, K], one True per node
    own = torch.where(match, logprobs.to(torch.float64).gather(1, rows), 0.0).sum(-1)  # [B, N]
    scores = own.clone()
    parent_index = parents.clamp(min=0)
    for depth in range(2, int(logprobs.shape[1]) + 1):
        scores = torch.where(depths == depth, own + scores.gather(1, parent_index), scores)
    return scores


def best_accept_curve(
    calibration: AcceptanceCalibration, depth: int, branching: int, nodes: int
) -> np.ndarray:
    """[nodes + 1] an upper bound of the calibrated Â(n), n = 0..nodes, of ANY tree of n nodes this drafter's
    top-K rows could give: what `build_tree` on calibrated log-probabilities can reach at best, whatever the
    drafter proposes (before the online correction c, which scales Â - 1).

    Per depth d the calibrated factor of a candidate of drafter probability q is
    g_d(q) = min(1, e^{b_d} q^{a_d}) (module docstring), so one node's factor is at most
    p_d = min(1, e^{b_d}); and the K candidates of one row, whose probabilities sum to at most 1, hold
    together at most m_d = min(K p_d, e^{b_d} K^{max(0, 1-a_d)}) (Σ q^a <= 1 for a >= 1; <= K^{1-a} for
    a < 1). The nodes at depth d of a tree then hold at most M_d = Π_{k<=d} m_k of calibrated path
    probability, each at most P_d = Π_{k<=d} p_k, and there are at most K^d of them. The bound relaxes the
    tree's shape to these per-depth caps: its n best node values, where depth d offers nodes of value P_d
    until its mass M_d is spent (the last one the remainder), taken best first across depths. depth: D,
    positions drafted; branching: K.
    """
    if depth < 1 or branching < 1 or nodes < 0:
        raise ValueError(f"need depth >= 1, branching >= 1, nodes >= 0, got {depth}, {branching}, {nodes}")
    slopes, offsets = calibration.depth_parameters(depth)
    values: list[float] = []
    level_cap, level_mass, level_count = 1.0, 1.0, 1
    for a, b in zip(slopes, offsets, strict=True):
        scale = math.exp(b)
        single = min(1.0, scale)
        level_cap *= single
        level_mass *= min(branching * single, scale * branching ** max(0.0, 1.0 - a))
        level_count = min(level_count * branching, nodes)
        if level_cap <= 0.0:
            break
        full = min(level_count, int(level_mass / level_cap))
        values.extend([level_cap] * full)
        if full < level_count and level_mass > full * level_cap:
            values.append(level_mass - full * level_cap)
    values.sort(reverse=True)
    gains = np.zeros(nodes + 1, dtype=np.float64)
    taken = np.cumsum(values[:nodes], dtype=np.float64)
    gains[1 : 1 + taken.shape[0]] = taken
    if taken.shape[0] < nodes:
        gains[1 + taken.shape[0] :] = taken[-1] if taken.shape[0] else 0.0
    return 1.0 + gains
