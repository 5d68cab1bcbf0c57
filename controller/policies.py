"""Budget policies: how many best-first nodes to verify this step (BASTION §2.4, Algorithm 1).

Terms. For a best-first tree with node scores log ρ_1 ≥ log ρ_2 ≥ ..., verifying the first n nodes costs
one target pass over s = n + 1 tokens (the root, i.e. the bonus token, plus n nodes) and is expected to
commit Â(n) = 1 + Σ_{i≤n} ρ_i tokens (eq. 3). The estimated cycle cost is
Ĉ(n) = T_draft + T_aux + T_verify(n + 1, c) (eq. 7), and the estimated speedup over plain decoding is
Ŝ(n) = Â(n) · L_AR / Ĉ(n) (eq. 6). Â is concave in n (eq. 5); with a convex Ĉ, Ŝ is unimodal and its
first drop is its maximum (Proposition 2.4).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol, runtime_checkable

import torch

if TYPE_CHECKING:
    from collections.abc import Callable, Sequence

    from bastion_sglang.controller.batched import DraftTreeBatch
    from bastion_sglang.controller.latency import LatencyModel
    from bastion_sglang.controller.profile import StepCosts

    Objective = Callable[[list[int]], tuple[float, float]]
    """(node counts per request) -> (estimated speedup, estimated verify seconds)."""


def expected_accept_curve(log_scores: torch.Tensor) -> torch.Tensor:
    """Â(n) for n = 0..N: [N] log ρ (best-first) -> [N + 1] float64, Â(0) = 1."""
    gains = torch.exp(log_scores.to(torch.float64))
    return torch.cat([gains.new_ones(1), 1.0 + torch.cumsum(gains, 0)])


def speedup_curve(
    log_scores: torch.Tensor, ctx_len: int, latency: LatencyModel, costs: StepCosts
) -> torch.Tensor:
    """Ŝ(n) for n = 1..N: [N] log ρ -> [N] float64 estimated speedups over plain decoding."""
    accept = expected_accept_curve(log_scores)[1:]
    tokens = torch.arange(2, log_scores.shape[0] + 2, dtype=torch.int64)
    verify = latency.predict_many(tokens, ctx_len)
    return accept.cpu() * costs.l_ar / costs.cycle_seconds(verify, tokens)


def first_drop(values: torch.Tensor) -> int:
    """Index of the first i with values[i + 1] < values[i], or the last index if values never drop.

    values: [M] on the host. Returns a Python int.
    """
    drops = torch.nonzero(values[1:] < values[:-1])
    return int(drops[0, 0]) if drops.numel() else values.shape[0] - 1


@runtime_checkable
class BudgetPolicy(Protocol):
    """Chooses n, the number of draft nodes of a best-first tree to verify in one step."""

    @property
    def topk_cap(self) -> int | None:
        """Candidates per depth the tree may use (1 for a chain); None: whatever the drafter gives."""

    @property
    def may_decline(self) -> bool:
        """Whether the policy may choose plain decoding (n = 0 for the batch) when no tree pays."""

    def choose(self, log_scores: torch.Tensor, ctx_len: int, latency: LatencyModel, costs: StepCosts) -> int:
        """log_scores: [N] float64 best-first log ρ; ctx_len: cached tokens; returns n in 0..N."""


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

    def choose(self, log_scores: torch.Tensor, ctx_len: int, latency: LatencyModel, costs: StepCosts) -> int:
        return min(self.nodes, int(log_scores.shape[0]))


@dataclass(frozen=True)
class ChainPolicy:
    """The drafter's top-1 token at every depth, all of them (what DFlash verifies)."""

    @property
    def topk_cap(self) -> int | None:
        return 1

    @property
    def may_decline(self) -> bool:
        return False

    def choose(self, log_scores: torch.Tensor, ctx_len: int, latency: LatencyModel, costs: StepCosts) -> int:
        return int(log_scores.shape[0])


@dataclass(frozen=True)
class AdaptivePolicy:
    """BASTION's rule: grow the best-first tree while Ŝ(n) rises; stop at its first drop."""

    @property
    def topk_cap(self) -> int | None:
        return None

    @property
    def may_decline(self) -> bool:
        return True

    def choose(self, log_scores: torch.Tensor, ctx_len: int, latency: LatencyModel, costs: StepCosts) -> int:
        if log_scores.shape[0] == 0:
            return 0
        return first_drop(speedup_curve(log_scores, ctx_len, latency, costs)) + 1


@dataclass(frozen=True)
class BucketedAdaptivePolicy:
    """Evaluate Ŝ at every verify width bucket and fill the best bucket completely.

    A verify pass padded to a captured CUDA-graph width costs the same whatever fills it, so the nodes
    that fill a paid bucket are free. For each bucket w (tokens per request) the tree holds
    n = min(w - 1, N) nodes and costs Ĉ at the bucket it is padded to; the largest Ŝ wins (the smaller n on a
    tie). Within one bucket the cost is flat and Â rises, so this is the argmax of Ŝ over every n when the
    latency model has the same buckets: never below the first-drop rule on step-function costs.
    The latency model must be built with these width buckets (it does the padding).
    """

    width_buckets: tuple[int, ...]

    def __post_init__(self) -> None:
        buckets = self.width_buckets
        if not buckets or any(b < 2 for b in buckets) or list(buckets) != sorted(set(buckets)):
            raise ValueError(f"width buckets must be sorted, unique and >= 2, got {buckets!r}")

    @property
    def topk_cap(self) -> int | None:
        return None

    @property
    def may_decline(self) -> bool:
        return True

    def choose(self, log_scores: torch.Tensor, ctx_len: int, latency: LatencyModel, costs: StepCosts) -> int:
        available = int(log_scores.shape[0])
        if available == 0:
            return 0
        nodes = torch.unique(
            torch.clamp(torch.tensor(self.width_buckets, dtype=torch.int64) - 1, max=available)
        )
        accept = expected_accept_curve(log_scores).cpu()[nodes]
        verify = latency.predict_many(nodes + 1, ctx_len)  # the latency model pads to the bucket itself
        speedup = accept * costs.l_ar / costs.cycle_seconds(verify, nodes + 1)
        return int(nodes[int(torch.argmax(speedup))])  # argmax returns the first (smallest) maximiser


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

    @property
    def speculates(self) -> bool:
        """Whether any request verifies a draft node."""
        return self.width > 1


def plain_plan(batch: int, l_ar: float, speculative_speedup: float = 1.0) -> BatchPlan:
    """Plain decoding for a batch of `batch` requests: no draft node, one token each, speedup exactly 1.
    l_ar: the plain decode step's seconds (the pass it runs)."""
    return BatchPlan(
        node_counts=(0,) * batch,
        width=1,
        expected_accept=(1.0,) * batch,
        expected_drafted=(0.0,) * batch,
        estimated_verify_seconds=l_ar,
        estimated_speedup=1.0,
        speculative_speedup=speculative_speedup,
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
    that `may_decline` returns `plain_plan` when its best speculative plan's estimated speedup is <= 1.
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
    trees: [B, N] best-first trees; ctx_lens: cached tokens per request. Syncs scores to the host.
    """
    batch = trees.batch_size
    if len(ctx_lens) != batch:
        raise ValueError(f"ctx_lens has {len(ctx_lens)} entries for a batch of {batch}")
    raw_gains = torch.exp(trees.log_scores.to(torch.float64)).cpu()  # host copy: planning is host-side
    if accept_scale is None:
        scale = torch.ones(batch, 1, dtype=torch.float64)
    elif len(accept_scale) != batch or any(not c > 0 for c in accept_scale):
        raise ValueError(f"accept_scale needs {batch} positive factors, got {list(accept_scale)!r}")
    else:
        scale = torch.tensor(list(accept_scale), dtype=torch.float64)[:, None]
    gains = raw_gains * scale
    # drafted[i][n] = Σ_{j<=n} ρ_ij before the correction, n = 0..N; accept[i][n] = Â_i(n)
    drafted = torch.cat([torch.zeros(batch, 1, dtype=torch.float64), raw_gains.cumsum(1)], dim=1)
    accept = (1.0 + drafted * scale).tolist()
    drafted_rows = drafted.tolist()
    contexts = list(ctx_lens)

    def objective(counts: list[int]) -> tuple[float, float]:
        verify = latency.predict_batch([n + 1 for n in counts], contexts)
        committed = sum(accept[i][n] for i, n in enumerate(counts))
        tokens = sum(n + 1 for n in counts)
        return committed * costs.l_ar / (batch * costs.cycle_seconds(verify, tokens)), verify

    if not common_width and isinstance(policy, AdaptivePolicy):
        counts = _greedy_ragged(gains, objective)
    else:
        counts = [_common_nodes(trees.num_nodes, policy, objective, batch)] * batch
    speedup, verify = objective(counts)
    chosen_accept = tuple(accept[i][n] for i, n in enumerate(counts))
    chosen_drafted = tuple(drafted_rows[i][n] for i, n in enumerate(counts))
    if allow_plain and policy.may_decline and speedup <= 1.0:
        return plain_plan(batch, costs.l_ar, speculative_speedup=speedup)
    return BatchPlan(tuple(counts), max(counts) + 1, chosen_accept, chosen_drafted, verify, speedup, speedup)


def _common_nodes(available: int, policy: BudgetPolicy, objective: Objective, batch: int) -> int:
    if isinstance(policy, FixedPolicy):
        return min(policy.nodes, available)
    if isinstance(policy, ChainPolicy):
        return available
    if available == 0:
        return 0
    if isinstance(policy, BucketedAdaptivePolicy):
        candidates = sorted({min(w - 1, available) for w in policy.width_buckets})
        scores = [objective([n] * batch)[0] for n in candidates]
        return candidates[max(range(len(candidates)), key=lambda i: (scores[i], -i))]
    if isinstance(policy, AdaptivePolicy):
        best = objective([1] * batch)[0]
        for n in range(2, available + 1):
            value = objective([n] * batch)[0]
            if value < best:
                return n - 1
            best = value
        return available
    raise ValueError(f"plan_batch does not know policy {policy!r}")


def _greedy_ragged(gains: torch.Tensor, objective: Objective) -> list[int]:
    batch, available = gains.shape
    counts = [0] * batch
    if available == 0:
        return counts
    # Row-major stable order: within a row the (non-increasing) gains keep their order.
    order = torch.argsort(gains.reshape(-1), descending=True, stable=True)
    best = objective(counts)[0]
    for flat in order.tolist():
        row = flat // available
        counts[row] += 1
        value = objective(counts)[0]
        if value < best:
            counts[row] -= 1
            break
        best = value
    return counts
