"""Test-only draft proposer that makes one tensor-parallel rank measure slower steps than the others.

Plugged in through `BastionConfig(draft_proposer="rank_skew:make_rank_skew", draft_proposer_arg=<json>)`
(the scheduler processes import it: tests/ is on their sys.path). The JSON file says which TP rank is slow,
by how many seconds per drafter pass, and which proposer to wrap: {"rank": 1, "seconds": 0.1,
"inner": "oracle_drafter:make_oracle", "inner_arg": "<path>"} ("inner" null: the drafter's own logits).

The sleep falls inside the draft stage of the slow rank only, so that rank's step-cost tracker sees a far
costlier drafter pass than rank 0's (whose wait lands in a later stage): planned on each rank's own
measurements, the ranks' gates and tree sizes would part.
"""

from __future__ import annotations

import importlib
import json
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

Proposer = Callable[[Sequence[Any], torch.Tensor, Sequence[int]], torch.Tensor]


def write_skew(path: Path, rank: int, seconds: float, inner: str | None, inner_arg: str | None) -> Path:
    """Store the skew's settings for `make_rank_skew`."""
    path.write_text(json.dumps({"rank": rank, "seconds": seconds, "inner": inner, "inner_arg": inner_arg}))
    return path


@dataclass(frozen=True)
class RankSkew:
    """Sleeps `seconds` per call on TP rank `rank`, then hands the logits to `inner` (if any)."""

    rank: int
    seconds: float
    inner: Proposer | None

    def __call__(
        self, reqs: Sequence[Any], draft_logits: torch.Tensor, prefix_lens: Sequence[int]
    ) -> torch.Tensor:
        """reqs: the batch's B requests; draft_logits: [B, D, V]; prefix_lens: [B] committed lengths.
        Returns [B, D, V] logits."""
        from sglang.srt.runtime_context import get_parallel

        if get_parallel().tp_rank == self.rank:
            time.sleep(self.seconds)
        return draft_logits if self.inner is None else self.inner(reqs, draft_logits, prefix_lens)


def make_rank_skew(path: str) -> RankSkew:
    """The seam's factory: read the settings `write_skew` stored."""
    data = json.loads(Path(path).read_text())
    inner = None
    if data["inner"] is not None:
        module_name, _, attr = data["inner"].partition(":")
        inner = getattr(importlib.import_module(module_name), attr)(data["inner_arg"])
    return RankSkew(int(data["rank"]), float(data["seconds"]), inner)
