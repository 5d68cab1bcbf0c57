"""`bastion bench` end to end on CPU, its aggregation functions, and its argument errors.

One run of `bastion bench` (module-scoped: two repeats of two Engines, about half a minute each on two cores)
with the tiny random fp32 Qwen3 target and DFlash drafter of tests/tiny_models.py, a JSONL file of two
prompts, policies ar and chain at T = 0, `--repeats 2`: the JSON report validates as `BenchReport`, every
repeat's numbers obey their definitions, the medians lie within their spread, the second repeat runs the
policies in the other order, the chain row's mean budget is what ChainPolicy verifies, the best policy in
hindsight is the one with the highest median, and the plot is a PNG. The other tests start no Engine: the
aggregation over repeats, decode timing from synthetic chunk arrivals, the streamed-batch protocol on a
stand-in Engine, and the argument errors.
"""

from __future__ import annotations

import argparse
import contextlib
import itertools
import json
import logging
import multiprocessing
import statistics
from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from pydantic import ValidationError
from tiny_models import make_tiny_drafter, make_tiny_target

from bastion_sglang import cli
from bastion_sglang.bench import cli as bench_cli
from bastion_sglang.bench.aggregate import EstimateSummary, make_row, summarize, with_speedups
from bastion_sglang.bench.histograms import (
    ESTIMATED_SPEEDUP_METRIC,
    EXPECTED_METRIC,
    EXPECTED_RAW_METRIC,
    LATENCY_ERROR_METRIC,
    REALISED_METRIC,
    REALISED_SPEEDUP_METRIC,
    STAGE_NAMES,
    TREE_NODES_METRIC,
    WORKER_METRICS,
    HistogramTotals,
    WorkerTotals,
)
from bastion_sglang.bench.measure import Measured, TemperatureRun, repeat_measurement, sampling_params
from bastion_sglang.bench.output import PLOT_NAME, REPORT_NAME, summary_line
from bastion_sglang.bench.plan import (
    CONTROL,
    DEFAULT_MAX_BUDGET,
    DEFAULT_POLICIES,
    BenchPolicy,
    BenchSettings,
    named_sets,
    parse_policies,
    plan_from_args,
    repeat_order,
)
from bastion_sglang.bench.report import BenchReport, BenchRow, RepeatMeasurement, Spread
from bastion_sglang.bench.run import WARMUP_BATCH_TOKENS, batch_bounds, rotated, warm_up_params
from bastion_sglang.bench.streaming import (
    ChunkArrival,
    DecodeTiming,
    decode_timing,
    latency_percentiles_ms,
    pooled_timing,
    stream_batch,
)

MAX_BUDGET = 8
BLOCK_SIZE = 16
CHAIN_NODES = min(MAX_BUDGET, BLOCK_SIZE - 1)
"""ChainPolicy verifies the whole top-1 path: a node per draft position (γ - 1 of them), at most N_max."""
MAX_NEW_TOKENS = 12
REPEATS = {"sequential": 1, "interleaved": 2}
"""Per schedule: the sequential run's property is its Engines' order, which one repeat shows; the interleaved
run's two repeats show the rotated orders and the rows' aggregation over repeats (two Engines fewer)."""
CONCURRENCY = 2
PNG_MAGIC = b"\x89PNG\r\n\x1a\n"
PROMPTS = ({"id": "greeting", "prompt": "hello world"}, {"turns": ["the quick brown fox"]})


def _write_prompts(path: Path) -> Path:
    path.write_text("".join(json.dumps(record) + "\n" for record in PROMPTS), encoding="utf-8")
    return path


class EngineEvents(logging.Handler):
    """Collects `bench.server`'s "engine ready" and "engine shut down" records and `bench.run`'s "warmed up"
    ones, as (event, label)."""

    def __init__(self) -> None:
        super().__init__()
        self.events: list[tuple[str, str]] = []

    def emit(self, record: logging.LogRecord) -> None:
        for event in ("engine ready", "warmed up", "engine shut down"):
            if event in record.getMessage():
                self.events.append((event, str(record.args[0])))  # type: ignore[index]


@pytest.fixture(scope="module", params=["sequential", "interleaved"])
def bench_run(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
) -> tuple[BenchReport, Path, str, list[tuple[str, str]]]:
    """(the report read back from bench.json, the output folder, stdout, the Engines' start and shutdown
    events) of one `bastion bench` run on each schedule."""
    root = tmp_path_factory.mktemp("bench")
    target = make_tiny_target(root / "target", vocab_size=260, initializer_range=0.1)
    drafter = make_tiny_drafter(root / "drafter", target, target_layer_ids=[0, 2], block_size=BLOCK_SIZE)
    prompts = _write_prompts(root / "prompts.jsonl")
    out = root / "results"
    argv = [
        "bench",
        "--model-path", str(target), "--draft-model-path", str(drafter), "--prompts", str(prompts),
        "--policies", "ar,chain", "--device", "cpu", "--dtype", "float32", "--concurrency", str(CONCURRENCY),
        "--max-new-tokens", str(MAX_NEW_TOKENS), "--ignore-eos", "--max-budget", str(MAX_BUDGET),
        "--repeats", str(REPEATS[request.param]), "--mem-fraction-static", "0.05",
        "--max-total-tokens", "8192", "--sglang-log-level", "error", "--schedule", request.param,
        "--out", str(out),
    ]  # fmt: skip
    stdout = root / "stdout.txt"
    events = EngineEvents()
    loggers = [logging.getLogger(f"bastion_sglang.bench.{name}") for name in ("server", "run")]
    for logger in loggers:
        logger.addHandler(events)
        logger.setLevel(logging.INFO)
    try:
        with stdout.open("w") as handle, contextlib.redirect_stdout(handle):
            status = cli.main(argv)
    finally:
        for logger in loggers:
            logger.removeHandler(events)
    assert status == 0
    report = BenchReport.model_validate_json((out / REPORT_NAME).read_text(encoding="utf-8"))
    assert report.settings.schedule == request.param
    return report, out, stdout.read_text(), events.events


BenchRun = tuple[BenchReport, Path, str, list[tuple[str, str]]]


@pytest.mark.slow
def test_engines_run_one_at_a_time_or_all_together(bench_run: BenchRun) -> None:
    """Sequential: each Engine shuts down before the next starts. Interleaved: every Engine of a repeat starts
    before any shuts down, and they warm up once all are up. In repeat order either way."""
    report, _, _, events = bench_run
    lifetime = ("engine ready", "warmed up", "engine shut down")
    expected = []
    for repeat, order in enumerate(report.repeat_orders, start=1):
        labels = [f"{name} (repeat {repeat})" for name in order]
        if report.settings.schedule == "sequential":
            expected += [(event, label) for label in labels for event in lifetime]
        else:
            expected += [(event, label) for event in lifetime for label in labels]
    assert events == expected


@pytest.mark.slow
def test_a_failing_engine_names_its_policy_and_leaves_no_engine_behind(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Interleaved: ar's Engine is up when chain's fails to load a drafter made for another target; the error
    names chain and ar's process is shut down with it."""
    target = make_tiny_target(tmp_path / "target", vocab_size=260)
    other = make_tiny_target(tmp_path / "other", vocab_size=260, hidden_size=32, heads=2, kv_heads=1)
    drafter = make_tiny_drafter(tmp_path / "drafter", other, target_layer_ids=[0, 2])
    prompts = _write_prompts(tmp_path / "prompts.jsonl")
    argv = [
        "bench",
        "--model-path", str(target), "--draft-model-path", str(drafter), "--prompts", str(prompts),
        "--policies", "ar,chain", "--device", "cpu", "--dtype", "float32", "--max-new-tokens", "4",
        "--repeats", "1", "--mem-fraction-static", "0.05", "--max-total-tokens", "8192",
        "--sglang-log-level", "error", "--schedule", "interleaved", "--out", str(tmp_path / "results"),
    ]  # fmt: skip
    assert cli.main(argv) == 1
    assert "error: chain (repeat 1):" in capsys.readouterr().err
    assert multiprocessing.active_children() == []
    assert not (tmp_path / "results").exists()


@pytest.mark.slow
def test_report_settings_and_repeat_orders(bench_run: BenchRun) -> None:
    report, _, _, _ = bench_run
    assert [(row.policy, row.temperature) for row in report.rows] == [("ar", 0.0), ("chain", 0.0)]
    assert report.settings.num_prompts == len(PROMPTS)
    assert report.settings.split == "all"  # a prompt file is used whole
    assert report.settings.device == "cpu"
    assert report.settings.repeats == REPEATS[report.settings.schedule]
    assert {"sglang", "torch", "bastion-sglang"} <= set(report.versions)
    rotated = (("ar", "chain"), ("chain", "ar"))  # rotated: repeat 2 starts with chain
    assert report.repeat_orders == rotated[: report.settings.repeats]


@pytest.mark.slow
def test_every_repeat_obeys_the_definitions(bench_run: BenchRun) -> None:
    report = bench_run[0]
    for row in report.rows:
        assert [m.repeat for m in row.per_repeat] == list(range(1, report.settings.repeats + 1))
        for m in row.per_repeat:
            assert m.requests == len(PROMPTS)
            assert m.completion_tokens == len(PROMPTS) * MAX_NEW_TOKENS
            # the first chunk of each request holds the prefill's token (never decode), its last chunk is
            # left out when two or more came after the first, the rest is decode; SGLang hands a reader that
            # lags the latest state (queued chunks coalesced), so a chunk may hold several steps and only
            # bounds that hold for any chunking are asserted here (the exact rule: the synthetic tests below)
            assert m.requests <= m.decode_tokens <= m.completion_tokens - m.requests
            assert m.tokens_per_second == pytest.approx(m.completion_tokens / m.wall_seconds)
            assert m.decode_tokens_per_second == pytest.approx(m.decode_tokens / m.decode_seconds)
            # each request decodes inside its batch's generate call
            assert m.decode_seconds <= CONCURRENCY * m.wall_seconds
            assert 0 < m.token_latency_p50_ms <= m.token_latency_p90_ms


@pytest.mark.slow
def test_rows_aggregate_the_repeats(bench_run: BenchRun) -> None:
    for row in bench_run[0].rows:
        for spread, values in (
            (row.decode_tokens_per_second, [m.decode_tokens_per_second for m in row.per_repeat]),
            (row.tokens_per_second, [m.tokens_per_second for m in row.per_repeat]),
        ):
            assert (spread.min, spread.max) == (min(values), max(values))
            assert spread.median == pytest.approx(statistics.median(values))
            assert spread.min <= spread.median <= spread.max
        assert row.token_latency_p50_ms == pytest.approx(
            statistics.median(m.token_latency_p50_ms for m in row.per_repeat)
        )
        assert row.token_latency_p50_ms <= row.token_latency_p90_ms
        assert row.requests == bench_run[0].settings.repeats * len(PROMPTS)
        assert row.completion_tokens == sum(m.completion_tokens for m in row.per_repeat)


@pytest.mark.slow
def test_ar_row(bench_run: BenchRun) -> None:
    ar = bench_run[0].rows[0]
    assert ar.mean_accept_length == 1.0
    assert ar.verify_passes is None
    assert all(m.verify_passes is None for m in ar.per_repeat)
    assert ar.mean_budget is None
    assert ar.speedup == 1.0 and ar.wall_speedup == 1.0


@pytest.mark.slow
def test_chain_row(bench_run: BenchRun) -> None:
    ar, chain = bench_run[0].rows
    assert chain.verify_passes is not None and 0 < chain.verify_passes <= chain.completion_tokens
    assert chain.verify_passes == sum(m.verify_passes or 0 for m in chain.per_repeat)
    assert chain.mean_accept_length == pytest.approx(chain.completion_tokens / chain.verify_passes)
    assert chain.mean_accept_length >= 1.0
    assert chain.mean_budget == CHAIN_NODES
    assert chain.speedup == pytest.approx(
        chain.decode_tokens_per_second.median / ar.decode_tokens_per_second.median
    )
    assert chain.wall_speedup == pytest.approx(chain.tokens_per_second.median / ar.tokens_per_second.median)
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
def test_best_in_hindsight(bench_run: BenchRun) -> None:
    report, _, stdout, _ = bench_run
    (summary,) = report.summaries
    best = max(report.rows, key=lambda row: row.decode_tokens_per_second.median)
    assert summary.temperature == 0.0
    assert summary.best_policy == best.policy
    assert summary.best_decode_tokens_per_second == best.decode_tokens_per_second.median
    assert summary.adaptive_vs_best is None and summary.adaptive_vs_ar is None  # adaptive was not run
    assert (
        f"T=0: best {best.policy} ({best.decode_tokens_per_second.median:.1f} tok/s)" in stdout.splitlines()
    )


@pytest.mark.slow
def test_table_and_plot(bench_run: BenchRun) -> None:
    _, out, stdout, _ = bench_run
    assert (out / PLOT_NAME).read_bytes().startswith(PNG_MAGIC)
    lines = stdout.splitlines()
    assert lines[0].split()[:5] == ["policy", "T", "decode/s", "min", "max"]
    assert [line.split()[0] for line in lines[2:4]] == ["ar", "chain"]
    assert f"{CHAIN_NODES:.1f}" in lines[3].split()


# ---- argument errors (no Engine) ------------------------------------------------------------------------


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
        (
            ["--policies", "ar,fixed:300", "--max-budget", "64"],
            "fixed:300 verifies more nodes than max_budget 64",
        ),
        (["--num-prompts", "0"], "--num-prompts must be >= 1, got 0"),
        (["--max-new-tokens", "1"], "--max-new-tokens must be >= 2"),
        (["--temperatures", "0,hot"], "'hot' is not a number"),
        (["--prompts", "mtbench,humanevil"], "--prompts mtbench,humanevil: 'humanevil' is not one of"),
        (["--prompts", "mtbench,mtbench"], "--prompts mtbench,mtbench: a set is named twice"),
        (["--policies", "chain", "--control"], "--control runs a second ar Engine beside ar"),
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


def test_prompts_name_sets_or_a_file(tmp_path: Path) -> None:
    assert named_sets("mtbench") == ("mtbench",)
    assert named_sets("mtbench, humaneval") == ("mtbench", "humaneval")
    assert named_sets("mtbnech") is None  # load_prompts names it as an unknown set
    with_comma = tmp_path / "a,b.jsonl"
    with_comma.write_text('{"prompt": "hi"}\n')
    assert named_sets(str(with_comma)) is None


@pytest.mark.parametrize(
    ("value", "message"),
    [
        ("0", "argument --repeats: must be >= 1, got 0"),
        ("two", "argument --repeats: 'two' is not an integer"),
    ],
)
def test_repeats_must_be_a_positive_integer(
    value: str, message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as exit_info:
        cli.main(["bench", "--repeats", value])
    assert exit_info.value.code == 2
    assert message in capsys.readouterr().err


def test_default_policies_fit_the_default_max_budget() -> None:
    policies = parse_policies(DEFAULT_POLICIES, DEFAULT_MAX_BUDGET)
    assert [p.name for p in policies][:2] == ["ar", "chain"] and policies[-1].name == "adaptive"
    fixed = [int(p.name.removeprefix("fixed:")) for p in policies if p.name.startswith("fixed:")]
    assert max(fixed) == DEFAULT_MAX_BUDGET


def test_dflash_on_cpu_refuses_sampling(
    model_dirs: tuple[Path, Path], capsys: pytest.CaptureFixture[str]
) -> None:
    """SGLang's DFLASH worker verifies greedily on the CPU whatever the temperature (bench.dflash_cpu)."""
    target, drafter = model_dirs
    argv = ["bench", "--model-path", str(target), "--draft-model-path", str(drafter), "--device", "cpu"]
    assert cli.main([*argv, "--policies", "ar,dflash", "--temperatures", "0,0.7"]) == 2
    assert "--temperatures 0,0.7 must be 0" in capsys.readouterr().err


def test_dflash_under_synthetic_acceptance_refuses_a_dflash2_drafter(
    model_dirs: tuple[Path, Path], capsys: pytest.CaptureFixture[str]
) -> None:
    """The bench's dflash seam covers a DFlash drafter's greedy head, not a DFlash2 selector."""
    target, drafter = model_dirs
    (drafter / "config.json").write_text(json.dumps({"architectures": ["DFlash2DraftModel"]}))
    profile = Path(__file__).parents[1] / "tools/offline_gpu/profiles/qwen3-8b-dflash-b16-gsm8k.json"
    argv = ["bench", "--model-path", str(target), "--draft-model-path", str(drafter), "--device", "cpu"]
    synthetic = ["--synthetic-acceptance", str(profile), "--ignore-eos"]
    assert cli.main([*argv, "--policies", "dflash", *synthetic]) == 2
    assert f"{drafter} is a DFlash2 drafter (DFlash2DraftModel)" in capsys.readouterr().err


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


# ---- timing of streamed chunks (no Engine) ----------------------------------------------------------------


def test_decode_timing_from_synthetic_chunk_arrivals() -> None:
    arrivals = [
        ChunkArrival(10.0, 1),  # the prefill's token: starts the clock, gives no sample
        ChunkArrival(10.5, 2),  # 1 token after 0.5 s
        ChunkArrival(10.7, 2),  # no new token: skipped
        ChunkArrival(11.1, 5),  # 3 tokens after 0.6 s (since 10.5): 3 samples of 0.2 s
        ChunkArrival(11.3, 6),  # 1 token after 0.2 s
        ChunkArrival(11.5, 8),  # the last chunk: left out
    ]
    timing = decode_timing(arrivals)
    assert timing.decode_tokens == 5  # tokens after the first chunk up to the last but one
    assert timing.decode_seconds == pytest.approx(1.3)
    assert timing.token_latencies == pytest.approx([0.5, 0.2, 0.2, 0.2, 0.2])
    assert sum(timing.token_latencies) == pytest.approx(timing.decode_seconds)
    # one chunk after the prefill's: that chunk is the decode phase
    assert decode_timing([ChunkArrival(3.0, 1), ChunkArrival(3.4, 5)]) == DecodeTiming(
        4, pytest.approx(0.4), (pytest.approx(0.1),) * 4
    )
    assert decode_timing([ChunkArrival(3.0, 1)]) == DecodeTiming(0, 0.0, ())  # done in its first chunk
    assert decode_timing([]) == DecodeTiming(0, 0.0, ())


def _arrivals(emitted_at: list[float]) -> list[ChunkArrival]:
    """One token per chunk, the i-th (1-based) arriving at emitted_at[i - 1]."""
    return [ChunkArrival(t, i) for i, t in enumerate(emitted_at, start=1)]


def test_decode_timing_is_the_same_with_and_without_the_overlap_schedulers_lag() -> None:
    """A prefill ending at 1.0 s, then decode steps of 0.1 s with one token each, 10 tokens. Without overlap a
    token leaves when the step making it ends: 1.0, 1.1, ..., 1.9. SGLang's overlap scheduler sends a step's
    token after the next step ran: the prefill's at 1.1, ..., the 9th at 1.9, and the 10th 1 ms after the 9th
    (no step follows). From the first chunk to the last, the overlapped Engine read 0.089 s per token."""
    step = 0.1
    plain = [1.0 + step * i for i in range(10)]
    overlapped = [1.0 + step * (i + 1) for i in range(9)] + [1.0 + step * 9 + 0.001]
    for emitted_at in (plain, overlapped):
        timing = decode_timing(_arrivals(emitted_at))
        assert timing.decode_seconds / timing.decode_tokens == pytest.approx(step)


def test_pooled_timing_and_percentiles() -> None:
    pooled = pooled_timing([DecodeTiming(1, 0.5, (0.5,)), DecodeTiming(4, 0.8, (0.2, 0.2, 0.2, 0.2))])
    assert pooled == DecodeTiming(5, 1.3, (0.5, 0.2, 0.2, 0.2, 0.2))
    p50, p90 = latency_percentiles_ms(pooled.token_latencies)
    assert p50 == pytest.approx(200.0)
    assert p90 == pytest.approx(380.0)  # sorted [.2, .2, .2, .2, .5]: 0.6 of the way from .2 to .5


class _StandInEngine:
    """Streams chunks the way SGLang 0.5.23's Engine does for a batch: interleaved, tagged with `index`,
    cumulative completion_tokens, spec_verify_ct only in a request's finished chunk."""

    def __init__(self, chunks: list[dict[str, Any]]) -> None:
        self.chunks = chunks
        self.calls: list[dict[str, Any]] = []

    def generate(self, **kwargs: Any) -> Iterator[dict[str, Any]]:
        self.calls.append(kwargs)
        return iter(self.chunks)


def _chunk(index: int, tokens: int, finished: bool = False, passes: int | None = None) -> dict[str, Any]:
    meta: dict[str, Any] = {
        "completion_tokens": tokens,
        "finish_reason": {"type": "length"} if finished else None,
    }
    if passes is not None:
        meta["spec_verify_ct"] = passes
    return {"index": index, "output_ids": [], "meta_info": meta}


def test_stream_batch_groups_interleaved_chunks_by_index() -> None:
    engine = _StandInEngine(
        [_chunk(1, 1), _chunk(0, 1), _chunk(0, 3), _chunk(1, 4, True, 2), _chunk(0, 4, True, 3)]
    )
    first, second = stream_batch(engine, [[1, 2], [3]], [{"temperature": 0.0}, {"temperature": 0.0}])
    assert engine.calls[0]["stream"] is True and engine.calls[0]["input_ids"] == [[1, 2], [3]]
    assert [a.completion_tokens for a in first.arrivals] == [1, 3, 4]
    assert [a.completion_tokens for a in second.arrivals] == [1, 4]
    assert (first.completion_tokens, first.verify_passes) == (4, 3)
    assert (second.completion_tokens, second.verify_passes) == (4, 2)
    measured = Measured.of([first, second], 1.0, None)
    # decode tokens: 2 of the first request (its last chunk left out), 3 of the second (one decode chunk)
    assert (measured.completion_tokens, measured.verify_passes, measured.decode.decode_tokens) == (8, 5, 5)


def test_batch_bounds_cover_every_prompt_once_in_order() -> None:
    assert batch_bounds(8, 8) == [(0, 8)]
    assert batch_bounds(7, 3) == [(0, 3), (3, 6), (6, 7)]
    assert batch_bounds(2, 5) == [(0, 2)]


def test_each_interleaved_batch_starts_at_the_next_policy() -> None:
    assert [rotated("abc", turn) for turn in range(4)] == [
        ["a", "b", "c"],
        ["b", "c", "a"],
        ["c", "a", "b"],
        ["a", "b", "c"],
    ]


def test_stream_batch_rejects_aborted_and_unfinished_requests() -> None:
    aborted = _chunk(0, 1)
    aborted["meta_info"]["finish_reason"] = {"type": "abort", "message": "out of memory"}
    with pytest.raises(RuntimeError, match="aborted request 0 of a batch: out of memory"):
        stream_batch(_StandInEngine([aborted]), [[1]], [{}])
    with pytest.raises(RuntimeError, match=r"requests \[1\]: stream ended early"):
        stream_batch(_StandInEngine([_chunk(0, 2, True), _chunk(1, 1)]), [[1], [2]], [{}, {}])


# ---- aggregation over repeats (no Engine) ----------------------------------------------------------------


def test_spread_of_known_values() -> None:
    assert Spread.of([3.0, 1.0, 2.0]) == Spread(median=2.0, min=1.0, max=3.0)
    assert Spread.of([1.0, 4.0]).median == 2.5
    assert Spread.of([7.0]) == Spread(median=7.0, min=7.0, max=7.0)
    with pytest.raises(ValidationError, match="min <= median <= max"):
        Spread(median=5.0, min=1.0, max=3.0)


@pytest.mark.parametrize("count", [1, 2, 3, 4, 5, 8, 9])
def test_repeat_order_is_balanced_for_carry_over(count: int) -> None:
    """Over one period of the Williams design (n rounds for even n, 2n for odd n) every policy takes every
    position equally often and follows every other policy equally often; later rounds repeat the rows."""
    policies = tuple(BenchPolicy(f"fixed:{i + 1}", "bastion") for i in range(count))
    period = count if count % 2 == 0 else 2 * count
    orders = [[p.name for p in repeat_order(policies, r)] for r in range(period + 2)]
    names = [p.name for p in policies]
    assert all(sorted(order) == sorted(names) for order in orders)
    rows = orders[:period]
    for position in range(count):
        assert Counter(order[position] for order in rows) == Counter(
            {name: period // count for name in names}
        )
    follows = Counter((a, b) for order in rows for a, b in itertools.pairwise(order))
    expected = period * (count - 1) // max(count * (count - 1), 1)
    assert set(follows.values()) <= {expected}
    assert len(follows) == count * (count - 1)
    assert orders[period:] == orders[:2]


def test_repeat_order_of_the_default_policies_never_puts_a_policy_after_the_same_one_twice() -> None:
    names = ("ar", "chain", "fixed:1", "fixed:2", "fixed:4", "fixed:8", "fixed:16", "fixed:64", "adaptive")
    policies = tuple(BenchPolicy(name, "bastion") for name in names)
    orders = [[p.name for p in repeat_order(policies, r)] for r in range(3)]
    assert orders[0] == [
        "ar",
        "chain",
        "adaptive",
        "fixed:1",
        "fixed:64",
        "fixed:2",
        "fixed:16",
        "fixed:4",
        "fixed:8",
    ]
    for name in names:
        before = [order[order.index(name) - 1] for order in orders if order.index(name) > 0]
        assert len(before) == len(set(before)), (name, before)


def _measurement(
    repeat: int, decode_rate: float, wall_rate: float, passes: int | None = None, p50: float = 10.0
) -> RepeatMeasurement:
    return RepeatMeasurement(
        repeat=repeat,
        requests=2,
        completion_tokens=24,
        verify_passes=passes,
        wall_seconds=24 / wall_rate,
        tokens_per_second=wall_rate,
        decode_tokens=22,
        decode_seconds=22 / decode_rate,
        decode_tokens_per_second=decode_rate,
        token_latency_p50_ms=p50,
        token_latency_p90_ms=2 * p50,
    )


def _totals(sums: dict[str, tuple[float, float]], stages: dict[str, tuple[float, float]]) -> WorkerTotals:
    def totals(pair: tuple[float, float]) -> HistogramTotals:
        return HistogramTotals(total=pair[0], count=pair[1])

    return WorkerTotals(
        metrics={name: totals(sums.get(name, (0.0, 0.0))) for name in WORKER_METRICS},
        stages={name: totals(stages.get(name, (0.0, 0.0))) for name in STAGE_NAMES},
    )


def test_make_row_takes_medians_of_rates_and_pools_the_rest() -> None:
    runs = [
        TemperatureRun(
            temperature=0.0,
            measurement=_measurement(1, decode_rate=30.0, wall_rate=20.0, passes=8, p50=9.0),
            growth=_totals({TREE_NODES_METRIC: (40.0, 10.0)}, {"verify": (0.1, 10.0)}),
        ),
        TemperatureRun(
            temperature=0.0,
            measurement=_measurement(2, decode_rate=10.0, wall_rate=12.0, passes=4, p50=11.0),
            growth=_totals({TREE_NODES_METRIC: (10.0, 5.0)}, {"verify": (0.2, 5.0)}),
        ),
        TemperatureRun(
            temperature=0.0,
            measurement=_measurement(3, decode_rate=20.0, wall_rate=14.0, passes=12, p50=30.0),
            growth=_totals({}, {}),
        ),
    ]
    row = make_row("chain", 0.0, runs)
    assert [m.repeat for m in row.per_repeat] == [1, 2, 3]
    assert row.decode_tokens_per_second == Spread(median=20.0, min=10.0, max=30.0)
    assert row.tokens_per_second == Spread(median=14.0, min=12.0, max=20.0)
    assert (row.token_latency_p50_ms, row.token_latency_p90_ms) == (11.0, 22.0)
    assert (row.requests, row.completion_tokens, row.verify_passes) == (6, 72, 24)
    assert row.mean_accept_length == 3.0  # pooled: 72 / 24
    assert row.mean_budget == pytest.approx(50.0 / 15.0)  # pooled, not the median of 4.0 and 2.0
    assert row.stage_ms is not None and row.stage_ms.verify == pytest.approx(1e3 * 0.3 / 15)
    assert row.speedup is None
    ar = make_row(
        "ar", 0.0, [TemperatureRun(temperature=0.0, measurement=_measurement(1, 8.0, 7.0), growth=None)]
    )
    assert ar.mean_accept_length == 1.0 and ar.verify_passes is None and ar.mean_budget is None


def _row(policy: str, temperature: float, decode_rate: float, wall_rate: float = 10.0) -> BenchRow:
    passes = None if policy == "ar" else 12
    run = TemperatureRun(
        temperature=temperature, measurement=_measurement(1, decode_rate, wall_rate, passes), growth=None
    )
    return make_row(policy, temperature, [run])


def test_speedups_compare_medians_with_ar_at_the_same_temperature() -> None:
    rows = with_speedups(
        [_row("ar", 0.0, 10.0, 8.0), _row("chain", 0.0, 25.0, 12.0), _row("chain", 0.7, 30.0)]
    )
    assert [row.speedup for row in rows] == [1.0, 2.5, None]  # no ar row at T = 0.7
    assert [row.wall_speedup for row in rows] == [1.0, 1.5, None]


def test_best_in_hindsight_and_adaptive_ratios() -> None:
    rows = [
        _row("ar", 0.0, 10.0),
        _row("fixed:4", 0.0, 20.0),
        _row("adaptive", 0.0, 16.0),
        _row("chain", 0.7, 12.0),
        _row("fixed:4", 0.7, 9.0),
    ]
    at_zero, at_hot = summarize(rows, (0.0, 0.7))
    assert (at_zero.best_policy, at_zero.best_decode_tokens_per_second) == ("fixed:4", 20.0)
    assert at_zero.adaptive_vs_best == pytest.approx(0.8) and at_zero.adaptive_vs_ar == pytest.approx(1.6)
    assert at_zero.adaptive_vs_best_per_repeat == Spread(median=0.8, min=0.8, max=0.8)
    assert summary_line(at_zero) == (
        "T=0: best fixed:4 (20.0 tok/s); adaptive 0.80x best, 1.60x ar; "
        "per repeat 0.80x best (0.80-0.80), 1.60x ar (1.60-1.60)"
    )
    assert (at_hot.best_policy, at_hot.adaptive_vs_best, at_hot.adaptive_vs_ar) == ("chain", None, None)
    assert at_hot.adaptive_vs_best_per_repeat is None and at_hot.adaptive_vs_ar_per_repeat is None
    assert summary_line(at_hot) == "T=0.7: best chain (12.0 tok/s)"


def test_control_is_a_second_ar_engine_after_the_policies(tmp_path: Path) -> None:
    target = make_tiny_target(tmp_path / "target", vocab_size=260)
    prompts = _write_prompts(tmp_path / "prompts.jsonl")
    parser = argparse.ArgumentParser()
    bench_cli.add_arguments(parser)
    base = ["--model-path", str(target), "--prompts", str(prompts), "--device", "cpu", "--policies", "ar"]
    plan = plan_from_args(parser.parse_args([*base, "--control"]))
    assert plan.policies == (BenchPolicy("ar", "ar"), CONTROL) and CONTROL.kind == "ar"
    assert plan.settings.policies == ("ar", "ar-control")
    assert plan_from_args(parser.parse_args(base)).policies == (BenchPolicy("ar", "ar"),)


def test_the_control_gives_the_noise_floor_and_is_never_the_best() -> None:
    """The control's per-repeat ratios to ar are reported as the run's noise floor; even when it is the
    fastest Engine it is not the best policy in hindsight."""
    ar = _repeated_row("ar", [10.0, 20.0, 5.0])
    control = _repeated_row(CONTROL.name, [10.3, 19.8, 5.5])
    adaptive = _repeated_row("adaptive", [9.9, 19.0, 5.0])
    (summary,) = summarize([ar, control, adaptive], (0.0,))
    assert summary.best_policy == "ar"
    noise = summary.control_vs_ar_per_repeat
    assert noise is not None and (noise.median, noise.min, noise.max) == pytest.approx((1.03, 0.99, 1.1))
    assert summary_line(summary).endswith("; noise floor: ar-control 1.03x ar per repeat (0.99-1.10)")
    (without,) = summarize([ar, adaptive], (0.0,))
    assert without.control_vs_ar_per_repeat is None and "noise floor" not in summary_line(without)


def _repeated_row(policy: str, decode_rates: list[float]) -> BenchRow:
    runs = [
        TemperatureRun(temperature=0.0, measurement=_measurement(k + 1, rate, 10.0, 12), growth=None)
        for k, rate in enumerate(decode_rates)
    ]
    return make_row(policy, 0.0, runs)


def test_per_repeat_ratios_pair_each_repeat_with_the_same_repeat() -> None:
    # the machine runs at 10, 20 and 5 tok/s in the three repeats; adaptive is 0.9x ar in every one of them
    ar = _repeated_row("ar", [10.0, 20.0, 5.0])
    adaptive = _repeated_row("adaptive", [9.0, 18.0, 4.5])
    (summary,) = summarize([ar, adaptive], (0.0,))
    assert summary.best_policy == "ar" and summary.adaptive_vs_best == pytest.approx(0.9)
    paired = summary.adaptive_vs_best_per_repeat
    assert paired is not None and (paired.median, paired.min, paired.max) == pytest.approx((0.9, 0.9, 0.9))
    # out of step: the medians agree (9 / 10) but repeat by repeat adaptive runs at 1.8x, 0.45x and 0.9x ar
    shuffled = _repeated_row("adaptive", [18.0, 9.0, 4.5])
    (summary,) = summarize([ar, shuffled], (0.0,))
    assert summary.adaptive_vs_ar == pytest.approx(0.9)
    paired = summary.adaptive_vs_ar_per_repeat
    assert paired is not None and (paired.median, paired.min, paired.max) == pytest.approx((0.9, 0.45, 1.8))


def test_estimate_summary_from_histogram_growth() -> None:
    before = _totals({EXPECTED_METRIC: (10.0, 5.0), REALISED_METRIC: (9.0, 5.0)}, {"verify": (1.0, 5.0)})
    after = _totals(
        {
            TREE_NODES_METRIC: (40.0, 10.0),
            EXPECTED_METRIC: (32.0, 15.0),  # 22 over 10 request-steps
            EXPECTED_RAW_METRIC: (30.0, 10.0),
            REALISED_METRIC: (29.0, 15.0),  # 20 over 10
            LATENCY_ERROR_METRIC: (0.5, 5.0),
            ESTIMATED_SPEEDUP_METRIC: (12.0, 5.0),
            REALISED_SPEEDUP_METRIC: (9.0, 4.0),
        },
        {"verify": (1.5, 10.0), "draft": (0.1, 5.0), "other": (0.02, 4.0)},
    )
    estimate = EstimateSummary.of(after.minus(before))
    assert (estimate.estimated_speedup, estimate.realised_speedup) == pytest.approx((2.4, 2.25))
    assert estimate.mean_budget == 4.0 and estimate.expected == pytest.approx(2.2)
    assert estimate.realised == pytest.approx(2.0) and estimate.latency_mape == pytest.approx(0.1)
    assert estimate.stage_ms is not None
    assert estimate.stage_ms.verify == pytest.approx(100.0) and estimate.stage_ms.other == pytest.approx(5.0)
    assert estimate.stage_ms.plan == 0.0  # no samples: nothing measured
    row = make_row(
        "adaptive",
        0.0,
        [
            TemperatureRun(
                temperature=0.0, measurement=_measurement(1, 20.0, 10.0, 8), growth=after.minus(before)
            )
        ],
    )
    assert row.accept_error == pytest.approx(0.1) and row.accept_error_raw == pytest.approx(0.5)


def test_repeat_measurement_refuses_what_it_cannot_measure() -> None:
    timing = DecodeTiming(4, 0.5, (0.125,) * 4)
    chain = BenchPolicy("chain", "bastion")
    with pytest.raises(RuntimeError, match="no spec_verify_ct"):
        repeat_measurement(chain, 1, Measured(2, 6, None, 1.0, timing, None))
    with pytest.raises(RuntimeError, match="no decode time"):
        repeat_measurement(chain, 1, Measured(2, 2, 2, 1.0, DecodeTiming(0, 0.0, ()), None))
    record = repeat_measurement(chain, 2, Measured(2, 6, 3, 0.5, timing, None))
    assert (record.repeat, record.tokens_per_second, record.decode_tokens_per_second) == (2, 12.0, 8.0)
    assert record.token_latency_p50_ms == record.token_latency_p90_ms == pytest.approx(125.0)


def test_report_requires_one_order_per_repeat_running_every_policy() -> None:
    settings = {
        "model_path": "m", "draft_model_path": "d", "prompts": "p.jsonl", "split": "all", "num_prompts": 2,
        "concurrency": 1, "max_new_tokens": 4, "ignore_eos": True, "temperatures": (0.0,),
        "policies": ("ar", "chain"), "repeats": 2, "max_budget": 8, "device": "cpu",
        "attention_backend": "torch_native", "dtype": "float32", "seed": 0,
    }  # fmt: skip
    rows = with_speedups([_row("ar", 0.0, 10.0), _row("chain", 0.0, 12.0)])
    report = {
        "created": "2025-01-01T00:00:00+00:00", "settings": settings, "device": "CPU", "versions": {},
        "rows": rows, "summaries": summarize(rows, (0.0,)),
    }  # fmt: skip
    BenchReport.model_validate({**report, "repeat_orders": (("ar", "chain"), ("chain", "ar"))})
    with pytest.raises(ValidationError, match="1 repeat orders for 2 repeats"):
        BenchReport.model_validate({**report, "repeat_orders": (("ar", "chain"),)})
    with pytest.raises(ValidationError, match="does not run each of"):
        BenchReport.model_validate({**report, "repeat_orders": (("ar", "chain"), ("chain", "chain"))})


def test_each_repeats_warm_up_draws_seeds_of_its_own() -> None:
    """The warm-up's steps feed the controller's online corrections: each repeat's warm-up takes seeds of its
    own (under synthetic acceptance, its own continuations), none of them a measured request's."""
    settings = BenchSettings.model_validate(
        {
            "model_path": "m", "draft_model_path": "d", "prompts": "p.jsonl", "split": "all",
            "num_prompts": 3, "concurrency": 1, "max_new_tokens": 4, "ignore_eos": True,
            "temperatures": (0.0,), "policies": ("chain",), "repeats": 3, "max_budget": 8, "device": "cpu",
            "attention_backend": "torch_native", "dtype": "float32", "seed": 7,
            "synthetic_acceptance": "profile.json",
        }
    )  # fmt: skip
    repeats = range(1, settings.repeats + 1)
    measured = {p["sampling_seed"] for r in repeats for p in sampling_params(settings, 0.0, r)}
    warm = [[p["sampling_seed"] for p in warm_up_params(settings, 0.0, r)] for r in repeats]
    assert len(measured) == 9 and all(len(seeds) == 3 for seeds in warm)
    assert len({seed for seeds in warm for seed in seeds}) == 9  # one set per repeat
    assert not measured & {seed for seeds in warm for seed in seeds}
    assert all(p["max_new_tokens"] == WARMUP_BATCH_TOKENS for p in warm_up_params(settings, 0.0, 1))
