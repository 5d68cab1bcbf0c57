"""Best-first lattice trees for a whole batch by the heap of `lattice_tree._best_first`, compiled with Numba:
the same pops in the same order, so the same nodes, order and float64 scores bit for bit, at about 0.1 µs a
node where the Python heap takes 0.8 µs (docs/planner.md, "A batch").

Numba is a dependency of SGLang (0.5.23 pins numba 0.65.1), so wherever SGLang is installed whole this path
is there. Where Numba cannot be imported (a trimmed bundle: this module then fails to import), or the rank
keys of a lattice would not fit in int64 (K^D >= 2^62, `keys_fit`), `lattice_tree.build_lattice_trees` uses
the numpy threshold search of `lattice_batched` instead, which returns the same trees.

Heap entry (the reference's): (-score, depth, key) with key = Σ_j r_j·K^(d-j), the rank tuple of a node of one
depth as an integer (its last rank is key mod K), so no two entries tie; plus the entry's parent index and
candidate. Entries are written once into parallel arrays; the binary min-heap holds their indices and, beside
them, their -scores, which settle nearly every comparison without reading an entry. A popped node is replaced
by its next sibling (as `heapq.heapreplace`) or removed, then pushes its first child. A row's candidates are
ranked lazily: its rank 0 when a node first pushes its first child, every rank when that child's first sibling
is due (most rows of a tree never need a second). Rows of K = 8 (DFlash's default topk) are ranked by a
sorting network of selects: on random rows every comparison is a coin toss, which a branch mispredicts half
the time. Any binary heap pops distinct keys in the same order, so this one pops exactly what `heapq` pops.
"""

from __future__ import annotations

import math

import numba
import numpy as np

from bastion_sglang.controller.lattice_batched import LatticeNodes

KEY_BITS = 62
"""Rank keys K^D must stay below 2^62 (int64, with room for key + 1 and key·K of a deeper node)."""


JIT = numba.njit(cache=True, nogil=True)
"""Compiled on first use (a few seconds), then loaded from Numba's on-disk cache (__pycache__ beside this
file, or the user's cache where that is read-only)."""


@JIT
def before(neg_a: float, a: int, neg_b: float, b: int, dep: np.ndarray, key: np.ndarray) -> bool:
    """Whether entry a (its -score neg_a) comes before entry b in key order."""
    if neg_a != neg_b:
        return neg_a < neg_b
    if dep[a] != dep[b]:
        return dep[a] < dep[b]
    return key[a] < key[b]


@JIT
def place(
    heap: np.ndarray,
    heap_neg: np.ndarray,
    size: int,
    i: int,
    entry: int,
    entry_neg: float,
    dep: np.ndarray,
    key: np.ndarray,
) -> None:
    """Put `entry` (its -score entry_neg) into the heap (entry indices, `size` of them, and beside them their
    -scores, which decide nearly every comparison) at its free slot i: down while a child comes before it,
    then up while the parent comes after it (only one of the two moves it)."""
    while True:
        child = 2 * i + 1
        if child >= size:
            break
        if child + 1 < size and before(
            heap_neg[child + 1], heap[child + 1], heap_neg[child], heap[child], dep, key
        ):
            child += 1
        if not before(heap_neg[child], heap[child], entry_neg, entry, dep, key):
            break
        heap[i], heap_neg[i] = heap[child], heap_neg[child]
        i = child
    while i > 0:
        up = (i - 1) // 2
        if not before(entry_neg, entry, heap_neg[up], heap[up], dep, key):
            break
        heap[i], heap_neg[i] = heap[up], heap_neg[up]
        i = up
    heap[i], heap_neg[i] = entry, entry_neg


NETWORK_WIDTH = 8
"""DFlash's default topk: rows of this width are ranked by a sorting network, without a branch."""


@JIT
def candidate(values: np.ndarray, ties: np.ndarray, start: int, c: int) -> tuple[float, float, int]:
    """Candidate c of the row at `start` as (value, tie value, index)."""
    return values[start + c], ties[start + c], c


@JIT
def ranks_before(x: tuple[float, float, int], y: tuple[float, float, int]) -> bool:
    """Whether candidate x ranks before candidate y: value, then tie value, descending, then index ascending.
    Bitwise operators, not `and`/`or`: no branch."""
    return (x[0] > y[0]) | ((x[0] == y[0]) & ((x[1] > y[1]) | ((x[1] == y[1]) & (x[2] < y[2]))))


@JIT
def in_rank_order(x: tuple[float, float, int], y: tuple[float, float, int]):
    """Candidates x and y in rank order. A select, not a branch: which comes first is a coin toss on random
    rows."""
    return (y, x) if ranks_before(y, x) else (x, y)


@JIT
def write_rank(ranked: np.ndarray, order: np.ndarray, at: int, x: tuple[float, float, int]) -> None:
    ranked[at], order[at] = x[0], x[2]


@JIT
def rank_row(values, ties, start: int, width: int, ranked, order) -> None:
    """`lattice_batched.rank_rows` of the [K] row at `start` of one flat lattice (ties: the values where none
    were given) into ranked/order: by value then tie value, descending, then index. Rows of NETWORK_WIDTH go
    through a 19-comparator sorting network (a total order, so any sort gives these ranks); others through
    an insertion sort."""
    if width != NETWORK_WIDTH:
        insertion_rank_row(values, ties, start, width, ranked, order)
        return
    x0 = candidate(values, ties, start, 0)
    x1 = candidate(values, ties, start, 1)
    x2 = candidate(values, ties, start, 2)
    x3 = candidate(values, ties, start, 3)
    x4 = candidate(values, ties, start, 4)
    x5 = candidate(values, ties, start, 5)
    x6 = candidate(values, ties, start, 6)
    x7 = candidate(values, ties, start, 7)
    x0, x2 = in_rank_order(x0, x2)
    x1, x3 = in_rank_order(x1, x3)
    x4, x6 = in_rank_order(x4, x6)
    x5, x7 = in_rank_order(x5, x7)
    x0, x4 = in_rank_order(x0, x4)
    x1, x5 = in_rank_order(x1, x5)
    x2, x6 = in_rank_order(x2, x6)
    x3, x7 = in_rank_order(x3, x7)
    x0, x1 = in_rank_order(x0, x1)
    x2, x3 = in_rank_order(x2, x3)
    x4, x5 = in_rank_order(x4, x5)
    x6, x7 = in_rank_order(x6, x7)
    x2, x4 = in_rank_order(x2, x4)
    x3, x5 = in_rank_order(x3, x5)
    x1, x4 = in_rank_order(x1, x4)
    x3, x6 = in_rank_order(x3, x6)
    x1, x2 = in_rank_order(x1, x2)
    x3, x4 = in_rank_order(x3, x4)
    x5, x6 = in_rank_order(x5, x6)
    for r, x in enumerate((x0, x1, x2, x3, x4, x5, x6, x7)):
        write_rank(ranked, order, start + r, x)


@JIT
def insertion_rank_row(values, ties, start: int, width: int, ranked, order) -> None:
    """`rank_row` of any width: an insertion sort by `ranks_before`."""
    for c in range(width):
        own = candidate(values, ties, start, c)
        at = c
        while at > 0:
            above = order[start + at - 1]
            if ranks_before(candidate(values, ties, start, above), own):
                break
            order[start + at] = above
            at -= 1
        order[start + at] = c
    for r in range(width):
        ranked[start + r] = values[start + order[start + r]]


@JIT
def best_of_row(values, ties, start: int, width: int, ranked, order) -> None:
    """Rank 0 of the [K] row at `start` alone (`rank_row`'s first entry): the largest value, then the largest
    tie value, then the lowest index. Rows of NETWORK_WIDTH play a knock-out of selects."""
    if width == NETWORK_WIDTH:
        first = in_rank_order(candidate(values, ties, start, 0), candidate(values, ties, start, 1))[0]
        second = in_rank_order(candidate(values, ties, start, 2), candidate(values, ties, start, 3))[0]
        third = in_rank_order(candidate(values, ties, start, 4), candidate(values, ties, start, 5))[0]
        fourth = in_rank_order(candidate(values, ties, start, 6), candidate(values, ties, start, 7))[0]
        best = in_rank_order(in_rank_order(first, second)[0], in_rank_order(third, fourth)[0])[0]
    else:
        best = candidate(values, ties, start, 0)
        for c in range(1, width):
            best = in_rank_order(best, candidate(values, ties, start, c))[0]
    write_rank(ranked, order, start, best)


@JIT
def batch_heap(values: np.ndarray, ties: np.ndarray, width: int, depth_count: int, nodes: int):
    """The first `nodes` pops of every row's heap (module docstring): values, ties [B, D·K·K] float64 (ties:
    the values themselves where none were given). Returns (scores [B, n] float64, parents, depths, candidates
    [B, n] int64)."""
    batch, flat_size = values.shape
    scores = np.zeros((batch, nodes))
    parents = np.zeros((batch, nodes), dtype=np.int64)
    depths = np.zeros((batch, nodes), dtype=np.int64)
    candidates = np.zeros((batch, nodes), dtype=np.int64)
    entries = 2 * nodes + 1  # the first entry, then at most a sibling and a child per pop
    neg = np.empty(entries)  # -score
    dep = np.empty(entries, dtype=np.int64)
    key = np.empty(entries, dtype=np.int64)
    par = np.empty(entries, dtype=np.int64)
    cand = np.empty(entries, dtype=np.int64)
    rnk = np.empty(entries, dtype=np.int64)  # the entry's rank in its row (key mod K)
    heap = np.empty(nodes + 1, dtype=np.int64)  # entry indices; a pop adds at most one entry net
    heap_neg = np.empty(nodes + 1)  # their -scores
    starts = np.empty(nodes, dtype=np.int64)
    ranked = np.empty(flat_size)
    order = np.empty(flat_size, dtype=np.int64)
    known = np.zeros(flat_size // width, dtype=np.int8)  # per row: 0 no rank, 1 rank 0 alone, 2 every rank
    for b in range(batch):
        row_values, row_ties = values[b], ties[b]
        known[:] = 0
        best_of_row(row_values, row_ties, 0, width, ranked, order)
        known[0] = 1
        neg[0], dep[0], key[0], par[0], cand[0], rnk[0] = -ranked[0], 1, 0, -1, order[0], 0
        heap[0], heap_neg[0], size, made = 0, neg[0], 1, 1
        for index in range(nodes):
            top = heap[0]
            negative, depth, own_key, parent, candidate = neg[top], dep[top], key[top], par[top], cand[top]
            rank = rnk[top] + 1
            if rank < width:  # the next sibling takes the popped node's place
                row = starts[parent] if parent >= 0 else 0
                if known[row // width] < 2:
                    rank_row(row_values, row_ties, row, width, ranked, order)
                    known[row // width] = 2
                at = row + rank
                base = scores[b, parent] if parent >= 0 else 0.0
                neg[made], dep[made], key[made] = -(base + ranked[at]), depth, own_key + 1
                par[made], cand[made], rnk[made] = parent, order[at], rank
                place(heap, heap_neg, size, 0, made, neg[made], dep, key)
                made += 1
            else:
                size -= 1
                if size > 0:
                    place(heap, heap_neg, size, 0, heap[size], heap_neg[size], dep, key)
            score = -negative
            scores[b, index], parents[b, index] = score, parent
            depths[b, index], candidates[b, index] = depth, candidate
            at = (depth * width + candidate) * width  # row [depth, candidate]: the first child's
            starts[index] = at
            if depth < depth_count:
                if known[at // width] == 0:
                    best_of_row(row_values, row_ties, at, width, ranked, order)
                    known[at // width] = 1
                neg[made], dep[made], key[made] = -(score + ranked[at]), depth + 1, own_key * width
                par[made], cand[made], rnk[made] = index, order[at], 0
                size += 1
                place(heap, heap_neg, size, size - 1, made, neg[made], dep, key)
                made += 1
    return scores, parents, depths, candidates


def keys_fit(depth_count: int, width: int) -> bool:
    """Whether the rank keys of a [B, D, K, K] lattice fit the heap's int64 (D·log2 K < KEY_BITS)."""
    return depth_count * math.log2(max(width, 1)) < KEY_BITS


def best_first_by_compiled_heap(values: np.ndarray, ties: np.ndarray | None, nodes: int) -> LatticeNodes:
    """`lattice_batched.best_first_batch`'s result (the first `nodes` nodes of every row in key order) by the
    compiled heap. values: [B, D, K, K] float64 log-probs <= 0, no NaN; ties: None or the same shape; nodes:
    n <= Σ_{d=1..D} K^d. Needs `keys_fit`. Returns LatticeNodes of [B, n] arrays."""
    batch, depth_count, width = values.shape[:3]
    if nodes == 0 or batch == 0:
        empty = np.zeros((batch, 0), dtype=np.int64)
        return LatticeNodes(np.zeros((batch, 0)), empty, empty, empty)
    flat = np.ascontiguousarray(values.reshape(batch, -1))
    # without tie values, the values themselves: equal values then have equal ties, so the index decides
    flat_ties = flat if ties is None else np.ascontiguousarray(ties.reshape(batch, -1))
    scores, parents, depths, candidates = batch_heap(flat, flat_ties, width, depth_count, nodes)
    return LatticeNodes(scores, parents, depths, candidates)
