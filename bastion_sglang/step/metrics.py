"""BASTION's measurements: stage timings of each decode step and the Prometheus series built on them.

Stages, in order (`STAGES`): draft (drafter forward + top-k), plan (tree search + budget), verify (the
target's TARGET_VERIFY forward), accept (accept walk + output tokens), commit (slot compaction + drafter
KV). `timing.StageTimer` measures them with host clocks on CPU and with CUDA events on a GPU; CUDA results
are read one step late (`finish_step` returns the previous step's times), so timing never waits on the device.
The verify stage feeds the latency model's EMA; draft and the host stages feed the planner's step costs.

`BastionMetrics` (only with `--enable-metrics`, on the scheduler's stats rank) exports, with SGLang's
scheduler labels, on the same `/metrics` as SGLang:
- sglang:bastion_tree_nodes (histogram): draft nodes verified per request per step;
- sglang:bastion_expected_accept_length (histogram): Â of the verified tree per request per step, with the
  acceptance calibration and its online correction applied (what the planner maximised);
- sglang:bastion_expected_accept_length_raw (histogram): the same tree's raw Â (1 + Σ drafter path
  probabilities), for comparison;
- sglang:bastion_accept_length (histogram): tokens committed per request per step;
- sglang:bastion_verify_seconds_estimated / _observed (histograms): per verify pass;
- sglang:bastion_verify_relative_error (histogram): |estimated - observed| / observed per verify pass,
  after the first WARMUP_STEPS passes;
- sglang:bastion_step_stage_seconds (histogram, label `stage`): seconds per stage of a decode step, STAGES
  plus `other` (host time between the end of one decode step and the start of the next);
- sglang:bastion_speedup_estimated / _realised (histograms): per decode step, the plan's estimated speedup
  over plain decoding and the realised one (tokens committed × L_AR / (batch × measured step seconds));
- sglang:bastion_acceptance_calibration_error (gauge): |Σ Â - Σ realised| / Σ realised over recent steps;
- sglang:bastion_acceptance_correction (gauge, label `mode` greedy|sampled): online factor on the drafted Â;
- sglang:bastion_decode_steps_total (counter, label `mode`): decode steps that speculated, that drafted and
  then planned plain decoding (declined), and that skipped the drafter (skipped);
- sglang:bastion_latency_ema_factor (gauge, most recent): the latency model's online correction;
- sglang:bastion_uncalibrated_steps_total (counter): steps planned without a calibration profile.

Writes are batched: a decode step's observations are held and written to the multiprocess files together
with those of the next steps, FLUSH_STEPS steps at a time, and at once before the output of a finished
request leaves the scheduler (`flush_all`, from the registration's hook on SGLang's output streamer), so a
client that has its response reads series that include it. A gauge is written once per flush, at its latest
value. Written one step at a time, the dozen series of a skipped step cost 0.17 ms of host time per step on
the CPU demo pair (0.7 % of a plain step); 16 steps at a time, 0.05 ms per step: prometheus_client's
per-sample work runs several times faster in one tight loop than spread between forward passes.
"""

from __future__ import annotations

import functools
import weakref
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

from bastion_sglang.step.timing import STAGES, StageTimes

if TYPE_CHECKING:
    from prometheus_client import CollectorRegistry

STEP_MODES = ("speculative", "declined", "skipped")
"""Modes of a decode step (`sglang:bastion_decode_steps_total{mode=...}`)."""
WARMUP_STEPS = 3
"""Verify passes left out of the relative-error histogram (first passes pay one-off allocation costs)."""
OTHER_STAGE = "other"
"""Stage label of the host time between two decode steps."""
RELATIVE_ERROR_BUCKETS = (0.01, 0.02, 0.03, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.5, 0.75, 1.0, 2.0)
SPEEDUP_BUCKETS = (0.1, 0.25, 0.5, 0.75, 0.9, 1.0, 1.1, 1.25, 1.5, 2.0, 3.0, 4.0, 6.0, 8.0)
TREE_NODE_BUCKETS = (0, 1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024)
ACCEPT_BUCKETS = (1, 2, 3, 4, 5, 6, 8, 10, 12, 16, 20, 24, 32)
SECONDS_BUCKETS = (1e-4, 2.5e-4, 5e-4, 1e-3, 2.5e-3, 5e-3, 1e-2, 2.5e-2, 5e-2, 0.1, 0.25, 0.5, 1.0, 2.5)
FLUSH_STEPS = 16
"""Decode steps whose observations `BastionMetrics` holds before writing them (module docstring)."""

_LIVE: weakref.WeakSet[BastionMetrics] = weakref.WeakSet()
"""This process's BastionMetrics, for `flush_all`."""


def flush_all() -> None:
    """Write every held observation of this process's BastionMetrics (before a finished request's output
    leaves the scheduler)."""
    for metrics in list(_LIVE):
        metrics.flush()


def _deferred(write: Callable[..., None]) -> Callable[..., None]:
    """An observe method whose Prometheus writes wait for the next `BastionMetrics.flush`."""

    @functools.wraps(write)
    def observe(self: BastionMetrics, *args: Any, **kwargs: Any) -> None:
        self._held.append(functools.partial(write, self, *args, **kwargs))

    return observe


def scheduler_metric_labels() -> dict[str, str]:
    """The labels SGLang's scheduler collector puts on its series (`SchedulerMetricsCollector.init_new`)."""
    from bastion_sglang.integration import sglang_adapter as sgl

    parallel = sgl.get_parallel()
    disagg = sgl.get_disagg()
    engine_type = (
        "dynamic"
        if disagg.enable_pd_role_switch
        else sgl.DisaggregationMode.to_engine_type(disagg.disaggregation_mode)
    )
    labels = {
        "model_name": sgl.get_serving().served_model_name,
        "engine_type": engine_type,
        "tp_rank": parallel.tp_rank,
        "pp_rank": parallel.pp_rank,
        "moe_ep_rank": parallel.moe_ep_rank,
    }
    if parallel.dp_rank is not None:
        labels["dp_rank"] = parallel.dp_rank
    extra = sgl.get_observability().extra_metric_labels
    if extra:
        labels.update(extra)
    return {key: str(value) for key, value in labels.items()}


class BastionMetrics:
    """BASTION's Prometheus series, exported on SGLang's `/metrics` (prefix `sglang:bastion_`).

    Created in the scheduler process after SGLang has set the multiprocess directory, so the series join
    SGLang's own. Per request per step: verified tree nodes, expected accepted length Â (tokens, bonus
    included), realised accepted length (tokens). Per step: estimated and observed verify seconds, steps
    planned without a calibrated profile. The EMA factor of the latency model is a gauge (most recent).
    """

    def __init__(self, labels: dict[str, str], registry: CollectorRegistry | None = None) -> None:
        """labels: SGLang's scheduler labels (`scheduler_metric_labels`); registry: where the series register
        (None: prometheus_client's default, which SGLang's /metrics serves)."""
        import prometheus_client

        registry = prometheus_client.REGISTRY if registry is None else registry
        counter = functools.partial(prometheus_client.Counter, registry=registry)
        gauge = functools.partial(prometheus_client.Gauge, registry=registry)
        histogram = functools.partial(prometheus_client.Histogram, registry=registry)
        names = list(labels)
        self.tree_nodes = histogram(
            "sglang:bastion_tree_nodes",
            "Draft nodes verified per request per step (root excluded).",
            names,
            buckets=TREE_NODE_BUCKETS,
        )
        self.expected_accept = histogram(
            "sglang:bastion_expected_accept_length",
            "Expected tokens committed per request per step, A-hat of the verified tree (bonus included).",
            names,
            buckets=ACCEPT_BUCKETS,
        )
        self.accept_length = histogram(
            "sglang:bastion_accept_length",
            "Tokens committed per request per step (accepted draft nodes + the bonus token).",
            names,
            buckets=ACCEPT_BUCKETS,
        )
        self.verify_estimated = histogram(
            "sglang:bastion_verify_seconds_estimated",
            "Verify-pass latency the latency model predicted for the planned tree sizes, seconds.",
            names,
            buckets=SECONDS_BUCKETS,
        )
        self.verify_observed = histogram(
            "sglang:bastion_verify_seconds_observed",
            "Measured verify-pass latency, seconds.",
            names,
            buckets=SECONDS_BUCKETS,
        )
        self.ema_factor = gauge(
            "sglang:bastion_latency_ema_factor",
            "Online correction of the latency model as one factor at its typical point (observed / offline).",
            names,
            multiprocess_mode="mostrecent",
        )
        self.expected_accept_raw = histogram(
            "sglang:bastion_expected_accept_length_raw",
            "Raw A-hat of the verified tree per request per step: 1 + sum of drafter path probabilities.",
            names,
            buckets=ACCEPT_BUCKETS,
        )
        self.verify_relative_error = histogram(
            "sglang:bastion_verify_relative_error",
            "|estimated - observed| / observed verify latency per pass, after warm-up.",
            names,
            buckets=RELATIVE_ERROR_BUCKETS,
        )
        self.stage_seconds = histogram(
            "sglang:bastion_step_stage_seconds",
            "Seconds per stage of a decode step (draft, plan, verify, accept, commit, other).",
            [*names, "stage"],
            buckets=SECONDS_BUCKETS,
        )
        self.speedup_estimated = histogram(
            "sglang:bastion_speedup_estimated",
            "Estimated speedup over plain decoding of each decode step's plan.",
            names,
            buckets=SPEEDUP_BUCKETS,
        )
        self.speedup_realised = histogram(
            "sglang:bastion_speedup_realised",
            "Realised speedup over plain decoding per decode step: tokens x L_AR / (batch x step seconds).",
            names,
            buckets=SPEEDUP_BUCKETS,
        )
        self.acceptance_error = gauge(
            "sglang:bastion_acceptance_calibration_error",
            "Relative error of the expected vs realised accept length over recent steps.",
            names,
            multiprocess_mode="mostrecent",
        )
        self.acceptance_correction = gauge(
            "sglang:bastion_acceptance_correction",
            "Online correction factor of the calibrated expected accept length (drafted part).",
            [*names, "mode"],
            multiprocess_mode="mostrecent",
        )
        self.decode_steps = counter(
            "sglang:bastion_decode_steps",
            "Decode steps by mode: speculative (a tree verified), declined (drafted, then plain decoding "
            "planned: no tree paid), skipped (no drafter pass: the speculation gate is backing off).",
            [*names, "mode"],
        )
        self._verify_passes = 0
        self.uncalibrated_steps = counter(
            "sglang:bastion_uncalibrated_steps",
            "Decode steps planned without a calibrated latency profile.",
            names,
        )
        # each series at this worker's labels, resolved once: prometheus_client's `labels` validates and
        # locks on every call, and a decode step writes a dozen series
        self._nodes = self.tree_nodes.labels(**labels)
        self._expected = self.expected_accept.labels(**labels)
        self._expected_raw = self.expected_accept_raw.labels(**labels)
        self._accepted = self.accept_length.labels(**labels)
        self._estimated = self.verify_estimated.labels(**labels)
        self._observed = self.verify_observed.labels(**labels)
        self._relative_error = self.verify_relative_error.labels(**labels)
        self._stages = {
            name: self.stage_seconds.labels(**labels, stage=name) for name in (*STAGES, OTHER_STAGE)
        }
        self._speedup_estimated = self.speedup_estimated.labels(**labels)
        self._speedup_realised = self.speedup_realised.labels(**labels)
        self._steps = {mode: self.decode_steps.labels(**labels, mode=mode) for mode in STEP_MODES}
        self._uncalibrated = self.uncalibrated_steps.labels(**labels)
        self._ema = self.ema_factor.labels(**labels)
        self._acceptance_error = self.acceptance_error.labels(**labels)
        self._corrections = {
            mode: self.acceptance_correction.labels(**labels, mode=mode) for mode in ("greedy", "sampled")
        }
        self._held: list[Callable[[], None]] = []  # writes of the steps since the last flush, in order
        self._held_steps = 0
        self._gauges: dict[Any, float] = {}  # each gauge's latest value since the last flush
        _LIVE.add(self)

    def end_step(self) -> None:
        """A decode step's observations are all made: write the held ones once FLUSH_STEPS steps are held.
        (The realised accept lengths of a step arrive after its end, and join the steps after it.)"""
        self._held_steps += 1
        if self._held_steps >= FLUSH_STEPS:
            self.flush()

    def flush(self) -> None:
        """Write every held observation to the Prometheus series, in the order they were made, then each
        gauge's latest value (a gauge keeps only its last value, so the values before it are not written)."""
        held, self._held, self._held_steps = self._held, [], 0
        gauges, self._gauges = self._gauges, {}
        for write in held:
            write()
        for gauge, value in gauges.items():
            gauge.set(value)

    @_deferred
    def observe_plan(
        self,
        node_counts: Sequence[int],
        expected_accept: Sequence[float],
        expected_accept_raw: Sequence[float],
        estimated_speedup: float,
        calibrated: bool,
        mode: str = "speculative",
    ) -> None:
        """One planned step: nodes, Â and raw Â per request; the plan's estimated speedup; whether the
        latency model had a profile; the step's mode (one of STEP_MODES: ValueError when written)."""
        if mode not in STEP_MODES:
            raise ValueError(f"unknown step mode {mode!r}; modes: {STEP_MODES}")
        self._steps[mode].inc()
        nodes_series, accept_series, raw_series = self._nodes, self._expected, self._expected_raw
        for nodes, accept, raw in zip(node_counts, expected_accept, expected_accept_raw, strict=True):
            nodes_series.observe(nodes)
            accept_series.observe(accept)
            raw_series.observe(raw)
        self._speedup_estimated.observe(estimated_speedup)
        if not calibrated:
            self._uncalibrated.inc()

    def observe_verify(self, estimated_seconds: float, observed_seconds: float, ema_factor: float) -> None:
        """One verify pass: the model's estimate, the measurement, the EMA factor after observing it."""
        self._gauges[self._ema] = ema_factor
        self._observe_verify(estimated_seconds, observed_seconds)

    @_deferred
    def _observe_verify(self, estimated_seconds: float, observed_seconds: float) -> None:
        self._estimated.observe(estimated_seconds)
        self._observed.observe(observed_seconds)
        self._verify_passes += 1
        if self._verify_passes > WARMUP_STEPS:
            error = abs(estimated_seconds - observed_seconds) / observed_seconds
            self._relative_error.observe(error)

    @_deferred
    def observe_stages(self, times: StageTimes, other_seconds: float | None) -> None:
        """One decode step's stage seconds; other_seconds: None when no decode step came just before."""
        stages = self._stages
        for name in STAGES:
            stages[name].observe(getattr(times, name))
        if other_seconds is not None:
            stages[OTHER_STAGE].observe(other_seconds)

    @_deferred
    def observe_realised_speedup(self, speedup: float) -> None:
        self._speedup_realised.observe(speedup)

    def observe_acceptance(
        self, calibration_error: float, greedy_correction: float, sampled_correction: float
    ) -> None:
        """The acceptance tracker after a step: its calibration error and per-mode corrections (gauges, the
        latest values written at the next flush)."""
        gauges = self._gauges
        gauges[self._acceptance_error] = calibration_error
        gauges[self._corrections["greedy"]] = greedy_correction
        gauges[self._corrections["sampled"]] = sampled_correction

    @_deferred
    def observe_accepted(self, accepted_drafts: Sequence[int]) -> None:
        """Accepted draft nodes per request of one step (host list); records tokens = accepted + 1."""
        series = self._accepted
        for accepted in accepted_drafts:
            series.observe(accepted + 1)
