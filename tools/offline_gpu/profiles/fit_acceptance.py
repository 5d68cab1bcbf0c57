"""Write the synthetic acceptance profiles of z-lab's Qwen3-8B-DFlash-b16 from its published acceptance.

    python tools/offline_gpu/profiles/fit_acceptance.py [--out-dir tools/offline_gpu/profiles]

Published (Ringel and Romano, arXiv:2604.12989, Table 1, Qwen3-8B, temperature 0): the DFlash chain's mean
accepted length τ (bonus included) and DDTree's at its best node budget, per dataset. The profile is the
simplest that reproduces both: every draft position alike, the rank-k candidate (k = 0 the best) accepted
with q_k = α·r^k given the path so far, K_p = 8 ranks. α makes the chain of 15 draft positions reach the
chain's τ; r makes the best-first tree of `TREE_BUDGET` nodes over those q (the tree BASTION's planner
builds, `build_tree`) reach the tree's τ in expectation. The paper does not state the best budget per
dataset; its budget study on MATH-500 peaks at 256 to 512 nodes, and 512 is assumed here. Real acceptance
falls with the position; this profile's does not: it fixes only the two published means.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable
from pathlib import Path

import torch

from bastion_sglang.controller.tree import build_tree, expected_accept_length
from bastion_sglang.step.synthetic_profile import SyntheticAcceptanceProfile

SOURCE = (
    "Ringel and Romano, Accelerating Speculative Decoding with Block Diffusion Draft Trees "
    "(arXiv:2604.12989), Table 1: Qwen3-8B with z-lab's DFlash drafter, temperature 0, mean acceptance "
    "length tau including the bonus token, of DFlash and of DFlash+DDTree at its best node budget (assumed "
    "512 here)"
)
PUBLISHED = {"gsm8k": ("GSM8K", 6.57, 9.54), "mtbench": ("MT-Bench", 4.28, 6.58)}
"""dataset: (its name in the table, DFlash chain tau, DFlash+DDTree tau)."""
DEPTH = 15
"""Draft positions of a block of 16."""
RANKS = 8
TREE_BUDGET = 512


def rank_probs(alpha: float, ratio: float) -> list[float]:
    """q_k = alpha * ratio**k for k < RANKS."""
    return [alpha * ratio**k for k in range(RANKS)]


def chain_tau(alpha: float) -> float:
    """The chain's mean accepted length with top-1 acceptance alpha at every one of DEPTH positions."""
    return sum(alpha**d for d in range(DEPTH + 1))


def tree_tau(q: torch.Tensor) -> float:
    """Expected accepted length of the best-first tree of TREE_BUDGET nodes over q [DEPTH, K] (descending)."""
    ids = torch.arange(q.shape[1]).repeat(DEPTH, 1)
    return expected_accept_length(build_tree(q.log(), ids, TREE_BUDGET))


def tree_tau_of(alpha: float, ratio: float) -> float:
    """tree_tau of q = rank_probs(alpha, ratio) at every position."""
    return tree_tau(torch.tensor([rank_probs(alpha, ratio)] * DEPTH, dtype=torch.float64))


def bisect(f: Callable[[float], float], target: float, low: float, high: float) -> float:
    """x in [low, high] with f(x) = target, f increasing; 60 halvings."""
    for _ in range(60):
        mid = (low + high) / 2
        low, high = (mid, high) if f(mid) < target else (low, mid)
    return (low + high) / 2


def fit(name: str, chain: float, tree: float) -> SyntheticAcceptanceProfile:
    """The profile whose chain and tree means are the published ones (module docstring)."""
    alpha = bisect(chain_tau, chain, 0.0, 1.0)
    most = bisect(lambda r: alpha * sum(r**k for k in range(RANKS)), 1.0, 0.0, 1.0)  # rows sum to <= 1
    if tree_tau_of(alpha, most) < tree:
        raise ValueError(f"{name}: tau {tree} is out of reach with top-1 acceptance {alpha:.4f}")
    ratio = bisect(lambda r: tree_tau_of(alpha, r), tree, 0.0, most)
    return SyntheticAcceptanceProfile(
        name=f"z-lab Qwen3-8B-DFlash-b16 on {name}, T=0 (synthetic: q_k = {alpha:.4f} * {ratio:.4f}^k)",
        source=SOURCE,
        published_chain_tau=chain,
        published_tree_tau=tree,
        tree_budget=TREE_BUDGET,
        rank_probs=(tuple(rank_probs(alpha, ratio)),) * DEPTH,
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--out-dir", type=Path, default=Path(__file__).resolve().parent)
    args = parser.parse_args(argv)
    for key, (name, chain, tree) in PUBLISHED.items():
        profile = fit(name, chain, tree)
        path = args.out_dir / f"qwen3-8b-dflash-b16-{key}.json"
        path.write_text(profile.model_dump_json(indent=2) + "\n", encoding="utf-8")
        taus = f"chain tau {profile.chain_tau(DEPTH):.3f}, tree tau {tree_tau(profile.probs(DEPTH)):.3f}"
        print(f"{path}: {profile.name}; {taus}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
