"""Best-first lattice trees for a whole batch by the heap of `lattice_tree._best_first`, compiled with Numba:
the same pops in the same order, so the same nodes, order and float64 scores bit for bit, at about 40 ns a
node where the Python heap takes 0.5 µs.

Numba is a dependency of SGLang (0.5.23 pins numba 0.65.1), so wherever SGLang is installed whole this path
is there. Where Numba cannot be imported (a trimmed bundle: this module then fails to import), or the rank
keys of a lattice would not fit in int64 (K^D >= 2^62, `keys_fit`), `lattice_tree.build_lattice_trees` uses
the numpy threshold search of `lattice_batched` instead, which returns the same trees.

Heap entry (the reference's): (-score, depth, key) with key = Σ_j r_j·K^(d-j), the rank tuple of a node of
one depth as an integer (its last rank is key mod K), so no two entries tie; plus the entry's parent index
and candidate. Entries live in parallel arrays ordered as a binary min-heap; a popped node is replaced by
its next sibling (as `heapq.heapreplace`) or removed, then pushes its first child. Any binary heap pops
distinct keys in the same order, so this one pops exactly what `heapq` pops.
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
def before(neg_a: float, dep_a: int, key_a: int, neg_b: float, dep_b: int, key_b: int) -> bool:
    """Whether entry a comes before entry b in key order."""
    if neg_a != neg_b:
        return neg_a < neg_b
    if dep_a != dep_b:
        return dep_a < dep_b
    return key_a < key_b


@JIT
def place(heap_f, heap_i, size: int, i: int, neg: float, dep: int, key: int, par: int, cand: int) -> None:
    """Put the entry (neg, dep, key, par, cand) into the heap of `size` entries whose slot i is free:
    down while a child comes before it, then up while the parent comes after it (only one moves)."""
    while True:
        child = 2 * i + 1
        if child >= size:
            break
        if child + 1 < size and before(
            heap_f[child + 1], heap_i[child + 1, 0], heap_i[child + 1, 1],
            heap_f[child], heap_i[child, 0], heap_i[child, 1],
        ):  # fmt: skip
            child += 1
        if not before(heap_f[child], heap_i[child, 0], heap_i[child, 1], neg, dep, key):
            break
        heap_f[i] = heap_f[child]
        heap_i[i] = heap_i[child]
        i = child
    while i > 0:
        up = (i - 1) // 2
        if not before(neg, dep, key, heap_f[up], heap_i[up, 0], heap_i[up, 1]):
            break
        heap_f[i] = heap_f[up]
        heap_i[i] = heap_i[up]
        i = up
    heap_f[i] = neg
    heap_i[i, 0], heap_i[i, 1], heap_i[i, 2], heap_i[i, 3] = dep, key, par, cand


@JIT
def rank_row(values, ties, start: int, width: int, ranked, order) -> None:
    """`lattice_batched.rank_rows` of the [K] row at `start` of one flat lattice (ties: zeros where none
    were given) into ranked/order: an insertion sort, stable, by value then tie value, descending."""
    for c in range(width):
        value, tie = values[start + c], ties[start + c]
        at = c
        while at > 0:
            above = order[start + at - 1]
            if values[start + above] > value or (
                values[start + above] == value and ties[start + above] >= tie
            ):
                break
            order[start + at] = above
            at -= 1
        order[start + at] = c
    for r in range(width):
        ranked[start + r] = values[start + order[start + r]]


@JIT
def batch_heap(values: np.ndarray, ties: np.ndarray, width: int, depth_count: int, nodes: int):
    batch, flat_size = values.shape
    scores = np.zeros((batch, nodes))
    parents = np.zeros((batch, nodes), dtype=np.int64)
    depths = np.zeros((batch, nodes), dtype=np.int64)
    candidates = np.zeros((batch, nodes), dtype=np.int64)
    heap_f = np.empty(nodes + 1)  # -score; a pop adds at most one entry net
    heap_i = np.empty((nodes + 1, 4), dtype=np.int64)  # depth, key, parent, candidate
    starts = np.empty(nodes, dtype=np.int64)
    ranked = np.empty(flat_size)
    order = np.empty(flat_size, dtype=np.int64)
    is_ranked = np.zeros(flat_size // width, dtype=np.bool_)
    for b in range(batch):
        row_values, row_ties = values[b], ties[b]
        is_ranked[:] = False
        rank_row(row_values, row_ties, 0, width, ranked, order)
        is_ranked[0] = True
        heap_f[0] = -ranked[0]
        heap_i[0, 0], heap_i[0, 1], heap_i[0, 2], heap_i[0, 3] = 1, 0, -1, order[0]
        size = 1
        for index in range(nodes):
            negative = heap_f[0]
            depth, own_key, parent, candidate = heap_i[0, 0], heap_i[0, 1], heap_i[0, 2], heap_i[0, 3]
            rank = own_key % width + 1
            if rank < width:  # the next sibling takes the popped node's place
                at = (starts[parent] if parent >= 0 else 0) + rank
                base = scores[b, parent] if parent >= 0 else 0.0
                place(heap_f, heap_i, size, 0, -(base + ranked[at]), depth, own_key + 1, parent, order[at])
            else:
                size -= 1
                last_f = heap_f[size]
                last_dep, last_key = heap_i[size, 0], heap_i[size, 1]
                last_par, last_cand = heap_i[size, 2], heap_i[size, 3]
                if size > 0:
                    place(heap_f, heap_i, size, 0, last_f, last_dep, last_key, last_par, last_cand)
            score = -negative
            scores[b, index], parents[b, index] = score, parent
            depths[b, index], candidates[b, index] = depth, candidate
            at = (depth * width + candidate) * width  # row [depth, candidate]: the first child's
            starts[index] = at
            if depth < depth_count:
                if not is_ranked[at // width]:
                    rank_row(row_values, row_ties, at, width, ranked, order)
                    is_ranked[at // width] = True
                size += 1
                place(
                    heap_f,
                    heap_i,
                    size,
                    size - 1,
                    -(score + ranked[at]),
                    depth + 1,
                    own_key * width,
                    index,
                    order[at],
                )
    return scores, parents, depths, candidates


def keys_fit(depth_count: int, width: int) -> bool:
    """Whether the rank keys of a [B, D, K, K] lattice fit the heap's int64 (D·log2 K < KEY_BITS)."""
    return depth_count * math.log2(max(width, 1)) < KEY_BITS


def best_first_by_compiled_heap(values: np.ndarray, ties: np.ndarray | None, nodes: int) -> LatticeNodes:
    """`lattice_batched.best_first_batch`'s result (the first `nodes` nodes of every row in key order) by the
    compiled heap. values: [B, D, K, K] float64 log-probs <= 0, no NaN; ties: None or the same shape; nodes:
    n <= Σ_{d=1..D} K^d. Needs `keys_fit`. Returns LatticeNodes of [B, n] arrays."""
    batch, depth_count, width = values.shape[:3]
    flat = np.ascontiguousarray(values.reshape(batch, -1))
    flat_ties = np.zeros_like(flat) if ties is None else np.ascontiguousarray(ties.reshape(batch, -1))
    scores, parents, depths, candidates = batch_heap(flat, flat_ties, width, depth_count, nodes)
    return LatticeNodes(scores, parents, depths, candidates)
