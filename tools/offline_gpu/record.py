"""Run one command of an offline-GPU item and write its `meta.json` beside its results (GPU machine side).

    python3 tools/offline_gpu/record.py --out "$OUT/NAME" --item ITEM --name NAME --commit SHA -- CMD ARG..

Runs CMD with the environment variable `RESULTS` set to --out (the command writes its result files there),
its stdout and stderr copied to `--out/log.txt` and to this process's stdout, then writes `--out/meta.json`:
format_version, item, name, commit, device (CUDA device 0's name, or "cpu"), torch, cuda (None without
CUDA) and sglang (None when not importable) versions, the command line, the start time (UTC, ISO 8601), the
wall seconds and the command's exit status, which is also this script's exit status.

Standard library only (torch is imported for the device name when installed): the GPU image has no pydantic.
The same fields are validated here by `offline_gpu.results.RunMeta` when the folder is ingested.
"""

from __future__ import annotations

import argparse
import importlib.metadata
import importlib.util
import json
import os
import re
import shlex
import subprocess
import sys
import time
from collections.abc import Sequence
from datetime import UTC, datetime
from pathlib import Path

FORMAT_VERSION = 1
META_NAME = "meta.json"
LOG_NAME = "log.txt"


def torch_versions() -> tuple[str | None, str | None, str]:
    """(torch version, the torch build's CUDA version, CUDA device 0's name or "cpu"); Nones without torch."""
    if importlib.util.find_spec("torch") is None:
        return None, None, "cpu"
    import torch

    device = torch.cuda.get_device_name(0) if torch.cuda.is_available() else "cpu"
    return torch.__version__, torch.version.cuda, device


def sglang_version() -> str | None:
    """SGLang's version from its distribution, or from `sglang/version.py` of a source tree on the path
    (the offline bundle is unpacked, not installed); None when SGLang is absent. Does not import SGLang."""
    try:
        return importlib.metadata.version("sglang")
    except importlib.metadata.PackageNotFoundError:
        pass
    spec = importlib.util.find_spec("sglang")
    if spec is None or spec.origin is None:
        return None
    version_file = Path(spec.origin).with_name("version.py")
    match = re.search(r"__version__\s*=\s*['\"]([^'\"]+)['\"]", version_file.read_text())
    return match.group(1) if match else None


def run_and_record(out: Path, item: str, name: str, commit: str, command: Sequence[str]) -> int:
    """Run `command` (RESULTS=out), tee its output to out/log.txt, write out/meta.json; returns its status."""
    out.mkdir(parents=True, exist_ok=True)
    started = datetime.now(UTC)
    clock = time.monotonic()
    environment = {**os.environ, "RESULTS": str(out)}
    with (out / LOG_NAME).open("wb") as log:
        process = subprocess.Popen(command, env=environment, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
        assert process.stdout is not None  # piped above
        for line in process.stdout:
            log.write(line)
            sys.stdout.buffer.write(line)
            sys.stdout.flush()
        returncode = process.wait()
    wall_s = time.monotonic() - clock
    torch_version, cuda_version, device = torch_versions()
    meta = {
        "format_version": FORMAT_VERSION,
        "item": item,
        "name": name,
        "commit": commit,
        "device": device,
        "torch": torch_version,
        "cuda": cuda_version,
        "sglang": sglang_version(),
        "command": shlex.join(command),
        "started_at": started.isoformat(),
        "wall_s": round(wall_s, 3),
        "returncode": returncode,
    }
    (out / META_NAME).write_text(json.dumps(meta, indent=1) + "\n")
    return returncode


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description="Run one command of an offline-GPU item; write meta.json and log.txt into --out."
    )
    parser.add_argument("--out", type=Path, required=True, help="results folder (on the machine: under $OUT)")
    parser.add_argument("--item", required=True, help="the item, e.g. sglang-cuda")
    parser.add_argument("--name", required=True, help="the command's name within the item")
    parser.add_argument("--commit", required=True, help="the repository commit the plan was made at")
    parser.add_argument("command", nargs=argparse.REMAINDER, help="-- then the command and its arguments")
    args = parser.parse_args(argv)
    command = args.command[1:] if args.command[:1] == ["--"] else args.command
    if not command:
        parser.error("no command given after --")
    return run_and_record(args.out, args.item, args.name, args.commit, command)


if __name__ == "__main__":
    sys.exit(main())
