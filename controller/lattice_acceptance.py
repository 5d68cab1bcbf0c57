"""Acceptance calibration on DFlash2 lattices: the recorded pass and the raw path scores of lattice trees.

A `LatticeRecord` is one DFlash2 drafter pass whose target continuation is known. Its conditional events
are `acceptance`'s with the top-K row of depth d replaced by the parent's transition row (module docstring
of `acceptance`, "Lattices"), so `fit_acceptance`, `conditional_events` and `evaluate_acceptance` take it as
they take an `AcceptanceRecord`, and the fitted map is the same `AcceptanceCalibration`.

`lattice_node_log_scores` (defined beside the lattice trees, `lattice_tree`) gives the path scores of lattice
trees under other transitions (the raw ones of trees built on calibrated transitions), as
`acceptance.node_log_scores` does for top-K trees.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

import numpy as np
import torch

from bastion_sglang.controller.acceptance import AcceptanceCalibration
from bastion_sglang.controller.fast_tree import host_draft
from bastion_sglang.controller.lattice_tree import build_lattice_tree, lattice_node_log_scores
from bastion_sglang.controller.tree import DraftTree

__all__ = ["LatticeRecord", "lattice_node_log_scores"]


@dataclass(frozen=True)
class LatticeRecord:
    """One DFlash2 drafter pass and what the target committed after its root.

    transitions: [D, K, K] raw log-probs, row [e, p] over slot e's candidates after candidate p of slot e-1
    (slot 0: row [0, 0], the root's); token_ids: [D, K] the candidates, distinct per slot; continuation: the
    target's tokens at depths 1..m (m <= D; fewer when the output ended).
    """

    transitions: torch.Tensor
    token_ids: torch.Tensor
    continuation: tuple[int, ...]

    def __post_init__(self) -> None:
        if self.transitions.dim() != 3 or self.transitions.shape[1] != self.transitions.shape[2]:
            raise ValueError(f"transitions must be [D, K, K], got shape {tuple(self.transitions.shape)}")
        if self.token_ids.shape != self.transitions.shape[:2]:
            raise ValueError(
                f"token_ids must be [D, K] = {list(self.transitions.shape[:2])}, got "
                f"{list(self.token_ids.shape)}"
            )

    @property
    def depth(self) -> int:
        return int(self.transitions.shape[0])

    def events(self, depths: int) -> Iterator[tuple[np.ndarray, np.ndarray]]:
        """`acceptance.DrafterPass.events`: depth d reads row [d - 1, p], p the candidate index of the
        target's token at depth d - 1 (0 at depth 1); stops after the first depth whose slot lacks the
        target's token. The transitions and candidates are read to the host in one copy."""
        rows, ids = host_draft(self.transitions, self.token_ids)
        parent = 0
        for d, target in enumerate(self.continuation[: min(depths, rows.shape[0])]):
            match = ids[d] == target
            yield rows[d, parent], match.astype(np.float64)
            if not match.any():
                return  # the target's path leaves the lattice: deeper events are not conditional ones
            parent = int(np.argmax(match))

    def tree(self, calibration: AcceptanceCalibration | None, budget: int) -> DraftTree:
        """The best-first lattice tree of `budget` nodes (every child kept), raw or calibrated transitions."""
        transitions = (
            self.transitions if calibration is None else calibration.apply(self.transitions[None])[0]
        )
        return build_lattice_tree(transitions, self.token_ids, budget)
