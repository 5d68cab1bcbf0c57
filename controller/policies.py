"""Budget policies: how many best-first nodes to verify this step (BASTION §2.4, Algorithm 1).

Terms. For a best-first tree with node scores log ρ_1 ≥ log ρ_2 ≥ ..., verifying the first n nodes costs
one target pass over s = n + 1 tokens (the root, i.e. the bonus token, plus n nodes) and is expected to
commit Â(n) = 1 + Σ_{i≤n} ρ_i tokens (eq. 3). The estimated cycle cost is
Ĉ(n) = T_draft + T_aux + T_verify(n + 1, c) (eq. 7), and the estimated speedup over plain decoding is
Ŝ(n) = Â(n) · L_AR / Ĉ(n) (eq. 6). Â is concave in n (eq. 5); with a convex Ĉ, Ŝ is unimodal and its
first drop is its maximum (Proposition 2.4).

Each policy owns its choice for a whole batch (`choose_batch`, on a `batch_objective.BatchObjective`), the
size of the tree to build for it (`tree_budget`) and the configurations it can run with (`check_config`), so
callers never branch on the policy's type; `choose` is the batch choice at B = 1.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol, runtime_checkable

import numpy as np
import torch

from bastion_sglang.controller.batch_objective import (
    PAYING_SPEEDUP,
    BatchObjective,
    accept_curves,
    adaptive_stop,
)
from bastion_sglang.controller.latency import validate_width_buckets

if TYPE_CHECKING:
    from collections.abc import Sequence

    from bastion_sglang.controller.batched import DraftTreeBatch
    from bastion_sglang.controller.latency import LatencyModel
    from bastion_sglang.controller.profile import StepCosts


def expected_accept_curve(log_scores: torch.Tensor) -> torch.Tensor:
    """Â(n) for n = 0..N: [N] log ρ (best-first) -> [N + 1] float64 on the host, Â(0) = 1 (the values the
    planners use: `batch_objective.accept_curves`)."""
    host = log_scores.detach().to(device="cpu", dtype=torch.float64).numpy()[None]
    return torch.from_numpy(accept_curves(host)[1][0])


def speedup_curve(
    log_scores: torch.Tensor, ctx_len: int, latency: LatencyModel, costs: StepCosts
) -> torch.Tensor:
    """Ŝ(n) for n = 1..N: [N] log ρ -> [N] float64 estimated speedups over plain decoding, on the host."""
    objective = BatchObjective.from_log_scores(log_scores[None], [ctx_len], latency, costs)
    nodes = np.arange(1, objective.available + 1)
    return torch.from_numpy(objective.common(nodes).speedup)


def _choose_one(
    policy: BudgetPolicy, log_scores: torch.Tensor, ctx_len: int, latency: LatencyModel, costs: StepCosts
) -> int:
    """`policy.choose` through its batch choice at B = 1."""
    objective = BatchObjective.from_log_scores(log_scores[None], [ctx_len], latency, costs)
    return policy.choose_batch(objective, common_width=True)[0]


def _fits_widest(policy: BudgetPolicy, nodes: int, max_width: int | None) -> int:
    """nodes, or ValueError when a pass of nodes + 1 tokens is wider than max_width (None: unbounded)."""
    if max_width is not None and nodes + 1 > max_width:
        raise ValueError(
            f"policy {policy!r} verifies up to {nodes + 1} tokens, beyond the largest width bucket "
            f"{max_width} of the latency model"
        )
    return nodes


@runtime_checkable
class BudgetPolicy(Protocol):
    """Chooses n, the number of draft nodes of a best-first tree to verify in one step."""

    @property
    def topk_cap(self) -> int | None:
        """Candidates per depth the tree may use (1 for a chain); None: whatever the drafter gives."""

    @property
    def may_decline(self) -> bool:
        """Whether the policy may choose plain decoding (n = 0 for the batch) when no tree pays."""

    def tree_budget(self, max_nodes: int, depth: int, max_width: int | None) -> int:
        """Nodes of the best-first tree to build per request. max_nodes: N_max, the most the caller builds for
        a policy that chooses; depth: D, the drafter's depth; max_width: the widest verify pass (tokens per
        request) the latency model prices, None: unbounded. ValueError when the policy needs a wider pass."""

    def check_config(self, max_budget: int, width_buckets: tuple[int, ...]) -> None:
        """ValueError, naming both, when the policy cannot run with N_max = max_budget nodes per request and
        these verify width buckets."""

    def choose_batch(self, objective: BatchObjective, common_width: bool) -> tuple[int, ...]:
        """Nodes per request (each in 0..N) for the batch of `objective`. common_width: every request must
        verify the same n (one width per pass); policies that always choose one n ignore it."""

    def choose(self, log_scores: torch.Tensor, ctx_len: int, latency: LatencyModel, costs: StepCosts) -> int:
        """log_scores: [N] float64 best-first log ρ; ctx_len: cached tokens; returns n in 0..N (the batch
        choice at B = 1)."""


@dataclass(frozen=True)
class FixedPolicy:
    """Always verify the best `nodes` nodes (DDTree's fixed node budget)."""

    nodes: int

    def __post_init__(self) -> None:
        if isinstance(self.nodes, bool) or not isinstance(self.nodes, int) or self.nodes < 1:
            raise ValueError(f"fixed budget must be a positive int, got {self.nodes!r}")

    @property
    def topk_cap(self) -> int | None:
        return None

    @property
    def may_decline(self) -> bool:
        return False

    def tree_budget(self, max_nodes: int, depth: int, max_width: int | None) -> int:
        return _fits_widest(self, self.nodes, max_width)

    def check_config(self, max_budget: int, width_buckets: tuple[int, ...]) -> None:
        if self.nodes > max_budget:
            raise ValueError(
                f"policy fixed:{self.nodes} verifies more nodes than max_budget {max_budget}; "
                f"raise the budget to at least {self.nodes} or lower N"
            )

    def choose_batch(self, objective: BatchObjective, common_width: bool) -> tuple[int, ...]:
        return (min(self.nodes, objective.available),) * objective.batch_size

    def choose(self, log_scores: torch.Tensor, ctx_len: int, latency: LatencyModel, costs: StepCosts) -> int:
        return _choose_one(self, log_scores, ctx_len, latency, costs)


@dataclass(frozen=True)
class ChainPolicy:
    """The drafter's top-1 token at every depth, all of them (what DFlash verifies)."""

    @property
    def topk_cap(self) -> int | None:
        return 1

    @property
    def may_decline(self) -> bool:
        return False

    def tree_budget(self, max_nodes: int, depth: int, max_width: int | None) -> int:
        return _fits_widest(self, depth, max_width)

    def check_config(self, max_budget: int, width_buckets: tuple[int, ...]) -> None:
        return None

    def choose_batch(self, objective: BatchObjective, common_width: bool) -> tuple[int, ...]:
        return (objective.available,) * objective.batch_size

    def choose(self, log_scores: torch.Tensor, ctx_len: int, latency: LatencyModel, costs: StepCosts) -> int:
        return _choose_one(self, log_scores, ctx_len, latency, costs)


@dataclass(frozen=True)
class AdaptivePolicy:
    """BASTION's rule: grow the best-first tree while Ŝ(n) rises; stop at its first drop.

    For a batch with one common width: the first drop of Σ_i Â_i(n) / Ĉ(n) over n = 1..N (a sum of concave
    curves over a convex cost, so unimodal), every n priced by one latency prediction; when the latency model
    pads passes to width buckets (CUDA graphs), Ĉ is a step function and the rule takes the maximum of Ŝ over
    every n instead (`batch_objective.adaptive_stop`). Without a common width: the greedy walk of
    `BatchObjective.greedy_walk`.
    """

    @property
    def topk_cap(self) -> int | None:
        return None

    @property
    def may_decline(self) -> bool:
        return True

    def tree_budget(self, max_nodes: int, depth: int, max_width: int | None) -> int:
        return max_nodes if max_width is None else min(max_nodes, max_width - 1)

    def check_config(self, max_budget: int, width_buckets: tuple[int, ...]) -> None:
        return None

    def choose_batch(self, objective: BatchObjective, common_width: bool) -> tuple[int, ...]:
        if not common_width:
            return tuple(int(n) for n in objective.greedy_walk())
        available = objective.available
        if available == 0:
            return (0,) * objective.batch_size
        speedup = objective.common(np.arange(1, available + 1)).speedup
        stop = adaptive_stop(speedup, stepped=objective.latency.width_buckets is not None)
        return (stop + 1,) * objective.batch_size

    def choose(self, log_scores: torch.Tensor, ctx_len: int, latency: LatencyModel, costs: StepCosts) -> int:
        return _choose_one(self, log_scores, ctx_len, latency, costs)


@dataclass(frozen=True)
class BucketedAdaptivePolicy:
    """Evaluate Ŝ at every verify width bucket and fill the best bucket completely.

    A verify pass padded to a captured CUDA-graph width costs the same whatever fills it, so the nodes
    that fill a paid bucket are free. For each bucket w (tokens per request) the tree holds
    n = min(w - 1, N) nodes and costs Ĉ at the bucket it is padded to; the largest Ŝ wins (the smaller n on a
    tie). Within one bucket the verify cost is flat and Â rises, so with no per-token step cost this is the
    adaptive policy's choice on the same buckets (the argmax of Ŝ over every n) from len(buckets) estimates
    instead of N.
    The latency model must be built with these width buckets (it does the padding).
    """

    width_buckets: tuple[int, ...]

    def __post_init__(self) -> None:
        validate_width_buckets(self.width_buckets, lowest=2)

    @property
    def topk_cap(self) -> int | None:
        return None

    @property
    def may_decline(self) -> bool:
        return True

    def tree_budget(self, max_nodes: int, depth: int, max_width: int | None) -> int:
        return max_nodes if max_width is None else min(max_nodes, max_width - 1)

    def check_config(self, max_budget: int, width_buckets: tuple[int, ...]) -> None:
        if self.width_buckets != width_buckets:
            raise ValueError(
                f"the bucketed policy's buckets {self.width_buckets} differ from width_buckets "
                f"{width_buckets}"
            )

    def choose_batch(self, objective: BatchObjective, common_width: bool) -> tuple[int, ...]:
        available = objective.available
        if available == 0:
            return (0,) * objective.batch_size
        nodes = np.unique(np.minimum(np.array(self.width_buckets, dtype=np.int64) - 1, available))
        speedup = objective.common(nodes).speedup
        return (int(nodes[int(np.argmax(speedup))]),) * objective.batch_size  # the first (smallest) maximiser

    def choose(self, log_scores: torch.Tensor, ctx_len: int, latency: LatencyModel, costs: StepCosts) -> int:
        return _choose_one(self, log_scores, ctx_len, latency, costs)


def parse_policy(spec: str, width_buckets: Sequence[int] | None = None) -> BudgetPolicy | None:
    """Policy from its command-line spelling: adaptive | bucketed | fixed:N | chain | ar (None: no draft)."""
    text = spec.strip().lower()
    if text == "ar":
        return None
    if text == "adaptive":
        return AdaptivePolicy()
    if text == "chain":
        return ChainPolicy()
    if text == "bucketed":
        if not width_buckets:
            raise ValueError("policy 'bucketed' needs width buckets (e.g. 16,32,64,128,256)")
        return BucketedAdaptivePolicy(tuple(width_buckets))
    if text.startswith("fixed:"):
        value = text.removeprefix("fixed:")
        if not value.isdigit() or int(value) < 1:
            raise ValueError(f"policy {spec!r}: fixed:N needs a positive integer N")
        return FixedPolicy(int(value))
    raise ValueError(f"unknown policy {spec!r}; expected adaptive, bucketed, fixed:N, chain or ar")


@dataclass(frozen=True)
class BatchPlan:
    """What one verify pass over a batch will hold."""

    node_counts: tuple[int, ...]  # draft nodes verified per request
    width: int  # tokens per request in the verify pass (1 + nodes), common to the batch
    expected_accept: tuple[float, ...]  # Â per request at its node count, online correction applied
    expected_drafted: tuple[float, ...]  # Σ ρ of the verified nodes per request, before the correction
    estimated_verify_seconds: float  # T_verify of the whole pass, from the latency model
    estimated_speedup: float  # Σ Â · L_AR / (B · Ĉ): committed tokens per second over plain decoding's
    speculative_speedup: float  # estimated speedup of the best speculative plan (= estimated_speedup unless
    # the policy declined to speculate, when estimated_speedup is 1)
    accept_curve: tuple[float, ...]  # [N + 1] mean over requests of Â_i(n), n = 0..N (corrected); (1.0,)
    # without a tree

    @property
    def speculates(self) -> bool:
        """Whether any request verifies a draft node."""
        return self.width > 1


def plain_plan(
    batch: int, l_ar: float, speculative_speedup: float = 1.0, accept_curve: tuple[float, ...] = (1.0,)
) -> BatchPlan:
    """Plain decoding for a batch of `batch` requests: no draft node, one token each, speedup exactly 1.
    l_ar: the plain decode step's seconds (the pass it runs); speculative_speedup, accept_curve: those of the
    declined trees (defaults: no tree was drafted)."""
    return BatchPlan(
        node_counts=(0,) * batch,
        width=1,
        expected_accept=(1.0,) * batch,
        expected_drafted=(0.0,) * batch,
        estimated_verify_seconds=l_ar,
        estimated_speedup=1.0,
        speculative_speedup=speculative_speedup,
        accept_curve=accept_curve,
    )


def plan_batch(
    trees: DraftTreeBatch,
    ctx_lens: Sequence[int],
    latency: LatencyModel,
    costs: StepCosts,
    policy: BudgetPolicy,
    common_width: bool = True,
    accept_scale: Sequence[float] | None = None,
    allow_plain: bool = False,
) -> BatchPlan:
    """Choose per-request node counts for one verify pass shared by the whole batch.

    Objective: maximise the batch's expected committed tokens per second, Σ_i Â_i(n_i) / Ĉ(n_1..n_B), reported
    as a speedup over plain decoding, Σ_i Â_i · L_AR / (B · Ĉ) with L_AR = `costs.l_ar`, the seconds of one
    plain decode step of the whole batch (which commits B tokens), where
    Ĉ = `StepCosts.cycle_seconds` of one pass over all requests' tokens (`LatencyModel.predict_batch`), and
    Â_i(n) = 1 + c_i·Σ_{j≤n} ρ_ij with c_i = accept_scale[i] (the online acceptance correction; 1 if None):
    a constant factor per request keeps each row's best-first order, so the trees stay optimal for Â.
    Plain decoding is option n = 0 for the whole batch, with speedup exactly 1: with `allow_plain`, a policy
    that `may_decline` returns `plain_plan` when its best speculative plan's estimated speedup is at most
    `batch_objective.PAYING_SPEEDUP` (1.05: the estimate's own error).
    With `common_width` (SGLang's verify needs one width per batch) every request verifies the same n:
    adaptive takes the first drop of Σ_i Â_i(n) / Ĉ(n) (a sum of concave curves over a convex cost, so
    unimodal); bucketed takes the best bucket; fixed and chain take their n. A common width is also the best
    ragged plan there: the pass costs Ĉ at B requests × W tokens whatever each request verifies (every row is
    padded to W), so verifying fewer than W - 1 nodes for a request the drafter predicts badly saves nothing
    and only lowers its Â; such requests are priced in by Σ_i Â_i and, when no request gains enough, the
    whole batch declines (n = 0). Without `common_width` (an engine that verifies ragged widths, where the
    pass costs Σ_i (n_i + 1) tokens) the nodes are handed out greedily by ρ across requests (exact for a sum
    of concave Â_i at any total), so requests the drafter predicts badly keep n_i = 0 while others
    speculate, and adaptive stops at the first drop of the objective along that order.
    The policy chooses (`BudgetPolicy.choose_batch`) on a `BatchObjective`, which prices all of its candidate
    plans (every n for adaptive) with one latency prediction; the reported estimates are those of the chosen
    plan (at a common n: the values the policy compared).
    trees: [B, N] best-first trees; ctx_lens: cached tokens per request. Reads the scores on the host
    (`DraftTreeBatch.on_host`: no device read for trees a host builder made, one packed copy, kept for the
    step's later reads, for the beam's).
    """
    objective = BatchObjective.from_log_scores(
        trees.on_host().log_scores, ctx_lens, latency, costs, accept_scale
    )
    counts = policy.choose_batch(objective, common_width)
    chosen = np.array(counts, dtype=np.int64)
    common = len(set(counts)) == 1
    estimates = objective.common(chosen[:1]) if common else objective.ragged(chosen[None])
    speedup, verify = float(estimates.speedup[0]), float(estimates.verify_seconds[0])
    accept_curve = tuple(objective.accept.mean(axis=0).tolist())
    if allow_plain and policy.may_decline and speedup <= PAYING_SPEEDUP:
        return plain_plan(len(counts), costs.l_ar, speculative_speedup=speedup, accept_curve=accept_curve)
    rows = np.arange(len(counts))
    return BatchPlan(
        node_counts=counts,
        width=max(counts) + 1,
        expected_accept=tuple(objective.accept[rows, chosen].tolist()),
        expected_drafted=tuple(objective.drafted[rows, chosen].tolist()),
        estimated_verify_seconds=verify,
        estimated_speedup=speedup,
        speculative_speedup=speedup,
        accept_curve=accept_curve,
    )
