"""Test-only oracle drafter: makes the drafter propose the target's own non-speculative continuation.

Plugged into `bastion_sglang.worker.BastionWorker` through its documented seam,
`BastionConfig(draft_proposer="oracle_drafter:make_oracle", draft_proposer_arg=<json path>)`; the
scheduler process imports this module (tests/ is on its sys.path). The JSON file holds the reference
run: {"prompts": [[ids], ...], "outputs": [[ids], ...]}. For a request whose prompt is known, draft
position d (1..D) after the root gets BOOST added to the logit of the reference token that follows the
root at distance d, so the tree search puts the reference path first and long accepted paths happen
even with random drafter weights. Requests with unknown prompts keep the drafter's logits.

With a decoy gap g (in the JSON: "decoy_gap"), every position also boosts a wrong token by BOOST - g, so
the reference token has probability ~e^g / (1 + e^g) per position. Best-first order then interleaves
the decoys with the reference path (e.g. ref1, decoy1, ref1·ref2, ...): the accepted path is not a
prefix of the verify row, so a mask that let a node see a non-ancestor would change the target's logits.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

BOOST = 30.0
"""Logit added to the reference token: its probability is ~1 after the softmax."""


class OracleProposer:
    """DraftProposer that boosts the reference continuation (see the module docstring)."""

    def __init__(self, references: dict[tuple[int, ...], list[int]], decoy_gap: float | None) -> None:
        self._references = references
        self._decoy_gap = decoy_gap

    def __call__(self, reqs: Sequence[Any], draft_logits: torch.Tensor) -> torch.Tensor:
        """reqs: B SGLang requests; draft_logits: [B, D, V]. Returns [B, D, V] boosted logits."""
        boosted = draft_logits.clone()
        depth = draft_logits.shape[1]
        for b, req in enumerate(reqs):
            reference = self._references.get(tuple(req.origin_input_ids))
            if reference is None:
                continue
            emitted = len(req.output_ids)  # the last emitted token is the root of this step's tree
            continuation = reference[emitted : emitted + depth]
            if continuation:
                index = torch.tensor(continuation, dtype=torch.int64, device=boosted.device)
                rows = torch.arange(len(continuation), device=boosted.device)
                boosted[b, rows, index] += BOOST
                if self._decoy_gap is not None:
                    decoy = (index + 1) % boosted.shape[-1]
                    boosted[b, rows, decoy] += BOOST - self._decoy_gap
        return boosted


def write_references(
    path: Path,
    prompts: Sequence[Sequence[int]],
    outputs: Sequence[Sequence[int]],
    decoy_gap: float | None = None,
) -> Path:
    """Store a reference run (prompt ids and output ids, same order) and the decoy gap for `make_oracle`."""
    data = {
        "prompts": [list(p) for p in prompts],
        "outputs": [list(o) for o in outputs],
        "decoy_gap": decoy_gap,
    }
    path.write_text(json.dumps(data))
    return path


def make_oracle(path: str) -> OracleProposer:
    """The seam's factory: read the reference run written by `write_references`."""
    data = json.loads(Path(path).read_text())
    references = {tuple(p): list(o) for p, o in zip(data["prompts"], data["outputs"], strict=True)}
    return OracleProposer(references, data["decoy_gap"])
