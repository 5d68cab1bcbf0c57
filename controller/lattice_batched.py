"""Best-first lattice trees for a whole batch at once: a depth-by-depth threshold search in numpy that returns
exactly the trees of the heap in `lattice_tree` (same nodes, same order, the same float64 scores bit for bit).

Terms are `lattice_tree`'s: a node at depth d is a candidate path (c_1, .., c_d), its children are scored by
row [d, c_d], and nodes are ordered by the key (-log ρ, depth, rank tuple). Let N be the node count, T the
first N nodes in key order (what the heap pops) and t their least score.

Search. Given a floor f per row, the search keeps, depth by depth and every row at once in flat arrays (each
depth's nodes of all rows side by side, grouped by row), the nodes scoring at least f:

1. Children only. The nodes scoring at least f are prefix-closed (a child never scores above its parent:
   log-probs are <= 0), so only children of kept depth-(d-1) nodes are scored at depth d, and no depth
   beyond N is reached.
2. Threshold. Once N nodes of depths < d are kept in a row, let τ be the N-th largest of
   their scores. A depth-d node scoring <= τ comes after those N nodes (each scores higher, or the same and
   is shallower), so it is not in T: the floor rises above τ. τ is recomputed after a depth that keeps many
   nodes (POOL_REFRESH).
3. Cap. A depth-d node of T comes after its d - 1 ancestors, so at most N - d depth-d nodes precede it: its
   score is at least the M_d-th largest score of the kept depth-d nodes, M_d = N - d + 1. Where a row keeps
   more than M_d nodes at a depth, only those scoring at least that are kept (ties included), which bounds
   the work where no threshold has formed (many ties, -inf).
If f <= t, the kept nodes contain T (points 2 and 3 drop no node of T). If f > t, fewer than N nodes score at
least f. So a row that keeps at least N nodes holds T, whatever f was.

Passes. The seeds (`seed_scores`) are every node of depths 1 and 2, then, along the greedy chain (the first
largest log-prob of every row), every child of a chain node of depth >= 2 and the first two greedy steps
below each child that leaves the chain: distinct nodes of many depths, scored as the heap scores them. Any
N distinct nodes bound t from below, so the N-th largest seed is a safe floor, at which budgets of up to
SAFE_FIRST_NODES search in one pass. Larger ones first search at the (N / DIVE_SHARE)-th largest seed, above
t as a rule: cheap, and it counts C(f), the nodes scoring at least f, for every f above its floor. The rows
that keep fewer than N nodes search again at a floor extrapolated from that count (log C linear in f) to keep
about GROWTH·N nodes, then, where that too keeps fewer than N, at the safe floor, which always holds T. Each
pass searches only the rows still open.

Order. The kept nodes of each row are sorted by score, descending. Where the first N + 1 of a row hold no two
equal scores, that sort is the key order and its first N entries are T. Every run of equal scores that
begins among them (equal log-probs, -inf, a log-prob of 0 that gives a child its parent's score) is put in
key order by depth, then by rank tuple, each node's ranks found by walking up its parents (`_order_ties`).

Scores are formed as the heap forms them, parent_score + logprob in float64 (depth 1: 0.0 + logprob, except
the rank-0 node, whose score is its logprob: a signed zero stays -0.0), so ties are the same ties.

Ranks. Each transition row is ranked by a stable descending sort (`rank_rows`): by value, then, where `ties`
is given, by the tie value (e.g. the raw transitions behind calibrated ones), then by candidate index.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

ROOT = -1
"""The parent index of a depth-1 node (`tree.ROOT`)."""
DIVE_SHARE = 8
"""Passes: above SAFE_FIRST_NODES, the first pass searches at the (N / DIVE_SHARE)-th largest seed."""
SAFE_FIRST_NODES = 64
"""Passes: up to this many nodes, the one pass searches at the safe floor (fewer numpy calls than two)."""
GROWTH = (2.5,)
"""Passes: the node counts, as multiples of N, that the passes after the first aim at."""
POOL_REFRESH = 8
"""Search, point 2: τ is recomputed after a depth keeping N / POOL_REFRESH nodes per row on average."""


@dataclass(frozen=True)
class LatticeNodes:
    """Best-first lattice nodes of a batch, n per row (root excluded), as host arrays.

    scores: [B, n] float64 log ρ, non-increasing along each row; parents: [B, n] int64 index of the parent
    within the row, or ROOT; depths: [B, n] int64, 1..D; candidates: [B, n] int64 candidate index of each
    node in its slot (its token is token_ids[b, depth - 1, candidate]).
    """

    scores: np.ndarray
    parents: np.ndarray
    depths: np.ndarray
    candidates: np.ndarray


@dataclass(frozen=True)
class _Level:
    """The kept nodes of one depth, all rows side by side, grouped by row (rows ascending).

    scores: [M] float64; rows: [M] int64 batch row; candidates: [M] int64 candidate index in the slot;
    parents: [M] int64 position of the parent in the previous level (ROOT at depth 1).
    """

    scores: np.ndarray
    rows: np.ndarray
    candidates: np.ndarray
    parents: np.ndarray

    def select(self, keep: np.ndarray) -> _Level:
        """The nodes where `keep` ([M] bool) holds, in their order."""
        return _Level(self.scores[keep], self.rows[keep], self.candidates[keep], self.parents[keep])


def rank_rows(values: np.ndarray, ties: np.ndarray | None = None) -> tuple[np.ndarray, np.ndarray]:
    """Each row of `values` ranked by a stable descending sort, ties broken by `ties` (descending) where
    given, then by the lower candidate index.

    values: [..., K] float64 log-probs (no NaN); ties: None or the same shape (no NaN).
    Returns (order, ranked): [..., K] int64, order[..., r] the candidate of rank r, and [..., K] float64,
    ranked[..., r] = values[..., order[..., r]].
    """
    if ties is None:
        order = np.argsort(-values, axis=-1, kind="stable")
    else:
        by_tie = np.argsort(-ties, axis=-1, kind="stable")
        by_value = np.argsort(-np.take_along_axis(values, by_tie, axis=-1), axis=-1, kind="stable")
        order = np.take_along_axis(by_tie, by_value, axis=-1)
    return order, np.take_along_axis(values, order, axis=-1)


def best_first_batch(values: np.ndarray, ties: np.ndarray | None, nodes: int) -> LatticeNodes:
    """The first `nodes` nodes of every row's lattice in key order (module docstring), as the heap of
    `lattice_tree` pops them.

    values: [B, D, K, K] float64 transition log-probs, <= 0, no NaN (row [b, 0, 0] for slot 0); ties: None or
    [B, D, K, K] float64 tie values for the ranks (`rank_rows`); nodes: n <= Σ_{d=1..D} K^d (every row has
    that many nodes).
    Returns LatticeNodes of [B, n] arrays.
    """
    batch = values.shape[0]
    if nodes == 0 or batch == 0:
        empty = np.zeros((batch, 0), dtype=np.int64)
        return LatticeNodes(np.zeros((batch, 0), dtype=np.float64), empty, empty, empty)
    seeds = seed_scores(values)
    safe = _finite_or(_nth_largest(seeds, nodes), -np.inf)
    floor = safe
    if nodes > SAFE_FIRST_NODES:
        floor = np.maximum(safe, _finite_or(_nth_largest(seeds, max(1, nodes // DIVE_SHARE)), -np.inf))
    out = LatticeNodes(
        scores=np.zeros((batch, nodes)),
        parents=np.zeros((batch, nodes), dtype=np.int64),
        depths=np.zeros((batch, nodes), dtype=np.int64),
        candidates=np.zeros((batch, nodes), dtype=np.int64),
    )
    open_rows = np.arange(batch)
    for attempt in range(len(GROWTH) + 2):
        part = values[open_rows]
        part_ties = None if ties is None else ties[open_rows]
        levels = _search(part, part_ties, floor, nodes)
        counts = np.bincount(np.concatenate([level.rows for level in levels]), minlength=open_rows.shape[0])
        held = counts >= nodes  # these rows hold T (module docstring, "Search")
        if held.any():
            found = _merge(levels, part, part_ties, held, nodes)
            for name in ("scores", "parents", "depths", "candidates"):
                getattr(out, name)[open_rows[held]] = getattr(found, name)
        if held.all():
            return out
        if attempt < len(GROWTH):
            floor = np.maximum(safe[open_rows], _extrapolate(levels, nodes, floor, GROWTH[attempt]))[~held]
        else:
            floor = safe[open_rows][~held]
        open_rows = open_rows[~held]
    raise AssertionError("unreachable: the search at the safe floor holds T in every row")


def _finite_or(values: np.ndarray, fallback: float) -> np.ndarray:
    """`values` with NaN replaced by `fallback`."""
    return np.where(np.isnan(values), fallback, values)


def _extrapolate(levels: list[_Level], nodes: int, floor: np.ndarray, growth: float) -> np.ndarray:
    """[B] a floor at which each row would keep about growth·N nodes, extrapolated from the nodes it kept at
    `floor` ([B]; every node scoring at least it, so C(f) is known for every f >= floor) on a count that
    grows exponentially as the floor falls: log C(f) linear in f through (floor, C(floor)) and (f_half,
    C(floor) / 2). -inf where a row kept fewer than 2 nodes."""
    batch = floor.shape[0]
    scores = np.concatenate([level.scores for level in levels])
    rows = np.concatenate([level.rows for level in levels])
    order = np.argsort(rows.astype(np.int16), kind="stable")
    dense = _dense(scores[order], rows[order], batch)  # [B, M], NaN padding
    counts = np.count_nonzero(~np.isnan(dense), axis=1)
    half = np.maximum(counts // 2, 1)
    ranked = -np.sort(-np.where(np.isnan(dense), -np.inf, dense), axis=1)
    f_half = ranked[np.arange(batch), half - 1]
    usable = (counts >= 2) & np.isfinite(floor) & np.isfinite(f_half)
    span = np.maximum(np.subtract(f_half, floor, out=np.zeros(batch), where=usable), 1e-3)  # nats per halving
    steps = np.log2(np.maximum(growth * nodes / np.maximum(counts, 1), 1.0))
    return np.where(usable, floor - steps * span, -np.inf)


def _search(values: np.ndarray, ties: np.ndarray | None, floor: np.ndarray, nodes: int) -> list[_Level]:
    """The kept nodes of every depth (module docstring, "Search"): the nodes scoring at least `floor` ([B])
    less those that points 2 and 3 prune."""
    batch, depth_count = values.shape[:2]
    flat = values.reshape(-1)
    levels = [_first_level(values, ties, floor)]
    pool, pooled = np.zeros((batch, 0)), 0  # the N largest scores of levels[:pooled], per row
    for depth in range(2, min(depth_count, nodes) + 1):
        level = _children(levels[-1], flat, depth, values.shape, floor)
        if level.scores.shape[0] == 0:
            break
        level = _cap(level, batch, nodes - depth + 1)
        levels.append(level)
        if depth < depth_count and level.scores.shape[0] * POOL_REFRESH >= batch * nodes:
            pool, floor = _raise_floor(pool, levels[pooled:], batch, nodes, floor)
            pooled = len(levels)
    return levels


def seed_scores(values: np.ndarray) -> np.ndarray:
    """[B, S] float64: each row's seeds (module docstring, "Passes"), NaN where a slot holds no seed.
    values: [B, D, K, K] as for `best_first_batch`."""
    batch, depth_count = values.shape[:2]
    first = 0.0 + values[:, 0, 0, :]  # [B, K]: depth 1
    families = [first]
    if depth_count >= 2:
        families.append((first[:, :, None] + values[:, 1, :, :]).reshape(batch, -1))  # depth 2
    if depth_count >= 3:
        families += _chain_seeds(values)
    return np.concatenate(families, axis=1)


def _chain_seeds(values: np.ndarray) -> list[np.ndarray]:
    """The seeds below depth 2 (module docstring, "Passes"), [B, *] float64 each, NaN where a slot holds no
    seed: the children of the greedy chain's nodes of depths 2..D-1, and one and two greedy steps below each
    of them that leaves the chain. values: [B, D, K, K], D >= 3."""
    batch, depth_count, width = values.shape[:3]
    best = values.max(axis=-1).reshape(-1)  # [B·D·K]: each row's largest log-prob
    greedy = values.argmax(axis=-1).reshape(-1)  # its first candidate
    base = np.arange(batch) * (depth_count * width)
    candidate = greedy[base]
    score = 0.0 + best[base]
    chain_candidates, chain_scores = [candidate], [score]
    for slot in range(1, depth_count - 1):
        at = base + slot * width + candidate
        score = score + best[at]
        candidate = greedy[at]
        chain_candidates.append(candidate)
        chain_scores.append(score)
    # children of the chain's depth-(e) nodes, e = 2..D-1: slot e's rows after the chain's candidate
    rows = np.arange(batch)[:, None]
    slots = np.arange(2, depth_count)[None, :]
    parents = np.stack(chain_candidates[1:], axis=1)  # [B, D-2]: the chain's candidates at slots 1..D-2
    children = np.stack(chain_scores[1:], axis=1)[:, :, None] + values[rows, slots, parents, :]  # [B, D-2, K]
    seeds = [children.reshape(batch, -1)]
    leaves = np.arange(width)[None, None, :] != greedy[(base[:, None] + slots * width + parents)][:, :, None]
    score, candidate = children[:, :-1], np.broadcast_to(np.arange(width), children[:, :-1].shape)
    for step in (1, 2):
        usable = depth_count - 2 - step  # slots whose child has `step` greedy steps below it
        if usable <= 0:
            break
        at = base[:, None, None] + (np.arange(2 + step, depth_count)[None, :, None]) * width
        at = at + candidate[:, :usable]
        score = score[:, :usable] + best[at]
        candidate = greedy[at]
        seeds.append(np.where(leaves[:, :usable], score, np.nan).reshape(batch, -1))
    return seeds


def _first_level(values: np.ndarray, ties: np.ndarray | None, floor: np.ndarray) -> _Level:
    """The depth-1 nodes scoring at least `floor` ([B]), formed as the heap forms them."""
    batch, width = values.shape[0], values.shape[-1]
    row = values[:, 0, 0, :]  # [B, K]
    scores = 0.0 + row
    first = rank_rows(row, None if ties is None else ties[:, 0, 0, :])[0][:, 0]  # [B]: each row's rank 0
    rows = np.arange(batch)
    scores[rows, first] = row[rows, first]  # the heap's first entry: the log-prob itself, not 0.0 + it
    keep = scores >= floor[:, None]
    every = np.broadcast_to(np.arange(width), (batch, width))
    return _Level(
        scores=scores[keep],
        rows=np.broadcast_to(rows[:, None], (batch, width))[keep],
        candidates=every[keep],
        parents=np.full(int(np.count_nonzero(keep)), ROOT, dtype=np.int64),
    )


def _children(
    parent: _Level, flat: np.ndarray, depth: int, shape: tuple[int, ...], floor: np.ndarray
) -> _Level:
    """The depth-`depth` children of `parent`'s nodes scoring at least their row's `floor` ([B]), each row's
    grouped by parent, then by candidate. flat: the [B·D·K·K] values; shape: (B, D, K, K)."""
    _, depth_count, width, _ = shape
    start = ((parent.rows * depth_count + depth - 1) * width + parent.candidates) * width  # [M]
    scores = parent.scores[:, None] + flat[start[:, None] + np.arange(width)]  # [M, K]
    at, candidate = np.nonzero(scores >= floor[parent.rows][:, None])
    return _Level(scores[at, candidate], parent.rows[at], candidate, at)


def _row_starts(rows: np.ndarray, batch: int) -> tuple[np.ndarray, np.ndarray]:
    """(counts [B], starts [B]) of flat entries grouped by row."""
    counts = np.bincount(rows, minlength=batch)
    return counts, np.cumsum(counts) - counts


def _dense(scores: np.ndarray, rows: np.ndarray, batch: int) -> np.ndarray:
    """Flat scores grouped by row as [B, widest] float64, NaN past a row's count."""
    counts, starts = _row_starts(rows, batch)
    out = np.full((batch, int(counts.max(initial=0))), np.nan)
    out[rows, np.arange(rows.shape[0]) - starts[rows]] = scores
    return out


def _nth_largest(dense: np.ndarray, n: int) -> np.ndarray:
    """[B] the n-th largest of each row of [B, M] scores (NaN padding), NaN where a row holds fewer."""
    if dense.shape[1] < n:
        return np.full(dense.shape[0], np.nan)
    return -np.partition(-dense, n - 1, axis=1)[:, n - 1]


def _cap(level: _Level, batch: int, cap: int) -> _Level:
    """`level` less the nodes of rows keeping more than `cap` that score below the row's cap-th largest
    score (module docstring, "Search", point 3)."""
    if level.scores.shape[0] <= cap:
        return level
    counts, _ = _row_starts(level.rows, batch)
    if int(counts.max()) <= cap:
        return level
    least = _nth_largest(_dense(level.scores, level.rows, batch), cap)
    least = np.where(np.isnan(least), -np.inf, least)  # rows within the cap keep every node
    return level.select(level.scores >= least[level.rows])


def _raise_floor(
    pool: np.ndarray, fresh: list[_Level], batch: int, nodes: int, floor: np.ndarray
) -> tuple[np.ndarray, np.ndarray]:
    """(the N largest scores of each row of `pool` ([B, <= N], NaN padding) and of the `fresh` levels, as
    [B, <= N]; `floor` raised to the float above their least where a row holds N: module docstring,
    "Search", point 2)."""
    merged = np.concatenate([pool, *(_dense(level.scores, level.rows, batch) for level in fresh)], axis=1)
    if merged.shape[1] > nodes:
        merged = -np.partition(-merged, nodes - 1, axis=1)[:, :nodes]
    nth = _nth_largest(merged, nodes)
    held = ~np.isnan(nth)
    above = np.nextafter(np.where(held, nth, -np.inf), np.inf)
    return merged, np.where(held, np.maximum(floor, above), floor)


def _merge(
    levels: list[_Level], values: np.ndarray, ties: np.ndarray | None, held: np.ndarray, nodes: int
) -> LatticeNodes:
    """The first `nodes` kept nodes of each row where `held` ([B] bool: rows keeping at least n nodes) in key
    order (module docstring, "Order"), parents re-indexed into that order: LatticeNodes of [Σ held, n]."""
    batch = held.shape[0]
    sizes = [level.scores.shape[0] for level in levels]
    starts = np.cumsum([0, *sizes])
    kept = _Level(
        scores=np.concatenate([level.scores for level in levels]),
        rows=np.concatenate([level.rows for level in levels]),
        candidates=np.concatenate([level.candidates for level in levels]),
        parents=np.concatenate(
            [levels[0].parents, *(lvl.parents + at for lvl, at in zip(levels[1:], starts, strict=False))]
        ),
    )
    depths = np.repeat(np.arange(1, len(levels) + 1), sizes)
    by_score = np.argsort(-kept.scores)
    by_row = np.argsort(kept.rows[by_score].astype(np.int16), kind="stable")  # a radix sort
    order = by_score[by_row]  # by row, then score descending
    _, row_starts = _row_starts(kept.rows, batch)
    _order_ties(order, kept, depths, row_starts, values, ties, nodes)
    chosen = order[row_starts[held][:, None] + np.arange(nodes)]  # [Σ held, n]
    total = kept.scores.shape[0]
    index = np.full(total + 1, ROOT, dtype=np.int64)
    index[chosen] = np.arange(nodes)
    picked = kept.parents[chosen]
    return LatticeNodes(
        scores=kept.scores[chosen],
        parents=index[np.where(picked == ROOT, total, picked)],
        depths=depths[chosen],
        candidates=kept.candidates[chosen],
    )


def _order_ties(
    order: np.ndarray,
    kept: _Level,
    depths: np.ndarray,
    row_starts: np.ndarray,
    values: np.ndarray,
    ties: np.ndarray | None,
    nodes: int,
) -> None:
    """Put every run of equal scores in `order` (flat indices of `kept`, by row, then score descending)
    that begins among a row's first `nodes` + 1 entries in key order, in place: by depth, then rank tuple
    (module docstring, "Order"). kept: every kept node, parents as flat indices; depths: [M] int64."""
    ordered_scores, ordered_rows = kept.scores[order], kept.rows[order]
    same = (ordered_scores[1:] == ordered_scores[:-1]) & (ordered_rows[1:] == ordered_rows[:-1])
    if not same.any():
        return
    run = np.concatenate(([0], np.cumsum(~same)))  # [M]: run id of each ordered entry
    first = np.concatenate(([True], ~same))
    place = np.arange(order.shape[0]) - row_starts[ordered_rows]
    run_place = np.maximum.accumulate(np.where(first, np.arange(order.shape[0]), 0))
    in_run = np.concatenate((same, [False])) | np.concatenate(([False], same))
    at = np.nonzero(in_run & (place[run_place] <= nodes))[0]  # ordered positions to sort, ascending
    if at.shape[0] == 0:
        return
    members = order[at]
    tuples = _rank_tuples(members, kept, depths, values, ties)
    keys = (*(tuples[:, column] for column in range(tuples.shape[1] - 1, -1, -1)), depths[members], run[at])
    order[at] = members[np.lexsort(keys)]


def _rank_tuples(
    members: np.ndarray, kept: _Level, depths: np.ndarray, values: np.ndarray, ties: np.ndarray | None
) -> np.ndarray:
    """[m, deepest] int64: the rank tuple of each node `members` names (flat indices of `kept`), padded with
    0 past its depth; ranks as `rank_rows` ranks each row."""
    tuples = np.zeros((members.shape[0], int(depths[members].max())), dtype=np.int64)
    who, node = np.arange(members.shape[0]), members
    while node.shape[0]:
        parent = kept.parents[node]
        slot = depths[node] - 1
        above = np.where(parent == ROOT, 0, kept.candidates[np.maximum(parent, 0)])  # row [0, 0] at slot 0
        rows = kept.rows[node]
        tie_rows = None if ties is None else ties[rows, slot, above]
        tuples[who, slot] = _rank_in_row(values[rows, slot, above], tie_rows, kept.candidates[node])
        alive = parent != ROOT
        who, node = who[alive], parent[alive]
    return tuples


def _rank_in_row(row_values: np.ndarray, row_ties: np.ndarray | None, candidates: np.ndarray) -> np.ndarray:
    """[m] the rank (`rank_rows`) of candidate candidates[i] within row_values[i] ([m, K]; ties: [m, K] or
    None): how many candidates come before it."""
    index = np.arange(candidates.shape[0])
    own = row_values[index, candidates][:, None]
    before = row_values > own
    same = row_values == own
    if row_ties is not None:
        own_tie = row_ties[index, candidates][:, None]
        before |= same & (row_ties > own_tie)
        same &= row_ties == own_tie
    lower = np.arange(row_values.shape[1])[None, :] < candidates[:, None]
    return np.count_nonzero(before | (same & lower), axis=1)
