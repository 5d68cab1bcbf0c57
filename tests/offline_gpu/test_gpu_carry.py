"""`gpu_carry`: a file cut into call-sized parts comes back byte for byte; a bad stash is named.

The sizes are small stand-ins for the 64 MiB call limit and the 98 MB GGUF (same code path, bytes scaled
down); the prompts come from the real held-out split.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
from pathlib import Path

import pytest
from offline_gpu import gpu_carry
from offline_gpu.gpu_bundle import folder_bytes
from offline_gpu.gpu_carry import (
    MANIFEST_NAME,
    MANIFEST_RESERVE_BYTES,
    MARGIN_BYTES,
    CarryError,
    join,
    pack,
    part_sizes,
    read_manifest,
    repository_bytes,
    write_prompts,
)

from bastion_sglang.assets.prompt_sets import load_prompts

ROOM = 150_000
"""Bytes a call has beside the repository in these tests."""
REPO = 40_000
LIMIT = REPO + MARGIN_BYTES + MANIFEST_RESERVE_BYTES + ROOM


@pytest.mark.parametrize(
    ("total", "first_room", "room", "expected"),
    [
        (10, 4, 5, [4, 5, 1]),
        (10, 0, 5, [5, 5]),
        (3, 4, 5, [3]),
        (10, 10, 5, [10]),
    ],
)
def test_part_sizes_fill_the_first_call_then_whole_calls(
    total: int, first_room: int, room: int, expected: list[int]
) -> None:
    assert part_sizes(total, first_room, room) == expected


def test_part_sizes_refuse_a_call_without_room() -> None:
    with pytest.raises(CarryError, match="no room for a part: each call has 0 bytes"):
        part_sizes(10, 0, 0)


@pytest.fixture
def packed(tmp_path: Path) -> tuple[Path, Path, Path]:
    """A 300 kB incompressible source packed with a 20 kB file for call-1: (source, out, extra)."""
    source = tmp_path / "model.bin"
    source.write_bytes(os.urandom(300_000))
    extra = tmp_path / "prompts.jsonl"
    extra.write_bytes(b"x" * 20_000)
    out = tmp_path / "carry"
    pack(source, out, [extra], REPO, LIMIT)
    return source, out, extra


def _stash_all(out: Path, stash: Path, calls: list[int]) -> None:
    stash.mkdir(exist_ok=True)
    for call in calls:
        shutil.copytree(out / f"call-{call}", stash, dirs_exist_ok=True)


def test_pack_fits_every_call_and_join_gives_back_the_bytes(
    packed: tuple[Path, Path, Path], tmp_path: Path
) -> None:
    source, out, extra = packed
    manifest = read_manifest(out / "call-1")
    assert manifest.calls == len(list(out.glob("call-*"))) >= 3
    assert [part.call for part in manifest.parts] == list(range(1, manifest.calls + 1))
    for call in range(1, manifest.calls + 1):
        folder = out / f"call-{call}"
        assert (folder / MANIFEST_NAME).read_text() == (out / "call-1" / MANIFEST_NAME).read_text()
        assert folder_bytes(folder) + REPO + MARGIN_BYTES <= LIMIT
    assert (out / "call-1" / extra.name).read_bytes() == extra.read_bytes()
    assert not list(out.glob("*.xz"))  # only call folders remain

    stash = tmp_path / "stash"
    _stash_all(out, stash, list(range(1, manifest.calls + 1)))
    joined = join(stash, tmp_path / "joined.bin")
    assert joined.read_bytes() == source.read_bytes()


def test_join_names_a_missing_part_and_writes_nothing(
    packed: tuple[Path, Path, Path], tmp_path: Path
) -> None:
    _, out, _ = packed
    stash = tmp_path / "stash"
    _stash_all(out, stash, [1, 3])
    missing = r"model\.bin\.xz\.02: missing \(part model\.bin\.xz\.02 comes with call-2\)"
    with pytest.raises(CarryError, match=missing):
        join(stash, tmp_path / "joined.bin")
    assert not list(tmp_path.glob("*joined*"))


@pytest.mark.parametrize("damage", ["flip", "truncate"])
def test_join_names_a_corrupt_part(packed: tuple[Path, Path, Path], tmp_path: Path, damage: str) -> None:
    _, out, _ = packed
    manifest = read_manifest(out / "call-1")
    stash = tmp_path / "stash"
    _stash_all(out, stash, list(range(1, manifest.calls + 1)))
    part = stash / manifest.parts[1].file
    data = bytearray(part.read_bytes())
    if damage == "flip":
        data[len(data) // 2] ^= 0xFF
    else:
        del data[-1]
    part.write_bytes(bytes(data))
    with pytest.raises(CarryError, match=rf"{part.name}: {len(data)} bytes with another content than the "):
        join(stash, tmp_path / "joined.bin")
    assert not list(tmp_path.glob("*joined*"))


def test_join_refuses_parts_that_decompress_to_another_file(
    packed: tuple[Path, Path, Path], tmp_path: Path
) -> None:
    _, out, _ = packed
    manifest = read_manifest(out / "call-1")
    stash = tmp_path / "stash"
    _stash_all(out, stash, list(range(1, manifest.calls + 1)))
    wrong = manifest.model_copy(update={"source_sha256": "0" * 64})
    (stash / MANIFEST_NAME).write_text(wrong.model_dump_json())
    with pytest.raises(CarryError, match=r"the joined parts give 300000 bytes .* not model\.bin's 300000"):
        join(stash, tmp_path / "joined.bin")
    assert not list(tmp_path.glob("*joined*"))


def test_join_without_a_manifest_names_the_file(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert gpu_carry.main(["join", "--stash", str(tmp_path), "--out", str(tmp_path / "x")]) == 1
    assert f"{tmp_path / MANIFEST_NAME}: no valid carry manifest" in capsys.readouterr().err


def test_pack_refuses_first_call_files_larger_than_a_call(tmp_path: Path) -> None:
    source = tmp_path / "model.bin"
    source.write_bytes(b"0" * 1000)
    extra = tmp_path / "wheels"
    extra.mkdir()
    (extra / "big.whl").write_bytes(b"w" * (ROOM + 1))
    too_big = rf"call-1's files take {ROOM + 1} bytes but a call has {ROOM} beside"
    with pytest.raises(CarryError, match=too_big):
        pack(source, tmp_path / "carry", [extra], REPO, LIMIT)
    assert not (tmp_path / "carry").exists()


def test_repository_bytes_count_what_travels(tmp_path: Path) -> None:
    subprocess.run(["git", "init", "-q", str(tmp_path)], check=True)
    (tmp_path / ".gitignore").write_text("ignored/\n")
    (tmp_path / "tracked.txt").write_bytes(b"t" * 100)
    subprocess.run(["git", "-C", str(tmp_path), "add", "tracked.txt", ".gitignore"], check=True)
    (tmp_path / "untracked.txt").write_bytes(b"u" * 30)
    (tmp_path / "ignored").mkdir()
    (tmp_path / "ignored" / "big.bin").write_bytes(b"i" * 5000)
    assert repository_bytes(tmp_path) == 100 + 30 + len("ignored/\n")


def test_prompts_take_the_held_out_sets_in_turn_then_fill_with_sharegpt(tmp_path: Path) -> None:
    dest = tmp_path / "prompts.jsonl"
    mtbench, humaneval = load_prompts("mtbench", "heldout"), load_prompts("humaneval", "heldout")
    sharegpt = load_prompts("sharegpt", "heldout")
    assert len(mtbench) + len(humaneval) == 25
    assert write_prompts(dest) == 64
    lines = [json.loads(line)["prompt"] for line in dest.read_text().splitlines()]
    first_two_each = [mtbench[0], humaneval[0], mtbench[1], humaneval[1]]
    assert lines[:4] == [prompt.turns[0] for prompt in first_two_each]
    assert lines[24] == humaneval[-1].turns[0]
    assert lines[25:] == [prompt.turns[0] for prompt in sharegpt[:39]]
    assert write_prompts(dest, fill_to=10) == 25  # the named sets are never cut
