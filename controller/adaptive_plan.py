"""Fused adaptive planning: grow the best-first tree only until Ŝ first drops (BASTION Algorithm 1).

`AdaptivePolicy.choose` builds a tree of N_max = min(budget, Σ K^d) nodes, then takes n* = the first drop of
Ŝ(n) = Â(n)·L_AR / Ĉ(n) over n = 1..N_max. `plan_adaptive` returns the same n* and the same first n* nodes
while building only what it needs:

1. Heap phase. The lazy heap of `tree.build_tree` pops nodes one at a time, up to HEAP_NODES of them, and
   tracks Ŝ as they come (a running sum of exp(log ρ), scalar arithmetic). That running Ŝ only says when to
   look: where it drops, Ŝ is computed exactly on the popped prefix, as the policy computes it, and its first
   drop is taken if it lies before the prefix's last node; otherwise popping goes on.
2. Chunk phase (n* >= HEAP_NODES). Prefixes of CHUNK_GROWTH · HEAP_NODES, then CHUNK_GROWTH times more
   nodes, ... from the exact builder of `fast_tree`, each checked exactly, until one holds the first drop
   or all N_max nodes.

A latency model with width buckets makes Ĉ a step function, so Ŝ is not unimodal: the policy then takes the
maximum of Ŝ over every n (`batch_objective.adaptive_stop`), and `plan_adaptive` builds all N_max nodes with
the exact builder to find it (no early stop).

Why n* is the same. (a) The first m nodes of the heap's order do not depend on the budget once it is >= m,
and the heap and the exact builder give the same nodes in the same order with the same float64 scores; so a
prefix of m nodes holds the full tree's first m scores, bit for bit. (b) The exact check forms Â as
`batch_objective.accept_curves` does (elementwise exp, a left-to-right running sum) and Ĉ with
`LatencyModel.predict_widths` (the values of `predict_passes`) and `StepCosts.cycle_seconds` (elementwise over
widths), so each Ŝ(n) is the
value `BatchObjective.common` gives the policy at B = 1. (c) `first_drop` over a prefix finds the full curve's
first drop whenever that lies before the prefix's last node. The scalar running Ŝ (libm exp) may differ from
the exact one in the last bit; it only decides when the exact check runs, never the answer.
Ĉ is asked for in chunks of at least COST_CHUNK widths; the first request also checks the full curve's
widest pass (N_max + 1 tokens) and the context, so bad input raises where `choose` raises.
"""

from __future__ import annotations

import heapq
import math
from typing import TYPE_CHECKING

import numpy as np
import torch

from bastion_sglang.controller.batch_objective import adaptive_stop, first_drop
from bastion_sglang.controller.batched import lattice_size
from bastion_sglang.controller.fast_tree import (
    HostNodes,
    best_first_nodes,
    checked_host_values,
    host_token_ids,
)
from bastion_sglang.controller.tree import ROOT, DraftTree, validate_budget
from bastion_sglang.controller.verify_passes import check_context

if TYPE_CHECKING:
    from bastion_sglang.controller.latency import LatencyModel
    from bastion_sglang.controller.profile import StepCosts

HEAP_NODES = 160
"""Most nodes the heap phase pops: below this a pop costs less than a chunk of the exact builder."""
CHUNK_GROWTH = 4
"""Each chunk of the chunk phase holds this many times the nodes of the previous prefix."""
COST_CHUNK = 64
"""Least number of widths per latency prediction (one call costs about the same for up to a few hundred)."""

HeapEntry = tuple[float, int, tuple, int, float]
"""(-score, depth, nested path, parent index or ROOT, parent's score, 0 at the root): one node waiting in
the heap phase's heap."""


class _CycleCurve:
    """Ĉ(n) = `costs.cycle_seconds` of a verify pass of n + 1 tokens over ctx_len cached tokens, n = 1..N_max,
    asked for in chunks. seconds: [covered] float64, Ĉ(1..covered)."""

    def __init__(self, n_max: int, ctx_len: int, latency: LatencyModel, costs: StepCosts) -> None:
        self._context = check_context(ctx_len)
        latency.padded_width(n_max + 1)  # a width past the buckets raises as in `choose`
        self._n_max, self._latency, self._costs = n_max, latency, costs
        self.seconds = np.empty(0, dtype=np.float64)

    def cover(self, n: int) -> np.ndarray:
        """Ĉ(1..n) as a [n] float64 host array, extending the chunks already asked for."""
        covered = self.seconds.shape[0]
        if n > covered:
            upto = min(self._n_max, max(n, COST_CHUNK, CHUNK_GROWTH * covered))
            widths = np.arange(covered + 2, upto + 2, dtype=np.int64)
            verify = self._latency.predict_widths(self._latency.padded_widths(widths), self._context)
            cycle = self._costs.cycle_seconds(verify, widths)
            self.seconds = np.concatenate((self.seconds, cycle)) if covered else cycle
        return self.seconds[:n]


def plan_adaptive(
    logprobs: torch.Tensor,
    token_ids: torch.Tensor,
    budget: int,
    ctx_len: int,
    latency: LatencyModel,
    costs: StepCosts,
) -> DraftTree:
    """The first n* nodes of `build_tree(logprobs, token_ids, budget)`, n* = `AdaptivePolicy().choose` on
    that whole tree, without building the nodes past the one that shows the drop (module docstring).

    logprobs: [D, K] log q_d of the top-K tokens per depth, rows sorted descending, <= 0.
    token_ids: [D, K] the matching token ids.
    budget: N_max, the most nodes the tree may hold (root excluded); 0 plans no node.
    ctx_len: cached tokens of the request; latency, costs: as for `AdaptivePolicy.choose`.
    Returns a DraftTree of n* nodes on the device of `logprobs`; n* = 0 when budget = 0. Raises the
    ValueErrors of `build_tree` on bad input, and those of the latency model as `choose` would.
    """
    values = checked_host_values(logprobs, token_ids)
    validate_budget(budget)
    n_max = lattice_size(*values.shape, budget)
    if n_max == 0:
        nodes = best_first_nodes(values, 0)
    else:
        cycle = _CycleCurve(n_max, ctx_len, latency, costs)
        if latency.width_buckets is not None:
            nodes = _peak_of_all(values.astype(np.float64), cycle, n_max, costs.l_ar)
        else:
            nodes = _heap_until_drop(values, cycle, n_max, costs.l_ar)
            if nodes is None:
                nodes = _chunks_until_drop(values.astype(np.float64), cycle, n_max, costs.l_ar)
    return nodes.to_tree(host_token_ids(token_ids), logprobs.device)


def _heap_until_drop(lattice: np.ndarray, cycle: _CycleCurve, n_max: int, l_ar: float) -> HostNodes | None:
    """The first n* nodes if the heap phase finds the drop (or pops all N_max nodes), else None.

    The pops are `tree.build_tree`'s, in the same order: entries (-score, depth, path, parent, parent's
    score), the sibling and the first child pushed after each pop. A path is the rank tuple nested as
    (parent's path, rank), ((), r) at depth 1: nested tuples of one depth compare as their flat rank tuples
    do, and each is built in O(1); no two paths are equal, so ties never compare the last two fields.
    lattice: [D, K] float32 or float64 host log-probs, read as Python floats (float64, exactly); n_max >= 1;
    l_ar: seconds.
    """
    depth_count, width = lattice.shape
    limit = min(n_max, HEAP_NODES)
    item, firsts = lattice.item, lattice[:, 0].tolist()
    push, replace, pop, exp = heapq.heappush, heapq.heapreplace, heapq.heappop, math.exp
    heap: list[HeapEntry] = [(-firsts[0], 1, ((), 0), ROOT, 0.0)]
    scores: list[float] = []
    parents: list[int] = []
    depths: list[int] = []
    ranks: list[int] = []
    add_score, add_parent, add_depth, add_rank = scores.append, parents.append, depths.append, ranks.append
    seconds = cycle.cover(min(limit, COST_CHUNK)).tolist()
    covered, accepted, previous = len(seconds), 1.0, -math.inf
    for index in range(limit):
        if index == covered:
            seconds = cycle.cover(min(limit, index + COST_CHUNK)).tolist()
            covered = len(seconds)
        key, depth, path, parent, base = heap[0]
        score = -key  # exact: the score the entry was pushed with
        up, last = path
        add_score(score)
        add_parent(parent)
        add_depth(depth)
        add_rank(last)
        accepted += exp(score)
        estimate = accepted * l_ar / seconds[index]
        if estimate < previous or index + 1 == limit:
            prefix = np.array(scores)
            stop = _first_drop_within(prefix, cycle.cover(index + 1), l_ar)
            if stop is not None:
                return HostNodes.of_lists(prefix[:stop], parents[:stop], depths[:stop], ranks[:stop])
        previous = estimate
        # the top leaves the heap by the first push (one sift for pop and push) or, with none, by heappop
        if last + 1 < width:
            sibling = base + item(depth - 1, last + 1)
            replace(heap, (-sibling, depth, (up, last + 1), parent, base))
            if depth < depth_count:
                child = score + firsts[depth]
                push(heap, (-child, depth + 1, (path, 0), index, score))
        elif depth < depth_count:
            child = score + firsts[depth]
            replace(heap, (-child, depth + 1, (path, 0), index, score))
        else:
            pop(heap)
    return HostNodes.of_lists(scores, parents, depths, ranks) if limit == n_max else None


def _chunks_until_drop(lattice: np.ndarray, cycle: _CycleCurve, n_max: int, l_ar: float) -> HostNodes:
    """The first n* best-first nodes: prefixes of CHUNK_GROWTH^k · HEAP_NODES nodes (k >= 1) from the exact
    builder until one holds Ŝ's first drop or all N_max nodes. lattice: [D, K] float64 host log-probs;
    n_max > HEAP_NODES; l_ar: seconds."""
    size = min(n_max, CHUNK_GROWTH * HEAP_NODES)
    while True:
        nodes = best_first_nodes(lattice, size)
        stop = _first_drop_within(nodes.scores, cycle.cover(size), l_ar)
        if stop is not None:
            return nodes.head(stop)
        if size == n_max:
            return nodes
        size = min(n_max, CHUNK_GROWTH * size)


def _peak_of_all(lattice: np.ndarray, cycle: _CycleCurve, n_max: int, l_ar: float) -> HostNodes:
    """The first n* best-first nodes where the latency model pads to width buckets: Ŝ is then not unimodal and
    its maximum over every n decides (`batch_objective.adaptive_stop`), so all N_max nodes are built first.
    lattice: [D, K] float64 host log-probs; n_max >= 1; l_ar: seconds."""
    nodes = best_first_nodes(lattice, n_max)
    return nodes.head(adaptive_stop(_speedups(nodes.scores, cycle.cover(n_max), l_ar), stepped=True) + 1)


def _first_drop_within(scores: np.ndarray, cycle: np.ndarray, l_ar: float) -> int | None:
    """n* if Ŝ first drops before the prefix's last node, else None. scores: [m] float64 log ρ of the first m
    best-first nodes; cycle: [m] float64 Ĉ(1..m), seconds; l_ar: plain decode step, seconds."""
    drop = first_drop(_speedups(scores, cycle, l_ar))
    return drop + 1 if drop < scores.shape[0] - 1 else None


def _speedups(scores: np.ndarray, cycle: np.ndarray, l_ar: float) -> np.ndarray:
    """Ŝ(1..m) [m] float64 as `BatchObjective.common` forms it at B = 1: Â · L_AR / Ĉ. scores: [m] float64
    log ρ of the first m best-first nodes; cycle: [m] float64 Ĉ(1..m), seconds; l_ar: plain decode step,
    seconds."""
    accept = 1.0 + np.add.accumulate(np.exp(scores))  # Â(1..m): the values of `accept_curves` (a cumsum)
    return accept * l_ar / cycle
