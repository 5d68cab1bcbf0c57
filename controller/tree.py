"""Best-first draft trees from one block-diffusion drafter pass (BASTION §2.3, DDTree Algorithm 1).

Terms. The drafter gives, for each future position (depth) d = 1..D, a marginal distribution q_d.
Only its top-K tokens are kept: `logprobs[d-1, k]` = log q_d of the rank-k token, each row sorted
descending, `token_ids[d-1, k]` = that token. A *node* is a prefix named by its rank tuple
(r_1, .., r_d), one rank per depth; its path score is log ρ = Σ_j logprobs[j-1, r_j] (eq. 1). The
root (the bonus token, ρ = 1) is implicit: it is not a node of `DraftTree`.

Order. Nodes are totally ordered by the key (-log ρ, depth, rank tuple): higher score first; on an
exact tie, shallower first; then the lexicographically smaller rank tuple first. A node's
predecessor in DDTree's enumeration (its previous sibling, or its parent if it is a first child)
always precedes it in this order, because ranks are sorted and log-probs are ≤ 0. Hence the heap
pops exactly in this order and the first n popped nodes are the top-n nodes: prefix-closed, with
the maximum Â for size n (Proposition 2.3), listed best-first with every parent before its children.
"""

from __future__ import annotations

import heapq
from dataclasses import dataclass

import torch

ROOT = -1
"""Parent index of depth-1 nodes: their parent is the root (the bonus token)."""


@dataclass(frozen=True)
class DraftTree:
    """A draft tree in best-first order (node i never precedes its parent).

    All tensors live on the same device and have length N (the number of draft nodes, root excluded).
    """

    tokens: torch.Tensor  # [N] int64: token id of each node
    parents: torch.Tensor  # [N] int64: parent node index (< own index), or ROOT (-1) for depth 1
    depths: torch.Tensor  # [N] int64: 1..D
    log_scores: torch.Tensor  # [N] float64: log ρ of each node, non-increasing

    def __len__(self) -> int:
        return int(self.tokens.shape[0])

    def truncate(self, n: int) -> DraftTree:
        """The first n nodes: a prefix of a best-first order is itself a valid (prefix-closed) tree."""
        return DraftTree(self.tokens[:n], self.parents[:n], self.depths[:n], self.log_scores[:n])


def validate_draft(logprobs: torch.Tensor, token_ids: torch.Tensor, batched: bool) -> None:
    """Check the drafter's top-K arrays once, at the public entry point; raise ValueError naming the problem.

    logprobs: [D, K] (or [B, D, K] when batched) floating log-probs, each row sorted descending, ≤ 0, no NaN.
    token_ids: same shape, integer.
    """
    validate_layout(logprobs, token_ids, batched)
    if torch.isnan(logprobs).any():
        raise ValueError("logprobs contain NaN")
    if (logprobs > 0).any():
        worst = logprobs.max().item()
        raise ValueError(f"logprobs must be log-probabilities (<= 0), found {worst}")
    if (logprobs[..., 1:] > logprobs[..., :-1]).any():
        bad = (logprobs[..., 1:] > logprobs[..., :-1]).nonzero()[0].tolist()
        raise ValueError(f"each row of logprobs must be sorted descending; first violation at index {bad}")


def validate_layout(logprobs: torch.Tensor, token_ids: torch.Tensor, batched: bool) -> None:
    """The shape and dtype checks of `validate_draft` (not the values); ValueError naming the problem."""
    rank = 3 if batched else 2
    layout = "[B, D, K]" if batched else "[D, K]"
    if logprobs.dim() != rank:
        raise ValueError(f"logprobs must be {layout}, got shape {tuple(logprobs.shape)}")
    if token_ids.shape != logprobs.shape:
        raise ValueError(
            f"token_ids shape {tuple(token_ids.shape)} differs from logprobs shape {tuple(logprobs.shape)}"
        )
    if not logprobs.is_floating_point():
        raise ValueError(f"logprobs must be a floating tensor, got {logprobs.dtype}")
    if token_ids.is_floating_point() or token_ids.dtype == torch.bool:
        raise ValueError(f"token_ids must be an integer tensor, got {token_ids.dtype}")
    if logprobs.shape[-1] == 0 or logprobs.shape[-2] == 0:
        raise ValueError(f"logprobs need at least one depth and one candidate, got {tuple(logprobs.shape)}")


def validate_budget(budget: int) -> None:
    if isinstance(budget, bool) or not isinstance(budget, int) or budget < 0:
        raise ValueError(f"budget must be a non-negative int, got {budget!r}")


def build_tree(logprobs: torch.Tensor, token_ids: torch.Tensor, budget: int) -> DraftTree:
    """The `budget` best prefixes of the top-K lattice, best-first (DDTree Algorithm 1, exact heap).

    logprobs: [D, K] log q_d of the top-K tokens per depth, rows sorted descending.
    token_ids: [D, K] the matching token ids.
    budget: maximum number of nodes (root excluded); fewer are returned if the lattice is smaller.
    Returns a DraftTree on the device of `logprobs`, log_scores in float64 (scores are accumulated
    as parent_score + logprob in float64, the same operation `build_trees` performs, so the two agree
    bit for bit). Runs on the host (one copy of the [D, K] scores).
    """
    validate_draft(logprobs, token_ids, batched=False)
    validate_budget(budget)
    depth_count, width = logprobs.shape
    lp_rows = logprobs.detach().to(device="cpu", dtype=torch.float64).tolist()  # host copy for the heap
    # heap entry: (-score, depth, rank tuple, parent node index or ROOT, score)
    first = lp_rows[0][0]
    heap: list[tuple[float, int, tuple[int, ...], int, float]] = [(-first, 1, (0,), ROOT, first)]
    scores: list[float] = []
    out_ranks: list[tuple[int, ...]] = []
    out_parents: list[int] = []
    while heap and len(out_ranks) < budget:
        _, depth, ranks, parent, score = heapq.heappop(heap)
        index = len(out_ranks)
        out_ranks.append(ranks)
        out_parents.append(parent)
        scores.append(score)
        last = ranks[-1]
        if last + 1 < width:
            base = 0.0 if parent == ROOT else scores[parent]
            sibling = base + lp_rows[depth - 1][last + 1]
            heapq.heappush(heap, (-sibling, depth, (*ranks[:-1], last + 1), parent, sibling))
        if depth < depth_count:
            child = score + lp_rows[depth][0]
            heapq.heappush(heap, (-child, depth + 1, (*ranks, 0), index, child))
    return _tree_from_ranks(out_ranks, out_parents, scores, token_ids, logprobs.device)


def _tree_from_ranks(
    ranks: list[tuple[int, ...]],
    parents: list[int],
    scores: list[float],
    token_ids: torch.Tensor,
    device: torch.device,
) -> DraftTree:
    depths = torch.tensor([len(r) for r in ranks], dtype=torch.int64)
    last_rank = torch.tensor([r[-1] for r in ranks], dtype=torch.int64)
    ids = token_ids.detach().to("cpu")
    tokens = ids[depths - 1, last_rank].to(torch.int64) if ranks else torch.empty(0, dtype=torch.int64)
    return DraftTree(
        tokens=tokens.to(device),
        parents=torch.tensor(parents, dtype=torch.int64, device=device),
        depths=depths.to(device),
        log_scores=torch.tensor(scores, dtype=torch.float64, device=device),
    )


def expected_accept_length(tree: DraftTree, n: int | None = None) -> float:
    """Â = 1 + Σ ρ over the first n nodes (BASTION eq. 3; the 1 is the always-committed root).

    n: number of nodes to count (default: all). Syncs to the host (returns a Python float).
    """
    scores = tree.log_scores if n is None else tree.log_scores[:n]
    return 1.0 + float(torch.exp(scores.double()).sum())
