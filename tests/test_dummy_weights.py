"""A target measured at its shape alone: `--load-format dummy`, `--random-prompts`, `--synthetic-acceptance`.

The target here is a tiny Qwen3 saved with weights and tokenizer (tests/tiny_models.py), and a second folder
holding only its config.json, as `tools/offline_gpu/models/qwen3-8b` holds only Qwen3-8B's. The drafter is
made from that config by `benchmarks/calibrate_gpu.py --make-drafter`. Slow tests run the real SGLang Engine
and ModelRunner on the CPU: `bastion bench` (chain under synthetic acceptance) and `bastion calibrate
--engine sglang` of the config-only target with SGLang's dummy weights. The others check the arguments, the
random prompts and the server arguments without starting an Engine.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from tiny_models import make_tiny_target

from bastion_sglang import cli
from bastion_sglang.bench import anatomy_cli
from bastion_sglang.bench.output import REPORT_NAME
from bastion_sglang.bench.plan import BenchPolicy, plan_from_args, server_args_for
from bastion_sglang.bench.report import BenchReport
from bastion_sglang.calibration.identity import model_config_hash
from bastion_sglang.controller.profile import load_profile
from bastion_sglang.integration.config import config_of
from bastion_sglang.integration.drafter_config import DrafterConfig, check_drafter_fits
from bastion_sglang.step.synthetic_profile import load_synthetic_profile

REPOSITORY = Path(__file__).resolve().parents[1]
MAKE_DRAFTER = [sys.executable, str(REPOSITORY / "benchmarks" / "calibrate_gpu.py"), "--make-drafter"]
VOCAB = 300
TARGET_LAYERS = 8
DRAFT_LAYERS = 2
PROMPT_TOKENS = 24
MAX_NEW_TOKENS = 48
SYNTHETIC = REPOSITORY / "tools" / "offline_gpu" / "profiles" / "qwen3-8b-dflash-b16-gsm8k.json"


def _run(argv: list[str]) -> subprocess.CompletedProcess[str]:
    env = os.environ | {"OMP_NUM_THREADS": "1"}
    return subprocess.run(argv, capture_output=True, text=True, timeout=600, env=env, check=False)


@pytest.fixture(scope="module")
def shapes(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path, Path]:
    """(the full target, a folder with only its config.json, the drafter made from that config)."""
    root = tmp_path_factory.mktemp("dummy")
    full = make_tiny_target(root / "full", vocab_size=VOCAB, num_layers=TARGET_LAYERS)
    config_only = root / "config-only"
    config_only.mkdir()
    shutil.copy(full / "config.json", config_only / "config.json")
    drafter = root / "drafter"
    made = _run([*MAKE_DRAFTER, str(drafter), "--target-config", str(config_only), "--draft-layers", "2"])
    assert made.returncode == 0, made.stderr[-4000:]
    return full, config_only, drafter


def test_make_drafter_fits_the_target_of_the_config(shapes: tuple[Path, Path, Path]) -> None:
    _, config_only, drafter_path = shapes
    drafter = DrafterConfig.from_json(drafter_path)
    target = json.loads((config_only / "config.json").read_text())
    check_drafter_fits(drafter, target)
    assert (drafter.num_hidden_layers, drafter.block_size) == (DRAFT_LAYERS, 16)
    assert drafter.target_layer_ids == (1, 5)  # DFlash's spread over 1..L-3 of an 8-layer target
    assert (drafter.hidden_size, drafter.vocab_size) == (target["hidden_size"], VOCAB)
    assert (drafter_path / "model.safetensors").is_file()


def test_make_drafter_errors(tmp_path: Path) -> None:
    result = _run([*MAKE_DRAFTER, str(tmp_path / "drafter")])
    assert result.returncode == 2 and "--make-drafter needs --target-config" in result.stderr
    result = _run([*MAKE_DRAFTER, str(tmp_path / "drafter"), "--target-config", str(tmp_path)])
    assert result.returncode == 2 and f"--target-config {tmp_path}: no readable config.json" in result.stderr
    assert not (tmp_path / "drafter").exists()


def _bench_args(target: Path, drafter: Path, **changes: object) -> argparse.Namespace:
    """The namespace `bastion bench` parses from these options (defaults for the rest)."""
    parser = argparse.ArgumentParser()
    subparsers = parser.add_subparsers(dest="command")
    from bastion_sglang.bench import cli as bench_cli

    bench_cli.add_arguments(subparsers.add_parser("bench"))
    argv = ["bench", "--model-path", str(target), "--draft-model-path", str(drafter), "--device", "cpu"]
    args = parser.parse_args([*argv, "--load-format", "dummy", "--random-prompts", "5"])
    for name, value in changes.items():
        setattr(args, name, value)
    return args


def test_random_prompts_are_seeded_and_within_the_vocabulary(shapes: tuple[Path, Path, Path]) -> None:
    _, target, drafter = shapes
    plan = plan_from_args(_bench_args(target, drafter, random_prompt_tokens=PROMPT_TOKENS))
    ids = plan.prompt_ids
    assert len(ids) == 5 and {len(prompt) for prompt in ids} == {PROMPT_TOKENS}
    assert all(0 <= token < VOCAB for prompt in ids for token in prompt)
    assert len({token for prompt in ids for token in prompt}) > PROMPT_TOKENS  # not one repeated token
    again = plan_from_args(_bench_args(target, drafter, random_prompt_tokens=PROMPT_TOKENS))
    assert again.prompt_ids == ids
    other_seed = plan_from_args(_bench_args(target, drafter, random_prompt_tokens=PROMPT_TOKENS, seed=1))
    assert other_seed.prompt_ids != ids
    capped = plan_from_args(_bench_args(target, drafter, random_prompt_tokens=PROMPT_TOKENS, num_prompts=2))
    assert capped.prompt_ids == ids[:2]
    settings = plan.settings
    assert (settings.prompts, settings.split, settings.num_prompts) == ("random", "all", 5)
    assert (settings.random_prompt_tokens, settings.load_format) == (PROMPT_TOKENS, "dummy")


def test_engines_load_dummy_weights_and_skip_the_tokenizer(
    shapes: tuple[Path, Path, Path], tmp_path: Path
) -> None:
    full, target, drafter = shapes
    profile = tmp_path / "profile.json"
    profile.write_text("{}")
    plan = plan_from_args(_bench_args(target, drafter, bastion_profile=str(profile)))
    plain = server_args_for(plan, BenchPolicy("ar", "ar"))
    assert (plain.load_format, plain.skip_tokenizer_init) == ("dummy", True)
    tree = server_args_for(plan, BenchPolicy("chain", "bastion"))
    assert (tree.load_format, tree.skip_tokenizer_init) == ("dummy", True)
    assert config_of(tree).profile_path == profile
    text = plan_from_args(_bench_args(full, drafter, load_format="auto", random_prompts=None))
    assert text.settings.prompts == "mtbench"
    with_weights = server_args_for(text, BenchPolicy("ar", "ar"))
    assert (with_weights.load_format, with_weights.skip_tokenizer_init) == ("auto", False)


@pytest.mark.parametrize(
    ("options", "message"),
    [
        (["--prompts", "mtbench"], "--random-prompts makes its own prompts; drop --prompts"),
        (["--split", "train"], "--random-prompts makes its own prompts; drop --split"),
        (["--random-prompts", "0"], "--random-prompts 0 --random-prompt-tokens 128: both must be >= 1"),
        (["--random-prompt-tokens", "0"], "--random-prompts 3 --random-prompt-tokens 0: both must be >= 1"),
        (["--bastion-profile", "nowhere.json"], "--bastion-profile nowhere.json: no such file"),
        (
            ["--synthetic-acceptance", "nowhere.json"],
            "synthetic acceptance profile nowhere.json: No such file",
        ),
        (["--synthetic-acceptance", str(SYNTHETIC)], "only the length may end a request"),
        (
            ["--synthetic-acceptance", str(SYNTHETIC), "--ignore-eos", "--temperatures", "0,0.7"],
            "--temperatures 0,0.7 must be 0",
        ),
    ],
)
def test_argument_errors(
    options: list[str],
    message: str,
    shapes: tuple[Path, Path, Path],
    capsys: pytest.CaptureFixture[str],
) -> None:
    _, target, drafter = shapes
    argv = ["bench", "--model-path", str(target), "--draft-model-path", str(drafter), "--device", "cpu"]
    assert cli.main([*argv, "--load-format", "dummy", "--random-prompts", "3", *options]) == 2
    assert message in capsys.readouterr().err


def test_a_dummy_target_must_name_its_architecture(
    shapes: tuple[Path, Path, Path], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    _, target, drafter = shapes
    config = json.loads((target / "config.json").read_text())
    del config["architectures"]
    (tmp_path / "config.json").write_text(json.dumps(config))
    argv = ["bench", "--model-path", str(tmp_path), "--draft-model-path", str(drafter), "--device", "cpu"]
    assert cli.main([*argv, "--load-format", "dummy", "--random-prompts", "3"]) == 2
    assert f"--model-path {tmp_path / 'config.json'}: no 'architectures' entry" in capsys.readouterr().err


def test_step_anatomy_takes_random_prompts(shapes: tuple[Path, Path, Path]) -> None:
    _, target, drafter = shapes
    parser = argparse.ArgumentParser()
    anatomy_cli.add_arguments(parser)
    argv = ["--model-path", str(target), "--draft-model-path", str(drafter), "--device", "cpu"]
    args = parser.parse_args(
        [*argv, "--load-format", "dummy", "--random-prompts", "8", "--concurrency", "1,3"]
    )
    plan = anatomy_cli.plan_anatomy(args)
    assert len(plan.bench.prompt_ids) == 3  # one batch of each concurrency: the first 3 prompts
    assert plan.bench.settings.load_format == "dummy"


@pytest.mark.slow
def test_bench_runs_the_config_only_target(shapes: tuple[Path, Path, Path], tmp_path: Path) -> None:
    """`bastion bench` of ar and chain on the config-only target, chain under synthetic acceptance: SGLang
    builds the target with dummy weights and no tokenizer, every request gets its tokens, chain's planner
    sees the over-confident drafter's chain (the stated Â of its 8 nodes) and its steps accept about what the
    profile's truth gives (the random drafter alone gets about 1)."""
    _, target, drafter = shapes
    out = tmp_path / "results"
    argv = [
        sys.executable, "-m", "bastion_sglang.cli", "bench",
        "--model-path", str(target), "--load-format", "dummy", "--draft-model-path", str(drafter),
        "--random-prompts", "4", "--random-prompt-tokens", str(PROMPT_TOKENS), "--policies", "ar,chain",
        "--synthetic-acceptance", str(SYNTHETIC),
        "--device", "cpu", "--dtype", "float32", "--concurrency", "4",
        "--max-new-tokens", str(MAX_NEW_TOKENS), "--ignore-eos", "--max-budget", "8", "--repeats", "1",
        "--mem-fraction-static", "0.05", "--max-total-tokens", "8192", "--sglang-log-level", "error",
        "--out", str(out),
    ]  # fmt: skip
    result = _run(argv)
    assert result.returncode == 0, result.stderr[-4000:]
    report = BenchReport.model_validate_json((out / REPORT_NAME).read_text(encoding="utf-8"))
    assert (report.settings.load_format, report.settings.prompts) == ("dummy", "random")
    assert report.settings.synthetic_acceptance == str(SYNTHETIC)
    rows = {row.policy: row for row in report.rows}
    for row in rows.values():
        assert (row.requests, row.completion_tokens) == (4, 4 * MAX_NEW_TOKENS)
    chain = rows["chain"]
    profile = load_synthetic_profile(SYNTHETIC)
    stated = profile.stated_chain_accept(8)  # 6.69: the over-confident drafter's chain
    assert chain.mean_expected_accept_length_raw == pytest.approx(stated, rel=0.05)
    assert 4.0 <= chain.mean_accept_length <= 7.0  # the truth's chain: 5.34


@pytest.mark.slow
def test_calibrate_measures_the_config_only_target(shapes: tuple[Path, Path, Path], tmp_path: Path) -> None:
    """`bastion calibrate --engine sglang --load-format dummy` of the config-only target: the profile names
    the real model's config hash, so a server of the real model finds it."""
    full, target, drafter = shapes
    out = tmp_path / "profile.json"
    argv = [sys.executable, "-m", "bastion_sglang.calibration", "--model-path", str(target)]
    argv += ["--load-format", "dummy", "--draft-model-path", str(drafter), "--engine", "sglang"]
    argv += ["--device", "cpu", "--max-width", "4", "--max-context", "128", "--repeats", "2", "--warmup", "1"]
    result = _run([*argv, "--no-acceptance", "--out", str(out)])
    assert result.returncode == 0, result.stderr[-4000:]
    assert "(random weights: --load-format dummy)" in result.stderr
    profile = load_profile(out)
    assert profile.metadata.model_config_hash == model_config_hash(full)
    assert profile.metadata.engine == "sglang" and profile.samples


@pytest.mark.parametrize(
    ("options", "message"),
    [
        (["--engine", "sglang"], "the acceptance calibration decodes real prompts"),
        (["--engine", "reference", "--no-acceptance"], "--load-format dummy needs --engine sglang"),
    ],
)
def test_calibrate_dummy_errors(
    options: list[str], message: str, shapes: tuple[Path, Path, Path], caplog: pytest.LogCaptureFixture
) -> None:
    _, target, drafter = shapes
    argv = ["calibrate", "--model-path", str(target), "--draft-model-path", str(drafter), "--device", "cpu"]
    assert cli.main([*argv, "--load-format", "dummy", *options]) == 2
    assert message in caplog.text
