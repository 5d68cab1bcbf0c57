"""One policy at one temperature in one repeat: its streamed batches, timed, and the worker's histograms.

`Measurement` collects the batches of one policy and temperature (`bench.server.BatchResult`) and reads the
worker's histogram growth over them; `repeat_measurement` turns that into the report's `RepeatMeasurement`;
`TemperatureRun` is what the repeat keeps of it.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pydantic import BaseModel, ConfigDict, Field

from bastion_sglang.bench.histograms import TREE_NODES_METRIC, WorkerTotals
from bastion_sglang.bench.plan import BenchPolicy, BenchSettings
from bastion_sglang.bench.report import RepeatMeasurement
from bastion_sglang.bench.server import BatchResult
from bastion_sglang.bench.streaming import (
    DecodeTiming,
    StreamedRequest,
    decode_timing,
    latency_percentiles_ms,
    pooled_timing,
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


def sampling_params(settings: BenchSettings, temperature: float, repeat: int) -> list[dict[str, Any]]:
    """Per prompt: its sampling parameters at `temperature` in repeat `repeat` (1..R; R + r for the warm-up
    of repeat r, `run.warm_up`).
    Request i samples with seed + repeat · N + i (N prompts) when T > 0 or under synthetic acceptance, whose
    true continuations are keyed by the request's seed: every policy of a repeat meets the same draws, and
    each repeat new ones."""
    seeded = temperature > 0 or settings.synthetic_acceptance is not None
    first = settings.seed + repeat * settings.num_prompts
    return [
        {
            "temperature": temperature,
            "max_new_tokens": settings.max_new_tokens,
            "ignore_eos": settings.ignore_eos,
            **({"sampling_seed": first + i} if seeded else {}),
        }
        for i in range(settings.num_prompts)
    ]


@dataclass
class Measurement:
    """One policy at one temperature in one repeat while its batches arrive: the worker's histograms when it
    began (None: the Engine exports no BASTION series), every request streamed so far and the seconds of their
    generate calls."""

    policy: BenchPolicy
    metrics_dir: Path
    before: WorkerTotals | None
    requests: list[StreamedRequest]
    seconds: float

    @classmethod
    def begin(cls, policy: BenchPolicy, metrics_dir: Path) -> Measurement:
        """Start measuring `policy`, whose Engine writes its Prometheus samples into `metrics_dir`."""
        before = WorkerTotals.read(metrics_dir) if policy.kind == "bastion" else None
        return cls(policy, metrics_dir, before, [], 0.0)

    def add(self, batch: BatchResult) -> None:
        self.requests += batch.requests
        self.seconds += batch.seconds

    def finish(self, repeat: int, temperature: float) -> TemperatureRun:
        """The run of every batch added, with the worker's histogram growth since `begin`; RuntimeError when
        it is not a measurement (see `repeat_measurement`)."""
        growth = None
        if self.before is not None:
            growth = WorkerTotals.read(self.metrics_dir).minus(self.before)
            if growth.metrics[TREE_NODES_METRIC].count <= 0:
                logger.warning(
                    "%s T=%g repeat %d: the worker recorded no %s samples; mean budget unknown",
                    self.policy.name,
                    temperature,
                    repeat,
                    TREE_NODES_METRIC,
                )
        measured = Measured.of(self.requests, self.seconds, growth)
        record = repeat_measurement(self.policy, repeat, measured)
        return TemperatureRun(temperature=temperature, measurement=record, growth=growth)


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
    """One policy at one temperature in one repeat, as the report keeps it."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    temperature: float = Field(ge=0)
    measurement: RepeatMeasurement
    growth: WorkerTotals | None = Field(description="the worker's histogram growth; None: not BASTION")
