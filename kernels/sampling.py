"""The target's processed next-token distribution, filtered exactly as SGLang 0.5.23's sampler filters it.

With p = softmax(logits / temperature) sorted descending (rank 0 = the mode), SGLang's sampler
(`layers/sampler.py`) keeps, depending on its sampling backend:

- `FilterRule.NONE`, when no request of the batch sets top-k, top-p or min-p (its "simple" case): p itself;
- `FilterRule.JOINT`, the `pytorch` backend (`top_k_top_p_min_p_sampling_from_probs_torch`), and the
  `flashinfer` backend without min-p (`top_k_top_p_sampling_from_probs`, filter order "joint"): a token
  survives if its rank is < top_k, the mass of p ranked strictly before it is <= top_p, and (min-p set)
  p >= min_p · p_max; every test on the unfiltered p;
- `FilterRule.SEQUENTIAL`, the `flashinfer` backend with min-p: `top_k_renorm_prob`, then
  `top_p_renorm_prob` on that renormalised distribution (the top-p mass test is on p restricted to the
  top-k, renormalised), then min-p (p >= min_p · p_max, unchanged by renormalising).

A probability exactly on a top-p boundary is kept (SGLang's torch rule); flashinfer's pivot search may
decide such a measure-zero tie the other way.
"""

from __future__ import annotations

import enum

import torch


class FilterRule(enum.Enum):
    """How top-k, top-p and min-p combine (see the module docstring)."""

    NONE = "none"
    JOINT = "joint"
    SEQUENTIAL = "sequential"


TOP_CANDIDATES = 256
"""Tokens the JOINT rule ranks first (`torch.topk`) before it sorts a whole vocabulary row."""


def filter_rule(sampling_backend: str, needs_top_k_or_top_p: bool, needs_min_p: bool) -> FilterRule:
    """The rule SGLang's sampler applies to a batch.

    sampling_backend: SGLang's `--sampling-backend` ("pytorch" or "flashinfer"); needs_*: whether some
    request of the batch sets the filter (SamplingBatchInfo.need_top_k_sampling / need_top_p_sampling /
    need_min_p_sampling).
    """
    if sampling_backend not in ("pytorch", "flashinfer"):
        raise ValueError(f"sampling backend must be 'pytorch' or 'flashinfer', got {sampling_backend!r}")
    if not (needs_top_k_or_top_p or needs_min_p):
        return FilterRule.NONE
    if sampling_backend == "flashinfer" and needs_min_p:
        return FilterRule.SEQUENTIAL
    return FilterRule.JOINT


def processed_probs(
    logits: torch.Tensor,
    temperatures: torch.Tensor,
    top_ks: torch.Tensor,
    top_ps: torch.Tensor,
    min_ps: torch.Tensor,
    rule: FilterRule,
) -> torch.Tensor:
    """The distribution SGLang's sampler draws each row's token from, as unnormalised weights.

    logits: [M, V] or [B, W, V] floating (penalties, grammar masks and biases applied), rows on the last
    dimension. The parameters are one per row, or broadcast to the rows: [M], or [B, 1] for W rows of one
    request sharing them (no copy per row). temperatures > 0; top_ks integer (>= V or SGLang's TOP_K_ALL: no
    limit); top_ps in (0, 1]; min_ps in [0, 1). rule: `filter_rule` of the batch. Returns float32
    non-negative weights shaped as logits, zero where filtered out; each row has positive mass (the mode
    always survives) and is proportional to p on its support.
    """
    if logits.dim() not in (2, 3) or not logits.is_floating_point():
        raise ValueError(
            f"logits must be floating [M, V] or [B, W, V], got {logits.dtype} {tuple(logits.shape)}"
        )
    rows, vocab = logits.shape[:-1], logits.shape[-1]
    for name, value in (
        ("temperatures", temperatures),
        ("top_ks", top_ks),
        ("top_ps", top_ps),
        ("min_ps", min_ps),
    ):
        if value.dim() != len(rows) or any(
            size not in (1, row) for size, row in zip(value.shape, rows, strict=True)
        ):
            raise ValueError(f"{name} must broadcast to the rows {tuple(rows)}, got {tuple(value.shape)}")
    probs = torch.softmax(logits.float() / temperatures.float()[..., None], dim=-1)
    if rule is FilterRule.NONE:
        return probs
    if rule is FilterRule.JOINT and vocab > TOP_CANDIDATES:
        return _joint_from_candidates(probs, top_ks, top_ps, min_ps)
    return _filtered_by_sort(probs, top_ks, top_ps, min_ps, rule)


def _joint_from_candidates(
    probs: torch.Tensor, top_ks: torch.Tensor, top_ps: torch.Tensor, min_ps: torch.Tensor
) -> torch.Tensor:
    """The JOINT rule from each row's TOP_CANDIDATES most likely tokens, sorting only rows that keep them all.

    Every JOINT test is monotone in rank (rank < top_k; the mass ranked before a token only grows; p only
    falls), so a row keeps a prefix of its sorted order: when the last candidate is dropped, the candidates
    decide the row exactly (the same values in the same order as a full sort, so the same cumulative sums).
    A full vocabulary sort costs milliseconds on a CPU for the few hundred tokens top-p usually keeps.
    probs: [..., V] softmax; the rest as `processed_probs`. Returns float32 weights shaped as probs.
    """
    top_probs, top_order = torch.topk(probs, TOP_CANDIDATES, dim=-1)  # [..., K], sorted descending
    kept, keep = _joint_kept(top_probs, top_ks, top_ps, min_ps)
    out = torch.zeros_like(probs).scatter_(-1, top_order, kept)
    longer = keep[..., -1]  # [...] rows whose kept prefix may reach past the candidates
    if bool(longer.any()):
        shape = longer.shape
        out[longer] = _filtered_by_sort(
            probs[longer],
            top_ks.expand(shape)[longer],
            top_ps.expand(shape)[longer],
            min_ps.expand(shape)[longer],
            FilterRule.JOINT,
        )
    return out


def _joint_kept(
    sorted_probs: torch.Tensor, top_ks: torch.Tensor, top_ps: torch.Tensor, min_ps: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """The JOINT rule on rows sorted descending (all V tokens or a leading prefix): (kept weights, keep mask),
    both [..., K]."""
    mass_before = torch.cumsum(sorted_probs, dim=-1) - sorted_probs
    return _kept_sorted(sorted_probs, mass_before, top_ks, top_ps, min_ps)


def _kept_sorted(
    sorted_probs: torch.Tensor,
    mass_before: torch.Tensor,
    top_ks: torch.Tensor,
    top_ps: torch.Tensor,
    min_ps: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Top-k, top-p (on `mass_before`, the mass ranked before each token under the rule) and min-p on rows
    sorted descending: (kept weights, keep mask), both [..., K]."""
    ranks = torch.arange(sorted_probs.shape[-1], device=sorted_probs.device)
    keep = (ranks < top_ks[..., None]) & (mass_before <= top_ps.float()[..., None])
    keep &= sorted_probs >= sorted_probs[..., :1] * min_ps.float()[..., None]
    return sorted_probs.masked_fill(~keep, 0.0), keep


def _filtered_by_sort(
    probs: torch.Tensor, top_ks: torch.Tensor, top_ps: torch.Tensor, min_ps: torch.Tensor, rule: FilterRule
) -> torch.Tensor:
    """JOINT or SEQUENTIAL over fully sorted rows. probs: [..., V] softmax. Returns float32 weights shaped as
    probs."""
    sorted_probs, order = probs.sort(dim=-1, descending=True)
    if rule is FilterRule.JOINT:
        kept, _ = _joint_kept(sorted_probs, top_ks, top_ps, min_ps)
        return torch.zeros_like(probs).scatter_(-1, order, kept)
    ranks = torch.arange(probs.shape[-1], device=probs.device)
    top_k_probs = sorted_probs * (ranks < top_ks[..., None])
    top_k_probs = top_k_probs / top_k_probs.sum(dim=-1, keepdim=True)
    mass_before = torch.cumsum(top_k_probs, dim=-1) - top_k_probs
    kept, _ = _kept_sorted(sorted_probs, mass_before, top_ks, top_ps, min_ps)
    return torch.zeros_like(probs).scatter_(-1, order, kept)
