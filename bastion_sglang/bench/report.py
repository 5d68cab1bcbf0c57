"""`bench.json`: the report's models, and the definition of every number in it.

Per policy, temperature and repeat (`RepeatMeasurement`):
- wall tokens/s: completion tokens / wall seconds of the generate calls (first call to last chunk; prefill and
  queueing included, engine start-up and warm-up excluded);
- decode tokens/s: Σ decode tokens / Σ decode seconds over the requests, where a request's decode seconds
  are the arrival of its last but one token-carrying chunk minus that of its first chunk, and its decode
  tokens are the tokens that arrived in between (after the first chunk, which holds the prefill's token, up
  to that chunk). The last chunk is left out (when at least two came after the first) because SGLang's overlap
  scheduler sends a step's tokens after the next step ran: its first chunk comes one decode step late and its
  last right behind the one before (`streaming.decode_timing`), which timed an overlapped Engine over one
  step fewer than it emitted tokens in. Prefill excluded. A per-request rate: with `--concurrency c` requests
  decode side by side, so the Engine's aggregate decode rate is up to c times it;
- per-token latency p50 / p90 (ms): each chunk after a request's first (up to the last but one, as above),
  carrying k new tokens g seconds after that request's previous token-carrying chunk, gives k samples g / k (a
  verify pass commits several tokens at once); percentiles (linear interpolation) over the samples of all the
  requests. Σ samples = Σ decode seconds, so their mean is 1 / decode tokens/s.

Per policy and temperature (`BenchRow`), over the repeats:
- medians, with min and max (each repeat's values under `per_repeat`): decode tokens/s and wall tokens/s; the
  token latency p50 and p90 are the medians of each repeat's percentile;
- speedup: median decode tokens/s over `ar`'s at the same temperature; wall_speedup: the same for wall
  tokens/s (null when `ar` is not run);
- pooled over every repeat's requests and steps (ratios of totals, not medians): requests, completion tokens,
  verify passes, and τ, the mean accepted length: Σ completion_tokens / Σ spec_verify_ct (tokens committed per
  verify pass, bonus included; 1.0 for `ar`).

The worker's histograms, pooled the same way: Σ over the repeats of each histogram's `_sum` growth over the
temperature's generate calls, over Σ of its `_count` growth, read with prometheus_client's multiprocess
collector from each Engine's PROMETHEUS_MULTIPROC_DIR (null for `ar` and `dflash`, which do not export them):
- mean budget: draft nodes verified per request per step (`sglang:bastion_tree_nodes`);
- mean_expected_accept_length: Â per request per step, the calibrated estimate the planner maximised (tokens
  committed, bonus included); mean_expected_accept_length_raw: the same trees' uncalibrated Â;
- realised_accept_length: tokens committed per request per step, as the worker counted them;
- accept_error / accept_error_raw: expected / realised - 1 (signed), calibrated and raw;
- latency_mape: mean |estimated - observed| / observed verify latency per pass, after the worker's warm-up;
- estimated_speedup / realised_speedup: the planner's Ŝ of the plans it chose (1 for plain steps) and its
  counterpart measured per step (committed tokens · L_AR / (B · step seconds)); with the Â columns they say
  which of acceptance and latency the planner got wrong at a fixed budget, and where adaptive stopped;
- stage_ms: mean milliseconds per decode step of each stage (draft, plan, verify, accept, commit) and of
  `other`, the host time between two decode steps outside the worker.

Per temperature (`TemperatureSummary`): the best policy in hindsight, the one with the highest median decode
tokens/s, and adaptive's median decode tokens/s over the best's and over `ar`'s (when they are run); and the
same ratios taken repeat by repeat (adaptive's decode tokens/s over the other policy's in the same repeat),
as their median, min and max. Under `--schedule interleaved` the policies of a repeat take turns batch by
batch, so these paired ratios are free of the machine's drift between repeats, which the ratio of medians
is not.
"""

from __future__ import annotations

import statistics
from collections.abc import Sequence
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from bastion_sglang.bench.plan import BenchSettings


class StageMs(BaseModel):
    """Mean milliseconds per decode step of each stage (`other`: per decode step that followed one)."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    draft: float = Field(ge=0)
    plan: float = Field(ge=0)
    verify: float = Field(ge=0)
    accept: float = Field(ge=0)
    commit: float = Field(ge=0)
    other: float = Field(ge=0)


class Spread(BaseModel):
    """A value over the repeats (a rate in tokens/s, or a ratio of two): its median, min and max."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    median: float = Field(ge=0)
    min: float = Field(ge=0)
    max: float = Field(ge=0)

    @model_validator(mode="after")
    def _ordered(self) -> Spread:
        if not self.min <= self.median <= self.max:
            raise ValueError(f"needs min <= median <= max, got {self.min}, {self.median}, {self.max}")
        return self

    @classmethod
    def of(cls, values: Sequence[float]) -> Spread:
        """The spread of one value per repeat (at least one)."""
        return cls(median=statistics.median(values), min=min(values), max=max(values))


class RepeatMeasurement(BaseModel):
    """One policy at one temperature in one repeat (its own fresh Engine); definitions in the module doc."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    repeat: int = Field(ge=1, description="the round, from 1")
    requests: int = Field(gt=0)
    completion_tokens: int = Field(ge=0, description="Σ meta_info completion_tokens")
    verify_passes: int | None = Field(description="Σ meta_info spec_verify_ct; None for ar")
    wall_seconds: float = Field(gt=0, description="wall time of the generate calls, seconds")
    tokens_per_second: float = Field(ge=0, description="completion_tokens / wall_seconds (prefill included)")
    decode_tokens: int = Field(
        gt=0, description="Σ per request: tokens that arrived after its first chunk, up to its last but one"
    )
    decode_seconds: float = Field(
        gt=0, description="Σ per request: last but one token-carrying chunk's arrival - first's, seconds"
    )
    decode_tokens_per_second: float = Field(gt=0, description="decode_tokens / decode_seconds, per request")
    token_latency_p50_ms: float = Field(ge=0, description="median per-token latency after the prefill, ms")
    token_latency_p90_ms: float = Field(ge=0, description="90th percentile per-token latency, ms")


class BenchRow(BaseModel):
    """One policy at one temperature over every repeat: medians of the rates, pooled means of the rest."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    policy: str
    temperature: float = Field(ge=0)
    per_repeat: tuple[RepeatMeasurement, ...] = Field(min_length=1, description="each repeat's, in order")
    requests: int = Field(gt=0, description="Σ over the repeats")
    completion_tokens: int = Field(ge=0, description="Σ meta_info completion_tokens over the repeats")
    verify_passes: int | None = Field(description="Σ meta_info spec_verify_ct over the repeats; None for ar")
    decode_tokens_per_second: Spread = Field(description="per request, prefill excluded; over the repeats")
    tokens_per_second: Spread = Field(description="wall clock, prefill included; over the repeats")
    token_latency_p50_ms: float = Field(ge=0, description="median over the repeats of each one's p50, ms")
    token_latency_p90_ms: float = Field(ge=0, description="median over the repeats of each one's p90, ms")
    mean_accept_length: float = Field(ge=0, description="τ = completion_tokens / verify_passes; 1 for ar")
    mean_budget: float | None = Field(
        description="draft nodes verified per request per step (sglang:bastion_tree_nodes); None: not BASTION"
    )
    speedup: float | None = Field(description="median decode tokens/s over ar's at this temperature")
    wall_speedup: float | None = Field(description="median wall tokens/s over ar's at this temperature")
    mean_expected_accept_length: float | None = Field(
        default=None, description="calibrated Â per request per step; None: not BASTION"
    )
    mean_expected_accept_length_raw: float | None = Field(default=None, description="uncalibrated Â")
    realised_accept_length: float | None = Field(
        default=None, description="tokens committed per request per step (the worker's count)"
    )
    accept_error: float | None = Field(default=None, description="expected / realised - 1, calibrated")
    accept_error_raw: float | None = Field(default=None, description="expected / realised - 1, raw")
    latency_mape: float | None = Field(default=None, description="mean relative verify-latency error")
    estimated_speedup: float | None = Field(
        default=None, description="the planner's Ŝ of its chosen plans, mean per decode step (1: plain)"
    )
    realised_speedup: float | None = Field(
        default=None,
        description="committed tokens · L_AR / (B · measured step seconds), mean per decode step: Ŝ's "
        "counterpart with the step's own acceptance and time (L_AR the latency model's)",
    )
    stage_ms: StageMs | None = Field(default=None, description="mean ms per decode step per stage")


class TemperatureSummary(BaseModel):
    """The best policy in hindsight at one temperature (by median decode tokens/s); adaptive against it."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    temperature: float = Field(ge=0)
    best_policy: str = Field(description="the policy with the highest median decode tokens/s")
    best_decode_tokens_per_second: float = Field(ge=0, description="its median decode tokens/s")
    adaptive_vs_best: float | None = Field(
        description="adaptive's median decode tokens/s over the best's; None: adaptive not run"
    )
    adaptive_vs_ar: float | None = Field(
        description="adaptive's median decode tokens/s over ar's; None: adaptive or ar not run"
    )
    adaptive_vs_best_per_repeat: Spread | None = Field(
        default=None, description="adaptive's decode tokens/s over the best's in each repeat; None: not run"
    )
    adaptive_vs_ar_per_repeat: Spread | None = Field(
        default=None, description="adaptive's decode tokens/s over ar's in each repeat; None: not run"
    )
    control_vs_ar_per_repeat: Spread | None = Field(
        default=None,
        description="the --control Engine's decode tokens/s over ar's in each repeat, the run's noise floor; "
        "None: no --control",
    )


class BenchReport(BaseModel):
    """`bench.json`: the settings, where it ran, package versions, each repeat's policy order, one row per
    policy × temperature and one summary per temperature."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    format_version: Literal[3] = Field(
        default=3,
        description="3: decode timing leaves each request's last chunk out (2: first to last chunk)",
    )
    created: str = Field(description="UTC time the report was written, ISO 8601")
    settings: BenchSettings
    device: str = Field(description="device name: the GPU's, or 'CPU <model>'")
    versions: dict[str, str] = Field(description="installed package -> version")
    repeat_orders: tuple[tuple[str, ...], ...] = Field(min_length=1, description="policy order per repeat")
    rows: tuple[BenchRow, ...] = Field(min_length=1)
    summaries: tuple[TemperatureSummary, ...] = Field(min_length=1, description="one per temperature")

    @model_validator(mode="after")
    def _orders_run_every_policy(self) -> BenchReport:
        if len(self.repeat_orders) != self.settings.repeats:
            raise ValueError(f"{len(self.repeat_orders)} repeat orders for {self.settings.repeats} repeats")
        for order in self.repeat_orders:
            if sorted(order) != sorted(self.settings.policies):
                raise ValueError(f"repeat order {order} does not run each of {self.settings.policies} once")
        return self
