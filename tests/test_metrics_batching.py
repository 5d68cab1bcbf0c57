"""BastionMetrics holds a decode step's observations and writes them FLUSH_STEPS steps at a time, in order,
and at once on `flush_all` (the hook before a finished request's output)."""

from __future__ import annotations

from pathlib import Path

import pytest
from prometheus_client import CollectorRegistry

from bastion_sglang.step.metrics import FLUSH_STEPS, BastionMetrics, flush_all
from bastion_sglang.step.timing import StageTimes

LABELS = {"model_name": "batching-test"}
STEPS = "sglang:bastion_decode_steps_total"
NODES = "sglang:bastion_tree_nodes_count"
CORRECTION = "sglang:bastion_acceptance_correction"


@pytest.fixture
def metrics(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> tuple[BastionMetrics, CollectorRegistry]:
    # prometheus_client may be in multiprocess mode in this process (engine tests set the folder before
    # importing it): give it a folder of its own
    monkeypatch.setenv("PROMETHEUS_MULTIPROC_DIR", str(tmp_path))
    registry = CollectorRegistry()
    return BastionMetrics(LABELS, registry=registry), registry


def skipped_step(metrics: BastionMetrics, batch: int) -> None:
    ones = [1.0] * batch
    metrics.observe_plan([0] * batch, ones, ones, 1.0, True, "skipped")
    metrics.observe_stages(StageTimes(0.0, 1e-4, 0.02, 1e-4, 1e-5, 0.0205), 1e-3)
    metrics.observe_verify(0.02, 0.021, 1.05)
    metrics.end_step()


def sample(registry: CollectorRegistry, name: str, **labels: str) -> float:
    return registry.get_sample_value(name, {**LABELS, **labels}) or 0.0


def test_observations_are_written_flush_steps_at_a_time(
    metrics: tuple[BastionMetrics, CollectorRegistry],
) -> None:
    worker, registry = metrics
    for _ in range(FLUSH_STEPS - 1):
        skipped_step(worker, batch=3)
    assert sample(registry, STEPS, mode="skipped") == 0.0
    assert sample(registry, NODES) == 0.0
    skipped_step(worker, batch=3)
    assert sample(registry, STEPS, mode="skipped") == FLUSH_STEPS
    assert sample(registry, NODES) == 3 * FLUSH_STEPS
    skipped_step(worker, batch=3)
    assert sample(registry, STEPS, mode="skipped") == FLUSH_STEPS


def test_flush_all_writes_what_is_held_in_order(metrics: tuple[BastionMetrics, CollectorRegistry]) -> None:
    worker, registry = metrics
    skipped_step(worker, batch=2)
    worker.observe_acceptance(0.1, 0.9, 0.8)
    worker.observe_acceptance(0.2, 0.7, 0.6)  # after the first: the gauges end at its values
    worker.observe_accepted([0, 3])  # a step's realised lengths arrive after the step ended
    flush_all()
    assert sample(registry, STEPS, mode="skipped") == 1.0
    assert sample(registry, CORRECTION, mode="greedy") == pytest.approx(0.7)
    assert sample(registry, "sglang:bastion_accept_length_sum") == pytest.approx(1.0 + 4.0)
    flush_all()  # nothing held: nothing written twice
    assert sample(registry, STEPS, mode="skipped") == 1.0


def test_an_unknown_step_mode_is_refused_when_written(
    metrics: tuple[BastionMetrics, CollectorRegistry],
) -> None:
    worker, registry = metrics
    worker.observe_plan([0], [1.0], [1.0], 1.0, True, "paused")
    with pytest.raises(ValueError, match="unknown step mode 'paused'"):
        worker.flush()
    assert sample(registry, STEPS, mode="paused") == 0.0
