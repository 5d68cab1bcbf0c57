"""SGLang's own penalizers on stand-in requests: the per-path rerun the tree penalty tests compare with."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field
from types import SimpleNamespace

import torch
from sglang.srt.sampling import penaltylib

PENALIZERS = {
    penaltylib.BatchedFrequencyPenalizer,
    penaltylib.BatchedMinNewTokensPenalizer,
    penaltylib.BatchedPresencePenalizer,
    penaltylib.BatchedRepetitionPenalizer,
}


@dataclass
class FakeReq:
    """The fields of SGLang's `Req` the penalizers read."""

    output_ids: list[int]
    sampling_params: SimpleNamespace
    eos_token_ids: set[int] | None = None
    tokenizer: SimpleNamespace = field(
        default_factory=lambda: SimpleNamespace(additional_stop_token_ids=None, eos_token_id=None)
    )


class FakeBatch:
    """What `BatchedPenalizerOrchestrator` reads from a ScheduleBatch."""

    def __init__(self, reqs: list[FakeReq]) -> None:
        self.reqs = reqs
        self.device = "cpu"


def make_req(
    vocab: int,
    output: list[int],
    frequency: float = 0.0,
    presence: float = 0.0,
    repetition: float = 1.0,
    min_new: int = 0,
    stop_ids: set[int] | None = None,
    eos: set[int] | None = None,
    tokenizer_eos: int | None = None,
) -> FakeReq:
    params = SimpleNamespace(
        frequency_penalty=frequency,
        presence_penalty=presence,
        repetition_penalty=repetition,
        min_new_tokens=min_new,
        stop_token_ids=stop_ids,
    )
    tokenizer = SimpleNamespace(additional_stop_token_ids={vocab - 1}, eos_token_id=tokenizer_eos)
    return FakeReq(output_ids=output, sampling_params=params, eos_token_ids=eos, tokenizer=tokenizer)


def sglang_row(
    req: FakeReq, path: list[int], raw: torch.Tensor, penalizers: Iterable[type] = PENALIZERS
) -> torch.Tensor:
    """SGLang's penalised logits [V] after the request's output followed by `path`, from raw [V]: a fresh
    orchestrator over the request alone cumulates the tokens one at a time (one per decode step), then
    applies its penalizers as SGLang's sampler does without overlap scheduling (`orchestrator.apply`), in
    the iteration order of `penalizers` (SGLang's own set by default)."""
    vocab = raw.shape[-1]
    batch = FakeBatch([req])
    orchestrator = penaltylib.BatchedPenalizerOrchestrator(vocab, batch, penalizers)
    for token in [*req.output_ids, *path]:
        orchestrator.cumulate_output_tokens(torch.tensor([token]))
    logits = raw.clone()[None]
    if orchestrator.is_required:
        orchestrator.apply(logits)
    return logits[0]
