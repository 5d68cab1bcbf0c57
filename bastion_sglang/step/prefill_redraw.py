"""The token after a re-prefill, drawn as a decode step draws it.

When the KV pool runs short SGLang retracts requests and later runs each again from a prefill of its prompt
and output so far; that prefill samples the next token with SGLang's own sampler. Every token after a
request's first one is BASTION's (`accept`): the target's argmax, or the sample at the uniform hashed from the
request's seed and the token's position, on the distribution after the request's output penalties for its
whole output. SGLang's sampler differs on both counts at a re-prefill (its uniforms are unseeded outside
deterministic mode, and its penalizers restart from an empty output), so a retracted request would leave the
output it has alone. `PrefillRedraw` wraps the target runner's `sample` for a prefill batch that re-runs a
retracted request: SGLang samples every row as usual, then each re-prefilled row's token is replaced by the
one a width-1 decode step with that request's last output token as root draws
(`docs/architecture.md`, "One decode step", stage 4), and its logprob follows the new token.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import TYPE_CHECKING, Any

import torch

from bastion_sglang.step.accept import Acceptor, RowLogits

if TYPE_CHECKING:
    from sglang.srt.managers.schedule_batch import Req, ScheduleBatch


def redrawn_rows(batch: ScheduleBatch) -> list[int]:
    """The rows of a prefill batch that re-run a retracted request to its end: the request has output and the
    batch's length for it covers its prompt and whole output (a chunk that stops short keeps SGLang's token,
    which the scheduler drops)."""
    lengths = batch.seq_lens_cpu.tolist()
    return [
        row
        for row, (req, length) in enumerate(zip(batch.reqs, lengths, strict=True))
        if req.output_ids and int(length) == len(req.origin_input_ids) + len(req.output_ids)
    ]


class PrefillRedraw:
    """Wraps `runner.sample` (SGLang's `ModelRunner`) around a prefill batch that re-runs retracted requests.

    The wrapper keeps the pass's raw logits [B, V], lets SGLang sample, then redraws the retracted rows with
    `acceptor`: the output penalties of each request's whole output with its last token as the root
    (`Acceptor.process_logits`), SGLang's grammar mask for the grammars' current states, the request's
    logit_bias, and `Acceptor.draw` at the position of the new token.
    """

    def __init__(self, acceptor: Acceptor, runner: Any) -> None:
        self._acceptor = acceptor
        self._runner = runner

    @contextmanager
    def around(self, batch: ScheduleBatch, keys: torch.Tensor) -> Iterator[None]:
        """Within this block a prefill of `batch` (keys: [B] int64, the walk keys of its requests) emits
        BASTION's token for every row `redrawn_rows` names; a batch with none runs untouched."""
        rows = redrawn_rows(batch)
        if not rows:
            yield
            return
        runner = self._runner
        sample: Callable[[Any, Any], torch.Tensor] = runner.sample

        def redrawing_sample(logits_output: Any, forward_batch: Any) -> torch.Tensor:
            raw = logits_output.next_token_logits[:, : self._acceptor.vocab_size].clone()
            token_ids = sample(logits_output, forward_batch)
            return self._redraw(batch, rows, keys, raw, token_ids, logits_output)

        own = vars(runner).get("sample")  # an instance attribute to restore, if the runner had one
        runner.sample = redrawing_sample
        try:
            yield
        finally:
            if own is None:
                del runner.sample  # the class's method again
            else:
                runner.sample = own

    def _redraw(
        self,
        batch: ScheduleBatch,
        rows: list[int],
        keys: torch.Tensor,
        logits: torch.Tensor,
        token_ids: torch.Tensor,
        logits_output: Any,
    ) -> torch.Tensor:
        """token_ids [B] (SGLang's) with `rows` redrawn; keys: [B] int64 walk keys; logits: [B, V] raw,
        processed here in place."""
        acceptor = self._acceptor
        reqs: list[Req] = batch.reqs
        last_tokens = [(req.output_ids or req.origin_input_ids)[-1] for req in reqs]
        roots = torch.tensor(last_tokens, dtype=torch.int64).to(logits.device)
        # committed lengths of a decode step whose root is the last token: prompt and output, less the root
        contexts = [len(req.origin_input_ids) + len(req.output_ids) - 1 for req in reqs]
        acceptor.process_logits(batch, logits, RowLogits(roots[:, None], None, None, None), contexts)
        sampling_info = batch.sampling_info
        if sampling_info.grammars and any(grammar is not None for grammar in sampling_info.grammars):
            sampling_info.update_regex_vocab_mask()  # the grammars' states SGLang's sampler just read
            sampling_info.grammar_mask.apply(logits)
            sampling_info.grammar_mask = None
        positions = torch.tensor(contexts, dtype=torch.int64).to(logits.device) + 1
        drawn = acceptor.draw(batch, logits, keys, positions).tokens
        index = torch.tensor(rows, dtype=torch.int64).to(logits.device)
        token_ids = token_ids.clone()
        token_ids[index] = drawn[index].to(token_ids.dtype)
        if batch.return_logprob and logits_output.next_token_logprobs is not None:
            logprobs = _token_logprobs(logits[index], drawn[index], sampling_info.temperatures[index])
            logits_output.next_token_logprobs[index] = logprobs.to(logits_output.next_token_logprobs.dtype)
        return token_ids


def _token_logprobs(logits: torch.Tensor, tokens: torch.Tensor, temperatures: torch.Tensor) -> torch.Tensor:
    """SGLang's logprob of each sampled token: log-softmax of the processed logits [R, V] over the rows'
    temperatures [R, 1] (greedy rows are normalised to temperature 1 by SGLang), at tokens [R]."""
    logprobs = torch.log_softmax(logits / temperatures.view(-1, 1), dim=-1)
    logprobs.clamp_(min=torch.finfo(logprobs.dtype).min)
    return logprobs.gather(1, tokens.view(-1, 1)).view(-1)
