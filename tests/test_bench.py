"""`bastion bench` end to end on CPU, and its argument errors.

One run of `bastion bench` (module-scoped: two Engines take about a minute on two cores) with the tiny
random fp32 Qwen3 target and DFlash drafter of tests/tiny_models.py, a JSONL file of two prompts, policies
ar and chain at T = 0: the JSON report validates as `BenchReport`, the numbers obey their definitions, the
chain row's mean budget is what ChainPolicy verifies, and the plot is a PNG. The error tests start no Engine.
"""

from __future__ import annotations

import contextlib
import json
from pathlib import Path

import pytest
from tiny_models import make_tiny_drafter, make_tiny_target

from bastion_sglang import cli
from bastion_sglang.bench import (
    EXPECTED_METRIC,
    EXPECTED_RAW_METRIC,
    LATENCY_ERROR_METRIC,
    PLOT_NAME,
    REALISED_METRIC,
    REPORT_NAME,
    STAGE_NAMES,
    TREE_NODES_METRIC,
    BenchPolicy,
    BenchReport,
    BenchRow,
    EstimateSummary,
    HistogramTotals,
    Measured,
    WorkerTotals,
    make_row,
    with_speedups,
)

MAX_BUDGET = 8
BLOCK_SIZE = 16
CHAIN_NODES = min(MAX_BUDGET, BLOCK_SIZE - 1)
"""ChainPolicy verifies the whole top-1 path: a node per draft position (γ - 1 of them), at most N_max."""
MAX_NEW_TOKENS = 12
PNG_MAGIC = b"\x89PNG\r\n\x1a\n"
PROMPTS = ({"id": "greeting", "prompt": "hello world"}, {"turns": ["the quick brown fox"]})


def _write_prompts(path: Path) -> Path:
    path.write_text("".join(json.dumps(record) + "\n" for record in PROMPTS), encoding="utf-8")
    return path


@pytest.fixture(scope="module")
def bench_run(tmp_path_factory: pytest.TempPathFactory) -> tuple[BenchReport, Path, str]:
    """(the report read back from bench.json, the output folder, stdout) of one `bastion bench` run."""
    root = tmp_path_factory.mktemp("bench")
    target = make_tiny_target(root / "target", vocab_size=260, initializer_range=0.1)
    drafter = make_tiny_drafter(root / "drafter", target, target_layer_ids=[0, 2], block_size=BLOCK_SIZE)
    prompts = _write_prompts(root / "prompts.jsonl")
    out = root / "results"
    argv = [
        "bench",
        "--model-path", str(target), "--draft-model-path", str(drafter), "--prompts", str(prompts),
        "--policies", "ar,chain", "--device", "cpu", "--dtype", "float32", "--concurrency", "2",
        "--max-new-tokens", str(MAX_NEW_TOKENS), "--ignore-eos", "--max-budget", str(MAX_BUDGET),
        "--mem-fraction-static", "0.05", "--max-total-tokens", "8192", "--sglang-log-level", "error",
        "--out", str(out),
    ]  # fmt: skip
    stdout = root / "stdout.txt"
    with stdout.open("w") as handle, contextlib.redirect_stdout(handle):
        status = cli.main(argv)
    assert status == 0
    report = BenchReport.model_validate_json((out / REPORT_NAME).read_text(encoding="utf-8"))
    return report, out, stdout.read_text()


@pytest.mark.slow
def test_report_rows(bench_run: tuple[BenchReport, Path, str]) -> None:
    report, _, _ = bench_run
    assert [(row.policy, row.temperature) for row in report.rows] == [("ar", 0.0), ("chain", 0.0)]
    assert report.settings.num_prompts == len(PROMPTS)
    assert report.settings.split == "all"  # a prompt file is used whole
    assert report.settings.device == "cpu"
    assert {"sglang", "torch", "bastion-sglang"} <= set(report.versions)
    for row in report.rows:
        assert row.requests == len(PROMPTS)
        assert row.completion_tokens == len(PROMPTS) * MAX_NEW_TOKENS
        assert row.tokens_per_second > 0
        assert row.tokens_per_second == pytest.approx(row.completion_tokens / row.wall_seconds)


@pytest.mark.slow
def test_ar_row(bench_run: tuple[BenchReport, Path, str]) -> None:
    ar = bench_run[0].rows[0]
    assert ar.mean_accept_length == 1.0
    assert ar.verify_passes is None
    assert ar.mean_budget is None
    assert ar.speedup == 1.0


@pytest.mark.slow
def test_chain_row(bench_run: tuple[BenchReport, Path, str]) -> None:
    ar, chain = bench_run[0].rows
    assert chain.verify_passes is not None and 0 < chain.verify_passes <= chain.completion_tokens
    assert chain.mean_accept_length == pytest.approx(chain.completion_tokens / chain.verify_passes)
    assert chain.mean_accept_length >= 1.0
    assert chain.mean_budget == CHAIN_NODES
    assert chain.speedup == pytest.approx(chain.tokens_per_second / ar.tokens_per_second)
    # the controller's estimate over the same steps; the worker counts what each decode step committed
    # (τ above also counts the prefill's first token, so the two differ)
    assert chain.realised_accept_length is not None and chain.realised_accept_length >= 1.0
    assert chain.mean_expected_accept_length is not None and chain.mean_expected_accept_length >= 1.0
    assert chain.mean_expected_accept_length_raw is not None
    assert chain.accept_error == pytest.approx(
        chain.mean_expected_accept_length / chain.realised_accept_length - 1.0
    )
    assert chain.stage_ms is not None and chain.stage_ms.verify > 0 and chain.stage_ms.draft > 0
    assert ar.mean_expected_accept_length is None and ar.stage_ms is None and ar.latency_mape is None


@pytest.mark.slow
def test_table_and_plot(bench_run: tuple[BenchReport, Path, str]) -> None:
    _, out, stdout = bench_run
    assert (out / PLOT_NAME).read_bytes().startswith(PNG_MAGIC)
    lines = stdout.splitlines()
    assert lines[0].split()[:4] == ["policy", "T", "tokens/s", "tau"]
    assert [line.split()[0] for line in lines[2:4]] == ["ar", "chain"]
    assert f"{CHAIN_NODES:.1f}" in lines[3].split()


@pytest.fixture
def model_dirs(tmp_path: Path) -> tuple[Path, Path]:
    """Two folders that pass the path checks (config.json present): the errors below come first."""
    folders = []
    for name in ("target", "drafter"):
        folder = tmp_path / name
        folder.mkdir()
        (folder / "config.json").write_text("{}")
        folders.append(folder)
    return folders[0], folders[1]


@pytest.mark.parametrize(
    ("options", "message"),
    [
        (["--policies", "ar,chian"], "unknown policy 'chian'"),
        (["--policies", "ar,fixed:0"], "'fixed:0'"),
        (["--policies", "ar,fixed:300", "--max-budget", "64"], "300 nodes exceed --max-budget 64"),
        (["--num-prompts", "0"], "--num-prompts must be >= 1, got 0"),
        (["--temperatures", "0,hot"], "'hot' is not a number"),
    ],
)
def test_argument_errors(
    options: list[str],
    message: str,
    model_dirs: tuple[Path, Path],
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
) -> None:
    target, drafter = model_dirs
    prompts = _write_prompts(tmp_path / "prompts.jsonl")
    base = ["bench", "--model-path", str(target), "--draft-model-path", str(drafter), "--device", "cpu"]
    assert cli.main([*base, "--prompts", str(prompts), *options]) == 2
    assert message in capsys.readouterr().err


def test_dflash_on_cpu_names_cuda(model_dirs: tuple[Path, Path], capsys: pytest.CaptureFixture[str]) -> None:
    target, drafter = model_dirs
    argv = ["bench", "--model-path", str(target), "--draft-model-path", str(drafter), "--device", "cpu"]
    assert cli.main([*argv, "--policies", "dflash"]) == 2
    assert "CUDA only" in capsys.readouterr().err


def test_missing_paths(
    model_dirs: tuple[Path, Path], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    target, drafter = model_dirs
    missing = tmp_path / "nowhere"
    common = ["bench", "--device", "cpu", "--policies", "ar,chain"]
    assert cli.main([*common, "--model-path", str(missing), "--draft-model-path", str(drafter)]) == 2
    assert f"--model-path {missing}: no such model folder" in capsys.readouterr().err
    assert cli.main([*common, "--model-path", str(target)]) == 2
    assert "--draft-model-path is required" in capsys.readouterr().err
    argv = [*common, "--model-path", str(target), "--draft-model-path", str(drafter)]
    assert cli.main([*argv, "--prompts", str(missing / "prompts.jsonl")]) == 2
    assert f"--prompts {missing / 'prompts.jsonl'}: no such file" in capsys.readouterr().err
    assert cli.main([*argv, "--prompts", "mtbnech"]) == 2
    assert "unknown prompt set 'mtbnech'" in capsys.readouterr().err


def test_malformed_prompt_file(
    model_dirs: tuple[Path, Path], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    target, drafter = model_dirs
    prompts = tmp_path / "bad.jsonl"
    prompts.write_text('{"prompt": "fine"}\n{"text": "no prompt field"}\n')
    argv = ["bench", "--device", "cpu", "--model-path", str(target), "--draft-model-path", str(drafter)]
    assert cli.main([*argv, "--prompts", str(prompts)]) == 2
    assert f"{prompts}:2: not a prompt record" in capsys.readouterr().err


def _row(policy: str, temperature: float, tokens_per_second: float) -> BenchRow:
    return BenchRow(
        policy=policy,
        temperature=temperature,
        requests=1,
        completion_tokens=int(tokens_per_second),
        verify_passes=None if policy == "ar" else 1,
        wall_seconds=1.0,
        tokens_per_second=tokens_per_second,
        mean_accept_length=1.0,
        mean_budget=None,
        speedup=None,
    )


def test_speedups_compare_with_ar_at_the_same_temperature() -> None:
    rows = with_speedups([_row("ar", 0.0, 10), _row("chain", 0.0, 25), _row("chain", 0.7, 30)])
    assert [row.speedup for row in rows] == [1.0, 2.5, None]  # no ar row at T = 0.7


def _totals(sums: dict[str, tuple[float, float]], stages: dict[str, tuple[float, float]]) -> WorkerTotals:
    names = (TREE_NODES_METRIC, EXPECTED_METRIC, EXPECTED_RAW_METRIC, REALISED_METRIC, LATENCY_ERROR_METRIC)
    return WorkerTotals(
        metrics={name: HistogramTotals(*sums.get(name, (0.0, 0.0))) for name in names},
        stages={name: HistogramTotals(*stages.get(name, (0.0, 0.0))) for name in STAGE_NAMES},
    )


def test_estimate_summary_and_row_from_histogram_growth() -> None:
    before = _totals({EXPECTED_METRIC: (10.0, 5.0), REALISED_METRIC: (9.0, 5.0)}, {"verify": (1.0, 5.0)})
    after = _totals(
        {
            TREE_NODES_METRIC: (40.0, 10.0),
            EXPECTED_METRIC: (32.0, 15.0),  # 22 over 10 request-steps
            EXPECTED_RAW_METRIC: (30.0, 10.0),
            REALISED_METRIC: (29.0, 15.0),  # 20 over 10
            LATENCY_ERROR_METRIC: (0.5, 5.0),
        },
        {"verify": (1.5, 10.0), "draft": (0.1, 5.0), "other": (0.02, 4.0)},
    )
    estimate = EstimateSummary.between(before, after)
    assert estimate.mean_budget == 4.0 and estimate.expected == pytest.approx(2.2)
    assert estimate.realised == pytest.approx(2.0) and estimate.latency_mape == pytest.approx(0.1)
    assert estimate.stage_ms is not None
    assert estimate.stage_ms.verify == pytest.approx(100.0) and estimate.stage_ms.other == pytest.approx(5.0)
    assert estimate.stage_ms.plan == 0.0  # no samples: nothing measured
    row = make_row(BenchPolicy("adaptive", "bastion"), 0.0, Measured(2, 40, 20, 2.0, estimate))
    assert row.accept_error == pytest.approx(0.1) and row.accept_error_raw == pytest.approx(0.5)
    plain = make_row(BenchPolicy("ar", "ar"), 0.0, Measured(2, 40, None, 2.0, None))
    assert plain.accept_error is None and plain.mean_budget is None
