"""Peak matmul throughput and memory bandwidth of the device, measured (the roofline's two peaks).

- Matmul: square GEMMs C = A·B of n×n matrices in the target's dtype, 2n³ FLOPs each; the best of the
  timed calls at each size, and the best size (the largest sizes usually win: the peak is what the
  hardware reaches, not a typical call).
- Bandwidth: `dst.copy_(src)` of one large buffer; it reads and writes every byte, so 2·size bytes move
  per call; the best of the timed calls.

Sizes are per device type (`MATMUL_SIZES`, `COPY_BYTES`): a GPU needs GEMMs of thousands and copies of a
GiB to saturate, a CPU reaches its plateau at far smaller sizes and would take minutes at GPU sizes.
The measured figures are printed next to the datasheet entry of `KNOWN_GPUS` for the device.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from pydantic import BaseModel, ConfigDict, Field, FiniteFloat

from bastion_sglang.calibration.identity import dtype_name
from bastion_sglang.controller.roofline import HardwareSpec, lookup_gpu
from bastion_sglang.step.timing import time_op

MATMUL_SIZES: dict[str, tuple[int, ...]] = {"cuda": (4096, 8192), "cpu": (512, 1024)}
"""n of the n×n GEMMs per device type."""
COPY_BYTES: dict[str, int] = {"cuda": 1 << 30, "cpu": 64 << 20}
"""Bytes of the copied buffer per device type."""
WARMUP = 2
REPEATS = 5


class MeasuredPeaks(BaseModel):
    """Peaks measured on one device: the roofline's denominators."""

    model_config = ConfigDict(frozen=True, strict=True, extra="forbid")

    device_name: str = Field(min_length=1)
    dtype: str = Field(min_length=1, description="dtype of the GEMMs")
    matmul_flops: FiniteFloat = Field(gt=0, description="FLOP/s, best square GEMM")
    matmul_size: int = Field(gt=0, description="n of the n×n GEMM that reached matmul_flops")
    copy_bandwidth: FiniteFloat = Field(gt=0, description="bytes/s read + written by a large copy")
    copy_bytes: int = Field(gt=0, description="size of the copied buffer, bytes")

    def hardware_spec(self) -> HardwareSpec:
        """The measured peaks as the roofline's HardwareSpec, named after the device."""
        return HardwareSpec(
            name=self.device_name, peak_flops=self.matmul_flops, bandwidth=self.copy_bandwidth
        )


def _sizes_for(device: torch.device) -> tuple[tuple[int, ...], int]:
    if device.type not in MATMUL_SIZES:
        raise ValueError(f"peak measurements run on {sorted(MATMUL_SIZES)} devices, got {device}")
    return MATMUL_SIZES[device.type], COPY_BYTES[device.type]


def measure_matmul_flops(device: torch.device, dtype: torch.dtype, size: int) -> float:
    """Best FLOP/s of an n×n GEMM (n = size) in `dtype` on `device`."""
    generator = torch.Generator(device=device).manual_seed(0)
    a = torch.randn((size, size), device=device, dtype=dtype, generator=generator)
    b = torch.randn((size, size), device=device, dtype=dtype, generator=generator)
    out = torch.empty((size, size), device=device, dtype=dtype)
    seconds = time_op(lambda: torch.matmul(a, b, out=out), device, WARMUP, REPEATS)
    return 2.0 * size**3 / min(seconds)


def measure_copy_bandwidth(device: torch.device, num_bytes: int) -> float:
    """Best bytes/s of copying a `num_bytes` buffer on `device` (2·num_bytes moved per copy)."""
    src = torch.ones(num_bytes, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    seconds = time_op(lambda: dst.copy_(src), device, WARMUP, REPEATS)
    return 2.0 * num_bytes / min(seconds)


def measure_peaks(device: torch.device, dtype: torch.dtype, name: str) -> MeasuredPeaks:
    """Measure the matmul peak (GEMMs in `dtype`) and the copy bandwidth of `device`, named `name`."""
    device = torch.device(device)
    sizes, copy_bytes = _sizes_for(device)
    flops = {size: measure_matmul_flops(device, dtype, size) for size in sizes}
    best_size = max(flops, key=lambda size: flops[size])
    return MeasuredPeaks(
        device_name=name,
        dtype=dtype_name(dtype),
        matmul_flops=flops[best_size],
        matmul_size=best_size,
        copy_bandwidth=measure_copy_bandwidth(device, copy_bytes),
        copy_bytes=copy_bytes,
    )


def datasheet_comparison(peaks: MeasuredPeaks) -> list[str]:
    """Lines comparing the measured peaks with the device's KNOWN_GPUS entry, or saying there is none."""
    measured = (
        f"measured: matmul {peaks.matmul_flops / 1e12:.2f} TFLOP/s ({peaks.dtype}, n={peaks.matmul_size}), "
        f"copy bandwidth {peaks.copy_bandwidth / 1e9:.1f} GB/s"
    )
    try:
        sheet = lookup_gpu(peaks.device_name)
    except ValueError:
        return [
            measured,
            f"datasheet: no KNOWN_GPUS entry for {peaks.device_name!r}; the roofline uses the measured peaks",
        ]
    return [
        measured,
        f"datasheet ({sheet.name}): matmul {sheet.peak_flops / 1e12:.2f} TFLOP/s (dense bf16), "
        f"bandwidth {sheet.bandwidth / 1e9:.1f} GB/s",
        f"measured / datasheet: matmul {peaks.matmul_flops / sheet.peak_flops:.0%}, "
        f"bandwidth {peaks.copy_bandwidth / sheet.bandwidth:.0%}; the roofline uses the measured peaks",
    ]


def datasheet_or_measured(name: str, measure: Callable[[], MeasuredPeaks]) -> tuple[HardwareSpec, bool]:
    """Peaks for the uncalibrated roofline of a GPU named `name` (as CUDA reports it): its KNOWN_GPUS
    datasheet entry, else the peaks `measure()` returns (e.g. `measure_peaks` on that device, a second or
    two). Returns (spec, measured): measured is True when the datasheet had no entry."""
    try:
        return lookup_gpu(name), False
    except ValueError:
        return measure().hardware_spec(), True
