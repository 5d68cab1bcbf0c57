"""The `sglang` measurement engine on a target ModelRunner of a BASTION deployment, verified as BASTION's
worker does: the runner `sglang_runner.open_sglang_measurement` builds for `bastion calibrate`, or a starting
server's own (`startup`).

- context: a prefill of B requests of the same c random tokens through SGLang's benchmark `extend`
  (sglang.benchmark.one_batch), each with its own KV slots;
- verify: `spec_input.prepare_verify_forward` with `kernels.flat_custom_mask` (forward batch and attention
  metadata, the worker's own preparation) over the B requests' rows, then `ModelRunner.forward`, timed from
  the preparation on;
- decode (L_AR): a DECODE forward of one token per request at position c, greedy pick;
- T_draft: the reference engine's DFlash drafter (`bastion_sglang.reference.drafter`) on the same device,
  reading the SGLang target's embedding and LM head weights; its context K/V come from random features
  (values do not change the cost). The worker drafts through SGLang's DFlash draft runner instead, which has
  no single-pass entry point; the FLOPs and bytes are the same, the kernels are not. A DFlash2 drafter is
  timed with its candidate selector (`reference.lattice_proposer.DFlash2Proposer`), and the sweep's trees
  are built over its lattice's unary top-K;
- acceptance records (`greedy_records`): the target's greedy continuations in SGLang's own forwards and the
  same drafter on the target's real features: its top-K at every root (`AcceptanceRecord`), or a DFlash2
  drafter's lattice there (`LatticeRecord`, as `acceptance_run` records the reference engine's), whose map
  `lattice_plan` applies to the lattice's transitions.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Collection, Sequence
from contextlib import AbstractContextManager, nullcontext
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np
import torch
from torch import nn

from bastion_sglang.calibration.random_inputs import CONTEXT_SEED
from bastion_sglang.controller.acceptance import AcceptanceRecord, DrafterPass
from bastion_sglang.controller.lattice_acceptance import LatticeRecord
from bastion_sglang.integration.draft_vocab import DraftVocabChoice, resolve_draft_vocabulary
from bastion_sglang.kernels.types import DraftTopK, TreeBatch, VerifyLayout

if TYPE_CHECKING:
    from sglang.srt.managers.schedule_batch import ScheduleBatch
    from sglang.srt.model_executor.model_runner import ModelRunner

    from bastion_sglang.reference.lattice_proposer import DFlash2Proposer
    from bastion_sglang.reference.proposer import DFlashProposer

logger = logging.getLogger(__name__)


class SglangMeasurement:
    """The `sglang` engine (module docstring) on a given target ModelRunner."""

    needs_flat_mask = True

    def __init__(
        self,
        runner: ModelRunner,
        draft_path: str | Path,
        *,
        device: torch.device,
        dtype: torch.dtype,
        max_width: int,
        owns_runtime: bool,
        verify_context: Callable[[int, int], AbstractContextManager[None]] | None = None,
        draft_vocab: DraftVocabChoice = "auto",
    ) -> None:
        """Measure on `runner`, a target ModelRunner of a BASTION deployment whose KV pools hold nothing else
        while the measurement runs (`open` builds one; a starting server passes its own). owns_runtime:
        whether `close` tears SGLang's process groups down (True) or only empties the KV pools (False).
        verify_context: given a verify width and batch size, the context its pass runs in (a serving worker's
        captured graph of that width, `TargetForward.verify_graph`); None: every pass eagerly. draft_vocab:
        the tokens the drafter's head scores, as the server's `--bastion-draft-vocab`
        (`integration.draft_vocab`; auto: the drafter folder's file), so T_draft and the acceptance records
        are the served draft's."""
        self._runner = runner
        self._device = torch.device(device)
        self._max_width = max_width
        self._owns_runtime = owns_runtime
        self._verify_context = verify_context or (lambda width, batch: nullcontext())
        self._vocab = int(runner.model_config.vocab_size)
        self._batch: ScheduleBatch | None = None
        self._context = 0
        self._slots = torch.empty((1, 0), dtype=torch.int64, device=self._device)  # [B, max_width] KV slots
        self._prefix = torch.zeros(1, dtype=torch.int64, device=self._device)  # [B] committed tokens
        self._prefix_cpu = torch.zeros(1, dtype=torch.int64)  # [B] host copy
        self._committed = torch.zeros(1, dtype=torch.int64, device=self._device)  # [context + 1] tokens
        self._no_features = torch.empty(0)  # [0, F·h] drafter features: nothing new to ingest
        self._proposer = _drafter_on_target(draft_path, runner, self._vocab, self._device, dtype, draft_vocab)

    @property
    def device(self) -> torch.device:
        return self._device

    @property
    def draft_vocab_size(self) -> int | None:
        """The tokens the timed draft scores: its draft vocabulary's size, None for the whole vocabulary."""
        from bastion_sglang.step.rank_sync import DraftHead

        head = self._proposer.lm_head
        if not isinstance(head, DraftHead) or head.token_ids is None:
            return None
        return int(head.token_ids.shape[0])

    @property
    def max_batch(self) -> int:
        """Requests the runner's request pool holds."""
        return int(self._runner.req_to_token_pool.size)

    def vocab_size(self) -> int:
        return self._vocab

    @property
    def depth(self) -> int:
        """D, the drafter's positions per pass: `greedy_records` decodes new_tokens + D - 1 steps."""
        return self._proposer.depth

    @torch.no_grad()
    def set_context(self, context: int, batch: int = 1, width: int | None = None) -> None:
        from sglang.benchmark.one_batch import extend, prepare_synthetic_inputs_for_latency_test

        from bastion_sglang.step.draft_protocols import DraftInput

        runner = self._runner
        runner.req_to_token_pool.clear()
        runner.token_to_kv_pool_allocator.clear()
        generator = np.random.default_rng(CONTEXT_SEED)
        tokens = generator.integers(0, self._vocab, context + 1).tolist()
        reqs = prepare_synthetic_inputs_for_latency_test(
            batch, context, custom_inputs=[tokens[:context]] * batch
        )
        _, _, prefilled = extend(reqs, runner)
        width = self._max_width if width is None else width
        slots = extend_slots(runner, prefilled.req_pool_indices.tolist(), [context] * batch, width)
        if slots is None:
            raise ValueError(f"SGLang's KV pool cannot hold {batch} requests of {context} + {width} tokens")
        self._batch, self._context, self._slots = prefilled, context, slots
        self._prefix = prefilled.seq_lens.clone()
        self._prefix_cpu = prefilled.seq_lens_cpu.clone()
        self._committed = torch.tensor(tokens, dtype=torch.int64, device=self._device)
        self._proposer.start(context + 1)
        features_generator = torch.Generator(device=self._device).manual_seed(CONTEXT_SEED)
        fc = self._proposer.drafter.fc
        features = torch.randn(
            (context, fc.in_features),
            device=self._device,
            dtype=fc.weight.dtype,
            generator=features_generator,
        )
        self._proposer.propose(DraftInput(self._committed, features), 1)  # ingests the context
        self._no_features = features[:0]

    @torch.no_grad()
    def draft(self, k: int) -> DraftTopK:
        """One drafter pass after the context: DraftTopK [1, D, k]; for a DFlash2 drafter its lattice's unary
        [1, D, K] (K: the selector's top_k), the selector timed with the pass."""
        from bastion_sglang.step.draft_protocols import DraftInput

        proposal = self._proposer.propose(DraftInput(self._committed, self._no_features), k)
        return proposal if isinstance(proposal, DraftTopK) else proposal.unary

    def _require_batch(self) -> ScheduleBatch:
        if self._batch is None:
            raise ValueError("set_context must run before a forward")
        return self._batch

    @torch.no_grad()
    def verify(self, rows: TreeBatch, layout: VerifyLayout) -> None:
        from bastion_sglang import kernels
        from bastion_sglang.step.spec_input import prepare_verify_forward

        batch = self._require_batch()
        mask = kernels.flat_custom_mask(layout.ancestor_mask, self._prefix, seq_lens_sum=self._lens_sum())
        slots = self._slots[:, : rows.width]  # [B, W]
        with self._verify_context(rows.width, rows.batch_size):
            forward_batch, _ = prepare_verify_forward(
                batch,
                self._runner,
                rows.tokens,
                layout.positions,
                mask,
                slots,
                self._prefix_cpu,
                self._lens_sum(),
            )
            self._runner.forward(forward_batch)

    def _lens_sum(self) -> int:
        """Σ committed tokens over the requests, a host int."""
        return self._context * int(self._slots.shape[0])

    @torch.no_grad()
    def decode(self) -> None:
        from bastion_sglang.integration.sglang_adapter import ForwardBatch, ForwardMode

        batch = self._require_batch()
        batch.forward_mode = ForwardMode.DECODE
        batch.spec_info = None
        batch.input_ids = self._committed[self._context :].repeat(int(self._slots.shape[0]))
        batch.out_cache_loc = self._slots[:, 0]
        batch.seq_lens = self._prefix + 1
        batch.seq_lens_cpu = self._prefix_cpu + 1
        batch.orig_seq_lens = batch.seq_lens.to(batch.orig_seq_lens.dtype)
        batch.seq_lens_sum = None
        forward_batch = ForwardBatch.init_new(batch, self._runner, return_hidden_states_before_norm=False)
        out = self._runner.forward(forward_batch)
        torch.argmax(out.logits_output.next_token_logits, dim=-1)

    @torch.no_grad()
    def greedy_records(
        self, prompts: Sequence[Sequence[int]], new_tokens: int, topk: int, eos_ids: Collection[int]
    ) -> list[list[DrafterPass]]:
        """The target's greedy continuation of every prompt in SGLang's own forwards, and at each of its
        first `new_tokens` roots the drafter's top-K (a DFlash2 drafter's lattice) on the target's real
        features of the tokens before it.

        One prefill of all prompts (every hidden state captured: the drafter's features), then
        new_tokens + D - 1 DECODE forwards of the whole batch (D: the drafter's depth); then, prompt by
        prompt, one drafter pass per root. Returns, per prompt, one record per root r: the drafter pass whose
        root is generated token r (an AcceptanceRecord of [D, topk] log-probs and ids; for a DFlash2 drafter
        a LatticeRecord of its [D, K, K] transitions and [D, K] candidates, all of the selector's K; host
        float32) and the target's next D tokens (fewer where the output ends at one of `eos_ids`, as a
        server's request would; no root after it). The KV pools are emptied first and hold these prompts
        afterwards.
        """
        from bastion_sglang.integration.sglang_adapter import CaptureHiddenMode, ForwardBatch
        from bastion_sglang.step.spec_input import plain_decode_forward

        runner, device = self._runner, self._device
        steps = new_tokens + self._proposer.depth - 1
        runner.req_to_token_pool.clear()
        runner.token_to_kv_pool_allocator.clear()
        batch = _prompt_batch(runner, prompts)
        forward_batch = ForwardBatch.init_new(
            batch, runner, capture_hidden_mode=CaptureHiddenMode.FULL, return_hidden_states_before_norm=False
        )
        out = runner.forward(forward_batch).logits_output
        lengths = [len(prompt) for prompt in prompts]
        features = list(out.hidden_states.split(lengths))  # per prompt [P, F·h], grown by one per step
        firsts = out.next_token_logits[:, : self._vocab].argmax(dim=-1).tolist()
        tokens = [[*prompt, first] for prompt, first in zip(prompts, firsts, strict=True)]
        slots = extend_slots(runner, batch.req_pool_indices.tolist(), lengths, steps)
        if slots is None:
            raise ValueError(
                f"SGLang's KV pool cannot hold {sum(lengths)} prompt tokens and {steps} more each"
            )
        prefix = torch.tensor(lengths, dtype=torch.int64, device=device)
        for step in range(steps):
            roots = torch.tensor([row[-1] for row in tokens], dtype=torch.int64, device=device)
            lens_sum = sum(lengths) + len(prompts) * (step + 1)
            with plain_decode_forward(
                batch, runner, roots, slots[:, step], prefix + 1, prefix.cpu(), lens_sum
            ) as decode:
                out = runner.forward(decode).logits_output
            for b, chosen in enumerate(out.next_token_logits[:, : self._vocab].argmax(dim=-1).tolist()):
                features[b] = torch.cat([features[b], out.hidden_states[b : b + 1]])
                tokens[b].append(chosen)
            prefix += 1
        return [
            self._records_along(row, length, row_features, new_tokens, topk, eos_ids)
            for row, length, row_features in zip(tokens, lengths, features, strict=True)
        ]

    def _records_along(
        self,
        tokens: list[int],
        prompt_length: int,
        features: torch.Tensor,
        new_tokens: int,
        topk: int,
        eos_ids: Collection[int],
    ) -> list[DrafterPass]:
        """`greedy_records` of one prompt: tokens, the prompt and its continuation; features [len, F·h], the
        target's features of every position but the last."""
        from bastion_sglang.step.draft_protocols import DraftInput

        depth = self._proposer.depth
        self._proposer.start(len(tokens) + 1)
        ingested = 0
        records: list[DrafterPass] = []
        for root in range(prompt_length, prompt_length + new_tokens):
            if tokens[root] in eos_ids:
                break  # the output ended: no step after it
            committed = torch.tensor(tokens[: root + 1], dtype=torch.int64, device=self._device)
            proposal = self._proposer.propose(DraftInput(committed, features[ingested:root]), topk)
            ingested = root
            continuation = tuple(tokens[root + 1 : root + 1 + depth])
            ends = next((i for i, token in enumerate(continuation) if token in eos_ids), None)
            if ends is not None:
                continuation = continuation[: ends + 1]
            if isinstance(proposal, DraftTopK):
                logprobs = proposal.logprobs[0, :, :topk].to("cpu", torch.float32)
                ids = proposal.token_ids[0, :, :topk].cpu()
                records.append(AcceptanceRecord(logprobs, ids, continuation))
            else:  # a DFlash2 lattice: all K candidates, each row a distribution over them
                transitions = proposal.transitions[0].to("cpu", torch.float32)
                records.append(LatticeRecord(transitions, proposal.unary.token_ids[0].cpu(), continuation))
        return records

    def discard(self) -> None:
        """Back to the committed prefix (verify and decode only wrote the reserved slots)."""
        batch = self._require_batch()
        batch.seq_lens = self._prefix.clone()
        batch.seq_lens_cpu = self._prefix_cpu.clone()
        batch.orig_seq_lens = batch.seq_lens.to(batch.orig_seq_lens.dtype)
        batch.seq_lens_sum = self._lens_sum()

    def close(self) -> None:
        """Tear down SGLang's process groups (a runtime `open` built), or empty the KV pools of a runner that
        goes on serving."""
        self._batch = None
        if not self._owns_runtime:
            self._runner.req_to_token_pool.clear()
            self._runner.token_to_kv_pool_allocator.clear()
            return
        from sglang.srt.distributed.parallel_state import (
            destroy_distributed_environment,
            destroy_model_parallel,
        )

        destroy_model_parallel()
        destroy_distributed_environment()


def extend_slots(
    runner: ModelRunner, rows: Sequence[int], lengths: Sequence[int], extra: int
) -> torch.Tensor | None:
    """KV slots for `extra` more positions of each request, written into its req_to_token row after its
    `lengths[i]` cached tokens: [len(rows), extra] int64, or None when the pool cannot hold them.

    With pages of one token any free slots do. With larger pages the new positions continue the request's
    last page and then take whole pages (SGLang's `alloc_extend`), as a paged attention kernel reads a row
    (page p of a request at slots row[p * page_size] onwards): a plain `alloc` would hand out whole pages
    only (none for fewer than a page) and break that layout.
    """
    allocator = runner.token_to_kv_pool_allocator
    pool = runner.req_to_token_pool.req_to_token
    count = len(rows) * extra
    if int(allocator.page_size) == 1:
        flat = allocator.alloc(count)
    else:
        prefix_cpu = torch.tensor(list(lengths), dtype=torch.int64)
        last = torch.tensor([int(pool[row, length - 1]) for row, length in zip(rows, lengths, strict=True)])
        prefix = prefix_cpu.to(pool.device)
        flat = allocator.alloc_extend(
            prefix, prefix_cpu, prefix + extra, prefix_cpu + extra, last.to(pool.device), count
        )
    if flat is None:
        return None
    slots = flat.to(torch.int64).view(len(rows), extra)
    for row, length, row_slots in zip(rows, lengths, slots, strict=True):
        pool[row, length : length + extra] = row_slots.to(pool.dtype)
    return slots


def _prompt_batch(runner: ModelRunner, prompts: Sequence[Sequence[int]]) -> ScheduleBatch:
    """An EXTEND batch of one request per prompt on `runner`'s pools, as SGLang's one-batch benchmark builds
    it (no prefix cache), ready for its forward."""
    from sglang.benchmark.one_batch import TreeCacheNamespace, prepare_synthetic_inputs_for_latency_test
    from sglang.srt.managers.schedule_batch import ScheduleBatch
    from sglang.srt.speculative.spec_info import SpeculativeAlgorithm

    from bastion_sglang.integration.sglang_adapter import get_schedule

    inputs = [list(prompt) for prompt in prompts]
    reqs = prepare_synthetic_inputs_for_latency_test(len(inputs), 0, custom_inputs=inputs)
    tree_cache = TreeCacheNamespace(
        page_size=get_schedule().page_size,
        device=runner.device,
        token_to_kv_pool_allocator=runner.token_to_kv_pool_allocator,
    )
    batch = ScheduleBatch.init_new(
        reqs=reqs,
        req_to_token_pool=runner.req_to_token_pool,
        token_to_kv_pool_allocator=runner.token_to_kv_pool_allocator,
        tree_cache=tree_cache,
        model_config=runner.model_config,
        enable_overlap=False,
        spec_algorithm=SpeculativeAlgorithm.NONE,
    )
    batch.prepare_for_extend()
    if batch.input_ids is None and getattr(batch, "prefill_input_ids_cpu", None) is not None:
        batch.input_ids = batch.prefill_input_ids_cpu.to(batch.device, non_blocking=True)
        batch.prefill_input_ids_cpu = None
    return batch


def _drafter_on_target(
    draft_path: str | Path,
    runner: ModelRunner,
    vocab: int,
    device: torch.device,
    dtype: torch.dtype,
    draft_vocab: DraftVocabChoice,
) -> DFlashProposer | DFlash2Proposer:
    """The reference DFlash drafter for T_draft (module docstring) on the SGLang target's embedding and
    LM head weights (no copy): a DFlash2Proposer for a DFlash2 drafter, else a DFlashProposer. draft_vocab:
    the server's `--bastion-draft-vocab`; a draft vocabulary is scored by the draft step's head
    (`rank_sync.DraftHead`, its rows copied).

    Under --tp-size N the target's embedding and LM head are vocabulary shards: the embedding all-reduces
    (a collective, which every rank runs with the same drafter passes) and the head is the draft step's own
    (`rank_sync.DraftHead`: this rank's logits all-gathered). A DFlash2 drafter reads the head's weight
    whole, so it is refused there (as the worker refuses it)."""
    from bastion_sglang.reference.drafter import DFlashDrafter
    from bastion_sglang.reference.lattice_proposer import DFlash2Proposer
    from bastion_sglang.reference.proposer import DFlashProposer
    from bastion_sglang.step.rank_sync import DraftHead, scheduler_group

    model = runner.model
    layers = int(runner.model_config.hf_config.num_hidden_layers)
    drafter = DFlashDrafter.from_pretrained(draft_path, device=device, dtype=dtype, target_num_layers=layers)
    group = scheduler_group()
    lattice = drafter.candidate_selector is not None
    vocabulary, _ = resolve_draft_vocabulary(draft_vocab, draft_path, vocab, topk=1, lattice_drafter=lattice)
    token_ids = None if vocabulary is None else vocabulary.token_ids
    if group is not None and lattice:
        raise ValueError(f"{draft_path}: a DFlash2 drafter is served and calibrated at --tp-size 1 only")
    if group is not None or token_ids is not None:
        return DFlashProposer(
            drafter, model.get_input_embeddings(), DraftHead.of(model.lm_head, vocab, group, token_ids)
        )
    head_weight = model.lm_head.weight[:vocab]
    head = nn.Linear(head_weight.shape[1], vocab, bias=False, device="meta")
    head.weight = nn.Parameter(head_weight, requires_grad=False)
    source = DFlashProposer if drafter.candidate_selector is None else DFlash2Proposer
    return source(drafter, model.get_input_embeddings(), head)
