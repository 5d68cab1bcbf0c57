"""SGLang requests' output penalties as `kernels.OutputPenalties` (host -> device, once a step).

SGLang's scheduler cumulates penalty state one token per decode step on its batch's orchestrator; a tree
step commits several tokens and hands the worker only a forward copy of the sampling info without that
orchestrator. The state is therefore rebuilt each step from what defines it: the request's
`sampling_params` and its `output_ids` (the tokens output so far, the verify root last).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

import torch

from bastion_sglang.kernels.penalties import OutputPenalties, Penalty

if TYPE_CHECKING:
    from sglang.srt.managers.schedule_batch import Req


def sglang_penalty_order() -> tuple[Penalty, ...]:
    """The order in which SGLang's sampler applies its penalizers in this process.

    `SamplingBatchInfo.from_schedule_batch` builds the orchestrator from a set literal of the four penalizer
    classes, and the orchestrator applies them in that set's iteration order, which depends on the classes'
    hashes (their ids): fixed within a process, not across processes. The same literal, built here in the
    scheduler process, iterates in the same order.
    """
    from bastion_sglang.sglang_adapter import penaltylib

    penalizers = {
        penaltylib.BatchedFrequencyPenalizer,
        penaltylib.BatchedMinNewTokensPenalizer,
        penaltylib.BatchedPresencePenalizer,
        penaltylib.BatchedRepetitionPenalizer,
    }
    kinds = {
        penaltylib.BatchedFrequencyPenalizer: Penalty.FREQUENCY,
        penaltylib.BatchedMinNewTokensPenalizer: Penalty.MIN_NEW_TOKENS,
        penaltylib.BatchedPresencePenalizer: Penalty.PRESENCE,
        penaltylib.BatchedRepetitionPenalizer: Penalty.REPETITION,
    }
    return tuple(kinds[penalizer] for penalizer in penalizers)


def has_output_penalty(req: Req) -> bool:
    """Whether the request sets a frequency, presence or repetition penalty or min_new_tokens."""
    params = req.sampling_params
    return (
        params.frequency_penalty != 0.0
        or params.presence_penalty != 0.0
        or params.repetition_penalty != 1.0
        or params.min_new_tokens > 0
    )


def min_new_tokens_stop_ids(req: Req) -> list[int]:
    """The ids SGLang's min_new_tokens penalizer bans: the request's stop_token_ids, its EOS ids, the
    tokenizer's additional stop ids and its eos_token_id (`BatchedMinNewTokensPenalizer._prepare`)."""
    tokenizer = req.tokenizer
    ids = (
        (req.sampling_params.stop_token_ids or set())
        | (req.eos_token_ids or set())
        | (getattr(tokenizer, "additional_stop_token_ids", None) or set())
        | (
            {tokenizer.eos_token_id}
            if tokenizer is not None and tokenizer.eos_token_id is not None
            else set()
        )
    )
    return sorted(token for token in ids if token is not None)


def output_penalties(reqs: Sequence[Req], vocab_size: int, device: torch.device) -> OutputPenalties | None:
    """The batch's penalty state, or None when no request sets an output penalty (nothing to apply)."""
    if not any(has_output_penalty(req) for req in reqs):
        return None
    outputs = [list(req.output_ids) for req in reqs]
    stops = [min_new_tokens_stop_ids(req) for req in reqs]

    def padded(rows: list[list[int]]) -> torch.Tensor:
        width = max(1, max(len(row) for row in rows))
        table = [row + [vocab_size] * (width - len(row)) for row in rows]
        return torch.tensor(table, dtype=torch.int64).to(device, non_blocking=True)

    def column(values: list[float | int], dtype: torch.dtype) -> torch.Tensor:
        return torch.tensor(values, dtype=dtype).to(device, non_blocking=True)

    params = [req.sampling_params for req in reqs]
    return OutputPenalties(
        output_ids=padded(outputs),
        output_lens=column([len(row) for row in outputs], torch.int64),
        frequency=column([p.frequency_penalty for p in params], torch.float32),
        presence=column([p.presence_penalty for p in params], torch.float32),
        repetition=column([p.repetition_penalty for p in params], torch.float32),
        min_new_tokens=column([p.min_new_tokens for p in params], torch.int64),
        stop_tokens=padded(stops),
    )
