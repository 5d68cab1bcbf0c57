"""The demo DFlash2 drafter stored as its selector: assembling the complete checkpoint, reusing it while its
parts are unchanged, and splitting a checkpoint into parts (CPU, fast; the committed drafter itself:
test_demo_dflash2.py)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from bastion_sglang.demo.drafters import (
    PARTS_NAME,
    SELECTOR_NAME,
    WEIGHTS_NAME,
    assemble_dflash2,
    split_dflash2,
)

BACKBONE = {"fc.weight": torch.arange(6.0).view(2, 3), "norm.weight": torch.ones(3)}
SELECTOR = {"candidate_selector.successor_codebook": torch.full((4, 2), 0.5)}


def folder(path: Path, weights: dict[str, torch.Tensor], name: str, card: str = "card") -> Path:
    path.mkdir(parents=True)
    save_file(weights, str(path / name))
    (path / "config.json").write_text(json.dumps({"architectures": ["DFlash2DraftModel"]}))
    (path / "README.md").write_text(card)
    return path


def test_assembled_checkpoint_is_backbone_and_selector_and_is_reused(tmp_path: Path) -> None:
    backbone = folder(tmp_path / "dflash", BACKBONE, WEIGHTS_NAME)
    parts = folder(tmp_path / "dflash2", SELECTOR, SELECTOR_NAME)
    out = assemble_dflash2(parts, backbone, tmp_path / "cache")
    weights = load_file(str(out / WEIGHTS_NAME))
    assert set(weights) == set(BACKBONE) | set(SELECTOR)
    assert all(torch.equal(weights[name], tensor) for name, tensor in {**BACKBONE, **SELECTOR}.items())
    assert (out / "README.md").read_text() == "card" and (out / PARTS_NAME).is_file()
    written = (out / WEIGHTS_NAME).stat().st_mtime_ns
    assert assemble_dflash2(parts, backbone, tmp_path / "cache") == out
    assert (out / WEIGHTS_NAME).stat().st_mtime_ns == written  # unchanged parts: not written again
    (parts / "README.md").write_text("new card")
    assemble_dflash2(parts, backbone, tmp_path / "cache")
    assert (out / "README.md").read_text() == "new card"


def test_a_missing_part_or_a_clash_is_named(tmp_path: Path) -> None:
    backbone = folder(tmp_path / "dflash", BACKBONE, WEIGHTS_NAME)
    parts = folder(tmp_path / "dflash2", {"norm.weight": torch.zeros(3)}, SELECTOR_NAME)
    with pytest.raises(ValueError, match=r"repeats backbone tensors \['norm.weight'\]"):
        assemble_dflash2(parts, backbone, tmp_path / "cache")
    (parts / SELECTOR_NAME).unlink()
    with pytest.raises(FileNotFoundError, match=SELECTOR_NAME):
        assemble_dflash2(parts, backbone, tmp_path / "cache")


def test_split_keeps_the_selector_and_refuses_a_trained_backbone(tmp_path: Path) -> None:
    backbone = folder(tmp_path / "dflash", BACKBONE, WEIGHTS_NAME)
    full = folder(tmp_path / "full", {**BACKBONE, **SELECTOR}, WEIGHTS_NAME)
    out = split_dflash2(full, backbone, tmp_path / "parts")
    assert set(load_file(str(out / SELECTOR_NAME))) == set(SELECTOR)
    moved = folder(tmp_path / "moved", {**BACKBONE, "fc.weight": torch.zeros(2, 3), **SELECTOR}, WEIGHTS_NAME)
    with pytest.raises(ValueError, match=r"changed backbone tensors \['fc.weight'\]"):
        split_dflash2(moved, backbone, tmp_path / "other")
