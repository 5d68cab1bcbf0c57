"""The accept stage of a decode step: logit processing, sampling inputs and the accept walk.

Each verify row's logits get, in SGLang's order, the request's output penalties for the output so far plus the
row's own path (`kernels.apply_tree_penalties`), the grammar along the path (SGLang's `GrammarTree`), then the
request's logit_bias. The target's token after each row is then its argmax (T = 0) or its sample
(`kernels.sample_tokens`) from the target's processed distribution (temperature, top-k, top-p, min-p exactly
as SGLang's sampler filters them, `sglang_adapter.target_sampling_probs`) with uniforms hashed from the
request's seed and the sequence position (`kernels.keyed_uniforms` of the request's `kernels.seed_keys`:
seeded output is batch-invariant), and `kernels.accept_paths` takes the longest path of draft nodes matching
those tokens (the accept walk), its compaction order and the step's output rows. A step of width 1 (the roots
alone) emits the target's token after each root: the argmax, or a sample with the same uniforms.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from bastion_sglang import kernels
from bastion_sglang.integration.sglang_adapter import (
    GrammarTree,
    build_grammar_vocab_mask,
    target_sampling_probs,
)
from bastion_sglang.step.graph_buckets import real_rows
from bastion_sglang.step.request_penalties import (
    RecentOutputs,
    has_output_penalty,
    output_penalties,
    sglang_penalty_order,
)

if TYPE_CHECKING:
    from sglang.srt.managers.schedule_batch import Req, ScheduleBatch


def is_greedy(req: Req) -> bool:
    """Whether the request decodes greedily (SGLang normalises temperature 0 to top_k = 1)."""
    params = req.sampling_params
    return params.top_k == 1 or params.temperature <= 0.0


@dataclass(frozen=True)
class TreeAccept:
    """What a tree step commits."""

    order: torch.Tensor  # [B, W] int64: each row's permutation with the accepted path first
    out_tokens: torch.Tensor  # [B, W] int64: accepted draft tokens, the bonus, then zeros
    commit_lens: torch.Tensor  # [B] int32: tokens emitted (accepted + 1)
    commit_counts: torch.Tensor  # [B] int64: commit_lens as int64, for the committed lengths
    bonus_tokens: torch.Tensor  # [B] int64: the next roots
    # [B, W, V] float32 weights of the processed distribution after each row (None: every request greedy)
    target_probs: torch.Tensor | None


@dataclass(frozen=True)
class RootTargets:
    """What a width-1 step commits: the target's token after each root, one token per request."""

    tokens: torch.Tensor  # [B] int64
    # [B, 1, V] float32 weights of the processed distribution each token was drawn from (None: all greedy)
    target_probs: torch.Tensor | None
    # [B] int32 ones, the tokens emitted; a view of a buffer nothing writes (`Acceptor.one_each`)
    commit_lens: torch.Tensor


@dataclass(frozen=True)
class RowLogits:
    """A verify pass's rows, for logit processing: tokens [B, W] int64, ancestors [B, W, W] bool (None: W = 1,
    the roots alone), the rows' grammar links (None: no grammar request) and SGLang's grammar barrier."""

    tokens: torch.Tensor
    ancestors: torch.Tensor | None
    grammar_tree: GrammarTree | None
    grammar_barrier: Any


class Acceptor:
    """The accept stage (module docstring) for a target of `vocab_size` tokens sampled on SGLang's
    `sampling_backend`; it keeps the tokens the requests' output_ids lack under overlap scheduling."""

    def __init__(self, vocab_size: int, sampling_backend: str) -> None:
        kernels.filter_rule(sampling_backend, False, False)  # refuses a backend it cannot reproduce
        self.vocab_size = vocab_size
        self._sampling_backend = sampling_backend
        self._penalty_order = sglang_penalty_order()
        self.recent_outputs = RecentOutputs()
        self._ones = torch.ones((0,), dtype=torch.int32)  # grown by one_each, never written

    def one_each(self, batch_size: int, device: torch.device) -> torch.Tensor:
        """[batch_size] int32 ones on `device`: the commit lengths of a width-1 step, as a view of a buffer
        that is only ever read (no op per step; the buffer is replaced, doubled, when a batch outgrows it)."""
        if self._ones.numel() < batch_size or self._ones.device != device:
            self._ones = torch.ones(
                (max(batch_size, 2 * self._ones.numel()),), dtype=torch.int32, device=device
            )
        return self._ones[:batch_size]

    def pass_logits(self, logits_output: Any, batch_size: int, width: int) -> torch.Tensor:
        """The verify pass's logits of its W real positions per request, [B * W, V] over the target's
        vocabulary (padding rows and padded vocabulary dropped), contiguous so that the in-place adjustments
        of `process_logits` land in the tensor sampled and returned as logprobs."""
        logits = real_rows(logits_output.next_token_logits, batch_size, width)
        return logits[:, : self.vocab_size].contiguous()

    def process_logits(
        self, batch: ScheduleBatch, logits: torch.Tensor, rows: RowLogits, contexts: list[int]
    ) -> None:
        """In place, in SGLang's order: the requests' output penalties for the output so far plus each row's
        path, their grammar along the path, their logit_bias. logits: [B * W, V] of the verify rows;
        contexts: [B] committed lengths (host)."""
        bs, width = rows.tokens.shape
        if any(has_output_penalty(req) for req in batch.reqs):
            outputs = self.recent_outputs.outputs(batch.reqs, contexts)
            penalties = output_penalties(batch.reqs, outputs, self.vocab_size, logits.device)
            ancestors = rows.ancestors
            if ancestors is None:
                ancestors = torch.ones((bs, 1, 1), dtype=torch.bool, device=logits.device)
            kernels.apply_tree_penalties(
                logits.view(bs, width, -1), rows.tokens, ancestors, penalties, self._penalty_order
            )
        sampling_info = batch.sampling_info
        if rows.grammar_tree is not None:
            grammar_mask = build_grammar_vocab_mask(
                reqs=batch.reqs,
                tree=rows.grammar_tree,
                sampling_info=sampling_info,
                device=logits.device,
                barrier=rows.grammar_barrier,
            )
            if grammar_mask is not None:
                grammar_mask.apply(logits)
        if sampling_info.logit_bias is not None:
            logits.view(bs, width, -1).add_(sampling_info.logit_bias[:, None, :])

    def sampling_inputs(
        self,
        batch: ScheduleBatch,
        logits: torch.Tensor,
        width: int,
        keys: torch.Tensor,
        positions: torch.Tensor,
    ) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        """The target's distributions [B, W, V] after each row (`target_sampling_probs`) and the walk's
        uniforms [B, W] at `positions` [B, W] (the position of each row's next token); (None, None) when every
        request is greedy. logits: [B * W, V] processed; keys: [B] int64 walk keys (`kernels.seed_keys`)."""
        sampling_info = batch.sampling_info
        if sampling_info.is_all_greedy:
            return None, None
        probs = target_sampling_probs(logits, sampling_info, width, self._sampling_backend)
        return probs, kernels.keyed_uniforms(keys, positions)

    def root_targets(
        self,
        batch: ScheduleBatch,
        logits: torch.Tensor,
        rows: RowLogits,
        contexts: list[int],
        keys: torch.Tensor,
        seq_lens: torch.Tensor,
    ) -> RootTargets:
        """The target's token after each root of a width-1 step, recorded as the step's output. logits:
        [B, V] the roots' logits (processed here, in place); keys: [B] walk keys; seq_lens: [B] L_b + 1, the
        position of each target token. A greedy batch with no logit processing issues one op (the argmax)."""
        self.process_logits(batch, logits, rows, contexts)
        targets = self.draw(batch, logits, keys, seq_lens)
        self.recent_outputs.record(batch.reqs, targets.tokens[:, None], targets.commit_lens)
        return targets

    def draw(
        self, batch: ScheduleBatch, logits: torch.Tensor, keys: torch.Tensor, seq_lens: torch.Tensor
    ) -> RootTargets:
        """The target's token of each request from its processed logits [B, V] (read only): the argmax, or
        the sample at its position's uniform. keys: [B] int64 walk keys; seq_lens: [B] the position of each
        token."""
        ones = self.one_each(logits.shape[0], logits.device)
        probs, uniforms = self.sampling_inputs(batch, logits, 1, keys, seq_lens[:, None])
        if probs is None:
            return RootTargets(torch.argmax(logits, dim=-1), None, ones)
        return RootTargets(kernels.sample_tokens(probs[:, 0], uniforms[:, 0]), probs, ones)

    def target_tokens(
        self,
        batch: ScheduleBatch,
        logits: torch.Tensor,
        rows: kernels.TreeBatch,
        keys: torch.Tensor,
        prefix: torch.Tensor,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The target's token after each verify row [B, W] int64 (the argmax, or the sample at the row's
        position) and the distributions they were drawn from [B, W, V] (None: every request greedy).
        logits: [B * W, V] processed; keys: [B] walk keys; prefix: [B] committed lengths."""
        bs, width = rows.tokens.shape
        if batch.sampling_info.is_all_greedy:
            return torch.argmax(logits.view(bs, width, -1), dim=-1), None
        positions = prefix[:, None] + 1 + rows.depths  # [B, W] the position of each row's next token
        probs, uniforms = self.sampling_inputs(batch, logits, width, keys, positions)
        samples = kernels.sample_tokens(probs.reshape(bs * width, -1), uniforms.reshape(-1))
        return samples.view(bs, width), probs

    def walk(
        self,
        batch: ScheduleBatch,
        logits: torch.Tensor,
        rows: kernels.TreeBatch,
        row_logits: RowLogits,
        contexts: list[int],
        keys: torch.Tensor,
        prefix: torch.Tensor,
    ) -> TreeAccept:
        """The accept walk over verify rows [B, W] (W > 1): the accepted path and bonus of each request,
        recorded as the step's output. logits: [B * W, V] of the rows (processed here, in place); keys: [B]
        walk keys; prefix: [B] committed lengths. After the logit processing its ops are fixed by (B, W) and
        whether any request samples (`kernels.accept_paths` on the argmax or on `kernels.sample_tokens`); no
        host sync."""
        width = rows.tokens.shape[1]
        ancestors = row_logits.ancestors
        if ancestors is None:
            raise ValueError(f"the accept walk over rows of width {width} needs their ancestor mask")
        self.process_logits(batch, logits, row_logits, contexts)
        target_tokens, probs = self.target_tokens(batch, logits, rows, keys, prefix)
        paths = kernels.accept_paths(rows, ancestors, target_tokens)
        self.recent_outputs.record(batch.reqs, paths.out_tokens, paths.commit_lens)
        return TreeAccept(
            paths.order, paths.out_tokens, paths.commit_lens, paths.commit_counts, paths.bonus_tokens, probs
        )
