"""Write the synthetic acceptance profiles of z-lab's Qwen3-8B-DFlash-b16 from its published acceptance.

    python tools/offline_gpu/profiles/fit_acceptance.py [--out-dir tools/offline_gpu/profiles]
        [--histogram tools/offline_gpu/profiles/smollm2-135m-dflash-ranks.json]

Published (Ringel and Romano, arXiv:2604.12989, Table 1, Qwen3-8B, temperature 0): the DFlash chain's mean
accepted length τ (bonus included) and DDTree's at its best node budget, per dataset. The paper does not state
the best budget per dataset; its budget study on MATH-500 peaks at 256 to 512 nodes, and 512 is assumed here.
Two profiles per dataset reproduce both means, each with K_p = 8 ranks over 15 draft positions:

- flat (`qwen3-8b-dflash-b16-<dataset>.json`): every draft position alike, the rank-k candidate (k = 0 the
  best) accepted with q_k = α·r^k given the path so far. α makes the chain of 15 draft positions reach the
  chain's τ; r makes the best-first tree of `TREE_BUDGET` nodes over those q (the tree BASTION's planner
  builds, `build_tree`) reach the tree's τ in expectation. It fixes only the two published means.
- shaped (`qwen3-8b-dflash-b16-<dataset>-shaped.json`): the rows of a measured rank histogram (the demo
  pair's, `record_ranks.py`; per position d, which of the drafter's candidates the target's token is, given
  that its path so far stayed inside the candidates: `RankHistogram.conditional_rows`) with two parameters
  fitted to the same two means (`shaped_probs`): a shift s of every position's rank-0 logit (the chain's τ),
  and a power p on every position's in-candidate share of what rank 0 misses (the tree's τ). Each position
  keeps the histogram's place in rank-0 logit and in-candidate share, and each row keeps the histogram's
  tail shape (ranks 1..7 in the measured proportions).
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

from bastion_sglang.calibration.rank_histogram import RankHistogram, load_rank_histogram
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
HISTOGRAM = Path(__file__).resolve().parent / "smollm2-135m-dflash-ranks.json"
"""The demo pair's rank histogram the shaped profiles take their rows from."""
SHIFT_RANGE = (-40.0, 40.0)
"""Rank-0 logit shifts searched: the chain's τ runs from 1 to DEPTH + 1 over it."""
POWER_RANGE = (0.0, 64.0)
"""Powers on the in-candidate share searched: 0 puts all that rank 0 misses on the candidates."""


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


@dataclass(frozen=True)
class HistogramShape:
    """A histogram's rows as the shaped transform reads them, per draft position d (float64):
    first [D] the rank-0 share; inside [D] the share of the rest (1 - first) on ranks 1..K_p - 1; tail
    [D, K_p - 1] ranks 1..K_p - 1 over their sum."""

    first: torch.Tensor
    inside: torch.Tensor
    tail: torch.Tensor


def histogram_shape(histogram: RankHistogram) -> HistogramShape:
    """The first DEPTH positions of the histogram's conditional rows, split (HistogramShape); ValueError
    when it has fewer than DEPTH positions or RANKS ranks."""
    if histogram.depth < DEPTH or histogram.ranks != RANKS:
        raise ValueError(
            f"rank histogram: {histogram.depth} positions x {histogram.ranks} ranks; "
            f"the profiles need {DEPTH} x {RANKS}"
        )
    rows = torch.from_numpy(histogram.conditional_rows()[:DEPTH])
    first, ranked = rows[:, 0], rows[:, 1:RANKS]
    return HistogramShape(first, ranked.sum(-1) / (1 - first), ranked / ranked.sum(-1, keepdim=True))


def shaped_probs(shape: HistogramShape, shift: float, power: float) -> torch.Tensor:
    """[DEPTH, RANKS] q: rank 0 at logit(first) + shift, the rest (1 - q_0) on the candidates by inside^power
    and among ranks 1.. by the tail's shape; each row sums to q_0 + (1 - q_0)·inside^power <= 1."""
    first = torch.sigmoid(torch.logit(shape.first) + shift)
    rest = (1 - first) * shape.inside.pow(power)
    return torch.cat([first[:, None], rest[:, None] * shape.tail], dim=-1)


def fit_shaped(
    name: str, chain: float, tree: float, histogram: RankHistogram, histogram_name: str
) -> SyntheticAcceptanceProfile:
    """The shaped profile whose chain and tree means are the published ones (module docstring). ValueError
    when the tree's τ is out of the transform's reach or a row would not be sorted by rank."""
    shape = histogram_shape(histogram)
    shift = bisect(
        lambda s: 1 + float(shaped_probs(shape, s, 0.0)[:, 0].cumprod(0).sum()), chain, *SHIFT_RANGE
    )
    reach = [tree_tau(shaped_probs(shape, shift, power)) for power in POWER_RANGE]
    if not reach[1] <= tree <= reach[0]:
        raise ValueError(
            f"{name}: tree tau {tree} is outside the shaped profiles' reach {reach[1]:.3f}..{reach[0]:.3f}"
        )
    power = bisect(lambda p: -tree_tau(shaped_probs(shape, shift, p)), -tree, *POWER_RANGE)
    q = shaped_probs(shape, shift, power)
    if bool((q[:, 1:] > q[:, :-1]).any()):
        raise ValueError(f"{name}: the shaped rows are not sorted by rank: {q.tolist()}")
    passes = sum(histogram.counts[0])
    return SyntheticAcceptanceProfile(
        name=f"z-lab Qwen3-8B-DFlash-b16 on {name}, T=0 (synthetic, shaped: the demo pair's rank histogram "
        f"with rank-0 logit {shift:+.4f} and in-candidate share ^{power:.4f})",
        source=f"{SOURCE}; per-position rows and rank tail from {histogram_name} ({passes} drafter passes of "
        f"{histogram.target} with {histogram.drafter}, recorded at commit {histogram.commit[:12]})",
        published_chain_tau=chain,
        published_tree_tau=tree,
        tree_budget=TREE_BUDGET,
        rank_probs=tuple(tuple(row) for row in q.tolist()),
    )


def write_profile(path: Path, profile: SyntheticAcceptanceProfile) -> None:
    """Write `profile` to `path` and print its chain and tree means."""
    path.write_text(profile.model_dump_json(indent=2) + "\n", encoding="utf-8")
    taus = f"chain tau {profile.chain_tau(DEPTH):.3f}, tree tau {tree_tau(profile.probs(DEPTH)):.3f}"
    print(f"{path}: {profile.name}; {taus}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--out-dir", type=Path, default=Path(__file__).resolve().parent)
    parser.add_argument("--histogram", type=Path, default=HISTOGRAM, help="rank histogram (record_ranks.py)")
    args = parser.parse_args(argv)
    histogram = load_rank_histogram(args.histogram)
    for key, (name, chain, tree) in PUBLISHED.items():
        write_profile(args.out_dir / f"qwen3-8b-dflash-b16-{key}.json", fit(name, chain, tree))
        shaped = fit_shaped(name, chain, tree, histogram, args.histogram.name)
        write_profile(args.out_dir / f"qwen3-8b-dflash-b16-{key}-shaped.json", shaped)
    return 0


if __name__ == "__main__":
    sys.exit(main())
