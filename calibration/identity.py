"""What a profile is measured for, and what a runtime must share with it to use it.

A profile is only valid for the deployment it was measured on, so the calibrate CLI and a starting server
record these facts in `ProfileMetadata` and the server describes itself with the same ones
(`RuntimeIdentity`) when it looks a profile up. Both sides compute them with the functions here, so the
strings agree.

Latency part (`RuntimeIdentity.mismatches`; every field must match):
- device name: `device_name(device)`: the name CUDA reports ("NVIDIA H100 80GB HBM3"), or "CPU " plus the
  processor model from /proc/cpuinfo (the machine architecture where that file does not exist);
- model: `config_hash` of the target's config.json file as written on disk (`model_config_hash`). Not of a
  loaded `PretrainedConfig.to_dict()`: Transformers adds default keys there, so the hashes would differ;
- dtype: the torch dtype's name without the "torch." prefix ("bfloat16");
- attention backend: SGLang's `--attention-backend` (triton, flashinfer, torch_native) or, for the
  reference engine, the Transformers attention implementation (sdpa, eager);
- TP size: tensor-parallel ranks the target is split over;
- engine (sglang or reference), when the runtime names one;
- SGLang version, for profiles of the sglang engine (`ProfileMetadata.sglang_version`);
- serving settings (`ServingSettings`): --quantization, the KV cache dtype (SGLang's auto resolved to the
  model dtype), --page-size, CUDA graphs on or off, the draft vocabulary's size (`--bastion-draft-vocab`:
  the drafter pass's cost, T_draft, depends on it), and the marks: a profile measured on dummy weights
  (`--load-format dummy`) or under synthetic acceptance is matched only by a runtime with the same mark
  (a bench), never by a serving one. Other load formats read the same weights and are not told apart.

Acceptance part (`RuntimeIdentity.acceptance_mismatch`): a profile's acceptance map (or its finding that no
map could be fitted) is for the drafter it was measured with, told by `weights_hash` of the drafter's folder
(config and weight files), so a retrained drafter with the same config is another drafter. A latency
profile serves every drafter of its target; an acceptance map only its drafter, and only a runtime without
marks (a dummy target or rewritten drafts make any map meaningless).

Profiles written before the serving settings were recorded (`recorded_settings`): the reference engine's
have none to differ (Transformers, eager, unquantized, KV cache in the model dtype, pages of one token);
`bastion calibrate`'s ran SGLang eagerly at page size 1, unquantized, KV cache in the model dtype, and one
that holds an acceptance map ran on real weights (calibrate refuses the map with dummy weights), so those
match on these settings; `bastion calibrate`'s without a map (its load format unknown) and every older
start-up profile (any server's settings) match no runtime. None had the drafter's weights hash, so their
acceptance maps apply to no drafter.
"""

from __future__ import annotations

import hashlib
import importlib.metadata
import logging
import platform
import shutil
import subprocess
from pathlib import Path
from typing import Any, Literal

import torch
from pydantic import BaseModel, ConfigDict, Field, field_validator

from bastion_sglang.controller.profile import CalibrationProfile, ServingSettings, config_hash
from bastion_sglang.controller.roofline import HF_CONFIG_NAME, read_hf_config

logger = logging.getLogger(__name__)

Engine = Literal["sglang", "reference"]
"""Measurement back ends: the SGLang model runner, or the Transformers reference engine."""

CPUINFO = Path("/proc/cpuinfo")
"""Where Linux names the processor model (the `model name` line)."""


def dtype_name(dtype: torch.dtype) -> str:
    """'bfloat16' for torch.bfloat16: the spelling profiles record."""
    if not isinstance(dtype, torch.dtype):
        raise ValueError(f"expected a torch.dtype, got {dtype!r}")
    return str(dtype).removeprefix("torch.")


def parse_dtype(name: str) -> torch.dtype:
    """torch.bfloat16 for 'bfloat16' (or 'torch.bfloat16'); ValueError naming the value otherwise."""
    value = getattr(torch, str(name).removeprefix("torch."), None)
    if not isinstance(value, torch.dtype) or not value.is_floating_point:
        raise ValueError(
            f"dtype {name!r} is not a torch floating-point dtype (e.g. bfloat16, float16, float32)"
        )
    return value


def _cpu_model() -> str:
    """The processor model from /proc/cpuinfo, else the machine architecture (e.g. 'x86_64')."""
    if CPUINFO.is_file():
        for line in CPUINFO.read_text(encoding="utf-8", errors="replace").splitlines():
            key, _, value = line.partition(":")
            if key.strip() == "model name" and value.strip():
                return value.strip()
    machine = platform.machine()
    if not machine:
        raise ValueError("cannot name this CPU: no 'model name' in /proc/cpuinfo and no machine architecture")
    return machine


def config_file(model_path: str | Path) -> Path:
    """The target's config.json: `model_path` itself if it is a file, else inside the folder, else (a hub
    id) the file in the local Hugging Face cache. ValueError naming the path when none exists."""
    path = Path(model_path)
    if path.is_file():
        return path
    if path.is_dir():
        candidate = path / HF_CONFIG_NAME
        if not candidate.is_file():
            raise ValueError(f"{path}: no {HF_CONFIG_NAME} in the model folder")
        return candidate
    from transformers.utils import cached_file

    try:
        cached = cached_file(str(model_path), HF_CONFIG_NAME, local_files_only=True)
    except (OSError, ValueError) as error:  # not cached, or not a valid hub id
        raise ValueError(
            f"{model_path}: neither a model folder nor a hub id with {HF_CONFIG_NAME} in the local "
            f"Hugging Face cache ({error})"
        ) from None
    if cached is None:
        raise ValueError(f"{model_path}: no {HF_CONFIG_NAME} in the local Hugging Face cache")
    return Path(cached)


def model_config_hash(model_path: str | Path) -> str:
    """`config_hash` of the target's config.json (`config_file`): the model part of the identity."""
    return config_hash(config_file(model_path))


def config_dtype(model_path: str | Path) -> torch.dtype:
    """The dtype the target's config.json declares (`dtype`, else `torch_dtype`). ValueError naming the file
    when it declares none: pass --dtype then."""
    path = config_file(model_path)
    data, _ = read_hf_config(path)
    text = data.get("text_config")
    declared = data.get("dtype") or data.get("torch_dtype")
    if declared is None and isinstance(text, dict):
        declared = text.get("dtype") or text.get("torch_dtype")
    if declared is None:
        raise ValueError(f"{path}: declares no dtype (keys 'dtype' / 'torch_dtype'); pass --dtype")
    return parse_dtype(str(declared))


def detect_device(choice: str | None) -> torch.device:
    """The device to use: `choice` ('cuda' or 'cpu') when given, else CUDA when a GPU is visible, else the
    CPU. Logs the choice. ValueError for 'cuda' without a visible GPU or another device name."""
    if choice is None:
        device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
        logger.info(
            "device: %s (%s)",
            device.type,
            "a CUDA GPU is visible" if device.type == "cuda" else "no CUDA GPU visible",
        )
        return device
    if choice not in ("cuda", "cpu"):
        raise ValueError(f"--device must be cuda or cpu, got {choice!r}")
    if choice == "cuda" and not torch.cuda.is_available():
        raise ValueError("--device cuda, but torch sees no CUDA GPU")
    return torch.device(choice)


def device_name(device: torch.device) -> str:
    """The device's name as profiles record it (module docstring). ValueError for other device types."""
    device = torch.device(device)
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    if device.type == "cpu":
        return f"CPU {_cpu_model()}"
    raise ValueError(f"calibration runs on cuda or cpu devices, got {device}")


WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth")
"""Files of a model folder whose bytes `weights_hash` reads besides config.json."""
_HASH_CHUNK = 1 << 22
_weights_hashes: dict[tuple[Any, ...], str] = {}


def weights_hash(model_path: str | Path) -> str:
    """sha256 hex digest of a model folder's config.json (`config_hash`) and the bytes of every weight file
    (`WEIGHT_SUFFIXES`, by name). model_path: a folder, its config.json, or a cached hub id. Remembered per
    process for unchanged files (name, size, modification time). ValueError naming the folder when it holds
    no weight file."""
    config = config_file(model_path)
    folder = config.parent
    files = sorted(path for path in folder.iterdir() if path.suffix in WEIGHT_SUFFIXES and path.is_file())
    if not files:
        raise ValueError(f"{folder}: no weight files ({', '.join(WEIGHT_SUFFIXES)}) to hash")
    key = (str(config.resolve()), *((path.name, *_stamp(path)) for path in files))
    if key not in _weights_hashes:
        digest = hashlib.sha256(config_hash(config).encode())
        for path in files:
            digest.update(path.name.encode())
            with path.resolve().open("rb") as stream:
                while chunk := stream.read(_HASH_CHUNK):
                    digest.update(chunk)
        _weights_hashes[key] = digest.hexdigest()
    return _weights_hashes[key]


def _stamp(path: Path) -> tuple[int, int]:
    stat = path.resolve().stat()
    return stat.st_size, stat.st_mtime_ns


KV_DTYPE_NAMES = {"bf16": "bfloat16", "fp16": "float16", "fp32": "float32", "half": "float16"}
"""SGLang's short spellings of --kv-cache-dtype, as the profiles record them."""


def plain_settings(dtype: str) -> ServingSettings:
    """The settings of a runtime that sets none: no quantization, the KV cache in the model dtype `dtype`,
    pages of one token, eager, real weights."""
    return ServingSettings(
        quantization=None, kv_cache_dtype=dtype, page_size=1, cuda_graphs=False, load_format="auto"
    )


def serving_settings(
    server_args: Any,
    dtype: torch.dtype,
    device: torch.device,
    synthetic_acceptance: bool,
    draft_vocab_size: int | None = None,
) -> ServingSettings:
    """The `ServingSettings` of a server from its SGLang ServerArgs (read by attribute): --quantization,
    --kv-cache-dtype (auto: `dtype`), --page-size, CUDA graphs (a CUDA device without
    --disable-cuda-graph), --load-format; synthetic_acceptance: whether its drafts are rewritten;
    draft_vocab_size: the tokens its draft step scores (None: the whole vocabulary)."""
    kv = str(getattr(server_args, "kv_cache_dtype", None) or "auto")
    load_format = getattr(server_args, "load_format", None) or "auto"
    return ServingSettings(
        quantization=getattr(server_args, "quantization", None) or None,
        kv_cache_dtype=dtype_name(dtype) if kv == "auto" else KV_DTYPE_NAMES.get(kv, kv),
        page_size=int(getattr(server_args, "page_size", None) or 1),
        cuda_graphs=torch.device(device).type == "cuda"
        and not getattr(server_args, "disable_cuda_graph", False),
        load_format=str(load_format),
        synthetic_acceptance=synthetic_acceptance,
        draft_vocab_size=draft_vocab_size,
    )


def recorded_settings(profile: CalibrationProfile) -> ServingSettings | str:
    """The serving settings `profile` was measured under, or why they cannot be known (module docstring:
    profiles written before they were recorded)."""
    meta = profile.metadata
    if meta.settings is not None:
        return meta.settings
    if meta.engine == "reference":
        return plain_settings(meta.dtype)
    if meta.made_by == "calibrate" and profile.acceptance is not None:
        return plain_settings(meta.dtype)
    if meta.made_by == "calibrate":
        return (
            "not recorded (a bastion calibrate profile from before they were, without an acceptance map: "
            "its weights may have been dummy)"
        )
    return "not recorded (a start-up profile from before they were, of a server whose settings are unknown)"


Mismatch = tuple[str, str, str]
"""(field, profile value, runtime value)."""


class RuntimeIdentity(BaseModel):
    """The deployment a profile must match (module docstring).

    engine: restricts matches to profiles measured with that engine; None accepts either.
    sglang_version: the installed SGLang of a server (matched against profiles of the sglang engine); None:
        not compared. settings: the serving settings (None: `plain_settings` of the dtype).
    drafter_weights_hash: `weights_hash` of the drafter (None: unknown; no acceptance map applies).
    model_path, draft_model_path: only used to spell the `bastion calibrate` command in messages.
    """

    model_config = ConfigDict(frozen=True, strict=True, extra="forbid")

    device_name: str = Field(min_length=1)
    model_config_hash: str = Field(pattern=r"^[0-9a-f]{64}$")
    dtype: str = Field(min_length=1)
    attention_backend: str = Field(min_length=1)
    tp_size: int = Field(ge=1)
    engine: Engine | None = None
    sglang_version: str | None = None
    settings: ServingSettings | None = None
    drafter_weights_hash: str | None = Field(default=None, pattern=r"^[0-9a-f]{64}$")
    model_path: str | None = None
    draft_model_path: str | None = None

    @field_validator("dtype")
    @classmethod
    def _known_dtype(cls, value: str) -> str:
        return dtype_name(parse_dtype(value))

    @classmethod
    def for_runtime(
        cls,
        *,
        device: torch.device,
        model_path: str | Path,
        dtype: torch.dtype,
        attention_backend: str,
        tp_size: int,
        engine: Engine | None = None,
        draft_model_path: str | None = None,
        settings: ServingSettings | None = None,
        sglang_version: str | None = None,
    ) -> RuntimeIdentity:
        """The identity of a running deployment. model_path: the target's folder (or config.json, or a
        cached hub id), hashed with `model_config_hash`; draft_model_path: the drafter's, hashed with
        `weights_hash` (None, or a drafter that cannot be hashed: no acceptance map applies, with a
        warning logged)."""
        return cls(
            device_name=device_name(device),
            model_config_hash=model_config_hash(model_path),
            dtype=dtype_name(dtype),
            attention_backend=attention_backend,
            tp_size=tp_size,
            engine=engine,
            sglang_version=sglang_version,
            settings=settings,
            drafter_weights_hash=_drafter_hash(draft_model_path),
            model_path=str(model_path),
            draft_model_path=draft_model_path,
        )

    @property
    def torch_dtype(self) -> torch.dtype:
        return parse_dtype(self.dtype)

    @property
    def serving(self) -> ServingSettings:
        """The serving settings, `plain_settings` of the dtype where none were given."""
        return self.settings if self.settings is not None else plain_settings(self.dtype)

    def mismatches(self, profile: CalibrationProfile) -> list[Mismatch]:
        """(field, profile value, runtime value) for every latency-part field where `profile` differs
        (module docstring). The engine counts only when this identity names one, the SGLang version only
        when it names one and the profile is of the sglang engine."""
        meta = profile.metadata
        pairs = [
            ("device", meta.device_name, self.device_name),
            ("model config hash", meta.model_config_hash, self.model_config_hash),
            ("dtype", meta.dtype, self.dtype),
            ("attention backend", meta.attention_backend, self.attention_backend),
            ("tp size", str(meta.tp_size), str(self.tp_size)),
        ]
        if self.engine is not None:
            pairs.append(("engine", meta.engine, self.engine))
        if self.sglang_version is not None and meta.engine == "sglang":
            pairs.append(("sglang version", str(meta.sglang_version), self.sglang_version))
        found = [(field, theirs, ours) for field, theirs, ours in pairs if theirs != ours]
        recorded, ours = recorded_settings(profile), self.serving
        if isinstance(recorded, str):
            return [*found, ("serving settings", recorded, _describe_settings(ours))]
        for field, theirs_value, ours_value in (
            ("quantization", recorded.quantization, ours.quantization),
            ("kv cache dtype", recorded.kv_cache_dtype, ours.kv_cache_dtype),
            ("page size", recorded.page_size, ours.page_size),
            ("cuda graphs", _on_off(recorded.cuda_graphs), _on_off(ours.cuda_graphs)),
            ("draft vocabulary", _vocabulary(recorded.draft_vocab_size), _vocabulary(ours.draft_vocab_size)),
        ):
            if theirs_value != ours_value:
                found.append((field, str(theirs_value), str(ours_value)))
        foreign = [mark for mark in recorded.marks if mark not in ours.marks]
        if foreign:
            found.append(("marks", ", ".join(foreign), ", ".join(ours.marks) or "none (serving)"))
        return found

    def acceptance_mismatch(self, profile: CalibrationProfile) -> str | None:
        """Why `profile`'s acceptance part (its map, or its finding that none fits) is not this runtime's,
        or None when it is: the same drafter's weights, and a runtime without marks."""
        if self.serving.marks:
            return f"this runtime plans no acceptance map ({', '.join(self.serving.marks)})"
        theirs = profile.metadata.drafter_weights_hash
        if theirs is None:
            return "the profile records no drafter weights hash"
        if self.drafter_weights_hash is None:
            return "this drafter's weights could not be hashed"
        if theirs != self.drafter_weights_hash:
            ours = self.drafter_weights_hash[:12]
            return f"measured for drafter weights {theirs[:12]}, this drafter's are {ours}"
        return None


def _on_off(flag: bool) -> str:
    return "on" if flag else "off"


def _vocabulary(size: int | None) -> str:
    return "whole" if size is None else f"{size} tokens"


def _describe_settings(settings: ServingSettings) -> str:
    return (
        f"quantization {settings.quantization or 'none'}, kv cache {settings.kv_cache_dtype}, page size "
        f"{settings.page_size}, cuda graphs {_on_off(settings.cuda_graphs)}, load format "
        f"{settings.load_format}, draft vocabulary {_vocabulary(settings.draft_vocab_size)}"
        + "".join(f", {mark}" for mark in settings.marks)
    )


def _drafter_hash(draft_model_path: str | None) -> str | None:
    """`weights_hash` of the drafter, None without a path or (with a warning) when it cannot be read."""
    if not draft_model_path:
        return None
    try:
        return weights_hash(draft_model_path)
    except (ValueError, OSError) as error:
        logger.warning("no acceptance map applies to drafter %s: %s", draft_model_path, error)
        return None


def driver_version(device: torch.device) -> str | None:
    """The NVIDIA driver version from nvidia-smi, None on the CPU or where nvidia-smi is absent."""
    smi = shutil.which("nvidia-smi")
    if device.type != "cuda" or smi is None:
        return None
    index = device.index if device.index is not None else torch.cuda.current_device()
    result = subprocess.run(
        [smi, "--query-gpu=driver_version", "--format=csv,noheader", "-i", str(index)],
        capture_output=True,
        text=True,
        check=False,
        timeout=30,
    )
    if result.returncode != 0:
        logger.warning("nvidia-smi failed (%s); the profile records no driver version", result.stderr.strip())
        return None
    return result.stdout.strip() or None


def installed_version(package: str) -> str | None:
    """The installed version of `package`, None when it is not installed."""
    try:
        return importlib.metadata.version(package)
    except importlib.metadata.PackageNotFoundError:
        return None
