"""Vectorised best-first trees for a batch: a per-depth top-M beam, exact w.r.t. the heap in `tree.py`.

Why the beam is exact. Order all nodes by the key of `tree.py`: (-log ρ, depth, rank tuple). Let M_d =
min(N - d + 1, K^d) and let B_d be the first M_d depth-d nodes in that order.

1. The global top-N nodes of depth d lie in B_d. A depth-d node x in the top N is preceded by its d - 1
   ancestors (each has a score >= x's and a smaller depth), so at most N - d depth-d nodes precede it.
2. B_d consists of children of B_{d-1}. Let x = (p, r) be a depth-d node with parent p. For every depth-(d-1)
   node p' preceding p, the node (p', r) precedes x: its score s(p') + log q_d(r) is >= x's, and on a tie
   s(p') = s(p), so p' is lexicographically smaller than p, and so is (p', r) than (p, r). These are distinct
   nodes, so x has at least as many depth-d predecessors as p has depth-(d-1) predecessors. If x is in B_d it
   has fewer than M_d <= M_{d-1} (or all K^{d-1} nodes are kept) predecessors, hence p is in B_{d-1}.
3. Pruning. If p sits at position i of B_{d-1} (0-based, in order) then the (i+1)(r+1) - 1 nodes (p', r')
   with p' at a position <= i and r' <= r, other than x, all precede x (same argument as in 2 with both
   coordinates). So x in B_d requires (i+1)(r+1) <= M_d: only O(M_d log K) candidate pairs are scored, not
   M_{d-1}·K.
So B_d is the top M_d of the pruned children of B_{d-1}; the union of B_1..B_D contains the global top N,
and its top N under the same key is exactly what the heap pops, in the same order. Scores are formed as
parent_score + logprob in float64, the same operation as the heap, so ties are the same ties.

Ordering within a depth uses a lexicographic rank: the rank tuple (p, r) compares as (lexrank(p), r), so
`lexrank(p) · K + r` is a unique integer key with the same order. Every sort is a pair of stable sorts
(secondary key first), which torch provides on CPU and CUDA; nothing leaves the device.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from functools import cached_property, lru_cache

import numpy as np
import torch

from bastion_sglang.controller.acceptance import node_log_scores
from bastion_sglang.controller.fast_tree import best_first_nodes, host_drafts
from bastion_sglang.controller.tree import ROOT, DraftTree, validate_budget, validate_draft


@dataclass(frozen=True)
class DraftTreeBatch:
    """One best-first DraftTree per request, stacked. Every row has the same node count N."""

    tokens: torch.Tensor  # [B, N] int64
    parents: torch.Tensor  # [B, N] int64: parent index within the row, or ROOT (-1)
    depths: torch.Tensor  # [B, N] int64: 1..D
    log_scores: torch.Tensor  # [B, N] float64: non-increasing along each row
    # [B, N] float64: each node's log ρ under the drafter's raw (uncalibrated) draft, for trees built on
    # calibrated values (`acceptance.node_log_scores`; the raw Â metric reads it); None: not scored
    raw_log_scores: torch.Tensor | None = None
    # the same trees on the host when a host builder made them (None: on the host already, or not kept)
    host_copy: DraftTreeBatch | None = field(default=None, repr=False, compare=False)

    def on_host(self) -> DraftTreeBatch:
        """These trees on the host: themselves when they are there, the copy their host builder kept (no
        device read), else their one packed copy (`_read_to_host`), made on the first call and kept."""
        if self.tokens.device.type == "cpu":
            return self
        if self.host_copy is not None:
            return self.host_copy
        return self._read_to_host

    @cached_property
    def _read_to_host(self) -> DraftTreeBatch:
        """These device trees on the host, read by ONE device-to-host copy (`fast_tree.host_drafts`: the
        float64 scores bit-cast beside the [B, N, 3] token, parent and depth fields), split there bit for bit.
        A batch without nodes is made on the host without a read."""
        if self.num_nodes == 0:
            empty = DraftTreeBatch.empty(self.batch_size, "cpu")
            raw = None if self.raw_log_scores is None else empty.log_scores
            return replace(empty, raw_log_scores=raw)
        scores = [self.log_scores] if self.raw_log_scores is None else [self.log_scores, self.raw_log_scores]
        fields = torch.stack([t.to(torch.int64) for t in (self.tokens, self.parents, self.depths)], dim=-1)
        values, ints = host_drafts(scores, fields)  # the one copy: a host sync on a device

        def host(array: np.ndarray) -> torch.Tensor:
            return torch.from_numpy(np.ascontiguousarray(array))

        tokens, parents, depths = (host(ints[..., column]) for column in range(3))
        floats = [host(value) for value in values]
        return DraftTreeBatch(tokens, parents, depths, floats[0], floats[1] if len(floats) > 1 else None)

    @classmethod
    def stack_on(cls, rows: list[DraftTree], device: torch.device) -> DraftTreeBatch:
        """Host-built trees of equal node count, stacked and moved to `device` (the host copy kept)."""
        return cls.stack(rows).to_device(device)

    @classmethod
    def stack(cls, rows: list[DraftTree]) -> DraftTreeBatch:
        """Host-built trees of equal node count, stacked on the host (no row: a batch of none)."""
        if not rows:
            return cls.empty(0, "cpu")
        return cls(
            tokens=torch.stack([r.tokens for r in rows]),
            parents=torch.stack([r.parents for r in rows]),
            depths=torch.stack([r.depths for r in rows]),
            log_scores=torch.stack([r.log_scores for r in rows]),
        )

    def to_device(self, device: torch.device) -> DraftTreeBatch:
        """These host trees on `device`, keeping themselves as the host copy (themselves on the host)."""
        if device.type == "cpu":
            return self
        fields = (self.tokens, self.parents, self.depths, self.log_scores)
        raw = None if self.raw_log_scores is None else self.raw_log_scores.to(device)
        return DraftTreeBatch(*(t.to(device) for t in fields), raw_log_scores=raw, host_copy=self)

    def deepest(self, nodes: int) -> int:
        """The greatest depth among each row's first `nodes` nodes (0 for none), read on the host."""
        if nodes <= 0:
            return 0
        return int(self.on_host().depths[:, :nodes].max())

    @property
    def batch_size(self) -> int:
        return int(self.tokens.shape[0])

    @property
    def num_nodes(self) -> int:
        return int(self.tokens.shape[1])

    @classmethod
    def empty(cls, batch: int, device: torch.device | str) -> DraftTreeBatch:
        """B trees of no node (a step that does not draft)."""
        nodes = torch.empty((batch, 0), dtype=torch.int64, device=device)
        return cls(nodes, nodes, nodes, torch.empty((batch, 0), dtype=torch.float64, device=device))

    def row(self, i: int) -> DraftTree:
        return DraftTree(self.tokens[i], self.parents[i], self.depths[i], self.log_scores[i])


def lattice_size(depth_count: int, width: int, cap: int) -> int:
    """Σ_{d=1..D} K^d, the number of prefixes in the top-K lattice, capped at `cap`."""
    total, level = 0, 1
    for _ in range(depth_count):
        level *= width
        total += level
        if total >= cap:
            return cap
    return total


def beam_widths(depth_count: int, width: int, budget: int) -> list[int]:
    """M_d = min(N - d + 1, K^d) for d = 1.. while positive (N = budget capped at the lattice size)."""
    n = lattice_size(depth_count, width, budget)
    widths: list[int] = []
    level = 1
    for d in range(1, depth_count + 1):
        level = min(level * width, n)
        m = min(n - d + 1, level)
        if m <= 0:
            break
        widths.append(m)
    return widths


@lru_cache(maxsize=256)
def _candidate_pairs(
    prev_width: int, width: int, keep: int, device: torch.device
) -> tuple[torch.Tensor, ...]:
    """Beam positions i and ranks r with (i+1)(r+1) <= keep, i < prev_width, r < width (see module doc, 3)."""
    pos = [i for r in range(width) for i in range(min(prev_width, keep // (r + 1)))]
    rank = [r for r in range(width) for _ in range(min(prev_width, keep // (r + 1)))]
    return (
        torch.tensor(pos, dtype=torch.int64, device=device),
        torch.tensor(rank, dtype=torch.int64, device=device),
    )


def _order(scores: torch.Tensor, secondary: torch.Tensor) -> torch.Tensor:
    """Permutation sorting each row by (score descending, secondary ascending). [B, M] -> [B, M] int64."""
    by_secondary = torch.sort(secondary, dim=1, stable=True).indices
    by_score = torch.sort(scores.gather(1, by_secondary), dim=1, descending=True, stable=True).indices
    return by_secondary.gather(1, by_score)


def _rank_of(keys: torch.Tensor) -> torch.Tensor:
    """Ascending rank (0..M-1) of each entry of each row of distinct integer keys [B, M]."""
    order = torch.argsort(keys, dim=1)
    ranks = torch.empty_like(order)
    ranks.scatter_(1, order, torch.arange(keys.shape[1], device=keys.device).expand_as(order))
    return ranks


def build_trees(logprobs: torch.Tensor, token_ids: torch.Tensor, budget: int) -> DraftTreeBatch:
    """Batched `build_tree`: row b equals `build_tree(logprobs[b], token_ids[b], budget)` exactly.

    logprobs: [B, D, K] log q_d of the top-K tokens per depth, rows sorted descending.
    token_ids: [B, D, K] the matching token ids.
    budget: maximum nodes per request (root excluded); N = min(budget, Σ K^d).
    Runs on the device of `logprobs` with no host synchronisation (all sizes come from shapes).
    """
    validate_draft(logprobs, token_ids, batched=True)
    validate_budget(budget)
    return build_trees_unchecked(logprobs, token_ids, budget)


def build_trees_unchecked(
    logprobs: torch.Tensor, token_ids: torch.Tensor, budget: int, raw: torch.Tensor | None = None
) -> DraftTreeBatch:
    """`build_trees` without input validation, for callers that produced the arrays themselves. raw: [B, D,
    K] other log-probs of the same candidates (the raw ones of a calibrated draft), each node's path score
    under them kept as `raw_log_scores` (None: not scored)."""
    return with_raw_scores(_beam(logprobs, token_ids, budget), raw, token_ids)


def with_raw_scores(
    trees: DraftTreeBatch, raw: torch.Tensor | None, token_ids: torch.Tensor
) -> DraftTreeBatch:
    """`trees` with `raw_log_scores` = `acceptance.node_log_scores` under raw [B, D, K] (on the trees'
    device, with token_ids [B, D, K]); the trees themselves when raw is None."""
    if raw is None:
        return trees
    scores = node_log_scores(trees.tokens, trees.parents, trees.depths, raw, token_ids)
    return replace(trees, raw_log_scores=scores)


def _beam(logprobs: torch.Tensor, token_ids: torch.Tensor, budget: int) -> DraftTreeBatch:
    """The per-depth beam of `build_trees` (module docstring), unchecked, on the device of `logprobs`."""
    batch, depth_count, width = logprobs.shape
    device = logprobs.device
    lp = logprobs.to(torch.float64)
    widths = beam_widths(depth_count, width, budget)
    if not widths:
        return DraftTreeBatch.empty(batch, device)

    # Depth 1: all K tokens are candidates; their lexicographic key is the rank itself.
    ranks1 = torch.arange(width, device=device).expand(batch, width)
    order = _order(lp[:, 0], ranks1)[:, : widths[0]]
    beam_scores = lp[:, 0].gather(1, order)
    beam_ranks = order
    beam_lex = _rank_of(order)
    level_scores, level_parents, level_tokens, level_lex = [beam_scores], [None], [], [beam_lex]
    level_tokens.append(token_ids[:, 0].gather(1, beam_ranks))

    for d in range(1, len(widths)):
        keep = widths[d]
        pos, rank = _candidate_pairs(widths[d - 1], width, keep, device)
        scores = beam_scores[:, pos] + lp[:, d, rank]  # parent_score + logprob, as in the heap
        lex_keys = beam_lex[:, pos] * width + rank
        chosen = _order(scores, lex_keys)[:, :keep]
        beam_scores = scores.gather(1, chosen)
        parent_pos = pos[chosen]
        beam_ranks = rank[chosen]
        beam_lex = _rank_of(lex_keys.gather(1, chosen))
        level_scores.append(beam_scores)
        level_parents.append(parent_pos)
        level_tokens.append(token_ids[:, d].gather(1, beam_ranks))
        level_lex.append(beam_lex)

    return _merge_levels(level_scores, level_parents, level_tokens, level_lex, widths, budget)


def _merge_levels(
    level_scores: list[torch.Tensor],
    level_parents: list[torch.Tensor | None],
    level_tokens: list[torch.Tensor],
    level_lex: list[torch.Tensor],
    widths: list[int],
    budget: int,
) -> DraftTreeBatch:
    """Merge the per-depth beams into the global best-first order and re-index parents."""
    device = level_scores[0].device
    batch = level_scores[0].shape[0]
    n = min(budget, sum(widths))
    offsets = [0]
    for m in widths[:-1]:
        offsets.append(offsets[-1] + m)
    stride = max(widths)
    scores = torch.cat(level_scores, dim=1)
    tokens = torch.cat(level_tokens, dim=1)
    secondary = torch.cat([lex + d * stride for d, lex in enumerate(level_lex)], dim=1)
    depths = torch.cat(
        [torch.full((m,), d + 1, dtype=torch.int64, device=device) for d, m in enumerate(widths)]
    ).expand(batch, -1)
    # Parent of each beam entry as an index into the concatenation (ROOT for depth 1).
    parent_flat = torch.cat(
        [
            torch.full((batch, widths[0]), ROOT, dtype=torch.int64, device=device),
            *[p + offsets[d - 1] for d, p in enumerate(level_parents) if p is not None],
        ],
        dim=1,
    )
    order = _order(scores, secondary)[:, :n]
    total = scores.shape[1]
    new_index = torch.full((batch, total + 1), ROOT, dtype=torch.int64, device=device)
    new_index[:, :total].scatter_(1, order, torch.arange(n, device=device).expand(batch, n))
    picked_parents = parent_flat.gather(1, order)
    parents = new_index.gather(1, torch.where(picked_parents == ROOT, total, picked_parents))
    return DraftTreeBatch(
        tokens=tokens.gather(1, order).to(torch.int64),
        parents=parents,
        depths=depths.gather(1, order),
        log_scores=scores.gather(1, order),
    )


def build_trees_host(logprobs: torch.Tensor, token_ids: torch.Tensor, budget: int) -> DraftTreeBatch:
    """The trees of `build_trees`, built row by row on the host by the exact threshold search
    (`fast_tree.best_first_nodes`), then stacked on the device of `logprobs`. Same arguments."""
    validate_draft(logprobs, token_ids, batched=True)
    validate_budget(budget)
    return build_trees_host_unchecked(logprobs, token_ids, budget)


def build_trees_host_unchecked(
    logprobs: torch.Tensor, token_ids: torch.Tensor, budget: int, raw: torch.Tensor | None = None
) -> DraftTreeBatch:
    """`build_trees_host` without input validation, for callers that produced the arrays themselves. The
    draft reaches the host in one copy (`fast_tree.host_drafts`: log-probs and ids packed on their device,
    with raw beside them when given). raw: as for `build_trees_unchecked`, scored on the host copy."""
    values = (logprobs,) if raw is None else (logprobs, raw)
    (lattices, *raw_host), ids = host_drafts(values, token_ids)  # [B, D, K] float64 and int64, one copy
    host = torch.device("cpu")
    rows = [best_first_nodes(lattices[b], budget).to_tree(ids[b], host) for b in range(ids.shape[0])]
    trees = DraftTreeBatch.stack(rows)
    if raw_host:
        trees = with_raw_scores(trees, torch.from_numpy(raw_host[0]), torch.from_numpy(ids))
    return trees.to_device(logprobs.device)


HOST_BUILDER_ROW_COST = 300
"""Host builder cost per row in node-equivalents: a row of `budget` nodes costs about budget + 300 units."""
HOST_BUILDER_LIMIT = 12_000
"""On CUDA the host builder is used while batch · (budget + HOST_BUILDER_ROW_COST) stays within this."""


def builds_on_host(batch: int, budget: int, device: torch.device) -> bool:
    """Whether `build_trees_auto` builds `batch` trees of `budget` nodes on the host (else the beam).

    Off CUDA always. On CUDA the beam costs about 4.5-8 ms whatever the batch (its many small kernels), the
    host builder (draft copied to the host, exact search row by row, trees copied back) a time that grows
    with batch · budget. Measured on one H200's host (`python -m bastion_sglang.controller.bench --device
    cuda`, medians, µs, host / beam): B = 1: 407 / 4937 at budget 64, 796 / 5890 at 1024; B = 8: 1371 /
    4754 at 64, 4750 / 7505 at 1024; B = 32: 4196 / 4712 at 64, 5191 / 4692 at 128, 16910 / 7689 at 1024.
    batch · (budget + 300) <= 12000 separates these cases; the plan stage syncs with the host anyway
    (`plan_batch` reads the scores), so the host builder adds no sync of its own beyond its one copy of the
    draft (log-probs and ids together, `fast_tree.host_draft`).
    """
    if device.type != "cuda":
        return True
    return batch * (budget + HOST_BUILDER_ROW_COST) <= HOST_BUILDER_LIMIT


def build_trees_auto(logprobs: torch.Tensor, token_ids: torch.Tensor, budget: int) -> DraftTreeBatch:
    """The trees of `build_trees`, built the fastest way for the device and size (`builds_on_host`): the
    exact threshold search row by row on the host (`build_trees_host`) or the beam. Both give identical
    results (tested). Same arguments as `build_trees`.
    """
    validate_draft(logprobs, token_ids, batched=True)
    validate_budget(budget)
    return build_trees_auto_unchecked(logprobs, token_ids, budget)


def build_trees_auto_unchecked(
    logprobs: torch.Tensor, token_ids: torch.Tensor, budget: int, raw: torch.Tensor | None = None
) -> DraftTreeBatch:
    """`build_trees_auto` without input validation, for callers that produced the arrays themselves. raw:
    as for `build_trees_unchecked` (scored on the host copy of the draft by the host builder, on the device
    by the beam; the trees' one host copy carries the scores either way)."""
    if builds_on_host(logprobs.shape[0], budget, logprobs.device):
        return build_trees_host_unchecked(logprobs, token_ids, budget, raw)
    return build_trees_unchecked(logprobs, token_ids, budget, raw)
