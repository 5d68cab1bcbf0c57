"""Timing one operation on a device: CUDA events on a GPU, `time.perf_counter` on the CPU.

`time_op(op, device, warmup, repeats, reset)` runs `op` warmup times untimed, then `repeats` timed times;
`reset` (if given) runs untimed before every call, e.g. to drop the KV a verify pass appended. On CUDA each
timed call is bracketed by two events on the current stream and the host waits once, after the last call,
so timing adds no synchronisation between calls.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable

import torch


def _check_counts(warmup: int, repeats: int) -> None:
    if isinstance(warmup, bool) or not isinstance(warmup, int) or warmup < 0:
        raise ValueError(f"warmup must be an int >= 0, got {warmup!r}")
    if isinstance(repeats, bool) or not isinstance(repeats, int) or repeats < 1:
        raise ValueError(f"repeats must be an int >= 1, got {repeats!r}")


def time_op(
    op: Callable[[], object],
    device: torch.device,
    warmup: int,
    repeats: int,
    reset: Callable[[], object] | None = None,
) -> list[float]:
    """Seconds of each of `repeats` timed calls of `op` on `device` (module docstring)."""
    _check_counts(warmup, repeats)
    for _ in range(warmup):
        if reset is not None:
            reset()
        op()
    if device.type == "cuda":
        pairs = []
        for _ in range(repeats):
            if reset is not None:
                reset()
            start = torch.cuda.Event(enable_timing=True)
            end = torch.cuda.Event(enable_timing=True)
            start.record()
            op()
            end.record()
            pairs.append((start, end))
        pairs[-1][1].synchronize()  # host sync: read every event once, after the last call
        return [start.elapsed_time(end) / 1000.0 for start, end in pairs]  # ms -> s
    seconds = []
    for _ in range(repeats):
        if reset is not None:
            reset()
        begin = time.perf_counter()
        op()
        seconds.append(time.perf_counter() - begin)
    return seconds


def median_seconds(
    op: Callable[[], object],
    device: torch.device,
    warmup: int,
    repeats: int,
    reset: Callable[[], object] | None = None,
) -> float:
    """Median of `time_op`, seconds."""
    return statistics.median(time_op(op, device, warmup, repeats, reset))
