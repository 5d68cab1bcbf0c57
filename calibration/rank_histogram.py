"""Rank histograms of a drafter: at which rank of its top-K the target's token sits, per draft position,
among the passes whose target path stayed inside the drafter's candidates so far.

counts[d - 1][k], for draft position d = 1..D and rank k = 0..K_p - 1 (k = 0 the drafter's best): the
passes in which the target's token at d is the drafter's rank-k candidate at d, among the passes whose
target tokens at 1..d - 1 were each one of the K_p candidates at their position (every pass counts at
d = 1). counts[d - 1][K_p] counts the passes in which it is none of them; such a pass counts at no deeper
position. A pass whose continuation ends before d (the output ended) counts at no position from d on. This
is the conditioning of `controller.acceptance.AcceptanceRecord.events` and of a synthetic acceptance
profile's q[d][k] (`step.synthetic_profile`): given the path so far, which candidate the target takes.

`RankHistogram` is the file (`tools/offline_gpu/profiles/record_ranks.py` writes it; `fit_acceptance.py`
reads it) with what produced it; `conditional_rows` gives the per-position distributions, the sparse deep
positions shrunk toward the position before.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import numpy as np
from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from bastion_sglang.controller.acceptance import AcceptanceRecord
from bastion_sglang.controller.fast_tree import host_draft

PRIOR_PASSES = 16.0
"""Pseudo-passes of the position before (of the pooled positions, at d = 1) added to each position's counts
by `conditional_rows`: a position with thousands of passes keeps its own distribution, a deep one with a
handful leans on the one above it instead of on a few events."""


def count_ranks(passes: Sequence[AcceptanceRecord], depth: int, ranks: int) -> list[list[int]]:
    """[depth][ranks + 1] counts of `passes` (module docstring): ranks 0..ranks - 1, then none of them.
    ValueError when a pass has fewer than `ranks` candidates per position."""
    if depth < 1 or ranks < 1:
        raise ValueError(f"depth and ranks must be >= 1, got depth={depth}, ranks={ranks}")
    counts = np.zeros((depth, ranks + 1), dtype=np.int64)
    for index, record in enumerate(passes):
        _, ids = host_draft(record.logprobs, record.token_ids)
        if ids.shape[1] < ranks:
            raise ValueError(f"pass {index} has {ids.shape[1]} candidates per position; {ranks} are needed")
        for d, target in enumerate(record.continuation[: min(depth, ids.shape[0])]):
            hits = np.flatnonzero(ids[d, :ranks] == target)
            counts[d, int(hits[0]) if hits.size else ranks] += 1
            if not hits.size:
                break
    return counts.tolist()


class RankHistogram(BaseModel):
    """A rank histogram file: the counts (module docstring) and what produced them."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    drafter: str = Field(description="the drafter's folder, as given to the recorder")
    drafter_sha256: str = Field(description="SHA-256 of the drafter's model.safetensors")
    target: str = Field(description="the target, e.g. the demo target's name")
    target_sha256: str = Field(description="SHA-256 of the target's model.safetensors")
    dtype: str = Field(description="the dtype both models ran in, e.g. 'float32'")
    prompt_sets: tuple[str, ...] = Field(min_length=1, description="prompt sets, interleaved, training split")
    prompt_keys: tuple[str, ...] = Field(min_length=1, description="'<set>/<id>' of every prompt decoded")
    max_new_tokens: int = Field(gt=0, description="tokens decoded per prompt, greedily (T = 0)")
    decode_budget: int = Field(gt=0, description="draft nodes of the fixed tree the decode verified per step")
    commit: str = Field(description="the repository's commit the recorder ran at")
    command: str = Field(description="the command that wrote the file")
    counts: tuple[tuple[int, ...], ...] = Field(
        min_length=1, description="[D][K_p + 1] passes per draft position and rank, then none of the K_p"
    )

    @model_validator(mode="after")
    def _counts_are_a_histogram(self) -> RankHistogram:
        width = len(self.counts[0])
        for d, row in enumerate(self.counts):
            if len(row) != width or width < 2:
                raise ValueError(
                    f"counts row {d} has {len(row)} entries; every row needs K_p + 1 >= 2 ({width})"
                )
            if any(count < 0 for count in row):
                raise ValueError(f"counts row {d} {list(row)}: counts must be >= 0")
        if sum(self.counts[0]) == 0:
            raise ValueError("counts row 0 is empty: no drafter pass was counted")
        return self

    @property
    def ranks(self) -> int:
        """K_p, the candidates counted per position."""
        return len(self.counts[0]) - 1

    @property
    def depth(self) -> int:
        """D, the draft positions counted."""
        return len(self.counts)

    def passes(self) -> list[int]:
        """[D] passes counted at each position (the conditioning event's size)."""
        return [sum(row) for row in self.counts]

    def conditional_rows(self) -> np.ndarray:
        """[D, K_p + 1] float64 distributions per position over the ranks and none, each row summing to 1,
        the ranks' part non-increasing: row[d] = (counts[d] + PRIOR_PASSES · row[d - 1]) / (passes[d] +
        PRIOR_PASSES), row[-1] being the pooled distribution of every position, then the ranks 0..K_p - 1
        made non-increasing by `non_increasing` (a drafter's candidates are sorted, and so must a profile's
        row be). Every entry is > 0 where every pooled entry is."""
        counts = np.asarray(self.counts, dtype=np.float64)
        previous = counts.sum(0) / counts.sum()
        rows = np.empty_like(counts)
        for d in range(self.depth):
            rows[d] = (counts[d] + PRIOR_PASSES * previous) / (counts[d].sum() + PRIOR_PASSES)
            rows[d, :-1] = non_increasing(rows[d, :-1])
            previous = rows[d]
        return rows


def non_increasing(shares: np.ndarray) -> np.ndarray:
    """The non-increasing sequence closest to `shares` [K] in least squares (pool adjacent violators: each
    run that rises is replaced by its mean), the maximum-likelihood estimate of a multinomial whose cells
    are ordered. Sums are kept."""
    means: list[float] = []  # one entry per block of pooled cells
    sizes: list[int] = []
    for share in shares.tolist():
        means.append(share)
        sizes.append(1)
        while len(means) > 1 and means[-2] < means[-1]:
            mean, size = means.pop(), sizes.pop()
            means[-1] = (means[-1] * sizes[-1] + mean * size) / (sizes[-1] + size)
            sizes[-1] += size
    return np.repeat(np.asarray(means, dtype=np.float64), sizes)


def load_rank_histogram(path: Path) -> RankHistogram:
    """The histogram in `path`; ValueError naming the file and the field when it is missing or malformed."""
    try:
        text = path.read_text(encoding="utf-8")
    except OSError as error:
        raise ValueError(f"rank histogram {path}: {error.strerror or error}") from None
    try:
        return RankHistogram.model_validate_json(text)
    except ValidationError as error:
        first = error.errors()[0]
        where = ".".join(str(part) for part in first["loc"]) or "(file)"
        raise ValueError(f"rank histogram {path}: {where}: {first['msg']}") from None
