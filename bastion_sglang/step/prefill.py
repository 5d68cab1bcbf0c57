"""The prefill stage: SGLang's DFlash prefill (it also fills the drafter KV) with BASTION's parts around it.

Before it, each request's sampling-walk key (`WalkSeeds`: hashed once per request, a decode step hashes only
its positions); around it, the re-prefill redraw (`prefill_redraw.PrefillRedraw`: a retracted request's token
is the one a decode step draws); after it, the prefill's hidden states for the requests that ask
(`request_outputs`), the prefill tokens as the requests' recent output (`Acceptor.recent_outputs`, which
overlap scheduling reads) and the first draft input, each request's prefill token its root.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch

from bastion_sglang import kernels
from bastion_sglang.integration.sglang_adapter import GenerationBatchResult
from bastion_sglang.step.accept import Acceptor
from bastion_sglang.step.prefill_redraw import PrefillRedraw
from bastion_sglang.step.request_outputs import attach_prefill_hidden_states
from bastion_sglang.step.spec_input import BastionDraftInput

if TYPE_CHECKING:
    from sglang.srt.managers.schedule_batch import Req, ScheduleBatch


class WalkSeeds:
    """Each request's sampling-walk key, hashed once at its prefill (`kernels.seed_keys`) from its
    sampling_seed, else from a seed drawn from the server's `random_seed`; a step hashes only positions."""

    def __init__(self, server_seed: int) -> None:
        self._source = torch.Generator().manual_seed(server_seed)

    def keys(self, reqs: list[Req], device: torch.device | str) -> torch.Tensor:
        """[B] int64 walk keys of `reqs`, on `device`."""
        seeds = torch.tensor([self.seed_for(req) for req in reqs], dtype=torch.int64, device=device)
        return kernels.seed_keys(seeds)

    def seed_for(self, req: Req) -> int:
        """Seed of the request's sampling walk: its sampling_seed, else one drawn from the server seed; as a
        two's-complement int64."""
        seed = req.sampling_params.sampling_seed
        if seed is None:
            seed = int(torch.randint(0, 2**62, (), generator=self._source))
        return (int(seed) + 2**63) % 2**64 - 2**63


class Prefill:
    """The prefill stage (module docstring) of a worker on `device` whose target runner is `runner`;
    `reserve`: the KV slots per request of a decode step's draft input (`spec_input.BastionDraftInput`)."""

    def __init__(
        self, acceptor: Acceptor, runner: Any, server_seed: int, device: torch.device | str, reserve: int
    ) -> None:
        self._acceptor = acceptor
        self._redraw = PrefillRedraw(acceptor, runner)
        self._seeds = WalkSeeds(server_seed)
        self._device = device
        self._reserve = reserve

    def run(
        self, batch: ScheduleBatch, forward: Callable[[], GenerationBatchResult]
    ) -> GenerationBatchResult:
        """Run `forward` (SGLang's prefill of `batch`) with the stage's parts around it; returns its result
        with the first draft input set."""
        keys = self._seeds.keys(batch.reqs, self._device)  # [B] int64 the requests' walk keys
        with self._redraw.around(batch, keys):
            result = forward()
        attach_prefill_hidden_states(batch, result.logits_output)
        prefill_tokens = result.next_token_ids.to(torch.int64)  # [B]
        ones = torch.ones_like(prefill_tokens)
        self._acceptor.recent_outputs.record(batch.reqs, prefill_tokens[:, None], ones)
        result.next_draft_input = BastionDraftInput(
            bonus_tokens=prefill_tokens,
            new_seq_lens=batch.seq_lens.to(torch.int64),
            seed_keys=keys,
            reserve=self._reserve,
        )
        return result
