"""Best-first draft trees over a DFlash2 selector lattice: the candidates of a slot depend on the one before.

Terms. A DFlash2 drafter keeps K candidates per slot e = 0..D-1 (`token_ids[e, c]`) and scores every
transition (SGLang's `CandidateSelector.build_lattice`): `lattice_logprobs[e, p, c]` = log q(candidate c of
slot e | candidate p of slot e-1), each [K] row a distribution over slot e's candidates
(`selector_logprobs`). Slot 0 follows the verified root token, so only row [0, 0] is read there (SGLang's
rows [0, p] are one row repeated). A *node* at depth d is a candidate path (c_1, .., c_d), c_j a candidate
of slot j-1; its children are the K candidates of slot d, scored by row [d, c_d]; its path score is
log ρ = lattice_logprobs[0, 0, c_1] + Σ_{j≥2} lattice_logprobs[j-1, c_{j-1}, c_j]. The root (the bonus
token, ρ = 1) is implicit, as in `tree.py`.

Ranks. Each row is sorted once, descending and stable: the *rank* of child c is its position in its parent's
row, so equal log-probs rank by the tie values where given (`ties`, descending: the raw transitions behind
calibrated or mass-weighted ones, so that a tie the calibration's clamp or rounding made goes to the raw
argmax), then by candidate index, lowest first (`lattice_batched.rank_rows`). A node's rank tuple (r_1, ..,
r_d) names it.

Order. Nodes are totally ordered by the key of `tree.py`, (-log ρ, depth, rank tuple): higher score first,
then shallower, then the lexicographically smaller rank tuple. A node's predecessor in the lazy enumeration
(its previous sibling, or its parent for a rank-0 child) precedes it in this order (log-probs are <= 0 and
each row is sorted), so the heap, where a popped node pushes its next sibling and its first child, pops
exactly in key order, and the first n pops are the n best nodes: prefix-closed, with the largest
Σ ρ = Â(n) - 1 of any n-node tree (every child scores <= its parent), listed best-first. Where every row
[e, p] equals row [e, 0] and is sorted (independent positions) the ranks are the candidate indices and the
tree is `build_tree`'s on logprobs = lattice_logprobs[:, 0], bit for bit.

Cost. One stable sort of the D·K rows, O(D·K² log K), then O(n log n) for n nodes (two pushes per pop).

Branching. `build_lattice_trees` may cap the children of every node at its best m (its row's first m ranks,
`cap_children`): the best-first tree of the capped lattice, whose first min(budget, Σ_d m^d) nodes have
finite scores. m = 1 leaves each node its rank-0 child only, which is `lattice_chain`'s walk on the tie
values (the raw transitions) wherever the values keep their order (a calibration's non-decreasing map, a
weight per slot).

Batches. `build_lattice_trees` builds every request's tree at once by the threshold search of
`lattice_batched` (the same trees bit for bit); `build_lattice_trees_by_heap` builds them row by row with the
heap, the reference it is tested against.

Mass outside the candidates. A lattice row is a softmax over the K candidates only, so its path scores sum to
1 over each slot's candidates although the drafter puts some of its mass elsewhere: Â of raw transitions is
too high and rises too steeply with the budget. `weight_by_candidate_mass` adds to every row of slot e the
log of the drafter's mass on slot e's K candidates (logsumexp of the unary log-probs), so a path scores the
drafter's probability of its tokens with every slot's mass outside the candidates counted as a miss.
"""

from __future__ import annotations

import heapq
import importlib
from collections.abc import Callable, Sequence
from dataclasses import replace
from functools import cache
from types import ModuleType

import numpy as np
import torch

from bastion_sglang.controller.batched import DraftTreeBatch, lattice_size
from bastion_sglang.controller.fast_tree import host_draft, host_drafts
from bastion_sglang.controller.lattice_batched import LatticeNodes, best_first_batch, rank_rows
from bastion_sglang.controller.tree import ROOT, DraftTree, validate_budget


def selector_logprobs(scores: torch.Tensor, temperature: float | torch.Tensor = 1.0) -> torch.Tensor:
    """The log of SGLang's DFlash2 walk distribution (`CandidateSelector.sample_path`): log_softmax over a
    slot's candidates of the float32 selector scores divided by the request's temperature.

    scores: [..., D, K, K] raw selector scores, scores[..., e, p, c] (SGLang's `build_lattice`).
    temperature: a float or a tensor of shape [...] (one per request), >= 0. Temperature 0 (greedy) plans on
    the temperature-1 log-probs: SGLang's greedy walk takes the argmax, which is the same at every
    temperature, and its point mass would price every other candidate at zero; the DFlash path plans greedy
    and sampled requests alike on temperature-1 log-probs (`kernels.topk_logprobs`).
    Returns [..., D, K, K] float32 log-probs on the device of `scores`. ValueError on a bad shape or
    temperature.
    """
    if scores.dim() < 3 or scores.shape[-1] != scores.shape[-2]:
        raise ValueError(f"scores must be [..., D, K, K], got shape {tuple(scores.shape)}")
    if not scores.is_floating_point():
        raise ValueError(f"scores must be a floating tensor, got {scores.dtype}")
    if not isinstance(temperature, torch.Tensor):
        return _at_temperature(scores, temperature)
    temps = temperature.to(torch.float32)
    if temps.dim() > 0 and temps.shape != scores.shape[:-3]:
        raise ValueError(
            f"temperature shape {tuple(temps.shape)} differs from the leading dims of scores "
            f"{tuple(scores.shape[:-3])}"
        )
    # checked where the temperatures live: a host read, or a device sync for temperatures on a device
    if not bool((temps >= 0).all()):
        raise ValueError(f"temperature must be >= 0 (0: greedy), got {temperature!r}")
    temps = temps.to(scores.device)
    temps = torch.where(temps > 0, temps, torch.ones_like(temps))
    return torch.log_softmax(scores.float() / temps[..., None, None, None], dim=-1)


def _at_temperature(scores: torch.Tensor, temperature: float) -> torch.Tensor:
    """`selector_logprobs` at one host temperature, checked on the host (no device read). Temperature 0 and
    every temperature whose float32 is 1 divide by 1.0, which leaves every float32 as it is (IEEE division
    by 1 is exact), so the division is skipped; any other one divides by a float32 tensor on the scores'
    device, as the per-request path does, so the result is the same bit for bit."""
    if not temperature >= 0:  # NaN fails too
        raise ValueError(f"temperature must be >= 0 (0: greedy), got {temperature!r}")
    logits = scores.float()
    if temperature == 0 or (0.5 < temperature < 2 and np.float32(temperature) == 1):
        return torch.log_softmax(logits, dim=-1)
    temps = torch.tensor(temperature, dtype=torch.float32, device=scores.device)
    return torch.log_softmax(logits / temps[..., None, None, None], dim=-1)


def validate_lattice(
    lattice_logprobs: torch.Tensor, token_ids: torch.Tensor
) -> tuple[np.ndarray, np.ndarray]:
    """Check one selector lattice; return it and its candidates on the host, read by one copy
    (`fast_tree.host_draft`): ([D, K, K] float64, [D, K] int64). ValueError naming the problem.

    lattice_logprobs: [D, K, K] floating log-probs, <= 0 (-inf allowed), no NaN, every entry checked (row
    [0, p > 0] included, although only row [0, 0] is read). token_ids: [D, K] integer.
    """
    validate_lattice_layout(lattice_logprobs, token_ids, batched=False)
    values, ids = host_draft(lattice_logprobs, token_ids)  # exact widening, one host copy
    check_lattice_values(values)
    return values, ids


def validate_lattice_layout(lattice_logprobs: torch.Tensor, token_ids: torch.Tensor, batched: bool) -> None:
    """The shape and dtype checks of `validate_lattice` (not the values) of one lattice, or of a batch of
    them ([B, D, K, K] and [B, D, K] when batched). ValueError naming the problem."""
    lead = 1 if batched else 0
    shape = tuple(lattice_logprobs.shape)
    if lattice_logprobs.dim() != 3 + lead or shape[-1] != shape[-2]:
        raise ValueError(
            f"lattice_logprobs must be {'[B, D, K, K]' if batched else '[D, K, K]'}, got shape {shape}"
        )
    depth_count, width = shape[lead : lead + 2]
    if depth_count == 0 or width == 0:
        raise ValueError(f"lattice_logprobs need at least one slot and one candidate, got {shape}")
    if tuple(token_ids.shape) != shape[:-1]:
        layout = (
            f"[B, D, K] = [{shape[0]}, {depth_count}, {width}]"
            if batched
            else f"[D, K] = [{depth_count}, {width}]"
        )
        raise ValueError(
            f"token_ids must be {layout} for lattice_logprobs of shape {shape}, got {tuple(token_ids.shape)}"
        )
    if not lattice_logprobs.is_floating_point():
        raise ValueError(f"lattice_logprobs must be a floating tensor, got {lattice_logprobs.dtype}")
    if token_ids.is_floating_point() or token_ids.dtype == torch.bool:
        raise ValueError(f"token_ids must be an integer tensor, got {token_ids.dtype}")


def check_lattice_values(values: np.ndarray) -> None:
    """The value checks of `validate_lattice` on one lattice's [D, K, K] float64 host copy."""
    if np.count_nonzero(values <= 0.0) != values.size:  # NaN fails the comparison too
        nan = np.isnan(values)
        if nan.any():
            raise ValueError(f"lattice_logprobs contain NaN, first at index {np.argwhere(nan)[0].tolist()}")
        worst = np.unravel_index(np.argmax(values), values.shape)
        raise ValueError(
            f"lattice_logprobs must be log-probabilities (<= 0), found {values[worst]} at index "
            f"{[int(i) for i in worst]}"
        )


def build_lattice_tree(
    lattice_logprobs: torch.Tensor, token_ids: torch.Tensor, budget: int, ties: torch.Tensor | None = None
) -> DraftTree:
    """The `budget` best nodes of the selector lattice, best-first (module docstring: key, exactness).

    lattice_logprobs: [D, K, K] log-probs, row [e, p] over slot e's candidates given candidate p of slot e-1
    (row [0, 0] for slot 0); <= 0, no NaN (`selector_logprobs` makes them from SGLang's scores).
    token_ids: [D, K] candidate token ids per slot.
    budget: maximum number of nodes (root excluded); fewer are returned if the lattice is smaller.
    ties: None or [D, K, K] tie values of the ranks (module docstring, "Ranks"), checked as the lattice.
    Returns a DraftTree on the device of `lattice_logprobs`: int64 tokens, parents and depths, float64
    log_scores formed as parent_score + logprob (depth 1: 0.0 + logprob, the first node its logprob), as
    `build_tree` forms them. ValueError on bad input. Runs on the host.
    """
    values, ids = validate_lattice(lattice_logprobs, token_ids)
    validate_budget(budget)
    tie_values = None if ties is None else validate_ties(ties, lattice_logprobs)
    return _lattice_tree(values, ids, budget, lattice_logprobs.device, tie_values)


def validate_ties(ties: torch.Tensor, lattice_logprobs: torch.Tensor) -> np.ndarray:
    """Check tie values for the lattice(s) `lattice_logprobs`: the same shape, floating, <= 0, no NaN.
    Returns their float64 host copy. ValueError naming the problem."""
    if tuple(ties.shape) != tuple(lattice_logprobs.shape):
        raise ValueError(
            f"ties must have the lattice's shape {tuple(lattice_logprobs.shape)}, got {tuple(ties.shape)}"
        )
    if not ties.is_floating_point():
        raise ValueError(f"ties must be a floating tensor, got {ties.dtype}")
    host = ties.detach().to(torch.float64).cpu().numpy()  # host sync where the ties live on a device
    check_lattice_values(host)
    return host


def _lattice_tree(
    values: np.ndarray, ids: np.ndarray, budget: int, device: torch.device, ties: np.ndarray | None = None
) -> DraftTree:
    """`build_lattice_tree` of a checked host lattice: values [D, K, K] float64, ids [D, K] int64, ties None
    or [D, K, K] float64."""
    order, ranked = rank_rows(values, ties)  # [D, K, K] each: each row's candidates by rank, their log-probs
    nodes = _best_first(ranked.ravel().tolist(), order.ravel().tolist(), values.shape[1], budget)
    return _to_tree(*nodes, ids, device)


def _best_first(
    ranked: list[float], order: list[int], width: int, budget: int
) -> tuple[list[float], list[int], list[int], list[int]]:
    """The heap of the module docstring. ranked, order: the [D, K, K] sorted log-probs of each row and the
    candidates they belong to, flattened; width: K. Returns (scores, parents, depths, candidates) of the
    first min(budget, Σ K^d) nodes in key order; parents index that order (ROOT for depth 1), candidates
    token_ids' rows.

    Heap entry: (-score, depth, key, parent, candidate), where key = Σ_j r_j·K^(d-j) orders the rank tuples
    of one depth lexicographically (the last rank is key mod K), so no two entries tie on the first three.
    Per popped node i, `bases[i + 1]` is its score and `starts[i + 1]` where its children's row begins in the
    flat arrays; index 0 is the root's (score 0.0, row [0, 0]), read through parent ROOT + 1.
    """
    depth_count = len(ranked) // (width * width)
    replace, push, pop = heapq.heapreplace, heapq.heappush, heapq.heappop
    bases, starts = [0.0], [0]
    parents: list[int] = []
    depths: list[int] = []
    candidates: list[int] = []
    heap = [(-ranked[0], 1, 0, ROOT, order[0])]
    for index in range(budget):
        if not heap:
            break
        negative, depth, key, parent, candidate = heap[0]
        rank = key % width + 1
        if rank < width:  # the next sibling takes the popped node's place
            at = starts[parent + 1] + rank
            replace(heap, (-(bases[parent + 1] + ranked[at]), depth, key + 1, parent, order[at]))
        else:
            pop(heap)
        score = -negative
        bases.append(score)
        parents.append(parent)
        depths.append(depth)
        candidates.append(candidate)
        at = (depth * width + candidate) * width  # row [depth, candidate]: the first child's
        starts.append(at)
        if depth < depth_count:
            push(heap, (-(score + ranked[at]), depth + 1, key * width, index, order[at]))
    return bases[1:], parents, depths, candidates


def _to_tree(
    scores: Sequence[float],
    parents: Sequence[int],
    depths: Sequence[int],
    candidates: Sequence[int],
    ids: np.ndarray,
    device: torch.device,
) -> DraftTree:
    """The DraftTree of n nodes given as sequences of length n, on `device`. ids: [D, K] int64 host array."""
    depth_array = np.array(depths, dtype=np.int64)
    fields = (
        ids[depth_array - 1, np.array(candidates, dtype=np.int64)].astype(np.int64, copy=False),
        np.array(parents, dtype=np.int64),
        depth_array,
        np.array(scores, dtype=np.float64),
    )
    on_host = [torch.from_numpy(field) for field in fields]
    return DraftTree(*(on_host if device.type == "cpu" else [field.to(device) for field in on_host]))


def lattice_chain(lattice_logprobs: torch.Tensor, token_ids: torch.Tensor) -> DraftTree:
    """DFlash2's own greedy walk as a DraftTree of D nodes: what the `chain` policy verifies on a lattice.

    The first token is the argmax of row [0, 0], each next one the argmax of row [e, previous candidate]
    (`CandidateSelector.sample_path` with its greedy mask), the lowest candidate index on a tie (torch's
    argmax): always the rank-0 child, so the chain is a path of `build_lattice_tree`'s order. It is SGLang's
    walk on the raw scores unless the float32 log_softmax rounds two distinct scores of a row to one value.
    lattice_logprobs: [D, K, K], token_ids: [D, K], validated as for `build_lattice_tree`.
    Returns a DraftTree on the device of `lattice_logprobs`; log_scores as `build_lattice_tree` forms them.
    """
    values, ids = validate_lattice(lattice_logprobs, token_ids)
    best = np.argmax(values, axis=-1).tolist()  # [D][K]: the first maximal candidate of each row
    rows = values.tolist()
    candidate = best[0][0]
    score = rows[0][0][candidate]
    scores, candidates = [score], [candidate]
    for slot in range(1, len(rows)):
        previous, candidate = candidate, best[slot][candidate]
        score = score + rows[slot][previous][candidate]
        scores.append(score)
        candidates.append(candidate)
    parents, depths = [ROOT, *range(len(rows) - 1)], list(range(1, len(rows) + 1))
    return _to_tree(scores, parents, depths, candidates, ids, lattice_logprobs.device)


def cap_children(
    lattice_logprobs: torch.Tensor, branching: int, ties: torch.Tensor | None = None
) -> torch.Tensor:
    """Keep the `branching` best entries of every row, the others -inf (module docstring, "Branching").

    lattice_logprobs: [..., D, K, K]; ties: None or the same shape. A row's ranks are its stable descending
    sort by value, then tie value, then the lowest candidate, as `build_lattice_tree` ranks them, so with
    finite log-probs the kept entries keep their ranks. Returns a new tensor (the input itself when
    branching >= K).
    """
    if isinstance(branching, bool) or not isinstance(branching, int) or branching < 1:
        raise ValueError(f"branching must be a positive int, got {branching!r}")
    if branching >= lattice_logprobs.shape[-1]:
        return lattice_logprobs
    if ties is None:
        order = torch.sort(lattice_logprobs, dim=-1, descending=True, stable=True).indices
    else:
        by_tie = torch.sort(ties, dim=-1, descending=True, stable=True).indices
        by_value = torch.sort(
            lattice_logprobs.gather(-1, by_tie), dim=-1, descending=True, stable=True
        ).indices
        order = by_tie.gather(-1, by_value)
    return lattice_logprobs.scatter(-1, order[..., branching:], float("-inf"))


def weight_by_candidate_mass(transitions: torch.Tensor, unary_logprobs: torch.Tensor) -> torch.Tensor:
    """Lattice transitions weighted by each slot's in-candidate mass (module docstring, "Mass outside the
    candidates"): transitions[..., e, p, c] + log Σ_c' exp(unary_logprobs[..., e, c']), at most 0.

    transitions: [..., D, K, K] log-probs, each row a distribution over slot e's candidates; unary_logprobs:
    [..., D, K] the drafter's log-probs of those candidates over the whole vocabulary (`DraftLattice.unary`).
    Returns [..., D, K, K] in the transitions' dtype, on their device. ValueError on mismatched shapes.
    """
    if transitions.dim() < 3 or tuple(transitions.shape[:-1]) != tuple(unary_logprobs.shape):
        raise ValueError(
            f"transitions [..., D, K, K] and unary_logprobs [..., D, K] disagree: {tuple(transitions.shape)} "
            f"and {tuple(unary_logprobs.shape)}"
        )
    mass = torch.logsumexp(unary_logprobs.to(transitions.dtype), dim=-1)  # [..., D]: log in-candidate mass
    return torch.clamp(transitions + mass[..., None, None], max=0.0)


def build_lattice_trees(
    lattice_logprobs: torch.Tensor,
    token_ids: torch.Tensor,
    budget: int,
    branching: int | None = None,
    raw: torch.Tensor | None = None,
    ties: torch.Tensor | None = None,
) -> DraftTreeBatch:
    """`build_lattice_tree` of every request, stacked: each node has at most `branching` children (None: K).

    lattice_logprobs: [B, D, K, K] finite log-probs; token_ids: [B, D, K]. Every row holds
    N = min(budget, Σ_{d=1..D} m^d) nodes, m = min(branching, K), best-first, so the trees stack; with
    branching 1 each row is `lattice_chain`'s path on the tie values (module docstring, "Branching"), cut to
    the budget. ValueError on bad input. The capped lattice and its candidates reach the host in one copy
    (`fast_tree.host_drafts`). raw: [B, D, K, K] other transitions of the same candidates (the raw ones of a
    calibrated lattice), packed in the same copy; each node's path score under them
    (`lattice_node_log_scores`, on the host) is kept as `raw_log_scores` (None: not scored). ties: None or
    [B, D, K, K] tie values of the ranks (module docstring, "Ranks"), <= 0, packed in the same copy.
    Every request's tree is built at once (`lattice_batched.best_first_batch`).
    """
    return _stacked_trees(lattice_logprobs, token_ids, budget, branching, raw, ties, by_heap=False)


def build_lattice_trees_by_heap(
    lattice_logprobs: torch.Tensor,
    token_ids: torch.Tensor,
    budget: int,
    branching: int | None = None,
    raw: torch.Tensor | None = None,
    ties: torch.Tensor | None = None,
) -> DraftTreeBatch:
    """`build_lattice_trees` built row by row by the heap of `build_lattice_tree`: the same trees, the
    reference the batched search is tested and timed against. Same arguments."""
    return _stacked_trees(lattice_logprobs, token_ids, budget, branching, raw, ties, by_heap=True)


def _stacked_trees(
    lattice_logprobs: torch.Tensor,
    token_ids: torch.Tensor,
    budget: int,
    branching: int | None,
    raw: torch.Tensor | None,
    ties: torch.Tensor | None,
    by_heap: bool,
) -> DraftTreeBatch:
    """`build_lattice_trees` (by_heap False) or `build_lattice_trees_by_heap` (True)."""
    validate_lattice_layout(lattice_logprobs, token_ids, batched=True)
    width = int(lattice_logprobs.shape[-1])
    children = width if branching is None else min(branching, width)
    if ties is not None and tuple(ties.shape) != tuple(lattice_logprobs.shape):
        raise ValueError(
            f"ties must have the lattice's shape {tuple(lattice_logprobs.shape)}, got {tuple(ties.shape)}"
        )
    capped = cap_children(lattice_logprobs, children, ties)
    validate_budget(budget)
    nodes = lattice_size(int(lattice_logprobs.shape[1]), children, budget)
    packed = [capped, *(t for t in (raw, ties) if t is not None)]
    (values, *extra), ids = host_drafts(packed, token_ids)  # [B, D, K, K] float64 each, [B, D, K] int64
    raw_host = extra[0] if raw is not None else None
    tie_host = extra[-1] if ties is not None else None
    check_lattice_values(values)
    if tie_host is not None:
        check_lattice_values(tie_host)
    if by_heap:
        host = torch.device("cpu")
        trees = DraftTreeBatch.stack(
            [
                _lattice_tree(values[b], ids[b], nodes, host, None if tie_host is None else tie_host[b])
                for b in range(values.shape[0])
            ]
        )
    else:
        trees = _batch_trees(values, tie_host, ids, nodes)
    if raw_host is not None:
        transitions, candidates = torch.from_numpy(raw_host), torch.from_numpy(ids)
        scores = lattice_node_log_scores(trees.tokens, trees.parents, trees.depths, transitions, candidates)
        trees = replace(trees, raw_log_scores=scores)
    return trees.to_device(lattice_logprobs.device)


@cache
def compiled_heap() -> ModuleType | None:
    """`lattice_heap`, imported once; None where Numba cannot be imported (a trimmed bundle), so the planning
    hot path never retries a failed import."""
    try:
        return importlib.import_module("bastion_sglang.controller.lattice_heap")
    except ImportError:
        return None


def batch_search(
    depth_count: int, width: int
) -> Callable[[np.ndarray, np.ndarray | None, int], LatticeNodes]:
    """How `build_lattice_trees` finds every request's nodes for [B, D, K, K] lattices: the compiled heap of
    `lattice_heap` where Numba imports and the rank keys fit, else the threshold search of `lattice_batched`
    (the same trees, bit for bit)."""
    heap = compiled_heap()
    if heap is None or not heap.keys_fit(depth_count, width):
        return best_first_batch
    return heap.best_first_by_compiled_heap


def _batch_trees(values: np.ndarray, ties: np.ndarray | None, ids: np.ndarray, nodes: int) -> DraftTreeBatch:
    """The host DraftTreeBatch of `batch_search`'s nodes on checked host lattices: values [B, D,
    K, K] float64, ties None or the same, ids [B, D, K] int64, n nodes per row."""
    found = batch_search(*values.shape[1:3])(values, ties, nodes)
    rows = np.arange(values.shape[0])[:, None]
    tokens = ids[rows, np.maximum(found.depths - 1, 0), found.candidates]  # [B, n]
    fields = (tokens, found.parents, found.depths)
    return DraftTreeBatch(
        *(torch.from_numpy(np.ascontiguousarray(field, dtype=np.int64)) for field in fields),
        log_scores=torch.from_numpy(np.ascontiguousarray(found.scores, dtype=np.float64)),
    )


def lattice_node_log_scores(
    tokens: torch.Tensor,
    parents: torch.Tensor,
    depths: torch.Tensor,
    transitions: torch.Tensor,
    token_ids: torch.Tensor,
) -> torch.Tensor:
    """Path scores of a batch of lattice trees under other transitions (e.g. the raw ones of trees built on
    calibrated values): Σ over each node's path of transitions[depth - 1, parent's candidate, candidate].

    tokens, parents, depths: [B, N] int64 (a `DraftTreeBatch` of `build_lattice_trees`, parents before
    children); transitions: [B, D, K, K]; token_ids: [B, D, K], distinct per slot, containing every node's
    token at its depth. A node's candidate is its token's index in its slot; depth 1 reads row 0.
    Returns [B, N] float64. No host sync.
    """
    batch, nodes = tokens.shape
    if nodes == 0:
        return torch.zeros((batch, 0), dtype=torch.float64, device=tokens.device)
    width = int(token_ids.shape[-1])
    slot = (depths - 1).clamp(min=0)  # [B, N]
    match = token_ids.gather(1, slot[:, :, None].expand(batch, nodes, width)) == tokens[:, :, None]
    candidate = match.to(torch.int64).argmax(-1)  # [B, N], the one True per node
    parent_candidate = torch.where(parents >= 0, candidate.gather(1, parents.clamp(min=0)), 0)
    flat = transitions.to(torch.float64).reshape(batch, -1)  # [B, D·K·K]
    own = flat.gather(1, (slot * width + parent_candidate) * width + candidate)  # [B, N]
    scores = own.clone()
    parent_index = parents.clamp(min=0)
    for depth in range(2, int(transitions.shape[1]) + 1):
        scores = torch.where(depths == depth, own + scores.gather(1, parent_index), scores)
    return scores
