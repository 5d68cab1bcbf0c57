"""SGLang requests' output penalties as `kernels.OutputPenalties` (host -> device, once a step).

SGLang's scheduler cumulates penalty state one token per decode step on its batch's orchestrator; a tree
step commits several tokens and hands the worker only a forward copy of the sampling info without that
orchestrator. The state is therefore rebuilt each step from what defines it: the request's
`sampling_params` and its output so far (the verify root last).

Without overlap scheduling that output is the request's `output_ids`. Under SGLang's overlap scheduler a
forward is launched before the result of the one before it is processed, so `output_ids` may lack that
forward's tokens: `RecentOutputs` keeps the last forwards' committed tokens and fills in what a request's
`output_ids` lacks, so penalties act on the whole output either way.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass
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
    from bastion_sglang.integration.sglang_adapter import penaltylib

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


@dataclass(frozen=True)
class CommittedTokens:
    """What one forward (a prefill or a decode step) committed: reqs [B] in batch order, tokens [B, T] int64
    (device), counts [B] (device) tokens committed per request, the first counts[b] of row b."""

    reqs: tuple[Req, ...]
    tokens: torch.Tensor
    counts: torch.Tensor


class RecentOutputs:
    """The tokens the last `keep` forwards committed, for requests whose `output_ids` do not hold them yet.

    Under the overlap scheduler SGLang appends a forward's tokens to `output_ids` only after it has launched
    the next forward; a request of a decode step therefore lacks at most the tokens of the last forward it
    was in (its prefill, or the previous decode step), which is one of the last two forwards. How many it
    lacks follows from its lengths: `committed + 1` tokens (KV of the committed ones, and the root) against
    `len(origin_input_ids) + len(output_ids)`.
    """

    def __init__(self, keep: int = 2) -> None:
        self._forwards: deque[CommittedTokens] = deque(maxlen=keep)

    def record(self, reqs: Sequence[Req], tokens: torch.Tensor, counts: torch.Tensor) -> None:
        """One forward's committed tokens: tokens [B, T] int64, counts [B] (see `CommittedTokens`)."""
        self._forwards.append(CommittedTokens(tuple(reqs), tokens, counts))

    def outputs(self, reqs: Sequence[Req], committed: Sequence[int]) -> list[list[int]]:
        """Each request's output so far, the root last: its `output_ids` and the recorded tokens they lack.

        committed: [B] host ints, tokens with KV per request (the step's prefix lengths). RuntimeError naming
        the request when its output lags by tokens no recorded forward holds (the worker's bookkeeping is
        then wrong: penalties would act on a different output).
        """
        rows = []
        for req, prefix in zip(reqs, committed, strict=True):
            output = list(req.output_ids)
            missing = prefix + 1 - len(req.origin_input_ids) - len(output)
            if missing:
                output += self._last_tokens(req, missing)
            rows.append(output)
        return rows

    def _last_tokens(self, req: Req, missing: int) -> list[int]:
        """The last `missing` tokens the most recent recorded forward of `req` committed for it."""
        for forward in reversed(self._forwards):
            row = next((row for row, held in enumerate(forward.reqs) if held is req), None)
            if row is None:
                continue
            count = int(forward.counts[row])
            if 0 < missing <= count:
                return forward.tokens[row, count - missing : count].tolist()
            break
        raise RuntimeError(
            f"request {req.rid}: its output lacks {missing} committed tokens that no recent forward holds"
        )


def output_penalties(
    reqs: Sequence[Req], outputs: Sequence[Sequence[int]], vocab_size: int, device: torch.device
) -> OutputPenalties:
    """The batch's penalty state: outputs [B] each request's output so far (`RecentOutputs.outputs`)."""
    stops = [min_new_tokens_stop_ids(req) for req in reqs]

    def padded(rows: Sequence[Sequence[int]]) -> torch.Tensor:
        width = max(1, max(len(row) for row in rows))
        table = [list(row) + [vocab_size] * (width - len(row)) for row in rows]
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
