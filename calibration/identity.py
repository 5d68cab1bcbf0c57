"""What a latency profile is measured for: one device, one target model, dtype, attention backend, TP size.

A profile is only valid for the deployment it was measured on, so the calibrate CLI records these five
facts in `ProfileMetadata` and the server describes itself with the same five (`RuntimeIdentity`) when it
looks a profile up. Both sides compute them with the functions here, so the strings agree:

- device name: `device_name(device)`: the name CUDA reports ("NVIDIA H100 80GB HBM3"), or "CPU " plus the
  processor model from /proc/cpuinfo (the machine architecture where that file does not exist);
- model: `config_hash` of the target's config.json file as written on disk (`model_config_hash`). Not of a
  loaded `PretrainedConfig.to_dict()`: Transformers adds default keys there, so the hashes would differ;
- dtype: the torch dtype's name without the "torch." prefix ("bfloat16");
- attention backend: SGLang's `--attention-backend` (triton, flashinfer, torch_native) or, for the
  reference engine, the Transformers attention implementation (sdpa, eager);
- TP size: tensor-parallel ranks the target is split over.
"""

from __future__ import annotations

import importlib.metadata
import logging
import platform
import shutil
import subprocess
from pathlib import Path
from typing import Literal

import torch
from pydantic import BaseModel, ConfigDict, Field, field_validator

from bastion_sglang.controller.profile import ProfileMetadata, config_hash
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


class RuntimeIdentity(BaseModel):
    """The deployment a latency profile must match (module docstring).

    engine: restricts matches to profiles measured with that engine; None accepts either.
    model_path, draft_model_path: only used to spell the `bastion calibrate` command in warnings.
    """

    model_config = ConfigDict(frozen=True, strict=True, extra="forbid")

    device_name: str = Field(min_length=1)
    model_config_hash: str = Field(pattern=r"^[0-9a-f]{64}$")
    dtype: str = Field(min_length=1)
    attention_backend: str = Field(min_length=1)
    tp_size: int = Field(ge=1)
    engine: Engine | None = None
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
    ) -> RuntimeIdentity:
        """The identity of a running deployment. model_path: the target's folder (or config.json, or a
        cached hub id), hashed with `model_config_hash`."""
        return cls(
            device_name=device_name(device),
            model_config_hash=model_config_hash(model_path),
            dtype=dtype_name(dtype),
            attention_backend=attention_backend,
            tp_size=tp_size,
            engine=engine,
            model_path=str(model_path),
            draft_model_path=draft_model_path,
        )

    @property
    def torch_dtype(self) -> torch.dtype:
        return parse_dtype(self.dtype)

    def mismatches(self, metadata: ProfileMetadata) -> list[tuple[str, str, str]]:
        """(field, profile value, runtime value) for every identity field where `metadata` differs.

        The engine counts only when this identity names one."""
        pairs = [
            ("device", metadata.device_name, self.device_name),
            ("model config hash", metadata.model_config_hash, self.model_config_hash),
            ("dtype", metadata.dtype, self.dtype),
            ("attention backend", metadata.attention_backend, self.attention_backend),
            ("tp size", str(metadata.tp_size), str(self.tp_size)),
        ]
        if self.engine is not None:
            pairs.append(("engine", metadata.engine, self.engine))
        return [(field, theirs, ours) for field, theirs, ours in pairs if theirs != ours]


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
