"""Calibration profile: the file the `calibrate` CLI writes and the server loads once at start-up.

A profile pins one (GPU, target model, dtype, attention backend, TP size, serving settings) to its measured
verify latencies, the fitted calibrated roofline, and the per-step costs the budget policies use, and its
acceptance part to one drafter (`ProfileMetadata.drafter_weights_hash`). Fields added to schema 2 after its
first files (`settings`, `draft_model_path`, `drafter_weights_hash`) default to None, so those files still
load. Format: JSON, one
`CalibrationProfile` object, `schema_version` = PROFILE_SCHEMA_VERSION. Loading validates everything once
and raises `ProfileError` naming the file and the bad field; nothing is re-read per step.

Model identity. `config_hash` is a sha256 over the canonical JSON of the model's Hugging Face config
(keys sorted, no whitespace, nested dicts included) after dropping the keys that do not change the
weights or the forward computation: every key starting with "_" (`_name_or_path`, `_commit_hash`,
`_attn_implementation`, ...), `transformers_version`, `torch_dtype` / `dtype` (the dtype is recorded on its
own in `ProfileMetadata.dtype`) and `use_cache`. `architectures` and `model_type` are kept: they choose
the forward implementation, so two configs differing there are different models.
"""

from __future__ import annotations

import hashlib
import json
import os
import tempfile
from pathlib import Path
from typing import Any, Literal

import numpy as np
import torch
from pydantic import (
    AwareDatetime,
    BaseModel,
    ConfigDict,
    Field,
    FiniteFloat,
    ValidationError,
    ValidationInfo,
    field_validator,
)

from bastion_sglang.controller.acceptance import AcceptanceCalibration, AcceptanceReport
from bastion_sglang.controller.latency import (
    FitReport,
    LatencyFit,
    LatencyModel,
    LatencySample,
    LeaveOutReport,
    validate_width_buckets,
)
from bastion_sglang.controller.roofline import HardwareSpec, ModelShape, RooflineModel, read_hf_config

PROFILE_SCHEMA_VERSION = 2
"""Version of the profile JSON layout this code reads and writes. 2: the additive latency model (`LatencyFit`
of β_fixed, α_gemm, α_attn, α_tok and the plain decode fit), decode samples, the leave-out report."""

IGNORED_CONFIG_KEYS = frozenset({"transformers_version", "torch_dtype", "dtype", "use_cache"})
"""Config keys left out of `config_hash` (besides every key starting with "_")."""


class ProfileError(Exception):
    """A calibration profile that cannot be read, parsed or validated. The message names the file."""

    def __init__(self, path: str | Path, detail: str) -> None:
        super().__init__(f"{path}: {detail}")
        self.path = Path(path)
        self.detail = detail


MadeBy = Literal["calibrate", "startup-quick", "startup-full"]
"""How a profile was measured (`ProfileMetadata.made_by`)."""
THOROUGHNESS: dict[MadeBy, int] = {"calibrate": 2, "startup-full": 1, "startup-quick": 0}
"""How thorough each kind of profile is (larger: more widths, contexts, repeats and prompts): among the
profiles that match a runtime, the store's lookup prefers the most thorough, then the newest."""
Mark = Literal["dummy-weights", "synthetic-acceptance"]
"""What makes a profile's numbers stand for something else than a serving deployment: measured on random
weights (`--load-format dummy`), or by a server whose drafts were rewritten to a synthetic acceptance."""


class ServingSettings(BaseModel):
    """The server settings besides device, model, dtype, attention backend and TP size that a profile was
    measured under: each changes a verify pass's cost or (draft vocabulary) the drafter pass's, or (load
    format, synthetic acceptance) what the profile's numbers stand for. Profiles written before these were
    recorded have none (`ProfileMetadata.settings` None): `calibration.identity.recorded_settings` says what
    can be known."""

    model_config = ConfigDict(frozen=True, strict=True, extra="forbid")

    quantization: str | None = Field(description="SGLang's --quantization, None: the checkpoint's weights")
    kv_cache_dtype: str = Field(
        min_length=1, description="the KV cache's dtype, SGLang's 'auto' resolved to the model dtype"
    )
    page_size: int = Field(ge=1, description="KV cache tokens per page (--page-size)")
    cuda_graphs: bool = Field(description="whether verify passes replay captured CUDA graphs")
    load_format: str = Field(min_length=1, description="SGLang's --load-format (dummy: random weights)")
    synthetic_acceptance: bool = Field(
        default=False, description="whether the server's drafts were rewritten to a synthetic acceptance"
    )
    draft_vocab_size: int | None = Field(
        default=None,
        ge=1,
        description="tokens the draft step's head scores (a draft vocabulary, --bastion-draft-vocab; it sets "
        "T_draft), None: the whole vocabulary",
    )

    @property
    def marks(self) -> tuple[Mark, ...]:
        """The marks (`Mark`) these settings give a profile, in a fixed order."""
        marks: list[Mark] = []
        if self.load_format == "dummy":
            marks.append("dummy-weights")
        if self.synthetic_acceptance:
            marks.append("synthetic-acceptance")
        return tuple(marks)


class ProfileMetadata(BaseModel):
    """Where and for what a profile was measured."""

    model_config = ConfigDict(frozen=True, strict=True, extra="forbid")

    device_name: str = Field(min_length=1, description="as CUDA reports it, e.g. 'NVIDIA H100 80GB HBM3'")
    driver_version: str | None
    cuda_version: str | None
    sglang_version: str | None
    engine: Literal["sglang", "reference"]
    model_path: str = Field(min_length=1)
    model_config_hash: str = Field(pattern=r"^[0-9a-f]{64}$", description="config_hash of the target")
    dtype: str = Field(min_length=1, description="target weight / activation dtype, e.g. 'bfloat16'")
    attention_backend: str = Field(min_length=1)
    tp_size: int = Field(ge=1)
    created_at: AwareDatetime
    made_by: MadeBy = Field(
        default="calibrate",
        description="calibrate: `bastion calibrate` (the thorough grid); startup-quick / startup-full: a "
        "server's start-up calibration (`--bastion-startup-calibration`)",
    )
    settings: ServingSettings | None = Field(
        default=None,
        description="the serving settings it was measured under (None: written before them)",
    )
    draft_model_path: str | None = Field(
        default=None, description="the drafter whose acceptance was measured (None: not recorded or none)"
    )
    drafter_weights_hash: str | None = Field(
        default=None,
        pattern=r"^[0-9a-f]{64}$",
        description="`calibration.identity.weights_hash` of that drafter: the profile's acceptance part (its "
        "map, or none where none could be fitted) is for this drafter only (None: not recorded)",
    )


class StepCosts(BaseModel):
    """Per-step costs outside the verify pass (BASTION eq. 7), seconds."""

    model_config = ConfigDict(frozen=True, strict=True, extra="forbid")

    t_draft: FiniteFloat = Field(ge=0, description="drafter forward per step, seconds")
    t_aux: FiniteFloat = Field(
        ge=0, description="tree build, accept walk and KV compaction per step, seconds"
    )
    l_ar: FiniteFloat = Field(gt=0, description="one plain autoregressive decode step of the target, seconds")
    t_aux_per_token: FiniteFloat = Field(
        default=0.0,
        ge=0,
        description="host and device work outside the forwards that grows with the verify tokens of the "
        "pass (mask, accept walk, logits processing), seconds per token",
    )
    aux_token_span: int | None = Field(
        default=None,
        ge=1,
        description="most verify tokens the per-token work was measured at: a pass with more is priced at "
        "this many (an online fit extrapolated past its points is noise; None: no limit)",
    )

    def cycle_seconds(
        self,
        verify_seconds: float | np.ndarray | torch.Tensor,
        verify_tokens: int | np.ndarray | torch.Tensor,
    ) -> float | np.ndarray | torch.Tensor:
        """Ĉ = T_draft + T_aux + t_aux_per_token · tokens + T_verify (BASTION eq. 7 with the per-token work),
        tokens capped at aux_token_span.

        verify_seconds: predicted verify seconds (float, [M] array or tensor); verify_tokens: tokens the pass
        holds over the whole batch (int, [M] array or tensor, broadcast with verify_seconds). Returns seconds,
        same kind.
        """
        span = self.aux_token_span
        if isinstance(verify_tokens, torch.Tensor):
            verify_tokens = verify_tokens.to(torch.float64)
            priced = verify_tokens if span is None else verify_tokens.clamp(max=span)
        elif isinstance(verify_tokens, np.ndarray):
            priced = verify_tokens if span is None else np.minimum(verify_tokens, span)
        else:
            priced = verify_tokens if span is None else min(verify_tokens, span)
        return self.t_draft + self.t_aux + self.t_aux_per_token * priced + verify_seconds


class CalibrationProfile(BaseModel):
    """Everything the controller needs to predict verify latency on one deployment."""

    model_config = ConfigDict(frozen=True, strict=True, extra="forbid")

    schema_version: Literal[2]
    metadata: ProfileMetadata
    model_shape: ModelShape
    hardware: HardwareSpec = Field(description="measured peak FLOP/s and bytes/s")
    bytes_per_element: FiniteFloat = Field(gt=0, description="bp the roofline and fit used, bytes")
    fit: LatencyFit
    report: FitReport
    leave_out: LeaveOutReport | None = Field(
        default=None, description="MAPE with whole widths and whole contexts left out of the fit"
    )
    samples: list[LatencySample] = Field(min_length=1, description="verify passes and plain decode steps")
    step_costs: StepCosts
    width_buckets: list[int] | None = Field(description="captured verify widths, tokens per request")
    max_context: int = Field(ge=1, description="largest cached context the calibration covered, tokens")
    acceptance: AcceptanceCalibration | None = Field(
        default=None, description="the drafter's acceptance calibration (None: raw path probabilities)"
    )
    acceptance_report: AcceptanceReport | None = Field(
        default=None, description="held-out expected vs realised accept length, raw and calibrated"
    )

    @field_validator("width_buckets")
    @classmethod
    def _buckets_sorted(cls, buckets: list[int] | None) -> list[int] | None:
        if buckets is not None:
            validate_width_buckets(buckets)
        return buckets

    @field_validator("fit")
    @classmethod
    def _positive_latency(cls, fit: LatencyFit, info: ValidationInfo) -> LatencyFit:
        """The fit must predict a positive latency (checked at s = 1, c = 0, its minimum: the coefficients
        are non-negative)."""
        needed = ("model_shape", "hardware", "bytes_per_element")
        if all(key in info.data for key in needed):  # absent when those fields failed their own checks
            shape, hardware, bp = (info.data[key] for key in needed)
            LatencyModel(RooflineModel(shape, hardware, bp), fit)
        return fit

    def roofline(self) -> RooflineModel:
        """The bare roofline of this profile's model and measured hardware."""
        return RooflineModel(self.model_shape, self.hardware, self.bytes_per_element)

    def latency_model(self, ema_alpha: float = 0.1) -> LatencyModel:
        """A fresh LatencyModel (EMA factor 1) with this profile's fit and width buckets."""
        return LatencyModel(self.roofline(), self.fit, ema_alpha, self.width_buckets)


def _describe(error: ValidationError) -> str:
    """'field.path: message' for every error, e.g. 'samples.3.seconds: Input should be greater than 0'."""
    parts = []
    for item in error.errors(include_url=False):
        location = ".".join(str(part) for part in item["loc"]) or "(top level)"
        parts.append(f"{location}: {item['msg']}")
    return "; ".join(parts)


def load_profile(path: str | Path) -> CalibrationProfile:
    """Read and validate a calibration profile. Raises ProfileError naming the file and what is wrong:
    missing or unreadable file, corrupt JSON (with line and column), a schema_version other than
    PROFILE_SCHEMA_VERSION (found vs supported), or invalid fields (with their dotted path)."""
    path = Path(path)
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise ProfileError(path, "calibration profile not found") from None
    except (OSError, UnicodeDecodeError) as error:
        raise ProfileError(path, f"cannot read calibration profile: {error}") from None
    try:
        data = json.loads(text)
    except json.JSONDecodeError as error:
        raise ProfileError(
            path, f"corrupt JSON at line {error.lineno} column {error.colno}: {error.msg}"
        ) from None
    if not isinstance(data, dict):
        raise ProfileError(path, f"the top level must be a JSON object, got {type(data).__name__}")
    if "schema_version" not in data:
        raise ProfileError(path, f"missing field schema_version (supported: {PROFILE_SCHEMA_VERSION})")
    version = data["schema_version"]
    if type(version) is not int or version != PROFILE_SCHEMA_VERSION:
        raise ProfileError(
            path,
            f"schema_version found {version!r}, supported {PROFILE_SCHEMA_VERSION}; re-run "
            "`bastion calibrate` to measure a profile this version reads",
        )
    try:
        return CalibrationProfile.model_validate_json(text)
    except ValidationError as error:
        raise ProfileError(path, f"invalid calibration profile: {_describe(error)}") from None


def save_profile(profile: CalibrationProfile, path: str | Path) -> None:
    """Write `profile` as JSON atomically: a temporary file in the target folder, then a rename.
    Creates missing parent folders. Raises ProfileError naming the file when it cannot be written."""
    if not isinstance(profile, CalibrationProfile):
        raise ValueError(f"profile must be a CalibrationProfile, got {type(profile).__name__}")
    path = Path(path)
    text = profile.model_dump_json(indent=2) + "\n"
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        handle, temporary = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
        try:
            with os.fdopen(handle, "w", encoding="utf-8") as stream:
                stream.write(text)
                stream.flush()
                os.fsync(stream.fileno())
            os.chmod(temporary, 0o644)
            os.replace(temporary, path)
        except BaseException:
            Path(temporary).unlink(missing_ok=True)
            raise
    except OSError as error:
        raise ProfileError(path, f"cannot write calibration profile: {error}") from None


def _shape_relevant(value: Any) -> Any:
    """`value` with IGNORED_CONFIG_KEYS and "_"-prefixed keys removed from every nested dict."""
    if isinstance(value, dict):
        return {
            key: _shape_relevant(item)
            for key, item in value.items()
            if not str(key).startswith("_") and key not in IGNORED_CONFIG_KEYS
        }
    if isinstance(value, list | tuple):
        return [_shape_relevant(item) for item in value]
    return value


def config_hash(config: dict[str, Any] | str | Path) -> str:
    """sha256 hex digest of a Hugging Face config's canonical JSON (see the module docstring for the
    keys left out). config: a dict, a config.json path, or a model folder. Raises ValueError naming the
    source when it cannot be read or holds values JSON cannot represent."""
    data, source = read_hf_config(config)
    try:
        canonical = json.dumps(
            _shape_relevant(data), sort_keys=True, separators=(",", ":"), ensure_ascii=True, allow_nan=False
        )
    except (TypeError, ValueError) as error:
        raise ValueError(f"{source}: cannot hash the model config: {error}") from None
    return hashlib.sha256(canonical.encode("utf-8")).hexdigest()
