"""Drafter context of the steps that skip the drafter, written later in one append.

Every decode step commits tokens, and the drafter must hold each committed token's target features as drafter
KV (at the token's KV slot) before its next pass reads them. A step that drafts writes them at once, in its
commit. A step that skips the drafter (the speculation gate declined, a plain step of one token per request)
would pay a whole drafter KV projection for one token per request: about 1.6 ms of a 60-80 ms plain step on
the CPU demo pair at batch 8. `DeferredDraftContext` keeps those rows instead, and the worker writes them all
in one append (`take`) when one of these comes first:

- the next drafter pass (the drafter reads exactly what it would have read without deferral);
- a prefill batch (a request that comes back after retraction, or one that reuses a finished request's
  prefix from the radix cache, reads drafter KV of slots written here);
- a request leaving the decode batch (it finished or was retracted: its slots pass to the radix cache, which
  keeps them until it evicts them, so they are written while they still hold that request's tokens);
- MAX_DEFERRED_STEPS deferred steps (the rows held stay bounded).

What is deferred is only when the drafter KV is written, never what: the rows are the committed tokens' own
target features, slots and positions, so outputs are those of writing them at once (the engine tests compare
with plain decoding). A slot that the radix cache evicts and hands to another request between a request's
departure and the next step is the one case where a deferred write can land in another request's drafter
KV; the verify pass is still the target's, so outputs stay exact, and that request's drafts are only worse.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

MAX_DEFERRED_STEPS = 64
"""Most deferred steps held before they are written regardless (a bound on held rows: steps x batch)."""


@dataclass(frozen=True)
class ContextRows:
    """Committed tokens whose target features the drafter KV still lacks, one row per token.

    hidden: [M, H_c] target features (the drafter's feature layers, concatenated); slots: [M] int64 KV slots;
    positions: [M] int64 sequence positions of the tokens.
    """

    hidden: torch.Tensor
    slots: torch.Tensor
    positions: torch.Tensor

    def __post_init__(self) -> None:
        rows = self.hidden.shape[0]
        if self.hidden.dim() != 2 or self.slots.shape != (rows,) or self.positions.shape != (rows,):
            raise ValueError(
                "context rows need hidden [M, H], slots [M] and positions [M]; got "
                f"{tuple(self.hidden.shape)}, {tuple(self.slots.shape)}, {tuple(self.positions.shape)}"
            )


class DeferredDraftContext:
    """The rows of steps that skipped the drafter, until the worker writes them (module docstring).

    Requests are told apart by identity (the scheduler's `Req` objects live as long as the request).
    """

    def __init__(self, max_steps: int = MAX_DEFERRED_STEPS) -> None:
        if max_steps < 1:
            raise ValueError(f"max_steps must be >= 1, got {max_steps}")
        self._max_steps = max_steps
        self._steps: list[ContextRows] = []
        self._requests: tuple[int, ...] = ()

    def __len__(self) -> int:
        """Deferred steps held."""
        return len(self._steps)

    def defer(self, reqs: Sequence[object], rows: ContextRows) -> None:
        """Hold one skipped step's rows: rows.hidden [B, H_c], one committed token per request of `reqs`.

        The step must come from the batch `due` was last asked about with nothing due, or from any batch
        when nothing is held.
        """
        if rows.hidden.shape[0] != len(reqs):
            raise ValueError(f"one row per request: {rows.hidden.shape[0]} rows for {len(reqs)} requests")
        requests = tuple(id(req) for req in reqs)
        if self._steps and requests != self._requests:
            raise ValueError("deferred steps must come from one batch; write the held rows first (`take`)")
        self._steps.append(rows)
        self._requests = requests

    def due(self, reqs: Sequence[object]) -> bool:
        """Whether the held rows must be written before a decode step of `reqs` that does not draft: a request
        held here has left the batch, the batch changed, or MAX_DEFERRED_STEPS steps are held."""
        if not self._steps:
            return False
        return len(self._steps) >= self._max_steps or tuple(id(req) for req in reqs) != self._requests

    def take(self) -> ContextRows | None:
        """All held rows, oldest step first (None when none are held), and forget them."""
        if not self._steps:
            return None
        steps, self._steps, self._requests = self._steps, [], ()
        if len(steps) == 1:
            return steps[0]
        return ContextRows(
            hidden=torch.cat([step.hidden for step in steps]),
            slots=torch.cat([step.slots for step in steps]),
            positions=torch.cat([step.positions for step in steps]),
        )
