"""Fused adaptive planning: grow the best-first tree only until Ŝ first drops (BASTION Algorithm 1).

`AdaptivePolicy.choose` builds a tree of N_max = min(budget, Σ K^d) nodes, then takes n* = the first drop of
Ŝ(n) = Â(n)·L_AR / Ĉ(n) over n = 1..N_max. `plan_adaptive` returns the same n* and the same first n* nodes
while building only a prefix of the tree: chunks of m = 64, 256, 1024, ... nodes (the exact builder of
`fast_tree`), each checked for the drop with a handful of vector operations, stopping at the first chunk that
contains it.

Why n* is the same. (a) The first m nodes of the heap's order do not depend on the budget once it is >= m,
so each chunk's scores are the full tree's first m scores, bit for bit. (b) Â comes from
`expected_accept_curve` on the prefix: exp is elementwise and cumsum a left-to-right running sum, so each
Â(n) equals the full curve's. (c) Ĉ comes from `latency.predict_many` and `costs.cycle_seconds` on the
widths n + 1, elementwise, as in `speedup_curve`. A call costs about the same for a few widths or a few
thousand, so they are asked for in chunks of at least COST_CHUNK (one call up to N_max = 4096); the first
request also holds N_max + 1, so a width beyond the latency model's buckets raises where `choose` raises.
(d) Ŝ(n) is formed as `speedup_curve` forms it, so it is the full curve's value, and `first_drop` over the
prefix finds the full curve's first drop whenever that lies before the prefix's last node; otherwise the
next chunk is built. At m = N_max the prefix is the whole tree.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np
import torch

from bastion_sglang.controller.batched import lattice_size
from bastion_sglang.controller.fast_tree import (
    HostNodes,
    best_first_nodes,
    host_logprobs,
    host_token_ids,
)
from bastion_sglang.controller.policies import expected_accept_curve, first_drop
from bastion_sglang.controller.tree import DraftTree, validate_budget, validate_draft

if TYPE_CHECKING:
    from bastion_sglang.controller.latency import LatencyModel
    from bastion_sglang.controller.profile import StepCosts

FIRST_CHUNK = 64
"""Nodes in the first chunk: up to about this size a build costs the same (fixed overhead per depth)."""
CHUNK_GROWTH = 4
"""Each further chunk holds this many times the nodes of the previous one (total work <= 4/3 of the last)."""
COST_CHUNK = 4096
"""Least number of widths per `predict_many` call: a call costs about the same up to a few thousand widths."""


class _CycleCurve:
    """Ĉ(n) = `costs.cycle_seconds` of a verify pass of n + 1 tokens, n = 1..N_max, asked for in chunks.

    seconds: [covered] float64 host tensor, Ĉ(1..covered).
    """

    def __init__(self, n_max: int, ctx_len: int, latency: LatencyModel, costs: StepCosts) -> None:
        self._n_max, self._ctx_len, self._latency, self._costs = n_max, ctx_len, latency, costs
        self.seconds = torch.empty(0, dtype=torch.float64)

    def cover(self, n: int) -> torch.Tensor:
        """Ĉ(1..n) as a [n] float64 host tensor, extending the chunks already asked for."""
        covered = self.seconds.shape[0]
        if n > covered:
            upto = min(self._n_max, max(n, COST_CHUNK, CHUNK_GROWTH * covered))
            tokens = torch.arange(covered + 2, upto + 2, dtype=torch.int64)
            # The first request also holds the full curve's widest pass: a width past the buckets raises here.
            if covered == 0:
                tokens = torch.cat([tokens, tokens.new_full((1,), self._n_max + 1)])
            verify = self._latency.predict_many(tokens, self._ctx_len)
            cycle = self._costs.cycle_seconds(verify, tokens).cpu()[: upto - covered]
            self.seconds = torch.cat([self.seconds, cycle])
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
    that whole tree, without building the nodes past the chunk that contains n* (module docstring).

    logprobs: [D, K] log q_d of the top-K tokens per depth, rows sorted descending, <= 0.
    token_ids: [D, K] the matching token ids.
    budget: N_max, the most nodes the tree may hold (root excluded); 0 plans no node.
    ctx_len: cached tokens of the request; latency, costs: as for `AdaptivePolicy.choose`.
    Returns a DraftTree of n* nodes on the device of `logprobs`; n* = 0 when budget = 0. Raises the
    ValueErrors of `build_tree` on bad input, and those of `latency.predict_many` as `choose` would.
    """
    validate_draft(logprobs, token_ids, batched=False)
    validate_budget(budget)
    lattice = host_logprobs(logprobs)
    n_max = lattice_size(*lattice.shape, budget)
    if n_max == 0:
        nodes = best_first_nodes(lattice, 0)
    else:
        nodes = _grow_until_drop(lattice, _CycleCurve(n_max, ctx_len, latency, costs), n_max, costs.l_ar)
    return nodes.to_tree(host_token_ids(token_ids), logprobs.device)


def _grow_until_drop(lattice: np.ndarray, cycle: _CycleCurve, n_max: int, l_ar: float) -> HostNodes:
    """The first n* best-first nodes: chunks of FIRST_CHUNK · CHUNK_GROWTH^k nodes until one holds Ŝ's first
    drop or all N_max nodes. lattice: [D, K] float64 host log-probs; n_max >= 1; l_ar: seconds."""
    size = min(n_max, FIRST_CHUNK)
    while True:
        nodes = best_first_nodes(lattice, size)
        stop = _first_drop_within(nodes, cycle.cover(size), l_ar)
        if stop is not None:
            return nodes.head(stop)
        if size == n_max:
            return nodes
        size = min(n_max, CHUNK_GROWTH * size)


def _first_drop_within(nodes: HostNodes, cycle: torch.Tensor, l_ar: float) -> int | None:
    """n* if Ŝ first drops before the prefix's last node, else None. nodes: the first m best-first nodes;
    cycle: [m] float64 Ĉ(1..m), seconds; l_ar: plain decode step, seconds. Ŝ is formed as `speedup_curve`
    forms it: Â · L_AR / Ĉ."""
    accept = expected_accept_curve(torch.from_numpy(nodes.scores))[1:]
    speedup = accept * l_ar / cycle
    drop = first_drop(speedup)
    return drop + 1 if drop < len(nodes) - 1 else None
