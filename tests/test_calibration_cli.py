"""`bastion calibrate` end to end on tiny real models (CPU), then `bastion profile` and the lookup on what
it wrote.

The reference-engine run is the CI check: a random fp32 Qwen3 target and DFlash drafter
(tests/tiny_models.py), widths 2..16 × contexts 64, 128 and a plain decode step per context, two timed runs
per point, one intra-op thread (the
CI box is shared: two threads contending for two busy cores turn millisecond passes into second-long
stalls). The SGLang-engine run starts SGLang's model runner on the CPU in a child process (SGLang's runtime
context is process-global) and is marked slow.
"""

from __future__ import annotations

import contextlib
import io
import itertools
import json
import logging
import os
import shutil
import struct
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch
from tiny_models import make_tiny_drafter, make_tiny_target

from bastion_sglang import cli
from bastion_sglang.calibration import __main__ as calibration_main
from bastion_sglang.calibration.identity import RuntimeIdentity, device_name, model_config_hash
from bastion_sglang.calibration.lookup import ProfileSource, resolve_latency_profile
from bastion_sglang.calibration.store import ProfileStore
from bastion_sglang.calibration.sweep import context_grid, width_grid
from bastion_sglang.controller.profile import CalibrationProfile, load_profile

CPU = torch.device("cpu")
PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"
GRID = ["--max-width", "16", "--max-context", "128", "--repeats", "2", "--warmup", "1"]


@dataclass(frozen=True)
class Calibrated:
    target: Path
    drafter: Path
    store: ProfileStore
    exit_code: int
    stdout: str
    seconds: float


@contextlib.contextmanager
def one_thread() -> Iterator[None]:
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def pair(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    root = tmp_path_factory.mktemp("pair")
    target = make_tiny_target(root / "target")
    return target, make_tiny_drafter(root / "drafter", target)


@pytest.fixture(scope="module")
def calibrated(pair: tuple[Path, Path], tmp_path_factory: pytest.TempPathFactory) -> Calibrated:
    target, drafter = pair
    store = ProfileStore(tmp_path_factory.mktemp("store") / "profiles")
    argv = ["calibrate", "--model-path", str(target), "--draft-model-path", str(drafter)]
    argv += ["--engine", "reference", "--device", "cpu", *GRID, "--store", str(store.root)]
    out = io.StringIO()
    start = time.perf_counter()
    with one_thread(), contextlib.redirect_stdout(out):
        code = cli.main(argv)
    return Calibrated(target, drafter, store, code, out.getvalue(), time.perf_counter() - start)


def only_profile(store: ProfileStore) -> tuple[Path, CalibrationProfile]:
    files = sorted(store.root.glob("*.json"))
    assert len(files) == 1, files
    return files[0], load_profile(files[0])


@pytest.mark.slow
def test_calibrate_runs_end_to_end(calibrated: Calibrated) -> None:
    assert calibrated.exit_code == 0, calibrated.stdout


@pytest.mark.slow
def test_profile_records_the_deployment(calibrated: Calibrated) -> None:
    _, profile = only_profile(calibrated.store)
    meta = profile.metadata
    assert meta.engine == "reference" and meta.attention_backend == "sdpa" and meta.tp_size == 1
    assert meta.device_name == device_name(CPU) and meta.device_name.startswith("CPU ")
    assert meta.model_config_hash == model_config_hash(calibrated.target)
    assert meta.model_path == str(calibrated.target)
    assert meta.dtype == "float32" and profile.bytes_per_element == 4.0
    assert meta.driver_version is None and meta.cuda_version is None and meta.sglang_version is None
    assert abs(time.time() - meta.created_at.timestamp()) < 600
    assert profile.hardware.name == meta.device_name


@pytest.mark.slow
def test_profile_holds_the_whole_grid_and_step_costs(calibrated: Calibrated) -> None:
    _, profile = only_profile(calibrated.store)
    verify = [sample for sample in profile.samples if sample.mode == "verify"]
    decode = [sample for sample in profile.samples if sample.mode == "decode"]
    points = {(sample.s, sample.c) for sample in verify}
    assert points == set(itertools.product(width_grid(16), context_grid(128)))
    assert len(verify) == len(points)
    assert sorted((sample.s, sample.c) for sample in decode) == [(1, c) for c in context_grid(128)]
    assert all(sample.seconds > 0 and sample.batch == 1 for sample in profile.samples)
    costs = profile.step_costs
    assert costs.t_draft > 0 and costs.t_aux + costs.t_aux_per_token > 0 and costs.l_ar > 0
    assert profile.max_context == 128 and profile.width_buckets is None
    assert profile.model_shape.num_layers == 4 and profile.model_shape.vocab_size == 512
    assert profile.report.num_samples == len(points) and profile.report.num_decode_samples == len(decode)
    assert profile.report.rmse_fit < profile.report.rmse_raw
    assert profile.fit.decode is not None
    held = profile.leave_out
    assert held is not None and [fold.held_out for fold in held.widths] == list(width_grid(16))
    assert [fold.held_out for fold in held.contexts] == list(context_grid(128))
    assert held.mape_widths is not None and held.mape_contexts is not None


@pytest.mark.slow
def test_plot_is_a_real_png_next_to_the_profile(calibrated: Calibrated) -> None:
    path, _ = only_profile(calibrated.store)
    plot = path.with_suffix(".png")
    data = plot.read_bytes()
    assert data[:8] == PNG_SIGNATURE
    assert data[12:16] == b"IHDR"
    width, height = struct.unpack(">II", data[16:24])
    assert width >= 600 and height >= 300
    assert len(data) > 10_000
    assert sorted(p.name for p in calibrated.store.root.iterdir()) == sorted([path.name, plot.name])


@pytest.mark.slow
def test_calibrate_prints_peaks_errors_and_the_path(calibrated: Calibrated) -> None:
    path, _ = only_profile(calibrated.store)
    text = calibrated.stdout
    assert "measured: matmul" in text and "copy bandwidth" in text
    assert f"no KNOWN_GPUS entry for '{device_name(CPU)}'" in text
    assert "raw roofline RMSE" in text and "calibrated RMSE" in text
    assert "widths left out MAPE" in text and "contexts left out MAPE" in text
    assert "verify, one width left out: MAPE" in text and "verify, one context left out: MAPE" in text
    assert f"profile    {path}" in text


@pytest.mark.slow
def test_auto_lookup_finds_the_new_profile_for_the_same_identity(calibrated: Calibrated) -> None:
    path, _ = only_profile(calibrated.store)
    identity = RuntimeIdentity.for_runtime(
        device=CPU,
        model_path=calibrated.target,
        dtype=torch.float32,
        attention_backend="sdpa",
        tp_size=1,
        engine="reference",
    )
    resolved = resolve_latency_profile("auto", identity, calibrated.store)
    assert (resolved.source, resolved.path, resolved.warnings) == (ProfileSource.STORE, path, ())
    other = identity.model_copy(update={"attention_backend": "eager"})
    missed = resolve_latency_profile("auto", other, calibrated.store)
    assert missed.profile is None and "--attention-backend eager" in missed.warnings[0]


@pytest.mark.slow
def test_profile_list_and_show(calibrated: Calibrated, capsys: pytest.CaptureFixture[str]) -> None:
    path, profile = only_profile(calibrated.store)
    assert cli.main(["profile", "list", "--store", str(calibrated.store.root)]) == 0
    listing = capsys.readouterr().out.splitlines()
    assert listing[0] == f"store {calibrated.store.root}"
    assert listing[1].split()[:3] == ["created", "device", "model"]
    assert path.name in listing[2] and "reference" in listing[2] and "float32" in listing[2]

    assert cli.main(["profile", "show", str(path)]) == 0
    shown = capsys.readouterr().out
    fit = profile.fit
    assert f"profile    {path}" in shown
    assert f"T = {fit.beta_fixed * 1e3:.3f} ms + {fit.alpha_gemm:.4g}·G + " in shown
    assert f"{fit.alpha_attn:.4g}·ΣF + {fit.alpha_kv:.4g}·ΣK" in shown
    assert fit.decode is not None and f"L_AR = {fit.decode.beta * 1e3:.3f} ms" in shown
    assert "held out   widths left out MAPE" in shown
    assert "T_draft" in shown and "L_AR" in shown and "widths 2..16 (7), contexts 64..128 (2)" in shown

    auto = ["profile", "show", "auto", "--model-path", str(calibrated.target), "--device", "cpu"]
    auto += ["--store", str(calibrated.store.root), "--attention-backend"]
    assert cli.main([*auto, "sdpa"]) == 0
    assert f"profile    {path}" in capsys.readouterr().out
    assert cli.main([*auto, "eager"]) == 1
    assert "warning: no latency profile" in capsys.readouterr().out


def test_profile_list_of_an_empty_store(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert cli.main(["profile", "list", "--store", str(tmp_path / "empty")]) == 0
    assert capsys.readouterr().out.strip() == f"no profiles in {tmp_path / 'empty'}"


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        (["--tp", "2"], "--tp 2: calibration measures tensor-parallel size 1 only"),
        (["--engine", "reference", "--attention-backend", "triton"], "not a reference-engine backend"),
        (["--max-context", "32"], "--max-context must be an int >= 64, got 32"),
        (["--widths", "8", "4"], "--widths must be at least two sorted"),
        (["--dtype", "int8"], "'int8' is not a torch floating-point dtype"),
        (["--engine", "reference", "--batches", "4"], "--batches 4 needs --engine sglang"),
        (["--engine", "sglang", "--batches", "0"], "--batches must be ints >= 1, got [0]"),
    ],
)
def test_bad_arguments_fail_before_measuring(
    pair: tuple[Path, Path], tmp_path: Path, caplog: pytest.LogCaptureFixture, extra: list[str], message: str
) -> None:
    target, drafter = pair
    argv = ["calibrate", "--model-path", str(target), "--draft-model-path", str(drafter), "--device", "cpu"]
    assert cli.main([*argv, "--out", str(tmp_path / "p.json"), *extra]) == 2
    assert message in caplog.text
    assert not (tmp_path / "p.json").exists()


def test_missing_model_folder_is_named(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    argv = ["calibrate", "--model-path", str(tmp_path / "missing"), "--draft-model-path", str(tmp_path)]
    assert cli.main(argv) == 2
    assert f"{tmp_path / 'missing'}: neither a model folder" in caplog.text


def test_python_dash_m_entry_point_has_the_calibrate_flags(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exited:
        calibration_main.main(["--help"])
    assert exited.value.code == 0
    text = capsys.readouterr().out
    assert text.startswith("usage: python -m bastion_sglang.calibration")
    for flag in ("--model-path", "--engine", "--max-width", "--widths", "--store", "--out"):
        assert flag in text


@pytest.mark.slow
def test_sglang_engine_on_cpu_writes_a_profile(pair: tuple[Path, Path], tmp_path: Path) -> None:
    target, drafter = pair
    out = tmp_path / "sglang.json"
    argv = [sys.executable, "-m", "bastion_sglang.calibration", "--model-path", str(target)]
    argv += ["--draft-model-path", str(drafter), "--engine", "sglang", "--device", "cpu", *GRID]
    argv += ["--max-width", "8", "--batches", "4", "--out", str(out)]
    result = subprocess.run(
        argv,
        capture_output=True,
        text=True,
        timeout=300,
        env=os.environ | {"OMP_NUM_THREADS": "1"},
        check=False,
    )
    assert result.returncode == 0, result.stderr[-4000:]
    profile = load_profile(out)
    assert (profile.metadata.engine, profile.metadata.attention_backend) == ("sglang", "torch_native")
    assert profile.metadata.sglang_version == "0.5.23"
    assert {sample.s for sample in profile.samples if sample.mode == "verify"} == set(width_grid(8))
    assert {sample.c for sample in profile.samples if sample.mode == "decode"} == set(context_grid(128))
    batched = {(sample.mode, sample.s, sample.c) for sample in profile.samples if sample.batch == 4}
    assert batched == {("verify", 2, 64), ("verify", 4, 64), ("verify", 8, 64), ("decode", 1, 64)}
    assert out.with_suffix(".png").read_bytes()[:8] == PNG_SIGNATURE


@pytest.mark.slow
def test_server_finds_the_sglang_profile_with_auto(
    pair: tuple[Path, Path], tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """`bastion calibrate --engine sglang` into a store, then the worker's latency setup with `auto`. The
    drafter folder holds a draft vocabulary: calibration times the draft over it and records its size, so a
    server drafting over it finds the profile and one scoring the whole vocabulary does not."""
    from sglang.srt.server_args import ServerArgs

    from bastion_sglang.integration.config import BastionConfig
    from bastion_sglang.integration.draft_vocab import (
        DRAFT_VOCAB_FILE,
        DraftVocabulary,
        write_draft_vocabulary,
    )
    from bastion_sglang.step.planning_setup import resolve_worker_profile, worker_latency_model

    target, tiny_drafter = pair
    drafter = tmp_path / "drafter"
    shutil.copytree(tiny_drafter, drafter)
    vocab_size = int(json.loads((target / "config.json").read_text())["vocab_size"])
    ids = list(range(0, vocab_size, 2))[:24]
    vocabulary = DraftVocabulary(
        target_vocab_size=vocab_size, source="test", counted_tokens=100, coverage=0.5, token_ids=ids
    )
    write_draft_vocabulary(drafter / DRAFT_VOCAB_FILE, vocabulary)
    store = tmp_path / "store"
    argv = [sys.executable, "-m", "bastion_sglang.calibration", "--model-path", str(target)]
    argv += ["--draft-model-path", str(drafter), "--engine", "sglang", "--device", "cpu", *GRID]
    argv += ["--max-width", "8", "--store", str(store)]
    env = os.environ | {"OMP_NUM_THREADS": "1"}
    result = subprocess.run(argv, capture_output=True, text=True, timeout=300, env=env, check=False)
    assert result.returncode == 0, result.stderr[-4000:]
    (path,) = sorted(store.glob("*.json"))
    profile = load_profile(path)
    assert profile.metadata.settings.draft_vocab_size == len(ids)
    server_args = ServerArgs(
        model_path=str(target),
        speculative_draft_model_path=str(drafter),
        device="cpu",
        attention_backend="torch_native",
    )
    config = json.loads((target / "config.json").read_text())
    cpu = torch.device("cpu")
    monkeypatch.setenv("BASTION_PROFILE_STORE", str(store))
    drafting = resolve_worker_profile(
        BastionConfig(), server_args, torch.float32, cpu, draft_vocab_size=len(ids)
    )
    latency, costs = worker_latency_model(
        BastionConfig(), server_args, config, torch.float32, cpu, resolved=drafting
    )
    assert latency.calibrated and latency.latency_fit == profile.fit
    assert costs == profile.step_costs
    with caplog.at_level(logging.WARNING):
        whole = resolve_worker_profile(BastionConfig(), server_args, torch.float32, cpu)
    assert whole.profile is None  # its T_draft was timed over 24 tokens, not the whole vocabulary
    caplog.clear()
    monkeypatch.setenv("BASTION_PROFILE_STORE", str(tmp_path / "empty"))
    with caplog.at_level(logging.WARNING):
        latency, costs = worker_latency_model(BastionConfig(), server_args, config, torch.float32, cpu)
    assert not latency.calibrated and costs is None
    assert "bastion calibrate" in caplog.text
