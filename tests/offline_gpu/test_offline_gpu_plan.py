"""The offline GPU items fit a lending, name only what exists, and their results come back into the docs.

For every item of `offline_gpu.plans`: each call carries less than 64 MiB with the repository's files, runs
under 9 minutes, the item is expected to take at most 15 minutes, and every file a command names exists
here, is built by a step the item names, or is listed as missing (from the allow-list). Then `record.py`'s
meta.json validates with the pydantic model, and `ingest` turns a results folder into a dated JSON and a row,
or refuses a bad folder naming the file and the field.
"""

from __future__ import annotations

import argparse
import json
import re
import subprocess
import sys
from pathlib import Path

import pytest
from calibration_profiles import make_profile
from offline_gpu import plans
from offline_gpu.gpu_carry import CALL_LIMIT_BYTES
from offline_gpu.results import IngestedItem, IngestError, RunMeta, ingest, read_meta

from bastion_sglang import cli
from bastion_sglang.controller.profile import load_profile

ROOT = Path(__file__).resolve().parents[2]
RECORD = ROOT / "tools" / "offline_gpu" / "record.py"
NAMED_PATH = re.compile(r"(?<![\w/$.])((?:tools|benchmarks|models|tests|docs)/[\w./-]+)")
"""Repository paths a command line names (scripts, configs, models, test folders)."""


@pytest.fixture(scope="module")
def sizes() -> plans.Sizes:
    return plans.checkout_sizes(ROOT)


@pytest.fixture(scope="module")
def items(sizes: plans.Sizes) -> tuple[plans.Item, ...]:
    return plans.all_items("0123456789ab", sizes)


def test_items_in_order(items: tuple[plans.Item, ...]) -> None:
    names = [item.name for item in items]
    assert names[0] == "sglang-cuda" and names[-1] == "controller-bench"
    assert names.index("demo-pair-c1-a") < names.index("qwen3-8b-dummy-calibrate")
    assert names.index("qwen3-8b-dummy-calibrate") < names.index("qwen3-8b-synthetic-c1")
    assert len(set(names)) == len(names)


def test_every_call_fits_and_every_item_fits_a_lending(
    items: tuple[plans.Item, ...], sizes: plans.Sizes
) -> None:
    for item in items:
        assert item.expected_minutes <= plans.MAX_ITEM_MINUTES, item.name
        for command in item.commands:
            carried = command.carried_bytes(sizes.repository_bytes)
            assert carried < CALL_LIMIT_BYTES, (item.name, command.name, carried)
            assert command.expected_s <= command.limit_s <= plans.MAX_LIMIT_S, (item.name, command.name)
            assert command.run.startswith("python3 tools/offline_gpu/record.py"), command.run
            assert f'--out "$OUT/{command.name}" --item {item.name} ' in command.run


def _covered_by_missing(path: str, item: plans.Item) -> bool:
    return any(entry.startswith(path) for entry in item.missing)


def test_every_named_file_exists_or_is_built_or_missing(items: tuple[plans.Item, ...]) -> None:
    for item in items:
        assert set(item.missing) <= plans.MISSING_ALLOWED, set(item.missing) - plans.MISSING_ALLOWED
        outputs = {output for step in item.builds for output in step.outputs}
        for step in item.builds:
            script = step.command.split()[0]
            assert (ROOT / script).is_file(), script
        for command in item.commands:
            for folder in command.carry:
                assert folder.build in {step.name for step in item.builds}, (item.name, folder)
                assert any(folder.path == out or folder.path.startswith(out + "/") for out in outputs)
            named = set(NAMED_PATH.findall(command.run)) | set(command.needs)
            for path in named:
                if any(path == out or path.startswith(out + "/") for out in outputs):
                    continue
                assert (ROOT / path).exists() or _covered_by_missing(path, item), (item.name, path)


BASTION_COMMAND = re.compile(r"python3 -m bastion_sglang\.cli (\S+)((?: (?!&&)[^'&]\S*)*)")
SCRIPT_COMMAND = re.compile(r"python3 (benchmarks/\S+\.py)((?: (?!&&)[^'&]\S*)*)")


def _options(parser: argparse.ArgumentParser) -> set[str]:
    return {option for action in parser._actions for option in action.option_strings}


def test_every_flag_is_one_its_command_has_or_is_missing(items: tuple[plans.Item, ...]) -> None:
    """Each flag of each `bastion` command and benchmark script a plan prints is one that command's parser
    has, unless the item lists it as missing: no item is printed as ready with a flag nobody built."""
    parser = cli.build_parser()
    commands = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction)).choices
    script_help = {}
    checked = 0
    for item in items:
        for command in item.commands:
            for name, rest in BASTION_COMMAND.findall(command.run):
                known = _options(commands[name])
                for flag in re.findall(r"(?<!\S)--[\w-]+", rest):
                    checked += 1
                    if flag not in known:
                        assert any(f"{name} {flag}" in entry for entry in item.missing), (item.name, flag)
            for script, rest in SCRIPT_COMMAND.findall(command.run):
                if script not in script_help:
                    argv = [sys.executable, str(ROOT / script), "--help"]
                    done = subprocess.run(argv, capture_output=True, text=True, check=True)
                    script_help[script] = done.stdout
                for flag in re.findall(r"(?<!\S)--[\w-]+", rest):
                    checked += 1
                    if flag not in script_help[script]:
                        assert any(f"{script} {flag}" in entry for entry in item.missing), (item.name, flag)
    assert checked > 100
    ready = [item.name for item in items if not item.missing]
    assert "sglang-cuda" in ready and "controller-bench" in ready and "demo-pair-c1-a" in ready
    assert "qwen3-8b-dummy-calibrate" in ready and "qwen3-8b-dummy-anatomy-c32" in ready


def test_demo_pair_items_cover_the_bench(items: tuple[plans.Item, ...]) -> None:
    runs = [c.run for i in items if i.name.startswith("demo-pair") for c in i.commands if "bench " in c.run]
    for concurrency in (1, 8, 32):
        at = [run for run in runs if f"--concurrency {concurrency} " in run]
        policies = {p for run in at for p in re.search(r"--policies (\S+)", run).group(1).split(",")}
        assert policies == {"ar", "dflash", "chain", "fixed:16", "fixed:64", "fixed:256", "adaptive"}
        overlaps = {re.search(r"--bastion-overlap-schedule (\w+)", run).group(1) for run in at}
        assert overlaps == {"off", "on"}
        assert any("adaptive" in run and "schedule on" in run for run in at)
    assert all("--temperatures 0,0.7" in run and "--repeats 2" in run for run in runs)


def test_bundle_gets_its_own_call_when_it_does_not_ride_with_the_last_part() -> None:
    repo = 18 * plans.MIB
    bundle = plans.Carried(".gpu-bundle", "bundle", 30 * plans.MIB, recorded=False)
    small_last = plans.Sizes(repo, bundle, tuple(
        plans.Carried(f".gpu-carry/call-{k}", "carry", size, recorded=False)
        for k, size in ((1, 44 * plans.MIB), (2, 2 * plans.MIB))
    ))  # fmt: skip
    large_last = plans.Sizes(repo, bundle, (*small_last.carry_calls[:1], plans.Carried(
        ".gpu-carry/call-2", "carry", 40 * plans.MIB, recorded=False
    )))  # fmt: skip
    together = plans.sglang_cuda("0123456789ab", small_last)
    apart = plans.sglang_cuda("0123456789ab", large_last)
    assert [c.name for c in together.commands] == ["stash-1", "prepare", "launch"]
    assert [folder.path for folder in together.commands[1].carry] == [".gpu-carry/call-2", ".gpu-bundle"]
    assert [c.name for c in apart.commands] == ["stash-1", "install", "prepare", "launch"]
    assert "gpu-install.sh" not in apart.commands[2].run


def test_carry_bounds_hold_the_gguf() -> None:
    repo = 18 * plans.MIB
    bounds = plans.carry_call_bounds(repo)
    assert len(bounds) == plans.estimated_carry_calls(repo) >= 2
    assert all(bound <= plans.carry_call_bound(repo) for bound in bounds)
    room = plans.carry_call_bound(repo) - plans.MANIFEST_RESERVE_BYTES
    held = room - plans.CALL_ONE_EXTRAS_BOUND_BYTES + (len(bounds) - 2) * room
    assert held + bounds[-1] - plans.MANIFEST_RESERVE_BYTES == plans.GGUF_XZ_BOUND_BYTES


def test_plan_prints_an_item() -> None:
    result = subprocess.run(
        [str(ROOT / "tools" / "offline_gpu" / "plan"), "qwen3-8b-synthetic-c1"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.returncode == 0, result.stderr
    assert "missing: " in result.stdout and "--synthetic-acceptance" in result.stdout
    assert "time limit" in result.stdout and "with the repository" in result.stdout


def _record(out: Path, *command: str, item: str = "sglang-cuda") -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, str(RECORD), "--out", str(out), "--item", item, "--name", "launch",
         "--commit", "0123456789ab", "--", *command],
        capture_output=True,
        text=True,
        timeout=120,
    )  # fmt: skip


@pytest.fixture(scope="module")
def recorded_folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A results folder written by record.py here: the command writes a JSON into $RESULTS."""
    out = tmp_path_factory.mktemp("results") / "launch"
    code = (
        "import json, os, pathlib; "
        "pathlib.Path(os.environ['RESULTS'], 'answer.json').write_text(json.dumps({'tokens_per_s': 41.5})); "
        "print('answered 64 tokens')"
    )
    result = _record(out, sys.executable, "-c", code)
    assert result.returncode == 0, result.stderr
    assert "answered 64 tokens" in result.stdout
    return out


def test_meta_json_round_trip(recorded_folder: Path) -> None:
    meta = read_meta(recorded_folder)
    assert (meta.item, meta.name, meta.returncode) == ("sglang-cuda", "launch", 0)
    assert meta.commit == "0123456789ab"
    assert meta.device == "cpu" and meta.cuda is None and meta.sglang == "0.5.23"
    assert meta.torch is not None and meta.wall_s > 0 and meta.started_at.tzinfo is not None
    assert "answer.json" in meta.command
    assert RunMeta.model_validate_json(meta.model_dump_json()) == meta


def test_record_passes_on_the_exit_status(tmp_path: Path) -> None:
    result = _record(tmp_path / "fails", sys.executable, "-c", "raise SystemExit(3)")
    assert result.returncode == 3
    assert read_meta(tmp_path / "fails").returncode == 3


def test_ingest_writes_the_dated_json_and_a_row(recorded_folder: Path, tmp_path: Path) -> None:
    docs = tmp_path / "docs"
    target = ingest([recorded_folder], docs)
    meta = read_meta(recorded_folder)
    assert target == docs / f"{meta.started_at.date().isoformat()}-sglang-cuda-cpu.json"
    record = IngestedItem.model_validate_json(target.read_text())
    (run,) = record.runs
    assert run.files == {"answer.json": {"tokens_per_s": 41.5}}
    assert run.meta == meta and run.last_line == "answered 64 tokens"
    page = (docs / "gpu-results.md").read_text()
    assert page.startswith("# GPU results")
    (row,) = [line for line in page.splitlines() if line.startswith("| 20")]
    assert "sglang-cuda" in row and "`0123456789ab`" in row and "| cpu |" in row and target.name in row
    ingest([recorded_folder], docs)
    assert (docs / "gpu-results.md").read_text().count("| sglang-cuda |") == 2  # appended, header once


def test_ingest_publishes_the_calibrate_items_profile(tmp_path: Path) -> None:
    """The profile the Qwen3-8B calibrate item writes lands where the synthetic item's plan reads it; a file
    that is not a profile is refused by name, and a failed run publishes nothing."""
    item = "qwen3-8b-dummy-calibrate"
    profile = make_profile()
    measured = tmp_path / "measured.json"
    measured.write_text(profile.model_dump_json())
    into = "os.path.join(os.environ['RESULTS'], 'profile.json')"
    write = f"import os, shutil; shutil.copy({str(measured)!r}, {into})"
    assert _record(tmp_path / "run", sys.executable, "-c", write, item=item).returncode == 0
    docs = tmp_path / "docs"
    ingest([tmp_path / "run"], docs)
    published = docs / Path(plans.QWEN3_8B_PROFILE).name
    assert load_profile(published) == profile
    (tmp_path / "run" / "profile.json").write_text('{"not": "a profile"}')
    with pytest.raises(IngestError, match=r"run/profile\.json: not a calibration profile"):
        ingest([tmp_path / "run"], tmp_path / "docs2")
    failing = f"{write}; raise SystemExit(1)"
    assert _record(tmp_path / "failed", sys.executable, "-c", failing, item=item).returncode == 1
    ingest([tmp_path / "failed"], tmp_path / "docs3")
    assert not (tmp_path / "docs3" / published.name).exists()


def test_ingest_refuses_a_folder_without_meta(tmp_path: Path) -> None:
    with pytest.raises(IngestError, match=r"meta\.json: missing"):
        ingest([tmp_path], tmp_path / "docs")
    assert not (tmp_path / "docs").exists()


def test_ingest_names_the_bad_field(recorded_folder: Path, tmp_path: Path) -> None:
    bad = tmp_path / "bad"
    bad.mkdir()
    meta = json.loads((recorded_folder / "meta.json").read_text())
    (bad / "meta.json").write_text(json.dumps({**meta, "wall_s": -1.0, "commit": "not-a-commit"}))
    with pytest.raises(IngestError, match=r"bad/meta\.json: field commit: .*; field wall_s: "):
        ingest([bad], tmp_path / "docs")
    del meta["device"]
    (bad / "meta.json").write_text(json.dumps(meta))
    with pytest.raises(IngestError, match=r"field device: Field required"):
        ingest([bad], tmp_path / "docs")


def test_ingest_command_line_reports_the_error(tmp_path: Path) -> None:
    result = subprocess.run(
        [str(ROOT / "tools" / "offline_gpu" / "ingest"), str(tmp_path), "--docs-dir", str(tmp_path / "d")],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.returncode == 1
    assert f"error: {tmp_path / 'meta.json'}: missing" in result.stderr
