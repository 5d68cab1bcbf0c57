"""benchmarks/startup_calibration.py scores a start-up profile's latency on a calibrate profile's grid, split
by what the start-up measured, and only like with like (graph replays against graph replays) (CPU, fast)."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import ModuleType

import pytest
from calibration_profiles import PLAIN_SETTINGS, TRUE_FIT, make_profile, synthetic_samples

BENCHMARK = Path(__file__).resolve().parents[1] / "benchmarks" / "startup_calibration.py"


@pytest.fixture(scope="module")
def benchmark() -> ModuleType:
    spec = importlib.util.spec_from_file_location("startup_calibration_benchmark", BENCHMARK)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # pydantic resolves the report's annotations through it
    spec.loader.exec_module(module)
    return module


def test_latency_error_is_split_by_what_the_start_up_measured(benchmark: ModuleType) -> None:
    startup = make_profile(synthetic_samples(TRUE_FIT, widths=(2, 4, 8), contexts=(64, 512)))
    calibrate = make_profile()  # widths 2..1024 (10) × contexts 64, 512, 4096
    quality = benchmark.latency_quality(startup, calibrate)
    assert quality.compared == "eager vs eager"
    counts = {(split.mode, split.kind): split.samples for split in quality.splits}
    assert counts == {
        ("verify", "measured"): 3 * 2,
        ("verify", "width measured"): 3 * 1,
        ("verify", "context measured"): 7 * 2,
        ("verify", "neither measured"): 7 * 1,
        ("decode", "measured"): 2,
        ("decode", "neither measured"): 1,
    }
    assert sum(counts.values()) == len(calibrate.samples)
    model = startup.latency_model()
    verify = {x for x in calibrate.samples if x.mode == "verify" and x.s in (2, 4, 8) and x.c == 4096}
    errors = [abs(model.predict(x.s, x.c) - x.seconds) / x.seconds for x in verify]
    width_measured = next(split for split in quality.splits if split.kind == "width measured")
    assert width_measured.mode == "verify" and width_measured.mape == pytest.approx(
        sum(errors) / 3, rel=1e-12
    )
    decode = [x for x in calibrate.samples if x.mode == "decode" and x.c == 4096]
    unmeasured = next(
        split for split in quality.splits if (split.mode, split.kind) == ("decode", "neither measured")
    )
    assert unmeasured.mape == pytest.approx(
        abs(model.predict_plain(4096) - decode[0].seconds) / decode[0].seconds, rel=1e-12
    )


def test_graph_replays_are_not_scored_against_eager_passes(benchmark: ModuleType) -> None:
    graphs = PLAIN_SETTINGS.model_copy(update={"cuda_graphs": True})
    startup = make_profile(made_by="startup-quick", settings=graphs)
    quality = benchmark.latency_quality(startup, make_profile())
    assert quality.compared == "not compared: the start-up timed graphs passes, the calibrate profile eager"
    assert quality.startup_mape_on_calibrate_grid is None and quality.splits == []
    same = benchmark.latency_quality(startup, make_profile(settings=graphs))
    assert same.compared == "graphs vs graphs" and len(same.splits) == 6
