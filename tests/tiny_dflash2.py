"""A tiny random DFlash2 drafter on disk: `tiny_models.make_tiny_drafter`'s backbone plus a candidate
selector, in the published DFlash2 format (architecture `DFlash2DraftModel`, the selector's keys in
`dflash_config`, its weights under SGLang's `candidate_selector.*` names). Deterministic in `seed`.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file
from tiny_models import make_tiny_drafter


def make_tiny_dflash2_drafter(
    path: str | Path,
    target_path: str | Path,
    *,
    rank: int = 8,
    top_k: int = 4,
    output_multiplier: float = 1.0,
    final_logit_softcapping: float | None = None,
    architecture: str = "DFlash2DraftModel",
    block_size: int = 16,
    codebook_std: float = 1.0,
    seed: int = 0,
) -> Path:
    """Save a random DFlash2 drafter for the target at `target_path` (2 draft layers) and return its folder.

    codebook_std: std of both codebooks and of the projection's rows scaled by 1/sqrt(h); at 1.0 the
    transition terms are on the scale of the unary logits, so the lattice's rows differ by predecessor.
    """
    out = make_tiny_drafter(path, target_path, num_layers=2, block_size=block_size, seed=seed)
    config = json.loads((out / "config.json").read_text())
    config["architectures"] = [architecture]
    del config["auto_map"]
    config["dflash_config"] |= {
        "selector_rank": rank,
        "selector_top_k": top_k,
        "output_multiplier": output_multiplier,
        "final_logit_softcapping": final_logit_softcapping,
    }
    hidden, vocab = int(config["hidden_size"]), int(config["vocab_size"])
    generator = torch.Generator().manual_seed(seed + 1)
    weights = load_file(str(out / "model.safetensors"))
    std = codebook_std
    weights |= {
        "candidate_selector.predecessor_codebook": torch.randn(vocab, rank, generator=generator) * std,
        "candidate_selector.successor_codebook": torch.randn(vocab, rank, generator=generator) * std,
        "candidate_selector.hidden_projection.weight": torch.randn(rank, hidden, generator=generator)
        * (std / hidden**0.5),
    }
    (out / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    save_file({k: v.contiguous() for k, v in weights.items()}, str(out / "model.safetensors"))
    return out
