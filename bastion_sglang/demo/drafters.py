"""The committed demo DFlash2 drafter, stored as what it adds to the DFlash one and assembled for loading.

`models/smollm2-135m-instruct-dflash2` holds the DFlash2 drafter's `config.json`, its model card and
`selector.safetensors`: the candidate selector's tensors only (6.3 MB in bf16). Its backbone is the demo
DFlash drafter's `model.safetensors`, unchanged (the selector was trained on it frozen), which the repository
does not store a second time: every copy of the repository travels to the GPU machines with its files, 64 MiB
per call in all, and a second backbone would leave too little of that.

`assemble_dflash2` writes the complete checkpoint in the published format (the config, the card and one
`model.safetensors` holding backbone and selector) into a cache folder, which SGLang's `DFlash2DraftModel`
and the reference engine load like any other. It writes once, and again only when a part changed: the
folder's `PARTS_NAME` records the SHA-256 of each part it was assembled from.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

from pydantic import BaseModel, ConfigDict
from safetensors.torch import load_file, save_file

from bastion_sglang.assets import default_cache_dir, sha256_file

DFLASH_DEMO = Path("models") / "smollm2-135m-instruct-dflash"
"""The demo DFlash drafter, relative to the repository root (a complete checkpoint)."""
DFLASH2_DEMO_PARTS = Path("models") / "smollm2-135m-instruct-dflash2"
"""What the demo DFlash2 drafter adds to `DFLASH_DEMO`, relative to the repository root."""
SELECTOR_NAME = "selector.safetensors"
WEIGHTS_NAME = "model.safetensors"
PARTS_NAME = "bastion-parts.json"
COPIED = ("config.json", "README.md")
"""Files of the parts folder copied into the assembled checkpoint as they are."""


class AssembledParts(BaseModel):
    """`PARTS_NAME` of an assembled checkpoint: the SHA-256 of every file it was made from."""

    model_config = ConfigDict(frozen=True, strict=True, extra="forbid")

    backbone_sha256: str
    selector_sha256: str
    copied_sha256: dict[str, str]


def _parts_of(parts: Path, backbone: Path) -> AssembledParts:
    for path in (backbone / WEIGHTS_NAME, parts / SELECTOR_NAME, *(parts / name for name in COPIED)):
        if not path.is_file():
            raise FileNotFoundError(f"{path} is missing: the DFlash2 drafter cannot be assembled without it")
    return AssembledParts(
        backbone_sha256=sha256_file(backbone / WEIGHTS_NAME),
        selector_sha256=sha256_file(parts / SELECTOR_NAME),
        copied_sha256={name: sha256_file(parts / name) for name in COPIED},
    )


def assemble_dflash2(
    parts: Path = DFLASH2_DEMO_PARTS, backbone: Path = DFLASH_DEMO, cache_dir: Path | None = None
) -> Path:
    """The complete DFlash2 checkpoint of `parts` over `backbone`'s weights, in `cache_dir` (default: the
    asset cache) under the parts folder's name; assembled now unless an up-to-date one is there.

    ValueError when a selector tensor's name is also a backbone tensor's; FileNotFoundError naming a missing
    part.
    """
    wanted = _parts_of(parts, backbone)
    target = (default_cache_dir() if cache_dir is None else cache_dir) / parts.resolve().name
    record = target / PARTS_NAME
    if record.is_file() and AssembledParts.model_validate_json(record.read_text()) == wanted:
        return target
    weights = load_file(str(backbone / WEIGHTS_NAME))
    selector = load_file(str(parts / SELECTOR_NAME))
    clashing = sorted(set(weights) & set(selector))
    if clashing:
        raise ValueError(f"{parts / SELECTOR_NAME} repeats backbone tensors {clashing[:3]}")
    staging = target.with_name(f".{target.name}.partial")
    shutil.rmtree(staging, ignore_errors=True)
    staging.mkdir(parents=True)
    save_file({**weights, **selector}, str(staging / WEIGHTS_NAME), metadata={"format": "pt"})
    for name in COPIED:
        shutil.copyfile(parts / name, staging / name)
    (staging / PARTS_NAME).write_text(json.dumps(wanted.model_dump(), indent=2) + "\n")
    shutil.rmtree(target, ignore_errors=True)
    staging.rename(target)
    return target


def split_dflash2(checkpoint: Path, backbone: Path, out: Path) -> Path:
    """Store a complete DFlash2 checkpoint trained on `backbone` (frozen) as parts in `out`: its config and
    card, and its selector tensors as `SELECTOR_NAME`. ValueError when a backbone tensor differs from the
    checkpoint's (the backbone was not frozen). Returns `out`."""
    weights = load_file(str(checkpoint / WEIGHTS_NAME))
    base = load_file(str(backbone / WEIGHTS_NAME))
    changed = sorted(name for name, tensor in base.items() if not weights[name].equal(tensor))
    if changed:
        raise ValueError(f"{checkpoint} changed backbone tensors {changed[:3]}: store it whole")
    out.mkdir(parents=True, exist_ok=True)
    selector = {name: tensor for name, tensor in weights.items() if name not in base}
    save_file(selector, str(out / SELECTOR_NAME), metadata={"format": "pt"})
    for name in COPIED:
        if (checkpoint / name).resolve() != (out / name).resolve():
            shutil.copyfile(checkpoint / name, out / name)
    return out
