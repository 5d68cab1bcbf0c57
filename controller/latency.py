"""Calibrated verify latency: the parts of a pass, a non-negative fit on relative error, an online correction.

Model (seconds). A verify pass of B requests, request i verifying s_i tokens over c_i cached tokens, run at
the padded width W (the width bucket the pass runs at: every request is padded to W), so T = B·W tokens:

    T_verify = β_fixed + α_gemm·G(T) + α_tok·min(T, T*) + α_attn·Σ_i F(W, c_i) + α_kv·Σ_i K(W, c_i)

    G(T)     = max(GEMM FLOPs(T) / peak, weight bytes / bandwidth)   linear layers, LM head; weights read once
    T*       = the GEMM ridge: GEMM FLOPs(T*) / peak = weight bytes / bandwidth
    F(s, c)  = attention FLOPs(s, c) / peak = 4·s·(c+s)·h_q·L / peak  one request's attention
    K(s, c)  = KV bytes(s, c) / bandwidth = bp·L·2h_kv·(c+2s) / bw   one request's KV cache

with the parts of `controller.roofline` (no attention score matrix anywhere: fused kernels never write it).
β_fixed (seconds): the per-step fixed cost (launches, scheduling, host work inside the forward). α_gemm,
α_attn, α_kv (dimensionless): how far the engine's GEMMs, attention math and KV-cache handling run from the
measured peaks. α_tok (seconds per token): what a token costs beyond the roofline in a pass narrower than
the GEMM ridge, where the roofline prices the GEMMs at the weight read whatever the tokens but narrow
(small-M) kernels do not stream the weights once and pay per row, and the element-wise and logits work per
token is not hidden under it. Beyond the ridge G itself grows by GEMM FLOPs / peak per token, and α_gemm
weighs that slope. Attention time adds after the GEMMs, rather than hiding under a max of whole-pass totals.

Why the token term stops at the ridge. T = min(T, T*) + max(T - T*, 0) and, beyond the ridge, G grows
linearly in T, so a token term over every T would make the columns 1, G, T, min(T, T*) linearly dependent
(rank 3): coefficients a fit could not pin down. Capped at the ridge, 1, G and min(T, T*) are independent
(for 1 < T* < the widest pass) and describe any piecewise-linear cost in T with a break at the ridge and
non-negative slopes on both sides: below it α_tok, above it α_gemm·GEMM FLOPs / peak per token.

Why this form (and not α_attn·Σ max(F, request bytes) + α_tok·T). Measured on the 2-core CPU
(SmolLM2-135M, fp32, SGLang torch_native, widths 2..64 × contexts 64..1024, 5 interleaved rounds): the
latency rises steeply over the first widths (about 10 ms a token up to the ridge, T* ≈ 10) and then at about
the GEMM FLOP rate (α_gemm ≈ 1.1), which one token slope over all T cannot follow; and the context costs
every request about the same whatever its width (the torch_native backend gathers and copies the KV cache
per layer at ~15× its bandwidth time) while the attention FLOPs grow with s·c: one coefficient on
max(F, bytes) cannot weigh both. On that grid the form above fits with 2.8 % MAPE and predicts left-out
whole widths with 4.1 % and left-out whole contexts with 3.0 % (the worst width, s = 2, the narrowest and
so an extrapolation, 14.6 %); α_attn·Σ max(F, request bytes) + α_tok·T gave 5.6 %, 7.0 % and 5.9 % (s = 2:
21.9 %), the max of two affine maps of eqs. (8) and (9) 7.0 %, 7.8 % and 8.1 %.

All five coefficients are >= 0, so T grows with every width and context; it is > 0 unless all five are 0,
which `LatencyModel` rejects.

Fit. `fit_latency` solves the coefficients by non-negative least squares (`scipy.optimize.nnls`) on
RELATIVE error: each row of [1, G, min(T, T*), ΣF, ΣK] and its observed seconds are divided by the
observed seconds, so a 1 ms pass weighs as much as a 1 s pass; MAPE is what the fit is judged by. The
columns are scaled to unit norm before the solve (and the solution scaled back). `evaluate_fit` reports RMSE
and MAPE of the bare roofline (eqs. 8 and 9, `RooflineModel.verify_seconds_batch`) and of the fit.
`validate_leave_out` refits with each whole width, then each whole context, left out and scores the
left-out samples: it says how the model predicts widths and contexts it never saw, which interleaved
hold-outs do not.

Plain decoding. A plain decode step (one token per request, n = 0: no drafter, no tree) is not a verify of
width 1: it is priced separately, L_AR. `fit_latency` fits it on the samples of mode "decode" (one token,
measured at every context of the calibration grid):

    L_AR(c_1..c_B) = β + α·Σ_i A(1, c_i) + P(B) - P(1)
    A(s, c)        = max(F(s, c), request bytes(s, c) / bandwidth)
    P(T)           = α_gemm·G(T) + α_tok·min(T, T*)    (the verify fit's parts that depend on tokens only)

β, α >= 0 (NNLS, relative error); a batch adds its extra tokens at the verify fit's per-token costs (the
P at B tokens minus P at 1). Without decode samples a calibrated model prices plain decoding
with the verify form at s = 1, and an uncalibrated one with the identity form (β = 0, α_gemm = α_attn =
α_kv = 1, α_tok = 0) at s = 1: the roofline of one token.

Online correction. After each measured pass the model refits a linear map of its own prediction P and the
tokens T of the pass, observed ≈ a·P + d·T, by exponentially weighted least squares on relative error
(`OnlineCorrection`: decay 1 - ema_alpha per observation, so ema_alpha is the weight of the newest
observation) with a constant ridge prior towards a = 1, d = 0. a fixes a change of scale; d, seconds per
token, a change of slope over widths (what the planner's budget choice hinges on), however flat the offline
prediction is there: an affine map a·P + b of the prediction alone can only stretch the slope the model
already has, and where the model is flat (every pass below the GEMM ridge costs about the weight read) it
would need a huge a and a huge negative b that a handful of passes at nearby widths cannot pin down. Both
carry over to widths never observed; one EMA factor per width bucket could fix a slope too, but only at the
buckets the planner happens to run, leaving the widths it is deciding about uncorrected. The prior never
decays, so a run of passes at one width cannot wind the estimate up in the direction it does not see (it
splits the correction between a and d there). What happens next depends on whether the model is calibrated:
- calibrated (an offline fit from a profile): the profile is evidence too. It enters the sums as 1 / ema_alpha
  pseudo-observations at a = 1, d = 0 (the weight an EMA holds in steady state), decaying like measured ones,
  so the measurements take over within a few dozen passes at the default ema_alpha, and a tiny ema_alpha
  keeps the profile (the rule `controller.step_costs` applies to the step costs: one knob for every online
  correction). A cold first pass (allocations, autotuning) cannot rescale such a model.
- uncalibrated (the bare roofline): the first observation's ratio observed / P becomes a base scale that
  every later prediction carries before a and d apply (an uncalibrated roofline of a small model on a CPU is
  off by two orders of magnitude, beyond what a bounded a and a regularised d reach).
Bounds: a in SCALE_BOUNDS, and the corrected prediction is at least CORRECTION_FLOOR × base × P, so it is
never <= 0 (base = 1 for a calibrated model).
Verify passes and plain decode steps (T = B requests) have one correction each; until a plain decode step has
been observed, plain decoding borrows the verify passes' correction. The planner compares the two
(Ŝ = Â·L_AR / Ĉ), and while speculation is off only plain steps are measured: the plain correction follows the
device (a bigger batch, a busier machine, a profile measured while the machine was slower) where the verify
correction cannot. With a profile, which relates the two passes, verify predictions therefore carry the
machine factor m, the plain correction as one factor (1 before any plain step): a verify pass is priced
m·V(P, T), and the verify correction V fits what is left, observed / m ≈ a·P + d·T (m as it stood at each
observation), so its prior (a = 1, d = 0) says "verify passes move as plain steps do" and the planner takes
the current L_AR. On the 2-core CPU demo pair (c = 1, T = 0.7) plain steps ran 0.8× a start-up profile while
the gate kept the drafter off; from the first verified probe on, L_AR followed them while Ĉ, with one verify
pass to learn from, stayed near the profile's 107 ms for a 5-token pass that ran in 86 ms, and the gate vetoed
drafting where `fixed:4` ran 1.14× plain decoding. Where the passes drift apart (at B = 8, priced from a
profile measured at B = 1, plain steps ran 1.8× the profile, verify passes 1.6× and drafter passes 1.7×) m
prices verify passes 12 % high until verify passes are observed: a cautious error, where a current L_AR over a
Ĉ that did not move put Ŝ about 1.7× too high and a probe verified a tree at an estimated 1.08 that cost two
plain steps. Without a profile the bare roofline does not relate the two passes: there m is 1 and the planner
prices L_AR with the plain correction as it stood at the last verify observation
(`predict_plain_batch_as_of_verify`), once a plain step was observed before the last verify pass. `ema_factor`
summarises the verify correction as a factor at its typical point: m·(a·P̄ + d·T̄) / P̄, with P̄ and T̄ the
weighted means of the predictions and tokens V saw.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from numbers import Integral, Real
from typing import Literal

import numpy as np
import torch
from pydantic import BaseModel, ConfigDict, Field, FiniteFloat, model_validator
from scipy.optimize import nnls

from bastion_sglang.controller.roofline import PassTerms, RooflineModel, TokenCounts
from bastion_sglang.controller.verify_passes import PassPrices, VerifyPasses, check_contexts

SCALE_BOUNDS = (0.1, 10.0)
"""Range of the online correction's scale a."""
CORRECTION_FLOOR = 0.1
"""The corrected prediction is at least this fraction of the offline one (so it stays > 0)."""
FIXED_TABLE_TOKENS = 4096
"""`predict_widths` looks up the parts of a pass that depend on its tokens alone up to this many tokens (a
table of that many floats, built once per model)."""
PRIOR_WEIGHT = 0.01
"""Weight of the online correction's prior (a = 1, b = 0), in observations; it never decays."""

Mode = Literal["verify", "decode"]


class LatencySample(BaseModel):
    """One measured pass: `batch` requests, each with s tokens over c cached tokens.

    mode "verify": a target verify pass of s tokens per request (s >= 2 for a speculative step: the root
    and at least one draft node). mode "decode": a plain decode step (s = 1: one token per request).
    """

    model_config = ConfigDict(frozen=True, strict=True, extra="forbid")

    s: int = Field(ge=1, description="tokens per request in the pass")
    c: int = Field(ge=0, description="cached context tokens per request")
    seconds: FiniteFloat = Field(gt=0, description="measured wall time of the pass, seconds")
    batch: int = Field(default=1, ge=1, description="requests in the pass")
    mode: Mode = Field(default="verify", description="verify pass or plain decode step")

    @model_validator(mode="after")
    def _decode_is_one_token(self) -> LatencySample:
        if self.mode == "decode" and self.s != 1:
            raise ValueError(f"a decode sample has s = 1 (one token per request), got s = {self.s}")
        return self


class DecodeFit(BaseModel):
    """L_AR(c) = β + α·A(1, c) for one plain decode step (module docstring); β seconds, α dimensionless."""

    model_config = ConfigDict(frozen=True, strict=True, extra="forbid")

    beta: FiniteFloat = Field(ge=0, description="fixed seconds of a plain decode step")
    alpha_attn: FiniteFloat = Field(ge=0, description="weight of the attention part A(1, c)")


class LatencyFit(BaseModel):
    """T = β_fixed + α_gemm·G + α_tok·min(T, T*) + α_attn·ΣF + α_kv·ΣK (module docstring), and the plain
    decode fit."""

    model_config = ConfigDict(frozen=True, strict=True, extra="forbid")

    beta_fixed: FiniteFloat = Field(ge=0, description="fixed seconds per verify pass")
    alpha_gemm: FiniteFloat = Field(ge=0, description="weight of the GEMM part G")
    alpha_tok: FiniteFloat = Field(ge=0, description="seconds per token of the pass, up to the GEMM ridge")
    alpha_attn: FiniteFloat = Field(ge=0, description="weight of the attention FLOPs part ΣF")
    alpha_kv: FiniteFloat = Field(ge=0, description="weight of the KV-cache bytes part ΣK")
    decode: DecodeFit | None = Field(default=None, description="plain decode fit (None: not measured)")

    @classmethod
    def identity(cls) -> LatencyFit:
        """β = 0, α_gemm = α_attn = α_kv = 1, α_tok = 0, no decode fit: the roofline's parts, added."""
        return cls(beta_fixed=0.0, alpha_gemm=1.0, alpha_tok=0.0, alpha_attn=1.0, alpha_kv=1.0)

    def coefficients(self) -> tuple[float, ...]:
        """(β_fixed, α_gemm, α_tok, α_attn, α_kv): the order of `_verify_design`'s columns."""
        return (
            self.beta_fixed,
            self.alpha_gemm,
            self.alpha_tok,
            self.alpha_attn,
            self.alpha_kv,
        )

    def seconds(self, terms: PassTerms) -> float:
        """Calibrated seconds of a pass from its roofline parts."""
        return (
            self.beta_fixed
            + self.alpha_gemm * terms.gemm_seconds
            + self.alpha_tok * terms.narrow_tokens
            + self.alpha_attn * terms.attention_compute_seconds
            + self.alpha_kv * terms.kv_seconds
        )

    def per_token_seconds(self, roofline: RooflineModel, tokens: int) -> float:
        """The parts of `seconds` that depend on the pass's total tokens only: α_gemm·G(T) + α_tok·min(T, T*)
        at T = tokens."""
        return self.alpha_gemm * roofline.gemm_seconds(tokens) + self.alpha_tok * min(
            float(tokens), roofline.gemm_ridge_tokens()
        )


IDENTITY_FIT = LatencyFit.identity()
"""The fit an uncalibrated model prices with (built once: a frozen value)."""


class FitReport(BaseModel):
    """Errors of the bare roofline (raw) and of the calibrated fit on a set of samples, in sample."""

    model_config = ConfigDict(frozen=True, strict=True, extra="forbid")

    num_samples: int = Field(ge=1, description="verify samples")
    rmse_raw: FiniteFloat = Field(ge=0, description="seconds")
    mape_raw: FiniteFloat = Field(ge=0, description="mean |predicted - observed| / observed, fraction")
    rmse_fit: FiniteFloat = Field(ge=0, description="seconds")
    mape_fit: FiniteFloat = Field(ge=0, description="fraction")
    num_decode_samples: int = Field(default=0, ge=0, description="plain decode samples")
    mape_decode_raw: FiniteFloat | None = Field(default=None, ge=0, description="fraction; None: no samples")
    mape_decode_fit: FiniteFloat | None = Field(default=None, ge=0, description="fraction; None: no samples")


class LeaveOutFold(BaseModel):
    """One fold of `validate_leave_out`: the samples of one width (or context), predicted by a fit without
    them."""

    model_config = ConfigDict(frozen=True, strict=True, extra="forbid")

    held_out: int = Field(ge=0, description="the width s or context c left out")
    num_samples: int = Field(ge=1)
    mape: FiniteFloat = Field(ge=0, description="fraction")


class LeaveOutReport(BaseModel):
    """Leave-one-width-out and leave-one-context-out MAPE of the fit (None: fewer than two values to
    split)."""

    model_config = ConfigDict(frozen=True, strict=True, extra="forbid")

    widths: list[LeaveOutFold] = Field(description="verify samples, one fold per width")
    mape_widths: FiniteFloat | None = Field(ge=0, description="over every verify sample, fraction")
    contexts: list[LeaveOutFold] = Field(description="verify samples, one fold per context")
    mape_contexts: FiniteFloat | None = Field(ge=0, description="over every verify sample, fraction")
    decode_contexts: list[LeaveOutFold] = Field(
        default_factory=list, description="decode samples, one fold per context"
    )
    mape_decode_contexts: FiniteFloat | None = Field(default=None, ge=0, description="fraction")


def _check_samples(samples: Sequence[LatencySample], minimum: int, purpose: str) -> list[LatencySample]:
    """The verify samples of `samples`; ValueError unless every item is a LatencySample and there are at
    least `minimum` verify samples."""
    for i, sample in enumerate(samples):
        if not isinstance(sample, LatencySample):
            raise ValueError(f"samples[{i}] must be a LatencySample, got {type(sample).__name__}")
    verify = [sample for sample in samples if sample.mode == "verify"]
    if len(verify) < minimum:
        raise ValueError(f"{purpose} needs at least {minimum} verify latency samples, got {len(verify)}")
    return verify


def _sample_terms(roofline: RooflineModel, sample: LatencySample) -> PassTerms:
    return roofline.pass_terms_batch([sample.s] * sample.batch, [sample.c] * sample.batch)


def _verify_design(roofline: RooflineModel, samples: Sequence[LatencySample]) -> np.ndarray:
    """[n, 5] float64 rows (1, G, min(T, T*), ΣF, ΣK) of verify samples."""
    rows = []
    for sample in samples:
        terms = _sample_terms(roofline, sample)
        rows.append(
            (
                1.0,
                terms.gemm_seconds,
                terms.narrow_tokens,
                terms.attention_compute_seconds,
                terms.kv_seconds,
            )
        )
    return np.array(rows, dtype=np.float64).reshape(-1, 5)


def _observed(samples: Sequence[LatencySample]) -> np.ndarray:
    return np.array([sample.seconds for sample in samples], dtype=np.float64)


def _nnls(design: np.ndarray, target: np.ndarray, observed: np.ndarray, relative: bool) -> np.ndarray:
    """x >= 0 minimising Σ_i w_i²(design_i·x - target_i)², w_i = 1 / observed_i (relative) or 1."""
    weights = 1.0 / observed if relative else np.ones_like(observed)
    matrix = design * weights[:, None]
    norms = np.linalg.norm(matrix, axis=0)
    norms[norms == 0] = 1.0
    solution, _ = nnls(matrix / norms, target * weights, maxiter=50 * design.shape[1])
    return solution / norms


def _fit_verify(roofline: RooflineModel, samples: Sequence[LatencySample], relative: bool) -> LatencyFit:
    """The verify coefficients (no decode fit) of `samples` by NNLS."""
    design = _verify_design(roofline, samples)
    observed = _observed(samples)
    solution = [float(x) for x in _nnls(design, observed, observed, relative)]
    if not any(solution):
        raise ValueError("the latency fit found no non-negative coefficients that predict the samples")
    beta, gemm, tok, attn, kv = solution
    return LatencyFit(beta_fixed=beta, alpha_gemm=gemm, alpha_tok=tok, alpha_attn=attn, alpha_kv=kv)


def _plain_extra(fit: LatencyFit, roofline: RooflineModel, requests: int) -> float:
    """Seconds a plain decode step of `requests` requests adds over one request, beyond attention."""
    if requests == 1:
        return 0.0
    return fit.per_token_seconds(roofline, requests) - fit.per_token_seconds(roofline, 1)


def _fit_decode(
    roofline: RooflineModel, verify: LatencyFit, samples: Sequence[LatencySample], relative: bool
) -> DecodeFit:
    design = np.array(
        [(1.0, x.batch * roofline.attention_seconds(1, x.c)) for x in samples], dtype=np.float64
    ).reshape(-1, 2)
    observed = _observed(samples)
    extra = np.array([_plain_extra(verify, roofline, x.batch) for x in samples], dtype=np.float64)
    beta, alpha = (float(x) for x in _nnls(design, observed - extra, observed, relative))
    if beta == alpha == 0.0:
        raise ValueError("the plain decode fit found no non-negative coefficients that predict the samples")
    return DecodeFit(beta=beta, alpha_attn=alpha)


def fit_latency(
    roofline: RooflineModel, samples: Sequence[LatencySample], *, relative: bool = True
) -> LatencyFit:
    """Non-negative least-squares fit of the module's model to measured passes (verify samples: the verify
    coefficients; decode samples, if any: the plain decode fit). Samples are fitted at their measured
    widths s. relative: minimise relative error (the default; False: absolute error in seconds, only to
    compare). Raises ValueError for fewer than 2 verify samples."""
    verify = _check_samples(samples, 2, "fitting")
    fit = _fit_verify(roofline, verify, relative)
    decode = [sample for sample in samples if sample.mode == "decode"]
    if not decode:
        return fit
    return fit.model_copy(update={"decode": _fit_decode(roofline, fit, decode, relative)})


def _predicted(roofline: RooflineModel, fit: LatencyFit, sample: LatencySample) -> float:
    """The fit's seconds for one sample (verify or decode), no padding, no online correction."""
    if sample.mode == "verify" or fit.decode is None:
        return fit.seconds(_sample_terms(roofline, sample))
    attention = sample.batch * roofline.attention_seconds(1, sample.c)
    return fit.decode.beta + fit.decode.alpha_attn * attention + _plain_extra(fit, roofline, sample.batch)


def _mape(predicted: np.ndarray, observed: np.ndarray) -> float:
    return float(np.mean(np.abs(predicted - observed) / observed))


def evaluate_fit(roofline: RooflineModel, fit: LatencyFit, samples: Sequence[LatencySample]) -> FitReport:
    """RMSE (seconds) and MAPE (fraction) of the bare roofline (eqs. 8, 9) and of `fit` on the verify
    samples, and MAPE of both on the decode samples (the roofline at s = 1 vs the plain decode fit)."""
    verify = _check_samples(samples, 1, "evaluate_fit")
    observed = _observed(verify)
    raw = np.array([roofline.verify_seconds_batch([x.s] * x.batch, [x.c] * x.batch) for x in verify])
    fitted = np.array([_predicted(roofline, fit, x) for x in verify])
    decode = [sample for sample in samples if sample.mode == "decode"]
    decode_raw = decode_fit = None
    if decode:
        decode_observed = _observed(decode)
        decode_raw = _mape(
            np.array([roofline.verify_seconds_batch([1] * x.batch, [x.c] * x.batch) for x in decode]),
            decode_observed,
        )
        decode_fit = _mape(np.array([_predicted(roofline, fit, x) for x in decode]), decode_observed)
    return FitReport(
        num_samples=len(verify),
        rmse_raw=float(np.sqrt(np.mean((raw - observed) ** 2))),
        mape_raw=_mape(raw, observed),
        rmse_fit=float(np.sqrt(np.mean((fitted - observed) ** 2))),
        mape_fit=_mape(fitted, observed),
        num_decode_samples=len(decode),
        mape_decode_raw=decode_raw,
        mape_decode_fit=decode_fit,
    )


def _leave_out(
    samples: Sequence[LatencySample],
    key: Callable[[LatencySample], int],
    refit: Callable[[list[LatencySample]], Callable[[LatencySample], float]],
) -> tuple[list[LeaveOutFold], float | None]:
    """Folds of `samples` by `key`: refit on all other values, predict the left-out ones."""
    values = sorted({key(sample) for sample in samples})
    if len(values) < 2:
        return [], None
    folds, errors = [], []
    for value in values:
        held = [sample for sample in samples if key(sample) == value]
        predict = refit([sample for sample in samples if key(sample) != value])
        fold_errors = [abs(predict(x) - x.seconds) / x.seconds for x in held]
        errors.extend(fold_errors)
        folds.append(LeaveOutFold(held_out=value, num_samples=len(held), mape=float(np.mean(fold_errors))))
    return folds, float(np.mean(errors))


def validate_leave_out(
    roofline: RooflineModel, samples: Sequence[LatencySample], *, relative: bool = True
) -> LeaveOutReport:
    """Leave-out validation of `fit_latency` (module docstring): for each width s of the verify samples, refit
    the verify coefficients without every sample of that width and predict them; the same per context c;
    and per context for the plain decode fit (its batch extra from the verify fit on all samples). The
    overall MAPE of a family is over all its samples, each predicted once. Raises ValueError for fewer than
    2 verify samples."""
    verify = _check_samples(samples, 2, "leave-out validation")

    def refit_verify(train: list[LatencySample]) -> Callable[[LatencySample], float]:
        fit = _fit_verify(roofline, train, relative)
        return lambda sample: _predicted(roofline, fit, sample)

    widths, mape_widths = _leave_out(verify, lambda x: x.s, refit_verify)
    contexts, mape_contexts = _leave_out(verify, lambda x: x.c, refit_verify)
    decode = [sample for sample in samples if sample.mode == "decode"]
    full = fit_latency(roofline, verify, relative=relative)

    def refit_decode(train: list[LatencySample]) -> Callable[[LatencySample], float]:
        fit = full.model_copy(update={"decode": _fit_decode(roofline, full, train, relative)})
        return lambda sample: _predicted(roofline, fit, sample)

    decode_contexts, mape_decode = _leave_out(decode, lambda x: x.c, refit_decode)
    return LeaveOutReport(
        widths=widths,
        mape_widths=mape_widths,
        contexts=contexts,
        mape_contexts=mape_contexts,
        decode_contexts=decode_contexts,
        mape_decode_contexts=mape_decode,
    )


def validate_width_buckets(width_buckets: Sequence[int], lowest: int = 1) -> tuple[int, ...]:
    """Buckets as a tuple; ValueError unless they are non-empty, sorted, duplicate-free ints >= lowest.
    The one check of verify width buckets (tokens per request, root included): the latency model and the
    profile take 1 (the plain decode width), the configuration and the bucketed policy start at 2."""
    buckets = tuple(width_buckets)
    if (
        not buckets
        or any(isinstance(b, bool) or not isinstance(b, Integral) or b < lowest for b in buckets)
        or list(buckets) != sorted(set(buckets))
    ):
        raise ValueError(
            f"width_buckets must be sorted, unique ints >= {lowest}, got {list(width_buckets)!r}"
        )
    return tuple(int(b) for b in buckets)


def _check_ema_alpha(ema_alpha: float) -> float:
    if isinstance(ema_alpha, bool) or not isinstance(ema_alpha, Real) or not 0 < ema_alpha <= 1:
        raise ValueError(f"ema_alpha must be in (0, 1], got {ema_alpha!r}")
    return float(ema_alpha)


class OnlineCorrection:
    """observed ≈ a·predicted + d·tokens, fitted online (module docstring: "Online correction").

    Exponentially weighted least squares on relative error, (p/y, n/y)·(a, d) ≈ 1 for each observation
    (p predicted seconds, n tokens of the pass, y observed seconds), with the weighted sums decayed by
    1 - ema_alpha per observation and a prior w·[(a - 1)² + (d·n̄ / p̄)²] (p̄, n̄: the weighted means of
    the predictions and tokens) with w = PRIOR_WEIGHT, which never decays, plus `prior_weight`, which decays
    like an observation. rescale: the first observation's observed / predicted ratio becomes the base scale
    (for an uncalibrated model); otherwise the base stays 1.
    """

    __slots__ = (
        "_a",
        "_base",
        "_d",
        "_decay",
        "_g11",
        "_g12",
        "_g22",
        "_observations",
        "_prior",
        "_r1",
        "_r2",
        "_rescale",
        "_sn",
        "_sp",
        "_sw",
    )

    def __init__(self, ema_alpha: float = 0.1, prior_weight: float = 0.0, rescale: bool = True) -> None:
        self._decay = 1.0 - _check_ema_alpha(ema_alpha)
        if (
            isinstance(prior_weight, bool)
            or not isinstance(prior_weight, Real)
            or not 0 <= prior_weight < math.inf
        ):
            raise ValueError(f"prior_weight must be finite and >= 0, got {prior_weight!r}")
        self._prior = float(prior_weight)
        self._rescale = rescale
        self._g11 = self._g12 = self._g22 = self._r1 = self._r2 = self._sw = self._sp = self._sn = 0.0
        self._a, self._d = 1.0, 0.0
        self._base = 1.0
        self._observations = 0

    @property
    def scale(self) -> float:
        """a (1 before any observation)."""
        return self._a

    @property
    def per_token(self) -> float:
        """d, seconds per token (0 before any observation)."""
        return self._d

    @property
    def observations(self) -> int:
        return self._observations

    @property
    def reference(self) -> tuple[float, float] | None:
        """(p̄ seconds, n̄ tokens): the weighted means of the base-scaled predictions and the tokens observed
        (None before any observation)."""
        return (self._sp / self._sw, self._sn / self._sw) if self._sw > 0 else None

    @property
    def factor(self) -> float:
        """(a·p̄ + d·n̄) / (p̄ / base): the correction as a factor over the offline prediction at its typical
        point (p̄ base-scaled; 1 before any observation)."""
        reference = self.reference
        if reference is None:
            return 1.0
        scaled, tokens = reference
        offline = scaled / self._base  # the reference holds base-scaled predictions
        return self.correct(offline, tokens) / offline

    @property
    def base(self) -> float:
        """With `rescale`, the first observation's observed / predicted ratio, which every prediction is
        scaled by before a and d apply (1 before any observation): one pass fixes a scale error of any size
        (an uncalibrated roofline can be off by orders of magnitude), and a and d refine it within their
        bounds. Without `rescale`, 1."""
        return self._base

    def copy(self) -> OnlineCorrection:
        """An independent correction in this one's state (later updates of either leave the other)."""
        twin = OnlineCorrection.__new__(OnlineCorrection)
        for name in OnlineCorrection.__slots__:
            setattr(twin, name, getattr(self, name))
        return twin

    def correct(self, predicted: float, tokens: float) -> float:
        """max(a·base·predicted + d·tokens, CORRECTION_FLOOR·base·predicted), seconds."""
        predicted = self._base * predicted
        return max(self._a * predicted + self._d * tokens, CORRECTION_FLOOR * predicted)

    def correct_array(self, predicted: np.ndarray, tokens: np.ndarray) -> np.ndarray:
        """Elementwise `correct` on the host: [M] float64 seconds and [M] float64 tokens -> [M] float64
        seconds (the same operations, so the same values)."""
        predicted = self._base * predicted
        return np.maximum(self._a * predicted + self._d * tokens, CORRECTION_FLOOR * predicted)

    def update(self, predicted: float, tokens: float, observed: float) -> None:
        """Add one observation (predicted and observed seconds > 0, tokens >= 1) and refit a and d."""
        if self._observations == 0 and self._rescale:
            self._base = observed / predicted
        predicted = self._base * predicted
        decay = self._decay
        x1, x2 = predicted / observed, tokens / observed
        self._g11 = decay * self._g11 + x1 * x1
        self._g12 = decay * self._g12 + x1 * x2
        self._g22 = decay * self._g22 + x2 * x2
        self._r1 = decay * self._r1 + x1
        self._r2 = decay * self._r2 + x2
        self._sw = decay * self._sw + 1.0
        self._sp = decay * self._sp + predicted
        self._sn = decay * self._sn + tokens
        self._prior *= decay
        self._observations += 1
        scale = (self._sn / self._sp) ** 2  # (n̄ / p̄)²: d in units of a
        prior = PRIOR_WEIGHT + self._prior
        m11 = self._g11 + prior
        m22 = self._g22 + prior * scale
        determinant = m11 * m22 - self._g12 * self._g12
        a = ((self._r1 + prior) * m22 - self._g12 * self._r2) / determinant
        low, high = SCALE_BOUNDS
        self._a = min(max(a, low), high)
        self._d = (self._r2 - self._g12 * self._a) / m22  # the best d for this a


class LatencyModel:
    """Predicted seconds of verify passes (at the padded width) and plain decode steps, corrected online.

    Everything but the online corrections is fixed at construction; `observe*` update them in place.
    ema_alpha: weight of the newest observation in the online corrections, in (0, 1].
    width_buckets: the verify widths passes run at (tokens per request), sorted and unique; None: no padding.
    """

    __slots__ = (
        "_bucket_array",
        "_buckets",
        "_ema_alpha",
        "_fit",
        "_plain",
        "_plain_at_verify",
        "_plain_memo",
        "_prices",
        "_roofline",
        "_token_table",
        "_verify",
    )

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
        self._roofline = roofline
        self._prices = PassPrices.of(roofline)
        self._fit = fit
        self._token_table = self._token_seconds(np.arange(FIXED_TABLE_TOKENS + 1, dtype=np.float64))
        self._ema_alpha = _check_ema_alpha(ema_alpha)
        self._buckets = None if width_buckets is None else validate_width_buckets(width_buckets)
        self._bucket_array = None if self._buckets is None else np.array(self._buckets, dtype=np.int64)
        self._verify = self._new_correction()
        self._plain = self._new_correction()
        # without a profile, the plain correction as it stood at the last verify observation (as it started
        # before any); None: the current one (always with a profile; without one, no plain step observed
        # since: copied when the next one comes)
        self._plain_at_verify: OnlineCorrection | None = None if fit is not None else self._plain.copy()
        self._plain_memo: tuple[tuple[int, ...], float] | None = None  # the last batch's `_plain_seconds`
        floors = (("verify", self._verify_seconds(1, 0)), ("plain decode", self._plain_seconds([0])))
        for what, floor in floors:
            if not floor > 0:
                raise ValueError(
                    f"the latency fit predicts {floor} s for a {what} pass at s=1, c=0; it must be positive: "
                    f"{fit!r}"
                )

    def _new_correction(self) -> OnlineCorrection:
        """A calibrated model's correction starts from its profile (1 / ema_alpha decaying pseudo-observations
        at a = 1, d = 0); an uncalibrated one's from the first pass's ratio (module docstring)."""
        if self._fit is None:
            return OnlineCorrection(self._ema_alpha)
        return OnlineCorrection(self._ema_alpha, prior_weight=1.0 / self._ema_alpha, rescale=False)

    @property
    def roofline(self) -> RooflineModel:
        return self._roofline

    @property
    def latency_fit(self) -> LatencyFit:
        """The offline fit in use (the identity when none was given)."""
        return self._fit if self._fit is not None else IDENTITY_FIT

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
    def verify_correction(self) -> OnlineCorrection:
        """The online correction of verify passes."""
        return self._verify

    @property
    def plain_correction(self) -> OnlineCorrection:
        """The online correction of plain decode steps."""
        return self._plain

    @property
    def ema_factor(self) -> float:
        """The verify correction as one factor at its typical point, the machine factor included (1 before
        any observation)."""
        return self.machine_factor * self._verify.factor

    @property
    def drift(self) -> float:
        """|ema_factor - 1|: how far the observed verify latency has moved from the offline fit, fraction."""
        return abs(self.ema_factor - 1.0)

    @property
    def machine_factor(self) -> float:
        """The machine factor m verify predictions carry (module docstring, "Online correction"): a calibrated
        model's plain correction as one factor, once a plain step was observed; else 1."""
        if self._fit is None or not self._plain.observations:
            return 1.0
        return self._plain.factor

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

    def _verify_seconds(self, width: int, c: int) -> float:
        return self.latency_fit.seconds(self._roofline.pass_terms(width, c))

    def _verify_batch_terms(self, s_per_request: TokenCounts, c_per_request: TokenCounts) -> PassTerms:
        s_list = s_per_request.tolist() if isinstance(s_per_request, torch.Tensor) else list(s_per_request)
        if self._buckets is not None and s_list:
            s_list = [self.padded_width(max(s_list))] * len(s_list)
        return self._roofline.pass_terms_batch(s_list, c_per_request)

    def _plain_seconds(self, contexts: list[int]) -> float:
        """Offline seconds of a plain decode step over `contexts` ([B] cached tokens, checked), before the
        online correction. The last batch's value is kept: a decode step prices its plain step for the
        planner and for the step record, then observes it, all at the same contexts."""
        key = tuple(contexts)
        if self._plain_memo is not None and self._plain_memo[0] == key:
            return self._plain_memo[1]
        fit = self.latency_fit
        terms = self._roofline.plain_pass_terms(contexts)
        if fit.decode is None:
            seconds = fit.seconds(terms)
        else:
            extra = _plain_extra(fit, self._roofline, len(contexts))
            seconds = fit.decode.beta + fit.decode.alpha_attn * terms.attention_seconds + extra
        self._plain_memo = (key, seconds)
        return seconds

    def predict(self, s: int, c: int) -> float:
        """Seconds of one verify pass of s tokens over c cached tokens, at the padded width, corrected."""
        width = self.padded_width(s)
        return self.machine_factor * self._verify.correct(self._verify_seconds(width, c), width)

    def predict_many(self, s: torch.Tensor, c: int) -> torch.Tensor:
        """Vectorised `predict`. s: [M] int64 widths; c: cached tokens. Returns [M] float64 seconds on s's
        device (the values of `predict`). Syncs once to the host: the widths are priced there."""
        if not isinstance(s, torch.Tensor) or s.dtype != torch.int64 or s.dim() != 1:
            got = f"{s.dtype} {tuple(s.shape)}" if isinstance(s, torch.Tensor) else type(s).__name__
            raise ValueError(f"s must be a 1-D int64 tensor [M], got {got}")
        host = s.detach().cpu().numpy()  # host sync: planning is host-side
        widths = self.padded_widths(host)
        if host.size and int(host.min()) < 1:
            raise ValueError(f"s (tokens verified) must be >= 1, got min {int(host.min())}")
        passes = VerifyPasses.common(widths, check_contexts([c]))
        return torch.from_numpy(self.predict_passes(passes)).to(s.device)

    def padded_widths(self, s: np.ndarray) -> np.ndarray:
        """Vectorised `padded_width` on the host: [M] int64 tokens per request -> [M] int64 widths the passes
        run at (s itself without buckets). ValueError naming the largest s when it exceeds the largest
        bucket."""
        buckets = self._bucket_array
        if buckets is None or s.size == 0:
            return s
        largest = int(s.max())
        if largest > buckets[-1]:
            raise ValueError(
                f"s = {largest} exceeds the largest width bucket; buckets: {list(self._buckets)}"
            )
        return buckets[buckets.searchsorted(s, side="left")]

    def predict_passes(self, passes: VerifyPasses) -> np.ndarray:
        """Seconds of M verify passes over one batch (`VerifyPasses` at the widths the passes run at: see
        `padded_widths`), corrected online: [M] float64.

        Each equals `predict_batch` of the same pass bit for bit while the FLOP, element and token counts stay
        below 2^53: the counts are exact integers, rounded once, then go through the same float operations.
        """
        prices, fit = self._prices, self.latency_fit
        # float64 copies of the counts: exact below 2^53, so each product is the exact count, rounded once
        tokens = passes.tokens.astype(np.float64)
        attention = passes.attention_pairs.astype(np.float64) * prices.attention_flops_per_pair
        kv_bytes = prices.bytes_per_element * (
            passes.kv_tokens.astype(np.float64) * prices.kv_elements_per_token
        )
        seconds = (
            self._token_seconds(tokens)
            + fit.alpha_attn * (attention / prices.peak_flops)
            + fit.alpha_kv * (kv_bytes / prices.bandwidth)
        )
        return self.machine_factor * self._verify.correct_array(seconds, tokens)

    def predict_widths(self, s: np.ndarray, c: int) -> np.ndarray:
        """Seconds of single-request verify passes of s[m] tokens over c cached tokens, corrected online:
        [M] float64, the values of `predict_passes` for those passes bit for bit.

        s: [M] int64 widths the passes run at (`padded_widths`), ascending; c: cached tokens (checked by the
        caller). The one-request curve of the adaptive planner: the parts that depend on the tokens alone
        come from the table built at construction (widths up to FIXED_TABLE_TOKENS), the rest as in
        `predict_passes` (the same operations on the same exact counts).
        """
        table = self._token_table
        if s.size == 0 or s[-1] >= table.shape[0]:
            return self.predict_passes(VerifyPasses.common(s, np.array([c], dtype=np.int64)))
        prices, fit = self._prices, self.latency_fit
        tokens = s.astype(np.float64)
        attention = tokens * (c + tokens) * prices.attention_flops_per_pair  # s·(c + s), exact, then priced
        kv_bytes = prices.bytes_per_element * ((c + 2 * tokens) * prices.kv_elements_per_token)
        seconds = (
            table[s]
            + fit.alpha_attn * (attention / prices.peak_flops)
            + fit.alpha_kv * (kv_bytes / prices.bandwidth)
        )
        return self.machine_factor * self._verify.correct_array(seconds, tokens)

    def _token_seconds(self, tokens: np.ndarray) -> np.ndarray:
        """β_fixed + α_gemm·G(T) + α_tok·min(T, T*), the fit's parts that depend on a pass's tokens alone.
        tokens: [M] float64 T (exact integers) -> [M] float64 seconds."""
        prices, fit = self._prices, self.latency_fit
        gemm = np.maximum(tokens * prices.gemm_flops_per_token / prices.peak_flops, prices.weight_seconds)
        return (
            fit.beta_fixed + fit.alpha_gemm * gemm + fit.alpha_tok * np.minimum(tokens, prices.ridge_tokens)
        )

    def predict_batch(self, s_per_request: TokenCounts, c_per_request: TokenCounts) -> float:
        """Seconds of one verify pass over a batch. s_per_request, c_per_request: [B] tokens verified and
        cached tokens per request.

        Without buckets each request verifies its own s_i tokens. With buckets the pass runs one captured
        width for the whole batch, the bucket of max_i s_i, so every request is padded to it.
        """
        terms = self._verify_batch_terms(s_per_request, c_per_request)
        return self.machine_factor * self._verify.correct(self.latency_fit.seconds(terms), terms.tokens)

    def predict_plain(self, c: int) -> float:
        """Seconds of one plain decode step (one token) over c cached tokens, corrected online."""
        return self.predict_plain_batch([c])

    def predict_plain_batch(self, contexts: TokenCounts) -> float:
        """Seconds of one plain decode step over a batch: one token for each request, contexts: [B] cached
        tokens per request."""
        return self._plain_prediction(self._plain, contexts)

    def predict_plain_batch_as_of_verify(self, contexts: TokenCounts) -> float:
        """The L_AR the planner's Ŝ compares with verify passes (module docstring, "Online correction"). With
        a profile, `predict_plain_batch`: verify predictions carry the plain steps' machine factor, so the two
        age alike. Without one, the plain correction as it stood at the last verify observation (as it
        started before any): the L_AR whose evidence is as old as the verify predictions'; equal to
        `predict_plain_batch` while every step verifies, and the current L_AR when no plain step had been
        observed by then: the bare roofline does not relate the two passes (a DECODE step of a tiny model on
        a CPU measured 4× what the verify passes' correction made of its roofline), so nothing of that age
        prices a plain step."""
        plain = self._plain if self._plain_at_verify is None else self._plain_at_verify
        if not plain.observations and not self.calibrated:
            plain = self._plain
        return self._plain_prediction(plain, contexts)

    def _plain_prediction(self, plain: OnlineCorrection, contexts: TokenCounts) -> float:
        c_list = _check_contexts(contexts)
        # before any plain step was measured, the verify passes' correction is the best evidence of how far
        # the offline model is from this device (an uncalibrated roofline can be off by orders of magnitude)
        correction = plain if plain.observations else self._verify
        return correction.correct(self._plain_seconds(c_list), len(c_list))

    def observe(self, s: int, c: int, seconds: float) -> None:
        """Online update after a measured verify pass of s tokens over c cached tokens taking `seconds`
        (compared with the offline prediction at the padded width). ValueError for non-finite or
        non-positive seconds."""
        _check_seconds(seconds)
        width = self.padded_width(s)
        self._verify.update(self._verify_seconds(width, c), width, float(seconds) / self.machine_factor)
        self._plain_at_verify = None

    def observe_batch(self, s_per_request: TokenCounts, c_per_request: TokenCounts, seconds: float) -> None:
        """`observe` for one measured verify pass over a batch (padded as in `predict_batch`)."""
        _check_seconds(seconds)
        terms = self._verify_batch_terms(s_per_request, c_per_request)
        observed = float(seconds) / self.machine_factor
        self._verify.update(self.latency_fit.seconds(terms), terms.tokens, observed)
        self._plain_at_verify = None

    def observe_plain(self, c: int, seconds: float) -> None:
        """Online update after a measured plain decode step of one request over c cached tokens."""
        self.observe_plain_batch([c], seconds)

    def observe_plain_batch(self, contexts: TokenCounts, seconds: float) -> None:
        """Online update after a measured plain decode step over a batch, contexts: [B] cached tokens."""
        _check_seconds(seconds)
        c_list = _check_contexts(contexts)
        if self._plain_at_verify is None and not self.calibrated:
            self._plain_at_verify = self._plain.copy()
        self._plain.update(self._plain_seconds(c_list), len(c_list), float(seconds))

    def fit(self, samples: Sequence[LatencySample]) -> LatencyModel:
        """A new model with `fit_latency(roofline, samples)`, the same roofline, EMA weight and buckets, and
        fresh online corrections. Samples are fitted at their measured widths s (no padding)."""
        return LatencyModel(
            self._roofline, fit_latency(self._roofline, samples), self._ema_alpha, self._buckets
        )


def _check_contexts(contexts: TokenCounts) -> list[int]:
    c_list = contexts.tolist() if isinstance(contexts, torch.Tensor) else list(contexts)
    if not c_list:
        raise ValueError("a plain decode step needs at least one request, got no contexts")
    if all(type(c) is int and c >= 0 for c in c_list):  # the common case, without the ABC checks below
        return c_list
    for c in c_list:
        if isinstance(c, bool) or not isinstance(c, Integral) or c < 0:
            raise ValueError(f"c (cached context tokens) must be an int >= 0, got {c!r}")
    return [int(c) for c in c_list]


def _check_seconds(seconds: float) -> None:
    if isinstance(seconds, bool) or not isinstance(seconds, Real) or not 0 < seconds < math.inf:
        raise ValueError(f"observed seconds must be finite and > 0, got {seconds!r}")
