"""One policy at one temperature in one repeat: every prompt streamed through an Engine, timed.

`measure` streams the prompts `concurrency` at a time and reads the worker's histogram growth;
`repeat_measurement` turns that into the report's `RepeatMeasurement`; `TemperatureRun` and `PolicyRun` are
what a policy's process hands back to the parent.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pydantic import BaseModel, ConfigDict, Field
from tqdm import tqdm

from bastion_sglang.bench.histograms import TREE_NODES_METRIC, WorkerTotals
from bastion_sglang.bench.plan import BenchPlan, BenchPolicy, BenchSettings
from bastion_sglang.bench.report import RepeatMeasurement
from bastion_sglang.bench.streaming import (
    DecodeTiming,
    StreamedRequest,
    decode_timing,
    latency_percentiles_ms,
    pooled_timing,
    stream_batch,
)

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class Measured:
    """What one policy returned at one temperature in one repeat."""

    requests: int
    completion_tokens: int
    verify_passes: int | None  # None: no response carried spec_verify_ct
    wall_seconds: float
    decode: DecodeTiming  # every request's, pooled
    growth: WorkerTotals | None  # the worker's histogram growth; None: the Engine exports no BASTION series

    @classmethod
    def of(
        cls, requests: Sequence[StreamedRequest], wall_seconds: float, growth: WorkerTotals | None
    ) -> Measured:
        passes = [r.verify_passes for r in requests if r.verify_passes is not None]
        return cls(
            requests=len(requests),
            completion_tokens=sum(r.completion_tokens for r in requests),
            verify_passes=sum(passes) if passes else None,
            wall_seconds=wall_seconds,
            decode=pooled_timing([decode_timing(r.arrivals) for r in requests]),
            growth=growth,
        )


def sampling_params(settings: BenchSettings, temperature: float) -> list[dict[str, Any]]:
    """Per prompt: its sampling parameters at `temperature` (request i samples with seed + i when T > 0)."""
    return [
        {
            "temperature": temperature,
            "max_new_tokens": settings.max_new_tokens,
            "ignore_eos": settings.ignore_eos,
            **({"sampling_seed": settings.seed + i} if temperature > 0 else {}),
        }
        for i in range(settings.num_prompts)
    ]


def measure(
    engine: Any,
    prompt_ids: Sequence[list[int]],
    temperature: float,
    plan: BenchPlan,
    metrics_dir: Path | None,
    label: str,
) -> Measured:
    """Stream every prompt at `temperature`, `concurrency` at a time; time only the generate calls.

    metrics_dir: the Engine's Prometheus folder when its worker exports the sglang:bastion_* series.
    """
    settings = plan.settings
    params = sampling_params(settings, temperature)
    before = WorkerTotals.read(metrics_dir) if metrics_dir is not None else None
    requests: list[StreamedRequest] = []
    seconds = 0.0
    with tqdm(total=len(prompt_ids), desc=label, unit="req", leave=False) as bar:
        for start in range(0, len(prompt_ids), settings.concurrency):
            end = start + settings.concurrency
            began = time.perf_counter()
            batch = stream_batch(engine, prompt_ids[start:end], params[start:end])
            seconds += time.perf_counter() - began
            requests += batch
            bar.update(len(batch))
    growth = None
    if metrics_dir is not None and before is not None:
        growth = WorkerTotals.read(metrics_dir).minus(before)
        if growth.metrics[TREE_NODES_METRIC].count <= 0:
            logger.warning(
                "%s: the worker recorded no %s samples; mean budget unknown", label, TREE_NODES_METRIC
            )
    return Measured.of(requests, seconds, growth)


def repeat_measurement(policy: BenchPolicy, repeat: int, measured: Measured) -> RepeatMeasurement:
    """The report's record of one measurement; RuntimeError when it cannot be one (nothing decoded, or a
    speculative Engine that reported no verify pass)."""
    if policy.kind != "ar" and not measured.verify_passes:
        raise RuntimeError(f"{policy.name}: the Engine reported no spec_verify_ct; is speculation running?")
    decode = measured.decode
    if decode.decode_tokens <= 0 or decode.decode_seconds <= 0:
        raise RuntimeError(
            f"{policy.name}: no token arrived after any request's first one, so no decode time was measured "
            "(pass --ignore-eos)"
        )
    p50, p90 = latency_percentiles_ms(decode.token_latencies)
    return RepeatMeasurement(
        repeat=repeat,
        requests=measured.requests,
        completion_tokens=measured.completion_tokens,
        verify_passes=measured.verify_passes,
        wall_seconds=measured.wall_seconds,
        tokens_per_second=measured.completion_tokens / measured.wall_seconds,
        decode_tokens=decode.decode_tokens,
        decode_seconds=decode.decode_seconds,
        decode_tokens_per_second=decode.decode_tokens / decode.decode_seconds,
        token_latency_p50_ms=p50,
        token_latency_p90_ms=p90,
    )


class TemperatureRun(BaseModel):
    """One policy at one temperature in one repeat, as its process hands it to the parent."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    temperature: float = Field(ge=0)
    measurement: RepeatMeasurement
    growth: WorkerTotals | None = Field(description="the worker's histogram growth; None: not BASTION")


class PolicyRun(BaseModel):
    """What one policy process writes to its scratch folder (`RUN_NAME`): every temperature of one repeat."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    policy: str
    repeat: int = Field(ge=1)
    runs: tuple[TemperatureRun, ...] = Field(min_length=1)
