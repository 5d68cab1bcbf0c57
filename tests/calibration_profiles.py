"""Synthetic calibration profiles for the calibration tests: known latencies, no measurement.

`synthetic_samples(fit)` gives the exact verify and plain decode seconds a known latency fit predicts for a
Qwen3-8B shape on an H100 datasheet spec; `make_profile(**metadata_changes)` fits them through the calibrate
CLI's own path (`calibration.fitting.build_profile`) with a metadata record that tests change field by field.
`save_serving_profile(path)` writes the profile of a memory-bound serving engine (SERVING_FIT), for Engines
whose adaptive plans must not depend on this machine's timings.
"""

from __future__ import annotations

from datetime import UTC, datetime
from itertools import product
from pathlib import Path
from typing import Any

from bastion_sglang.calibration.fitting import build_profile
from bastion_sglang.calibration.identity import RuntimeIdentity
from bastion_sglang.controller.latency import DecodeFit, LatencyFit, LatencyModel, LatencySample
from bastion_sglang.controller.profile import (
    CalibrationProfile,
    ProfileMetadata,
    ServingSettings,
    StepCosts,
    save_profile,
)
from bastion_sglang.controller.roofline import KNOWN_GPUS, QWEN3_8B, RooflineModel

H100 = KNOWN_GPUS["H100-SXM"]
TRUE_FIT = LatencyFit(
    beta_fixed=2.5e-3,
    alpha_gemm=1.3,
    alpha_tok=2e-6,
    alpha_attn=1.8,
    alpha_kv=4.0,
    decode=DecodeFit(beta=1.5e-3, alpha_attn=1.4),
)
WIDTHS = (2, 4, 8, 16, 32, 64, 128, 256, 512, 1024)
CONTEXTS = (64, 512, 4096)
SERVING_FIT = TRUE_FIT.model_copy(
    update={"beta_fixed": 18e-3, "decode": DecodeFit(beta=17e-3, alpha_attn=1.4)}
)
"""A memory-bound serving engine: verify and plain decode cost about the same fixed time at any width."""
SERVING_EMA_ALPHA = 1e-6
"""ema_alpha that weighs a profile as 1 / α = 1e6 passes and steps, so the CPU's own timings (noisy on a
shared 2-core machine) do not reshape the latency model or the step costs: plans then depend on the drafts
alone."""
COSTS = StepCosts(t_draft=2.0e-3, t_aux=4.0e-4, l_ar=1.8e-2)
HASH = "a" * 64
OTHER_HASH = "b" * 64
PLAIN_SETTINGS = ServingSettings(
    quantization=None, kv_cache_dtype="bfloat16", page_size=1, cuda_graphs=False, load_format="auto"
)
"""The serving settings of BASE_METADATA and of IDENTITY (which sets none): unquantized, KV cache in bfloat16,
pages of one token, eager, real weights."""
BASE_METADATA: dict[str, Any] = dict(
    device_name="NVIDIA H100 80GB HBM3",
    driver_version="550.54.15",
    cuda_version="12.4",
    sglang_version="0.5.23",
    engine="sglang",
    model_path="/models/Qwen3-8B",
    model_config_hash=HASH,
    dtype="bfloat16",
    attention_backend="triton",
    tp_size=1,
    created_at=datetime(2026, 1, 1, tzinfo=UTC),
    settings=PLAIN_SETTINGS,
)
IDENTITY = RuntimeIdentity(
    device_name="NVIDIA H100 80GB HBM3",
    model_config_hash=HASH,
    dtype="bfloat16",
    attention_backend="triton",
    tp_size=1,
    model_path="/models/Qwen3-8B",
    draft_model_path="/models/Qwen3-8B-DFlash-b16",
)


def synthetic_samples(
    fit: LatencyFit, widths: tuple[int, ...] = WIDTHS, contexts: tuple[int, ...] = CONTEXTS
) -> list[LatencySample]:
    """Verify seconds at every (width, context) and plain decode seconds at every context, exactly as `fit`
    on the Qwen3-8B / H100 roofline predicts them."""
    model = LatencyModel(RooflineModel(QWEN3_8B, H100, 2), fit)
    verify = [LatencySample(s=s, c=c, seconds=model.predict(s, c)) for s, c in product(widths, contexts)]
    decode = [LatencySample(s=1, c=c, seconds=model.predict_plain(c), mode="decode") for c in contexts]
    return verify + decode


def startup_samples() -> list[LatencySample]:
    """`synthetic_samples` of TRUE_FIT and, as a start-up calibration measures them, verify passes of 4
    requests at the smallest context (`predict_batch` of the same model)."""
    model = LatencyModel(RooflineModel(QWEN3_8B, H100, 2), TRUE_FIT)
    batched = [
        LatencySample(s=s, c=CONTEXTS[0], batch=4, seconds=model.predict_batch([s] * 4, [CONTEXTS[0]] * 4))
        for s in (2, 16, 64)
    ]
    return synthetic_samples(TRUE_FIT) + batched


def make_profile(samples: list[LatencySample] | None = None, **metadata: Any) -> CalibrationProfile:
    """A profile fitted by `build_profile` on `samples` (default: TRUE_FIT's), BASE_METADATA | metadata; a
    `dtype` given without `settings` keeps the KV cache in that dtype."""
    if "dtype" in metadata and "settings" not in metadata:
        metadata["settings"] = PLAIN_SETTINGS.model_copy(update={"kv_cache_dtype": metadata["dtype"]})
    return build_profile(
        metadata=ProfileMetadata(**(BASE_METADATA | metadata)),
        shape=QWEN3_8B,
        hardware=H100,
        bytes_per_element=2.0,
        samples=samples if samples is not None else synthetic_samples(TRUE_FIT),
        step_costs=COSTS,
        max_context=max(CONTEXTS),
    )


def serving_plan_flags(folder: Path) -> dict[str, Any]:
    """`make_config` keyword arguments that plan on the SERVING_FIT profile (written into `folder`) weighed
    as 1 / SERVING_EMA_ALPHA passes: plans that depend on the drafts alone."""
    profile = save_serving_profile(folder / "serving.json")
    return {"profile": str(profile), "ema_alpha": SERVING_EMA_ALPHA}


def save_serving_profile(path: Path) -> Path:
    """Write the SERVING_FIT profile (a verify pass costs about a plain decode step, 18 ms vs 17 ms, nearly
    the same from 1 to a few hundred tokens; the drafter 2 ms) to `path`; returns `path`."""
    save_profile(make_profile(synthetic_samples(SERVING_FIT)), path)
    return path
