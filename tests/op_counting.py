"""Counting the torch ops and host reads of one call, and the sampling state such a call reads.

`counted` runs a call inside a `StepAnatomy` step (the counter `bastion step-anatomy` uses) and returns what
it issued outside any forward; on the CPU every read of a tensor counts as a host read.
`sampling_info_stand_in` is the part of SGLang's `SamplingBatchInfo` the accept stage reads, for op-count
tests that call it without an Engine (the Engine tests check its outputs).
"""

from __future__ import annotations

from collections.abc import Callable
from types import SimpleNamespace

import torch

from bastion_sglang.step.step_anatomy import OUTSIDE, StageCounts, StepAnatomy, StepCounts


def counted(call: Callable[[], object], kind: str = "speculative") -> StageCounts:
    """The ops and host reads of `call()`, counted as one step of `kind`."""
    records: list[StepCounts] = []
    anatomy = StepAnatomy(True, records.append)
    anatomy.open_step(1, ("r0",))
    anatomy.set_kind(kind)
    call()
    record = anatomy.close_step()
    assert record is not None
    return record.stages[OUTSIDE]


def sampling_info_stand_in(batch: int, vocab: int, greedy: bool) -> SimpleNamespace:
    """SamplingBatchInfo of `batch` requests without logit_bias: greedy, or temperature 0.7 and no top-k,
    top-p or min-p filter."""
    return SimpleNamespace(
        is_all_greedy=greedy,
        logit_bias=None,
        need_top_k_sampling=False,
        need_top_p_sampling=False,
        need_min_p_sampling=False,
        temperatures=torch.full((batch, 1), 0.7),
        top_ks=torch.full((batch,), vocab, dtype=torch.int32),
        top_ps=torch.ones(batch),
        min_ps=torch.zeros(batch),
        sampling_mask_batch_indices=None,
    )
