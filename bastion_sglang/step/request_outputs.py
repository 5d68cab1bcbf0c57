"""What a request may ask for besides its tokens, for the tokens each step commits: the target's hidden states
(`return_hidden_states`) and its sampler's support (`return_sampling_mask`), in SGLang's shapes and order.

Hidden states. Without speculation SGLang returns, per request, the target's final hidden state (after the
final norm) at every position whose forward sampled an output token: the prompt's positions from the
prefill (all of them, or the last one where the server returns only the last), then the one position of
each decode step. The state that goes with a committed token is that of the position before it: in a tree
step the root and the accepted nodes, in path order (the bonus token is sampled after the deepest of them);
nodes off the accepted path never appear. BASTION's passes capture the drafter's aux layers in
`LogitsProcessorOutput.hidden_states`; the target's logits processor is made to keep its final-norm states
of every position as well (`capture_final_hidden_states`, `last_hidden_states`), and the rows of the
committed tokens are gathered from those.

Sampling masks. Per committed token, the support of the processed distribution it was drawn from (after
penalties, grammar, logit_bias, temperature and top-k / top-p, as `accept.Acceptor` built it) and its
log-probabilities, packed by SGLang's `SpeculativeSamplingMaskCapture` as DFlash packs its own: position j
of a request's row is its committed token j, whose distribution is that of the j-th node of its accepted
path. A greedy batch gets each token itself with log-probability 0, as SGLang's greedy sampler returns it.
The prefill's token keeps the mask of SGLang's own sampler.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch

from bastion_sglang.integration import sglang_adapter as sgl
from bastion_sglang.integration.sglang_adapter import (
    DFlashWorkerV2,
    SpeculativeSamplingMaskCapture,
    get_server_return_hidden_states_mode,
)
from bastion_sglang.step.commit import attach_logprobs
from bastion_sglang.step.graph_buckets import real_rows

if TYPE_CHECKING:
    from sglang.srt.managers.schedule_batch import ScheduleBatch


def capture_final_hidden_states(worker: DFlashWorkerV2) -> None:
    """Where the server may return hidden states (`--enable-return-hidden-states`,
    `--return-hidden-states-mode`), make the target's passes keep their final-norm hidden states beside the
    drafter's aux states. Call before the target's graphs are captured."""
    if get_server_return_hidden_states_mode().need_capture():
        sgl.keep_final_hidden_states(worker)


def attach_prefill_hidden_states(batch: ScheduleBatch, logits_output: Any) -> None:
    """The prefill's hidden states where SGLang's scheduler reads them, for a batch that asks for them: every
    prompt position [Σ extend_lens, H] where the server returns full hidden states, else each request's last
    position [B, H]. Drops the pass's final-norm states otherwise."""
    final = logits_output.last_hidden_states
    logits_output.last_hidden_states = None
    if not batch.return_hidden_states:
        return
    if max(batch.return_hidden_states_mode, get_server_return_hidden_states_mode()).is_last():
        ends = torch.tensor(batch.extend_lens, dtype=torch.int64, device=final.device).cumsum(0)
        final = final[ends - 1]
    logits_output.hidden_states = final


def attach_step_hidden_states(
    batch: ScheduleBatch, logits_output: Any, bs: int, width: int, order: torch.Tensor | None
) -> None:
    """A decode step's hidden states where SGLang's scheduler reads them, for a batch that asks for them:
    [B * W, H], row b * W + j the final-norm state after which request b's committed token j was sampled
    (the scheduler reads the first commit_len rows of each request).

    bs: B; width: W, the real positions of the pass (its padding rows are dropped); order: [B, W] int64 the
    accept walk's compaction order (None: W = 1, the roots). The drafter's aux states are dropped either way
    (the commit has written them).
    """
    final = logits_output.last_hidden_states
    logits_output.last_hidden_states = None
    logits_output.hidden_states = None
    if not batch.return_hidden_states:
        return
    rows = real_rows(final, bs, width)
    if order is not None:
        hidden = rows.view(bs, width, -1)
        rows = hidden.gather(1, order[:, :, None].expand(-1, -1, hidden.shape[-1])).reshape(bs * width, -1)
    logits_output.hidden_states = rows


def attach_sampling_masks(
    batch: ScheduleBatch,
    logits_output: Any,
    target_probs: torch.Tensor | None,
    out_tokens: torch.Tensor,
    order: torch.Tensor | None,
    commit_lens: torch.Tensor,
) -> None:
    """A decode step's sampling masks where SGLang's scheduler reads them (`sampling_mask_output`), for the
    requests of `batch` that ask for them (none: nothing is built).

    target_probs: [B, W, V] float32 the rows' processed distributions as non-negative weights
    (`Acceptor`; None: every request greedy); out_tokens: [B, W] int64 the step's output rows (committed
    tokens first); order: [B, W] int64 the compaction order (None: W = 1); commit_lens: [B] int32.
    """
    sampling_info = batch.sampling_info
    rows = sampling_info.sampling_mask_batch_indices  # [R] int64 the requests that ask, in batch order
    if rows is None:
        return
    probs = None
    if target_probs is not None:
        probs = target_probs.index_select(0, rows)
        if order is not None:
            path = order.index_select(0, rows)
            probs = probs.gather(1, path[:, :, None].expand(-1, -1, probs.shape[-1]))
        probs = probs / probs.sum(dim=-1, keepdim=True)
    capture = SpeculativeSamplingMaskCapture(
        target_probs=probs,
        batch_indices=torch.arange(rows.numel(), device=rows.device),  # the rows are selected above
        max_top_k=max(sampling_info.sampling_mask_top_ks),
        support_capture_indices=sampling_info.sampling_support_logprobs_capture_indices,
    )
    logits_output.sampling_mask_output = capture.build_output(
        out_tokens=out_tokens.index_select(0, rows), commit_lens=commit_lens.index_select(0, rows)
    )


def attach_step_outputs(
    batch: ScheduleBatch,
    logits_output: Any,
    logits: torch.Tensor,
    target_probs: torch.Tensor | None,
    out_tokens: torch.Tensor,
    order: torch.Tensor | None,
    commit_lens: torch.Tensor,
) -> None:
    """Everything a decode step returns besides its tokens, for the requests that ask: hidden states
    (`attach_step_hidden_states`), sampling masks (`attach_sampling_masks`) and logprobs
    (`commit.attach_logprobs`).

    logits: [B * W, V] the rows' processed logits; target_probs: [B, W, V] (None: every request greedy);
    out_tokens: [B, W] int64 the step's output rows; order: [B, W] int64 the compaction order (None: W = 1,
    the roots); commit_lens: [B] int32.
    """
    bs, width = out_tokens.shape
    attach_step_hidden_states(batch, logits_output, bs, width, order)
    attach_sampling_masks(batch, logits_output, target_probs, out_tokens, order, commit_lens)
    if batch.return_logprob:
        attach_logprobs(batch, logits_output, logits, out_tokens, order)
