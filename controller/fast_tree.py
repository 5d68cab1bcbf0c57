"""Exact best-first trees at large budgets on the host: a depth-by-depth threshold search in numpy.

`build_tree_fast` returns exactly what the heap of `tree.build_tree` pops (same nodes, same order, the same
float64 scores bit for bit) while scoring only the lattice nodes that can still make the top N.

Why it is exact. Order all nodes by the key of `tree.py`, (-log ρ, depth, rank tuple); let N be the budget and
T the first min(N, Σ K^d) nodes in that order (what the heap pops). Depth by depth, the search scores a set
of lattice nodes, the candidates, that contains every node of T:

1. Children only. T is prefix-closed, so a depth-d node of T is a child of a depth-(d-1) node of T: only
   children of depth-(d-1) candidates are scored at depth d, and no node deeper than N.
2. Threshold. Once N candidates are scored, let τ be the N-th largest score among the candidates of depths
   < d. A depth-d node scoring <= τ comes after N nodes (each scores higher, or the same and is shallower),
   so it is not in T, nor is any of its descendants (T is prefix-closed). So only parents scoring > τ get
   children (a child never scores above its parent: log-probs are <= 0), and only children scoring > τ are
   needed: when τ = -inf, those with a finite log-prob. τ only rises. Any lower bound of that N-th largest
   score prunes safely (less), so τ is recomputed only after a depth that adds at least N / TAU_REFRESH
   candidates, and the search prunes by the larger of τ and σ (point 6).
3. For a finite τ the children scoring > τ are a prefix of the ranks: a child's score fl(s + lp[r]) is
   monotone in lp[r] and each row is sorted descending. One `searchsorted` of fl(s - τ) into the ascending
   row -lp counts them for every parent at once, over-counting a little but never under-counting:
   fl(s + lp) > τ implies s + lp > τ (rounding is monotone and τ is a float), so -lp < s - τ, so
   -lp <= fl(s - τ) (-lp is a float). The extra children are real nodes with exact scores <= τ, at most K
   per parent scoring > τ (of which there are fewer than N), and they get no children of their own.
4. Rank bound: the counts before N candidates are scored, and a cap on the counts of points 2 and 3 when they
   would score more than THIN_POOL·N children while τ = -inf or fewer than THIN_POOL·N candidates are scored
   (τ may then sit near the least of them and prune little). A node of T at depth d comes after its
   d - 1 ancestors, so at most N - d depth-d nodes precede it. The child x = (p, r) comes after its r elder
   siblings and, for every parent p' "ahead" of p and every r' <= r, after (p', r'): (a) p' is ahead if
   s(p') >= s(p) + δ, δ = 4 ulps of the largest finite |s| + |lp| of the depth: then fl(s(p') + lp[r']) >
   fl(s(p) + lp[r]) for finite lp, whatever the rounding (δ is the float maximum, so that only (b) counts,
   when the sums could come near overflow); (b) or if s(p') = s(p) and p' is lexicographically first: the sums
   tie or p' wins, and a tie goes to the lexicographically smaller. (A parent ahead by less than δ does not
   count: rounding can make its child's sum equal x's, and the tie may go to x.) With A parents ahead,
   (A+1)(r+1) - 1 depth-d nodes precede x: x is in T only if (A+1)(r+1) <= N - d + 1 (`batched.py`, point 3,
   kept safe under rounding). A child scoring -inf (an lp of -inf, or a parent at -inf) ties with every -inf
   node and is ordered by (depth, rank tuple) alone: with p at position j of the lexicographic order, the
   (p', r') with p' among the first j + 1 parents and r' <= r precede it, so it needs (j+1)(r+1) <= N - d + 1.
   Each child comes after its elder sibling, so once one fails the rest fail: the kept children are a prefix
   of the ranks. Positions among the candidates understate positions among all nodes, so the bounds stay safe.
5. One sort. Candidates are stored depth by depth and, within a depth, in lexicographic rank-tuple order
   (parents in that order, then ranks ascending), so the storage index increases with (depth, rank tuple):
   a stable sort on -score of the candidates scoring >= the final threshold (every node of T, plus a few)
   is the heap's order, and its first N entries are T.
6. Seeds. Any N distinct lattice nodes bound the score of T's last node from below, so nodes scoring below
   the least of them cannot be in T. The seeds are the chain (rank 0 at every depth) with one deviation:
   rank r < SEED_RANKS at depth d, then rank 0 down to any depth e >= d. Their scores are estimated in a few
   array operations, a = (c_{d-1} + lp_d[r]) + (lp_{d+1}[0] + ... + lp_e[0]) with c the chain's running sums
   (exactly the heap's chain scores), rather than formed left to right: every term is <= 0, so each sum is
   off its exact value by at most (D + 1)·u·|sum| (u = 2^-53), and the two by less than 8·(D + 1)
   ulps of |a_N|, a_N the N-th largest estimate, for the N seeds estimated >= a_N. So σ, the float below
   a_N - 8·(D + 1)·ulp(|a_N|), lies strictly below every score of T: the search keeps only nodes scoring > σ.
   No seeding (σ = -inf) below SEED_MIN_BUDGET, when fewer than N seeds are finite, or when |a_N| >
   SAFE_MAGNITUDE (no sum near overflow).

Scores are formed as the heap forms them, parent_score + logprob in float64 (depth 1: 0.0 + logprob, except
the rank-0 node, whose score is its logprob), so ties are the same ties.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np
import torch

from bastion_sglang.controller.tree import (
    ROOT,
    DraftTree,
    validate_budget,
    validate_draft,
    validate_layout,
)

SEED_RANKS = 32
"""Point 6: deviation ranks per depth of the seed nodes."""
SEED_MIN_BUDGET = 512
"""Point 6: smaller budgets search without seeds (at a few hundred nodes τ soon prunes as well)."""
TAU_REFRESH = 8
"""Point 2: τ is recomputed after a depth that adds at least N / TAU_REFRESH candidates."""
THIN_POOL = 2
"""Point 4: the rank bound also caps a depth's counts when they exceed THIN_POOL·N children while fewer than
THIN_POOL·N candidates are scored (or τ = -inf)."""
SAFE_MAGNITUDE = 1e300
"""Largest |score| + |logprob| for which point 4 trusts a gap of δ (no sum near overflow)."""


@dataclass(frozen=True)
class HostNodes:
    """Best-first nodes as host arrays, all of length n (root excluded).

    scores: [n] float64 log ρ, non-increasing; parents: [n] int64 index of the parent in this order, or ROOT;
    depths: [n] int64, 1..D; ranks: [n] int64 rank of each node's token in its depth's top-K row.
    """

    scores: np.ndarray
    parents: np.ndarray
    depths: np.ndarray
    ranks: np.ndarray

    def __len__(self) -> int:
        return int(self.scores.shape[0])

    @classmethod
    def of_lists(
        cls, scores: np.ndarray | list[float], parents: list[int], depths: list[int], ranks: list[int]
    ) -> HostNodes:
        """HostNodes of n nodes given as Python lists (the heap's pops, in order; scores may be a [n] float64
        array already)."""
        return cls(
            scores=np.asarray(scores, dtype=np.float64),
            parents=np.array(parents, dtype=np.int64),
            depths=np.array(depths, dtype=np.int64),
            ranks=np.array(ranks, dtype=np.int64),
        )

    def head(self, n: int) -> HostNodes:
        """The first n nodes: a prefix of a best-first order is itself a prefix-closed tree."""
        return HostNodes(self.scores[:n], self.parents[:n], self.depths[:n], self.ranks[:n])

    def to_tree(self, token_ids: np.ndarray, device: torch.device) -> DraftTree:
        """The DraftTree of these nodes on `device`. token_ids: [D, K] integer host array of top-K tokens."""
        tokens = token_ids[self.depths - 1, self.ranks].astype(np.int64, copy=False)
        fields = (tokens, self.parents, self.depths, self.scores)
        on_host = [torch.from_numpy(field) for field in fields]
        return DraftTree(*(on_host if device.type == "cpu" else [field.to(device) for field in on_host]))


@dataclass
class _Candidates:
    """Candidates per depth, each depth in lexicographic rank-tuple order (module docstring, point 5).

    scores[d]: [M_d] float64; parents[d]: [M_d] int64 storage index of the parent (ROOT at depth 1), where
    the storage index is the position in the depth-major concatenation; ranks[d]: [M_d] int64.
    """

    scores: list[np.ndarray] = field(default_factory=list)
    parents: list[np.ndarray] = field(default_factory=list)
    ranks: list[np.ndarray] = field(default_factory=list)
    last_start: int = 0  # storage index of the first candidate of the deepest depth stored
    size: int = 0  # candidates stored

    def add(self, scores: np.ndarray, parents: np.ndarray, ranks: np.ndarray) -> None:
        """Store the next depth. parents: [M] int64 position of each parent among the previous depth's
        candidates (ROOT at depth 1)."""
        if self.scores:
            parents = parents + self.last_start
            self.last_start += self.scores[-1].shape[0]
        self.scores.append(scores)
        self.parents.append(parents)
        self.ranks.append(ranks)
        self.size += scores.shape[0]


def host_draft(values: torch.Tensor, token_ids: torch.Tensor) -> tuple[np.ndarray, np.ndarray]:
    """`values` and `token_ids` on the host, read together by ONE device-to-host copy (one host sync where
    they live on a device, where two copies would be two).

    values: [*L, *R] floating (a top-K's [.., D, K] log-probs, a lattice's [.., D, K, K] transitions);
    token_ids: [*L, k] integer, on the same device, L = token_ids.shape[:-1]. On their device both go into
    one int64 tensor [*L, Π R + k]: the values widened to float64 (exact from any float dtype) and bit-cast,
    beside the ids widened to int64 (exact); that tensor is copied to the host once and split there.
    Returns (float64 values of shape [*L, *R], int64 ids of shape [*L, k]): the inputs' values bit for bit,
    as numpy views of the one copy. ValueError when the leading shapes differ.
    """
    (copy,), ids = host_drafts((values,), token_ids)
    return copy, ids


def host_drafts(
    values: Sequence[torch.Tensor], token_ids: torch.Tensor
) -> tuple[tuple[np.ndarray, ...], np.ndarray]:
    """`host_draft` of several value tensors beside one set of ids, all in the same ONE copy (e.g. the
    calibrated log-probs a tree is built on and the raw ones its metric reads): each values[i] is
    [*L, *R_i] floating, packed side by side (widened to float64, bit-cast) before the ids. Returns (the
    float64 values, one per input, each of its input's shape, bit for bit; the [*L, k] int64 ids).
    ValueError when a leading shape differs from the ids'.
    """
    lead = tuple(token_ids.shape[:-1])
    widths = []
    for value in values:
        if tuple(value.shape[: len(lead)]) != lead:
            raise ValueError(
                f"values of shape {tuple(value.shape)} do not lead with token_ids' {lead} (token_ids "
                f"{tuple(token_ids.shape)})"
            )
        widths.append(math.prod(value.shape[len(lead) :]))
    flats = [
        v.detach().to(torch.float64).reshape(*lead, w).view(torch.int64)
        for v, w in zip(values, widths, strict=True)
    ]
    packed = torch.cat((*flats, token_ids.detach().to(torch.int64)), dim=-1)
    host = packed.cpu().numpy()  # the one copy: a host sync where the draft lives on a device
    starts = np.cumsum([0, *widths]).tolist()
    copies = tuple(
        host[..., start : start + width].view(np.float64).reshape(value.shape)
        for value, start, width in zip(values, starts[:-1], widths, strict=True)
    )
    return copies, host[..., starts[-1] :]


def host_values(logprobs: torch.Tensor) -> np.ndarray:
    """[D, K] log-probs as a float32 or float64 host array holding exactly the draft's values (half-precision
    drafts widened to float32, which is exact)."""
    host = logprobs.detach().cpu()  # host sync where the draft lives on a device
    if host.dtype not in (torch.float32, torch.float64):
        host = host.to(torch.float32)  # bfloat16 has no numpy dtype
    return host.numpy()


def host_logprobs(logprobs: torch.Tensor) -> np.ndarray:
    """[D, K] log-probs as a float64 host array, converted as the heap converts them (widening is exact)."""
    return host_values(logprobs).astype(np.float64)


def checked_host_values(logprobs: torch.Tensor, token_ids: torch.Tensor) -> np.ndarray:
    """`validate_draft` of one [D, K] draft, the values checked on the host copy; returns that copy, [D, K]
    float32 or float64 (`host_values`). Raises the ValueErrors of `validate_draft`."""
    validate_layout(logprobs, token_ids, batched=False)
    values = host_values(logprobs)
    _check_rows(values, logprobs, token_ids)
    return values


def checked_host_pair(logprobs: torch.Tensor, token_ids: torch.Tensor) -> tuple[np.ndarray, np.ndarray]:
    """`validate_draft` of one [D, K] draft, the values checked on the host copy that `host_draft` reads in
    one transfer; returns that copy, ([D, K] float64 values, [D, K] int64 ids). Raises the ValueErrors of
    `validate_draft`."""
    validate_layout(logprobs, token_ids, batched=False)
    values, ids = host_draft(logprobs, token_ids)
    _check_rows(values, logprobs, token_ids)
    return values, ids


def _check_rows(values: np.ndarray, logprobs: torch.Tensor, token_ids: torch.Tensor) -> None:
    """Raise the ValueError of `validate_draft` unless the [D, K] host values (an exact copy of `logprobs`,
    maybe widened) have rows sorted descending from a first entry <= 0 (then every entry is <= 0; NaN fails
    every comparison)."""
    holds = np.count_nonzero(values[:, 0] <= 0.0) + np.count_nonzero(values[:, 1:] <= values[:, :-1])
    if holds != values.size:
        validate_draft(logprobs, token_ids, batched=False)  # raises, naming the problem


def host_token_ids(token_ids: torch.Tensor) -> np.ndarray:
    """[D, K] token ids as an integer host array."""
    return token_ids.detach().cpu().numpy()


def build_tree_fast(logprobs: torch.Tensor, token_ids: torch.Tensor, budget: int) -> DraftTree:
    """`build_tree` by the threshold search of the module docstring: the same tree, bit for bit.

    logprobs: [D, K] log q_d of the top-K tokens per depth, rows sorted descending, <= 0 (-inf allowed).
    token_ids: [D, K] the matching token ids.
    budget: maximum number of nodes (root excluded); fewer are returned if the lattice is smaller.
    Returns a DraftTree on the device of `logprobs` (int64 tokens, parents and depths, float64 log_scores).
    Raises the ValueErrors of `build_tree` on bad input. Runs on the host.
    """
    lattice, ids = checked_host_pair(logprobs, token_ids)  # one host copy of the values and the ids
    validate_budget(budget)
    return best_first_nodes(lattice, budget).to_tree(ids, logprobs.device)


def best_first_nodes(logprobs: np.ndarray, budget: int) -> HostNodes:
    """The first min(budget, Σ K^d) nodes of the heap's order.

    logprobs: [D, K] float64 host array, already validated (rows sorted descending, <= 0, no NaN).
    budget: int >= 0.
    """
    if budget == 0:
        empty = np.empty(0, dtype=np.int64)
        return HostNodes(np.empty(0, dtype=np.float64), empty, empty, empty)
    candidates, threshold = _search(logprobs, budget)
    return _select(candidates, threshold, budget)


def _search(logprobs: np.ndarray, budget: int) -> tuple[_Candidates, float]:
    """Candidates depth by depth (module docstring, points 1-4 and 6) and the final threshold, max(τ, σ).
    budget >= 1."""
    costs = -logprobs  # [D, K], rows ascending: the searchsorted side of point 3
    seed = _seed_threshold(logprobs, budget)
    candidates = _Candidates()
    scores = _first_scores(logprobs[0], budget)
    candidates.add(scores, np.full(scores.shape[0], ROOT, dtype=np.int64), np.arange(scores.shape[0]))
    pool, tau = _raise_threshold(np.empty(0), scores, budget)
    threshold = max(tau, seed)
    for d in range(1, min(logprobs.shape[0], budget)):  # row d holds depth d + 1
        live, counts = _child_counts(
            scores, logprobs[d], costs[d], threshold, candidates.size, budget - d, budget
        )
        parents = live.repeat(counts)  # each live parent's first counts children, in lexicographic order
        if parents.shape[0] == 0:
            break
        ranks = np.arange(parents.shape[0]) - (counts.cumsum() - counts).repeat(counts)
        scores = scores[parents] + logprobs[d][ranks]  # parent_score + logprob, as in the heap
        candidates.add(scores, parents, ranks)
        if pool.shape[0] < budget or TAU_REFRESH * scores.shape[0] >= budget:
            pool, tau = _raise_threshold(pool, scores, budget)
            threshold = max(tau, seed)
    return candidates, threshold


def _seed_threshold(logprobs: np.ndarray, budget: int) -> float:
    """σ of point 6 (-inf: no seeding). logprobs: [D, K] float64, validated; budget: N >= 1."""
    depth_count = logprobs.shape[0]
    if budget < SEED_MIN_BUDGET:
        return -np.inf
    chain = logprobs[:, 0].cumsum()  # c_1..c_D: the heap's scores of the chain nodes
    # [D, R]: c_{d-1} + lp_d[r], the heap's score of each deviation node
    base = np.concatenate(([0.0], chain[:-1]))[:, None] + logprobs[:, :SEED_RANKS]
    base[1:, 0] = -np.inf  # rank 0 past depth 1 is the chain again: each seed once
    # tails[d, j] = lp_{d+1}[0] + ... + lp_{d+j}[0] for j = 0..D-1 (0.0 at j = 0), -inf past depth D
    firsts = np.concatenate((logprobs[:, 0], np.full(depth_count, -np.inf)))
    below = firsts[np.arange(1, depth_count + 1)[:, None] + np.arange(depth_count - 1)]
    tails = np.concatenate((np.zeros((depth_count, 1)), below.cumsum(axis=1)), axis=1)
    estimates = (base[:, :, None] + tails[:, None, :]).reshape(-1)  # every term <= 0: no NaN
    if estimates.shape[0] < budget:
        return -np.inf
    cut = estimates.shape[0] - budget
    least = float(np.partition(estimates, cut)[cut])  # a_N
    if least < -SAFE_MAGNITUDE:  # -inf included
        return -np.inf
    return float(np.nextafter(least - 8 * (depth_count + 1) * np.spacing(abs(least)), -np.inf))


def _child_counts(
    parent_scores: np.ndarray,
    row: np.ndarray,
    cost_row: np.ndarray,
    threshold: float,
    scored: int,
    keep: int,
    budget: int,
) -> tuple[np.ndarray, np.ndarray]:
    """The parents that may have children and how many each (a prefix of the ranks), points 2-4.

    parent_scores: [P] float64 in lexicographic order; row, cost_row: [K] float64 log-probs of the children's
    depth and their negations; threshold: τ; scored: candidates so far; keep: N - d + 1 for children at depth
    d; budget: N. Returns (positions among the P parents, counts), both [P'] int64.
    """
    if scored < budget and threshold == -np.inf:  # no τ yet, no seed
        return np.arange(parent_scores.shape[0]), _rank_counts(parent_scores, row, keep)
    live = np.flatnonzero(parent_scores > threshold)
    if threshold > -np.inf:
        counts = _threshold_counts(parent_scores[live], cost_row, threshold)
    else:
        counts = np.full(live.shape[0], int((row > -np.inf).sum()))  # the finite log-probs
    weak = threshold == -np.inf or scored < THIN_POOL * budget
    if weak and counts.sum() > THIN_POOL * budget:
        counts = np.minimum(counts, _rank_counts(parent_scores, row, keep)[live])
    return live, counts


def _first_scores(row: np.ndarray, budget: int) -> np.ndarray:
    """Depth-1 scores of ranks r < budget (point 4: r elder siblings come first). row: [K] float64 log-probs.
    As the heap forms them: 0.0 + logprob (which maps -0.0 to 0.0), but the rank-0 node's is its logprob."""
    scores = row[: min(row.shape[0], budget)] + 0.0
    scores[0] = row[0]
    return scores


def _threshold_counts(parent_scores: np.ndarray, cost_row: np.ndarray, threshold: float) -> np.ndarray:
    """Per parent, an over-count of the children scoring > τ (point 3). parent_scores: [P] float64, all > τ;
    cost_row: [K] float64 -logprobs of the children's depth, ascending; threshold: τ, finite. [P] int64."""
    return cost_row.searchsorted(parent_scores - threshold, side="right")


def _rank_counts(parent_scores: np.ndarray, row: np.ndarray, keep: int) -> np.ndarray:
    """Per parent, the children allowed by the rank bounds of point 4. parent_scores: [P] float64 in
    lexicographic order; row: [K] float64 log-probs of the children's depth; keep: N - d + 1 for children at
    depth d. Returns [P] int64 counts (a prefix of the ranks each)."""
    parents = parent_scores.shape[0]
    finite = int((row > -np.inf).sum())  # ranks below it have finite log-probs (-inf is the row's tail)
    order = np.argsort(-parent_scores, kind="stable")  # the key order (ties: lexicographic)
    position = np.empty_like(order)
    position[order] = np.arange(parents)
    ascending = parent_scores[order[::-1]]
    gap = _separation(ascending, row, finite)
    higher = parents - ascending.searchsorted(parent_scores, side="right")
    clear = parents - ascending.searchsorted(parent_scores + gap, side="left")
    by_score = keep // (clear + position - higher + 1)  # ahead: by >= δ, or equal and lexicographically first
    if finite == row.shape[0] and ascending[0] > -np.inf:  # no -inf log-prob or parent: (a), (b) suffice
        return np.minimum(by_score, finite)
    by_lex = keep // np.arange(1, parents + 1)
    counts = np.where(by_score < finite, by_score, np.maximum(finite, by_lex))
    return np.minimum(np.where(parent_scores == -np.inf, by_lex, counts), row.shape[0])


def _separation(ascending: np.ndarray, row: np.ndarray, finite: int) -> float:
    """δ of point 4: a score gap that survives the rounding of every parent_score + logprob sum of a depth.
    ascending: [P] float64 parent scores, sorted; row: [K] float64 log-probs, descending; finite: how many of
    them are finite. The float maximum (nothing counts as ahead by a gap) when the sums could overflow."""
    lowest = ascending.searchsorted(-np.inf, side="right")  # position of the least finite parent score
    least_score = ascending[lowest] if lowest < ascending.shape[0] else 0.0
    least_logprob = row[finite - 1] if finite else 0.0
    largest = -least_score - least_logprob
    if largest > SAFE_MAGNITUDE:
        return float(np.finfo(np.float64).max)
    return 4.0 * float(np.spacing(largest))


def _raise_threshold(pool: np.ndarray, scores: np.ndarray, budget: int) -> tuple[np.ndarray, float]:
    """Merge new candidate scores into the pool of the `budget` best so far (point 2). pool: [<= budget]
    float64; scores: [M] float64. Returns the new pool and τ, its least score (-inf while it holds fewer)."""
    merged = np.concatenate((pool, scores))
    cut = merged.shape[0] - budget
    if cut < 0:
        return merged, -np.inf
    best = np.partition(merged, cut)[cut:]
    return best, float(best[0])


def _select(candidates: _Candidates, threshold: float, budget: int) -> HostNodes:
    """The first `budget` candidates in the heap's order (point 5), parents re-indexed to that order."""
    scores = np.concatenate(candidates.scores)
    eligible = np.flatnonzero(scores >= threshold)
    order = eligible[np.argsort(-scores[eligible], kind="stable")[:budget]]
    # output position of each stored candidate; the extra last slot (ROOT) is what parent index -1 reads
    position = np.full(scores.shape[0] + 1, ROOT, dtype=np.int64)
    position[order] = np.arange(order.shape[0])
    sizes = [level.shape[0] for level in candidates.scores]
    return HostNodes(
        scores=scores[order],
        parents=position[np.concatenate(candidates.parents)[order]],
        depths=np.repeat(np.arange(1, len(sizes) + 1), sizes)[order],
        ranks=np.concatenate(candidates.ranks)[order],
    )
