"""Results that come back from the GPU machine: `meta.json` validated, and ingested into `docs/benchmarks/`.

Every command of an item (`offline_gpu.plans`) writes into its own results folder, through
`tools/offline_gpu/record.py`: its result files, `log.txt` and `meta.json` (`RunMeta`). `ingest` turns one
or more such folders of one item into

- a dated JSON `docs/benchmarks/<date>-<item>-<device>.json` (`IngestedItem`): every command's meta with
  every JSON file it wrote, parsed, so each figure sits beside its command, device and commit;
- one row per command in `docs/benchmarks/gpu-results.md` (created with its header when absent);
- a calibration profile a later item plans with (`PUBLISHED_PROFILES`), validated and copied to its fixed
  name under `docs/benchmarks/` from the successful run that wrote it.

A folder without a valid `meta.json` is refused with an `IngestError` naming the file and the field.

    tools/offline_gpu/ingest RESULTS_DIR [RESULTS_DIR ..]
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any, Literal

from pydantic import AwareDatetime, BaseModel, ConfigDict, Field, ValidationError

from offline_gpu import REPO_ROOT

META_NAME = "meta.json"
LOG_NAME = "log.txt"
DOCS_DIR = REPO_ROOT / "docs" / "benchmarks"
RESULTS_PAGE = "gpu-results.md"
PAGE_HEADER = """# GPU results

Rows added by `tools/offline_gpu/ingest` from the results folders of the offline GPU items
(`tools/offline_gpu/README.md`): one row per command, with the device, the commit and the command line
beside its outcome; every figure it produced is in the dated JSON the row links to.

| date | item | command | device | commit | versions | wall s | exit | last output line | JSON |
| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |
"""


PUBLISHED_PROFILES = {"qwen3-8b-dummy-calibrate": ("profile.json", "qwen3-8b-dummy-profile.json")}
"""item: (the profile a run writes into its results folder, its name under docs/benchmarks/)."""


class IngestError(ValueError):
    """A results folder that cannot be ingested; the message names the file and the field or value."""


class RunMeta(BaseModel):
    """`meta.json` of one command's results folder (written by `record.py` with the standard library)."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    format_version: Literal[1]
    item: str = Field(min_length=1, description="the item, e.g. sglang-cuda")
    name: str = Field(min_length=1, description="the command's name within the item")
    commit: str = Field(pattern=r"^[0-9a-f]{7,40}(\+dirty)?$", description="the plan's commit")
    device: str = Field(min_length=1, description="CUDA device 0's name, or cpu")
    torch: str | None = Field(description="torch version; None without torch")
    cuda: str | None = Field(description="CUDA version of the torch build; None for a CPU build")
    sglang: str | None = Field(description="SGLang version; None when SGLang was absent")
    command: str = Field(min_length=1, description="the command line run")
    started_at: AwareDatetime = Field(description="start time")
    wall_s: float = Field(ge=0, description="wall seconds of the command")
    returncode: int = Field(description="the command's exit status")


class IngestedRun(BaseModel):
    """One command's results: its meta, the JSON files it wrote (parsed, by relative path), its last line."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    meta: RunMeta
    files: dict[str, Any]
    last_line: str


class IngestedItem(BaseModel):
    """The dated JSON under docs/benchmarks/: the runs of one item on one device."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    format_version: Literal[1] = 1
    item: str
    device: str
    date: str = Field(pattern=r"^\d{4}-\d{2}-\d{2}$", description="start date of the first run (UTC)")
    runs: tuple[IngestedRun, ...] = Field(min_length=1)


def read_meta(folder: Path) -> RunMeta:
    """The folder's `meta.json`; IngestError naming the file (and each bad field) when absent or invalid."""
    path = folder / META_NAME
    if not path.is_file():
        raise IngestError(f"{path}: missing (every results folder needs the meta.json record.py writes)")
    try:
        return RunMeta.model_validate_json(path.read_text())
    except ValidationError as error:
        fields = "; ".join(
            f"field {'.'.join(map(str, issue['loc'])) or '(top level)'}: {issue['msg']}"
            for issue in error.errors()
        )
        raise IngestError(f"{path}: {fields}") from error


def read_run(folder: Path) -> IngestedRun:
    """One results folder: its meta, every JSON file under it but meta.json, and its log's last line."""
    meta = read_meta(folder)
    files: dict[str, Any] = {}
    for path in sorted(folder.rglob("*.json")):
        if path == folder / META_NAME:
            continue
        try:
            files[str(path.relative_to(folder))] = json.loads(path.read_text())
        except json.JSONDecodeError as error:
            raise IngestError(f"{path}: not JSON ({error})") from error
    log = folder / LOG_NAME
    text = log.read_text(errors="replace") if log.is_file() else ""
    lines = [line for line in text.splitlines() if line.strip()]
    return IngestedRun(meta=meta, files=files, last_line=lines[-1].strip() if lines else "")


def device_slug(device: str) -> str:
    """A file-name part for a device name: "NVIDIA H200" -> "h200", "NVIDIA H100 80GB HBM3" -> "h100"."""
    match = re.search(r"\b([A-Z]\d{2,4}[A-Z]?)\b", device)
    return (match.group(1) if match else re.sub(r"[^a-z0-9]+", "-", device.lower()).strip("-")).lower()


def _cell(text: str) -> str:
    return text.replace("|", "\\|").replace("\n", " ")


def table_row(run: RunMeta, last_line: str, json_name: str) -> str:
    """The gpu-results.md row of one command."""
    versions = f"torch {run.torch}, CUDA {run.cuda}, SGLang {run.sglang}"
    cells = [
        run.started_at.date().isoformat(),
        run.item,
        f"`{_cell(run.name)}`: `{_cell(run.command)}`",
        _cell(run.device),
        f"`{run.commit}`",
        versions,
        f"{run.wall_s:.0f}",
        str(run.returncode),
        _cell(last_line[:160]),
        f"[{json_name}]({json_name})",
    ]
    return "| " + " | ".join(cells) + " |\n"


def ingest(folders: Sequence[Path], docs_dir: Path = DOCS_DIR) -> Path:
    """Write the dated JSON of `folders` (one item, one device) into `docs_dir` and append their rows to its
    gpu-results.md (created with its header); returns the JSON's path.

    Raises IngestError naming the folder's meta.json or the field when a folder is not valid, or when the
    folders mix items or devices.
    """
    if not folders:
        raise IngestError("no results folder given")
    runs = [read_run(folder) for folder in folders]
    first = runs[0].meta
    for folder, run in zip(folders, runs, strict=True):
        if (run.meta.item, run.meta.device) != (first.item, first.device):
            raise IngestError(
                f"{folder / META_NAME}: item {run.meta.item!r} on {run.meta.device!r}, but "
                f"{folders[0] / META_NAME} is item {first.item!r} on {first.device!r}; ingest one item and "
                "device at a time"
            )
    date = min(run.meta.started_at for run in runs).date().isoformat()
    record = IngestedItem(item=first.item, device=first.device, date=date, runs=tuple(runs))
    docs_dir.mkdir(parents=True, exist_ok=True)
    target = docs_dir / f"{date}-{first.item}-{device_slug(first.device)}.json"
    target.write_text(record.model_dump_json(indent=1) + "\n")
    page = docs_dir / RESULTS_PAGE
    if not page.exists():
        page.write_text(PAGE_HEADER)
    with page.open("a") as handle:
        for run in runs:
            handle.write(table_row(run.meta, run.last_line, target.name))
    publish_profile(folders, runs, docs_dir)
    return target


def publish_profile(folders: Sequence[Path], runs: Sequence[IngestedRun], docs_dir: Path) -> Path | None:
    """Copy the item's published profile (`PUBLISHED_PROFILES`) from the successful run that wrote it into
    `docs_dir`; its path, or None when the item publishes none or no successful run wrote it. IngestError
    naming the file when it is not a valid calibration profile."""
    from bastion_sglang.controller.profile import ProfileError, load_profile

    published = PUBLISHED_PROFILES.get(runs[0].meta.item)
    if published is None:
        return None
    written, name = published
    for folder, run in zip(folders, runs, strict=True):
        source = folder / written
        if run.meta.returncode != 0 or not source.is_file():
            continue
        try:
            load_profile(source)
        except ProfileError as error:
            raise IngestError(f"{source}: not a calibration profile: {error}") from error
        target = docs_dir / name
        target.write_text(source.read_text())
        return target
    return None


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="tools/offline_gpu/ingest",
        description="Turn results folders of one offline-GPU item into a dated JSON under docs/benchmarks/ "
        "and rows of docs/benchmarks/gpu-results.md.",
    )
    parser.add_argument("folders", type=Path, nargs="+", help="results folders, each with a meta.json")
    parser.add_argument("--docs-dir", type=Path, default=DOCS_DIR, help="where the JSON and the page go")
    args = parser.parse_args(argv)
    try:
        target = ingest(args.folders, args.docs_dir)
    except IngestError as error:
        print(f"error: {error}", file=sys.stderr)
        return 1
    print(f"wrote {target} and {len(args.folders)} row(s) of {args.docs_dir / RESULTS_PAGE}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
