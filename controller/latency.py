"""Calibrated verify latency: the roofline, an offline affine fit per branch, and an online EMA (BASTION H.4).

Calibrated roofline (BASTION §2.4, appendix F): with T_comp = FLOPs / peak and T_mem = Bytes / bandwidth,

    T(s, c) = max(α_c·T_comp(s, c) + β_c, α_m·T_mem(s, c) + β_m)   seconds,

α dimensionless (> 0), β in seconds. Online, a multiplicative factor f tracks what the offline fit misses
("EMA+Calib"): after each verify pass, f <- (1 - a)·f + a·(observed / T), and the model predicts f·T.

Monotonicity. T_comp and T_mem grow with s and with c, and both α are positive, so T grows with s and c;
its minimum is at s = 1, c = 0. `LatencyModel` checks T(1, 0) > 0 once, which makes every prediction
positive.

Width buckets. A verify pass is padded to the smallest captured CUDA-graph width >= s, so a tree of s
tokens costs the width it is padded to: the prediction is a step function of s.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from numbers import Integral, Real

import numpy as np
import torch
from pydantic import BaseModel, ConfigDict, Field, FiniteFloat

from bastion_sglang.controller.roofline import RooflineModel, TokenCounts

_MAX_ROUNDS = 100
"""Cap on assign/refit rounds per start of `fit_latency`; a start also ends when an assignment repeats."""


class LatencySample(BaseModel):
    """One measured verify pass: `batch` requests, each verifying s tokens over c cached tokens."""

    model_config = ConfigDict(frozen=True, strict=True, extra="forbid")

    s: int = Field(ge=1, description="tokens verified per request")
    c: int = Field(ge=0, description="cached context tokens per request")
    seconds: FiniteFloat = Field(gt=0, description="measured wall time of the pass, seconds")
    batch: int = Field(default=1, ge=1, description="requests in the pass")


class LatencyFit(BaseModel):
    """T = max(α_c·T_comp + β_c, α_m·T_mem + β_m); α dimensionless, β seconds."""

    model_config = ConfigDict(frozen=True, strict=True, extra="forbid")

    alpha_c: FiniteFloat = Field(gt=0)
    beta_c: FiniteFloat
    alpha_m: FiniteFloat = Field(gt=0)
    beta_m: FiniteFloat

    @classmethod
    def identity(cls) -> LatencyFit:
        """α = 1, β = 0: the bare roofline."""
        return cls(alpha_c=1.0, beta_c=0.0, alpha_m=1.0, beta_m=0.0)

    def apply(self, compute_seconds: float, memory_seconds: float) -> float:
        """Calibrated seconds from the roofline's compute and memory seconds."""
        return max(self.alpha_c * compute_seconds + self.beta_c, self.alpha_m * memory_seconds + self.beta_m)

    def apply_many(self, compute_seconds: torch.Tensor, memory_seconds: torch.Tensor) -> torch.Tensor:
        """Elementwise `apply`: [M] float64 compute and memory seconds -> [M] float64 seconds."""
        return torch.maximum(
            self.alpha_c * compute_seconds + self.beta_c, self.alpha_m * memory_seconds + self.beta_m
        )


class FitReport(BaseModel):
    """Errors of the bare roofline (raw) and of the calibrated fit on a set of samples."""

    model_config = ConfigDict(frozen=True, strict=True, extra="forbid")

    num_samples: int = Field(ge=1)
    rmse_raw: FiniteFloat = Field(ge=0, description="seconds")
    mape_raw: FiniteFloat = Field(ge=0, description="mean |predicted - observed| / observed, fraction")
    rmse_fit: FiniteFloat = Field(ge=0, description="seconds")
    mape_fit: FiniteFloat = Field(ge=0, description="fraction")


def _roofline_terms(roofline: RooflineModel, samples: Sequence[LatencySample]) -> tuple[np.ndarray, ...]:
    """(T_comp, T_mem, observed) seconds, [n] float64 each; a sample of batch B uses the batch form."""
    compute = np.empty(len(samples))
    memory = np.empty(len(samples))
    for i, sample in enumerate(samples):
        s, c = [sample.s] * sample.batch, [sample.c] * sample.batch
        compute[i] = roofline.compute_seconds_batch(s, c)
        memory[i] = roofline.memory_seconds_batch(s, c)
    observed = np.array([sample.seconds for sample in samples])
    return compute, memory, observed


def _check_samples(samples: Sequence[LatencySample], minimum: int, purpose: str) -> None:
    if len(samples) < minimum:
        raise ValueError(f"{purpose} needs at least {minimum} latency samples, got {len(samples)}")
    for i, sample in enumerate(samples):
        if not isinstance(sample, LatencySample):
            raise ValueError(f"samples[{i}] must be a LatencySample, got {type(sample).__name__}")


def _fit_branch(
    feature: np.ndarray, observed: np.ndarray, nonnegative_intercept: bool = False
) -> tuple[float, float]:
    """(α, β) of observed ≈ α·feature + β by least squares on one branch's samples.

    nonnegative_intercept: constrain β >= 0 (the memory branch: β is the fixed cost of a pass, and the
    branch sets the latency at s = 1, c = 0, which must stay positive). When the free least-squares β is
    negative, the constrained optimum is β = 0 with α = Σ feature·observed / Σ feature².
    Degenerate branch (fewer than 2 samples, one distinct feature value, or a least-squares α <= 0):
    α = median(observed / feature) over the branch and β = mean(observed - α·feature), the least-squares β
    for that α (clipped at 0 under the constraint).
    """
    if feature.size >= 2 and np.ptp(feature) > 1e-9 * np.max(feature):
        design = np.stack([feature, np.ones_like(feature)], axis=1)
        (alpha, beta), *_ = np.linalg.lstsq(design, observed, rcond=None)
        if alpha > 0 and math.isfinite(alpha) and math.isfinite(beta):
            if beta >= 0 or not nonnegative_intercept:
                return float(alpha), float(beta)
            return float(np.dot(feature, observed) / np.dot(feature, feature)), 0.0
    alpha = float(np.median(observed / feature))
    beta = float(np.mean(observed - alpha * feature))
    return alpha, max(beta, 0.0) if nonnegative_intercept else beta


def _fit_assignment(
    compute: np.ndarray, memory: np.ndarray, observed: np.ndarray, on_compute: np.ndarray
) -> LatencyFit:
    """Refit both branches for one assignment of samples (True: compute branch).

    A branch that holds no sample gets α = median ratio over all samples and the largest β that keeps it
    at or below the other branch on every sample, so it changes no prediction on the data (for the memory
    branch at least 0: β_m >= 0 keeps every fit's latency positive at s = 1, c = 0).
    """
    if on_compute.all():
        alpha_c, beta_c = _fit_branch(compute, observed)
        alpha_m = float(np.median(observed / memory))
        beta_m = max(float(np.min(alpha_c * compute + beta_c - alpha_m * memory)), 0.0)
    elif not on_compute.any():
        alpha_m, beta_m = _fit_branch(memory, observed, nonnegative_intercept=True)
        alpha_c = float(np.median(observed / compute))
        beta_c = float(np.min(alpha_m * memory + beta_m - alpha_c * compute))
    else:
        alpha_c, beta_c = _fit_branch(compute[on_compute], observed[on_compute])
        alpha_m, beta_m = _fit_branch(memory[~on_compute], observed[~on_compute], nonnegative_intercept=True)
    return LatencyFit(alpha_c=alpha_c, beta_c=beta_c, alpha_m=alpha_m, beta_m=beta_m)


def _branches(fit: LatencyFit, compute: np.ndarray, memory: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    return fit.alpha_c * compute + fit.beta_c, fit.alpha_m * memory + fit.beta_m


def _starts(compute: np.ndarray, memory: np.ndarray, widths: np.ndarray) -> list[np.ndarray]:
    """Initial assignments (True: compute branch): roofline dominance, all-compute, all-memory, and
    splits at the quartiles of s and of the arithmetic-intensity ratio T_comp / T_mem."""
    intensity = compute / memory
    starts = [compute >= memory, np.ones_like(compute, bool), np.zeros_like(compute, bool)]
    for quantile in (0.25, 0.5, 0.75):
        starts.append(widths > np.quantile(widths, quantile))
        starts.append(intensity > np.quantile(intensity, quantile))
    return starts


def fit_latency(roofline: RooflineModel, samples: Sequence[LatencySample]) -> LatencyFit:
    """Least-squares fit of T = max(α_c·T_comp + β_c, α_m·T_mem + β_m) to measured passes.

    The max of two affine maps is fitted by alternation: assign each sample to the branch that is larger
    under the current fit, refit each branch's (α, β) by linear least squares on its samples (see
    `_fit_branch` for a degenerate branch), and repeat until the assignment no longer changes. This runs
    from every start of `_starts`; every fit visited is scored by its squared error on all samples under
    the max model, and the lowest wins. β_m is kept >= 0 (with α_m > 0 every fit then predicts a positive
    latency at s = 1, c = 0, as `LatencyModel` requires, however noisy the samples); β_c is free (a compute
    branch fitted on large widths may cross zero below them). Raises ValueError for fewer than 2 samples.
    """
    _check_samples(samples, 2, "fitting")
    compute, memory, observed = _roofline_terms(roofline, samples)
    widths = np.array([sample.s for sample in samples], dtype=np.float64)
    best_fit, best_error = LatencyFit.identity(), math.inf
    for on_compute in _starts(compute, memory, widths):
        seen: set[bytes] = set()
        for _ in range(_MAX_ROUNDS):
            seen.add(on_compute.tobytes())
            fit = _fit_assignment(compute, memory, observed, on_compute)
            compute_branch, memory_branch = _branches(fit, compute, memory)
            error = float(np.sum((np.maximum(compute_branch, memory_branch) - observed) ** 2))
            if error < best_error:
                best_fit, best_error = fit, error
            on_compute = compute_branch >= memory_branch
            if on_compute.tobytes() in seen:
                break
    return best_fit


def evaluate_fit(roofline: RooflineModel, fit: LatencyFit, samples: Sequence[LatencySample]) -> FitReport:
    """RMSE (seconds) and MAPE (fraction) of the bare roofline and of `fit` on `samples`."""
    _check_samples(samples, 1, "evaluate_fit")
    compute, memory, observed = _roofline_terms(roofline, samples)
    raw = np.maximum(compute, memory)
    fitted = np.maximum(*_branches(fit, compute, memory))
    return FitReport(
        num_samples=len(samples),
        rmse_raw=float(np.sqrt(np.mean((raw - observed) ** 2))),
        mape_raw=float(np.mean(np.abs(raw - observed) / observed)),
        rmse_fit=float(np.sqrt(np.mean((fitted - observed) ** 2))),
        mape_fit=float(np.mean(np.abs(fitted - observed) / observed)),
    )


def validate_width_buckets(width_buckets: Sequence[int]) -> tuple[int, ...]:
    """Buckets as a tuple; ValueError unless they are non-empty, sorted, duplicate-free ints >= 1."""
    buckets = tuple(width_buckets)
    if (
        not buckets
        or any(isinstance(b, bool) or not isinstance(b, Integral) or b < 1 for b in buckets)
        or list(buckets) != sorted(set(buckets))
    ):
        raise ValueError(f"width_buckets must be sorted, unique ints >= 1, got {list(width_buckets)!r}")
    return tuple(int(b) for b in buckets)


class LatencyModel:
    """Predicted verify seconds: EMA factor × calibrated roofline at the padded width.

    Everything but the EMA factor is fixed at construction; `observe` updates the factor in place.
    ema_alpha: weight a of the newest observation, in (0, 1].
    width_buckets: captured verify widths (tokens per request), sorted and unique; None: no padding.
    """

    __slots__ = ("_bucket_tensor", "_buckets", "_ema_alpha", "_factor", "_fit", "_roofline")

    def __init__(
        self,
        roofline: RooflineModel,
        fit: LatencyFit | None = None,
        ema_alpha: float = 0.1,
        width_buckets: Sequence[int] | None = None,
    ) -> None:
        if not isinstance(roofline, RooflineModel):
            raise ValueError(f"roofline must be a RooflineModel, got {type(roofline).__name__}")
        if fit is not None and not isinstance(fit, LatencyFit):
            raise ValueError(f"fit must be a LatencyFit or None, got {type(fit).__name__}")
        if isinstance(ema_alpha, bool) or not isinstance(ema_alpha, Real) or not 0 < ema_alpha <= 1:
            raise ValueError(f"ema_alpha must be in (0, 1], got {ema_alpha!r}")
        self._roofline = roofline
        self._fit = fit
        self._ema_alpha = float(ema_alpha)
        self._buckets = None if width_buckets is None else validate_width_buckets(width_buckets)
        self._bucket_tensor = (
            None if self._buckets is None else torch.tensor(self._buckets, dtype=torch.int64)
        )
        self._factor = 1.0
        floor = self._calibrated_seconds(1, 0)
        if floor <= 0:
            raise ValueError(f"the latency fit predicts {floor} s at s=1, c=0; it must be positive: {fit!r}")

    @property
    def roofline(self) -> RooflineModel:
        return self._roofline

    @property
    def latency_fit(self) -> LatencyFit:
        """The offline fit in use (the identity when none was given)."""
        return self._fit if self._fit is not None else LatencyFit.identity()

    @property
    def calibrated(self) -> bool:
        """True when an offline fit was given."""
        return self._fit is not None

    @property
    def ema_alpha(self) -> float:
        return self._ema_alpha

    @property
    def width_buckets(self) -> tuple[int, ...] | None:
        return self._buckets

    @property
    def ema_factor(self) -> float:
        """Multiplicative correction f learned online (1 before any observation)."""
        return self._factor

    @property
    def drift(self) -> float:
        """|f - 1|: how far the observed latency has moved from the offline fit, fraction."""
        return abs(self._factor - 1.0)

    def padded_width(self, s: int) -> int:
        """The verify width a pass of s tokens per request runs at: the smallest bucket >= s (s itself
        without buckets). ValueError when s exceeds the largest bucket."""
        if isinstance(s, bool) or not isinstance(s, Integral) or s < 1:
            raise ValueError(f"s (tokens verified) must be an int >= 1, got {s!r}")
        if self._buckets is None:
            return int(s)
        if s > self._buckets[-1]:
            raise ValueError(f"s = {s} exceeds the largest width bucket; buckets: {list(self._buckets)}")
        return next(b for b in self._buckets if b >= s)

    def _calibrated_seconds(self, width: int, c: int) -> float:
        fit = self.latency_fit
        return fit.apply(self._roofline.compute_seconds(width, c), self._roofline.memory_seconds(width, c))

    def _calibrated_batch_seconds(self, s_per_request: TokenCounts, c_per_request: TokenCounts) -> float:
        s_list = s_per_request.tolist() if isinstance(s_per_request, torch.Tensor) else list(s_per_request)
        if self._buckets is not None and s_list:
            s_list = [self.padded_width(max(s_list))] * len(s_list)
        compute = self._roofline.compute_seconds_batch(s_list, c_per_request)
        memory = self._roofline.memory_seconds_batch(s_list, c_per_request)
        return self.latency_fit.apply(compute, memory)

    def predict(self, s: int, c: int) -> float:
        """Seconds of one verify pass of s tokens over c cached tokens: f × T(padded width, c)."""
        return self._factor * self._calibrated_seconds(self.padded_width(s), c)

    def predict_many(self, s: torch.Tensor, c: int) -> torch.Tensor:
        """Vectorised `predict`. s: [M] int64 widths; c: cached tokens. Returns [M] float64 seconds on s's
        device. Syncs once to the host to check the widths against the buckets."""
        if not isinstance(s, torch.Tensor) or s.dtype != torch.int64 or s.dim() != 1:
            got = f"{s.dtype} {tuple(s.shape)}" if isinstance(s, torch.Tensor) else type(s).__name__
            raise ValueError(f"s must be a 1-D int64 tensor [M], got {got}")
        widths = s
        if self._buckets is not None and self._bucket_tensor is not None and s.numel():
            largest = int(s.max())  # host sync: reject widths beyond the captured buckets
            if largest > self._buckets[-1]:
                raise ValueError(
                    f"s = {largest} exceeds the largest width bucket; buckets: {list(self._buckets)}"
                )
            buckets = self._bucket_tensor.to(s.device)
            widths = buckets[torch.searchsorted(buckets, s, side="left")]
        compute = self._roofline.compute_seconds_many(widths, c)
        memory = self._roofline.memory_seconds_many(widths, c)
        return self._factor * self.latency_fit.apply_many(compute, memory)

    def predict_batch(self, s_per_request: TokenCounts, c_per_request: TokenCounts) -> float:
        """Seconds of one verify pass over a batch. s_per_request, c_per_request: [B] tokens verified and
        cached tokens per request.

        Without buckets each request verifies its own s_i tokens. With buckets the pass runs one captured
        width for the whole batch, the bucket of max_i s_i, so every request is padded to it.
        """
        return self._factor * self._calibrated_batch_seconds(s_per_request, c_per_request)

    def _update(self, seconds: float, predicted: float) -> None:
        self._factor = (1.0 - self._ema_alpha) * self._factor + self._ema_alpha * (seconds / predicted)

    def observe(self, s: int, c: int, seconds: float) -> None:
        """EMA update after a measured pass of s tokens over c cached tokens taking `seconds`:
        f <- (1 - a)·f + a·(seconds / T(padded width, c)). ValueError for non-finite or non-positive seconds.
        """
        _check_seconds(seconds)
        self._update(seconds, self._calibrated_seconds(self.padded_width(s), c))

    def observe_batch(self, s_per_request: TokenCounts, c_per_request: TokenCounts, seconds: float) -> None:
        """`observe` for one measured pass over a batch (padded as in `predict_batch`)."""
        _check_seconds(seconds)
        self._update(seconds, self._calibrated_batch_seconds(s_per_request, c_per_request))

    def fit(self, samples: Sequence[LatencySample]) -> LatencyModel:
        """A new model with `fit_latency(roofline, samples)`, the same roofline, EMA weight and buckets, and
        a fresh EMA factor of 1. Samples are fitted at their measured widths s (no padding)."""
        return LatencyModel(
            self._roofline, fit_latency(self._roofline, samples), self._ema_alpha, self._buckets
        )


def _check_seconds(seconds: float) -> None:
    if isinstance(seconds, bool) or not isinstance(seconds, Real) or not 0 < seconds < math.inf:
        raise ValueError(f"observed seconds must be finite and > 0, got {seconds!r}")
