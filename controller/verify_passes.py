"""Many candidate verify passes over one batch, as the exact integer counts the latency model prices.

A verify pass of B requests, request i verifying s_i tokens over c_i cached tokens, costs (see
`controller.latency`) a GEMM part of its T = Σ_i s_i tokens, an attention part of its Σ_i s_i·(c_i + s_i)
query-key pairs and a KV part of its Σ_i (c_i + 2·s_i) cached-token reads and new-token writes. These three
integers describe the pass completely, so `LatencyModel.predict_passes` prices M candidate passes (every
candidate width of a batch plan at once, or every step of a greedy walk) with a handful of array operations.

Counts are int64. Widths here are the widths the pass runs at: pad them first (`LatencyModel.padded_widths`)
where the engine pads.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from numbers import Integral
from typing import TYPE_CHECKING

import numpy as np

if TYPE_CHECKING:
    from bastion_sglang.controller.roofline import RooflineModel


@dataclass(frozen=True)
class VerifyPasses:
    """M verify passes over one batch of requests, as integer counts (module docstring)."""

    tokens: np.ndarray  # [M] int64: T = Σ_i s_i, tokens in the pass
    attention_pairs: np.ndarray  # [M] int64: Σ_i s_i·(c_i + s_i), query-key pairs per head and layer
    kv_tokens: np.ndarray  # [M] int64: Σ_i (c_i + 2·s_i), KV tokens read (c + s) and written (s)

    def __len__(self) -> int:
        return int(self.tokens.shape[0])

    @classmethod
    def common(cls, widths: np.ndarray, contexts: np.ndarray) -> VerifyPasses:
        """Pass m: every request verifies widths[m] tokens.

        widths: [M] int64 tokens per request (>= 1); contexts: [B] int64 cached tokens per request (>= 0).
        """
        batch = contexts.shape[0]
        cached = sum(contexts.tolist())  # exact: Python ints
        return cls(
            tokens=batch * widths,
            attention_pairs=widths * (cached + batch * widths),
            kv_tokens=cached + 2 * batch * widths,
        )

    @classmethod
    def ragged(cls, widths: np.ndarray, contexts: np.ndarray) -> VerifyPasses:
        """Pass m: request i verifies widths[m, i] tokens.

        widths: [M, B] int64 tokens per request (>= 1); contexts: [B] int64 cached tokens per request (>= 0).
        """
        return cls(
            tokens=widths.sum(axis=1),
            attention_pairs=(widths * (contexts + widths)).sum(axis=1),
            kv_tokens=(contexts + 2 * widths).sum(axis=1),
        )


@dataclass(frozen=True)
class PassPrices:
    """What the roofline charges per unit of each count of `VerifyPasses` (one target on one device)."""

    gemm_flops_per_token: int  # GEMM FLOPs = T · this
    attention_flops_per_pair: int  # attention FLOPs = query-key pairs · this (4·h_q·L)
    kv_elements_per_token: int  # KV elements = KV tokens · this (L·2h_kv)
    bytes_per_element: float  # bp, bytes
    peak_flops: float  # FLOP/s
    bandwidth: float  # bytes/s
    weight_seconds: float  # weight bytes / bandwidth: the GEMMs' floor, seconds
    ridge_tokens: float  # T*, the GEMM ridge, tokens

    @classmethod
    def of(cls, roofline: RooflineModel) -> PassPrices:
        return cls(
            gemm_flops_per_token=roofline.gemm_flops_per_token(),
            attention_flops_per_pair=roofline.attention_flops_per_pair(),
            kv_elements_per_token=roofline.kv_elements_per_token(),
            bytes_per_element=roofline.bytes_per_element,
            peak_flops=roofline.hw.peak_flops,
            bandwidth=roofline.hw.bandwidth,
            weight_seconds=roofline.weight_bytes() / roofline.hw.bandwidth,
            ridge_tokens=roofline.gemm_ridge_tokens(),
        )


def check_context(c: int) -> int:
    """c, cached tokens of one request, as a Python int; ValueError unless it is an int >= 0."""
    if isinstance(c, bool) or not isinstance(c, Integral) or c < 0:
        raise ValueError(f"c (cached context tokens) must be an int >= 0, got {c!r}")
    return int(c)


def check_contexts(contexts: Sequence[int]) -> np.ndarray:
    """[B] cached tokens per request as an int64 host array; ValueError naming the first that is not an
    int >= 0."""
    return np.array([check_context(c) for c in contexts], dtype=np.int64).reshape(-1)
