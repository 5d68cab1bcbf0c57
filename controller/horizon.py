"""The draft horizon: how many drafted positions the drafter's LM head scores in a step.

A DFlash pass drafts D = γ - 1 positions after each root. It costs the drafter's layers over B·γ tokens plus
the LM head over B·D rows of V logits; with a small drafter the head is most of it (the demo drafter at
B = 8, D = 15, V = 49152, H = 576: 6.8 GFLOP of head against about 2 GFLOP of layers). A tree of n nodes
reaches depth n at most, and where speculation barely pays (a CPU, a large batch, text the drafter cannot
predict) the planned trees are one or two levels deep: scoring all D positions then wastes most of the pass.

So the head scores positions 1..h only, and the tree search sees a [B, h, K] lattice. h follows the trees
the planner chose (`DraftHorizon.observe`, with d the deepest planned node of the step, 0 for a plain plan):
- d < h: the horizon did not bind; h becomes clamp(2·d, min_horizon, D), room to grow by half again.
- d = h: the plan used the last scored position and may have wanted deeper ones; h doubles (at most D).
  While h < D the speculation gate bounds what deeper nodes would add (`controller.gate.horizon_gain`).
It starts at `start` (at most D): a first pass on easy text binds and reaches D within two more passes
(4, 8, 15), and a first pass where speculation does not pay costs a quarter of the head. A probe of the
speculation gate (a step that drafts while the gate backs off, `controller.gate`) scores every position
(`open`): it is there to learn what the text allows, and a probe planned within two positions (the horizon
after a decline) left the gate to bound the deeper nodes, so loosely that on the 2-core CPU demo pair at
concurrency 1 the ceiling read 1.1 to 1.6 where the probes' own plans read 0.6 to 0.8, and three requests
in six paid a verified tree priced below plain decoding. The trees are the best trees within the horizon,
so a step after a sudden rise in depth plans a shallower tree than it could have, once, before the horizon
doubles.

The rule is for policies that size the tree by its estimated speedup (adaptive, bucketed). A policy with a
fixed size (fixed:N, chain) keeps all D positions (`DraftHorizon.full`): its trees are the best N nodes of the
whole lattice, as DDTree and DFlash define them, whatever steps came before.
"""

from __future__ import annotations

from dataclasses import dataclass, field

DEFAULT_START = 4
"""Horizon of the first drafted step, positions."""
DEFAULT_MIN_HORIZON = 2
"""Smallest horizon, positions: a plain plan keeps room for two levels at the next probe."""


@dataclass
class DraftHorizon:
    """The module docstring's rule. depth: D, the positions the drafter proposes (block size - 1)."""

    depth: int
    start: int = DEFAULT_START
    min_horizon: int = DEFAULT_MIN_HORIZON
    _horizon: int = field(default=0, init=False)

    def __post_init__(self) -> None:
        if self.depth < 1:
            raise ValueError(f"the drafter must propose at least one position, got depth {self.depth}")
        if not 1 <= self.min_horizon <= self.start:
            raise ValueError(f"need 1 <= min_horizon <= start, got {self.min_horizon} and {self.start}")
        self._horizon = min(self.start, self.depth)

    @classmethod
    def full(cls, depth: int) -> DraftHorizon:
        """A horizon that stays at D = `depth` whatever is observed."""
        return cls(depth, start=depth, min_horizon=depth)

    @property
    def horizon(self) -> int:
        """h: drafted positions the next pass scores, 1..D."""
        return self._horizon

    def open(self) -> None:
        """The next pass is a probe: it scores all D positions (`observe` then follows its plan)."""
        self._horizon = self.depth

    def observe(self, deepest: int) -> None:
        """After a drafted step's plan: `deepest`, the depth of its deepest planned node (0: plain plan)."""
        if not 0 <= deepest <= self._horizon:
            raise ValueError(f"a plan within horizon {self._horizon} cannot reach depth {deepest}")
        if deepest == self._horizon:
            self._horizon = min(2 * self._horizon, self.depth)
        else:
            self._horizon = min(max(2 * deepest, self.min_horizon), self.depth)
