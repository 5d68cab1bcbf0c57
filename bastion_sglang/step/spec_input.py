"""BASTION's SpecInput records: the per-request state SGLang carries between steps, and one verify pass.

Terms. A request's *prefix* is the number of its tokens whose KV is in the cache (`seq_lens`). The
*bonus* token is the last committed token; its KV is not written yet, so it is the root of the next draft
tree and sits at position `prefix`. A verify pass holds W tokens per request (the root plus W - 1 draft
nodes, `kernels.TreeBatch` order) at slots `req_to_token[r, prefix : prefix + W]`.

SGLang drives these through its spec-v2 scheduler: `BastionDraftInput.prepare_for_decode` reserves KV slots
before each decode step, `filter_batch` / `merge_batch` follow the batch when requests finish or join. Under
the overlap scheduler the draft input a step returns is also the relay handle of the next step: SGLang stashes
its bonus tokens in the future map, sets `future_indices`, and fills `bonus_tokens` and the batch's
`seq_lens` from the map before the next forward (architecture page, "Overlap scheduling").
`BastionVerifyInput` is what the target's TARGET_VERIFY forward reads (tokens, positions, the flat ancestor
mask, the width W).

The forward builders of a decode step are here too: `prepare_verify_forward` (the target's tree pass),
`plain_decode_forward` (the target's DECODE pass of the roots alone, as SGLang runs it without speculation)
and `prepare_draft_forward` (the drafter's block pass); `step_result` is what a decode step returns to the
scheduler.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from bastion_sglang.integration import sglang_adapter as sgl
from bastion_sglang.integration.sglang_adapter import (
    CaptureHiddenMode,
    ForwardBatch,
    ForwardMode,
    GenerationBatchResult,
    SpecInput,
    SpecInputType,
    SpeculativeAlgorithm,
    alloc_for_spec_decode,
    enable_num_token_non_padded,
)

if TYPE_CHECKING:
    from sglang.srt.managers.schedule_batch import ScheduleBatch
    from sglang.srt.mem_cache.kv_index_translator import KVIndexTranslator
    from sglang.srt.mem_cache.kv_loc_plan import IdSpaceKind, KVLocPlan
    from sglang.srt.model_executor.model_runner import ModelRunner


TOP_UP_SLOTS = 32
"""KV slots a decode allocation adds past each request's reserve, where the pool has them free: with the
reserve alone a step that commits one token would allocate (and write req_to_token) at every step."""


@dataclass(frozen=True)
class DecodeAllocation:
    """The KV lengths a decode step allocates the requests from and to (host ints, one per request)."""

    current: list[int]  # allocated now
    target: list[int]  # allocated after, each >= current
    needed: int  # slots to allocate: sum(target - current)


def decode_allocation(
    committed: Sequence[int],
    allocated: Sequence[int],
    *,
    reserve: int,
    page_size: int,
    row_len: int,
    free_slots: Callable[[], int],
) -> DecodeAllocation | None:
    """The allocation before a decode step, or None when every request already has `reserve` slots past
    its committed KV (the common case: nothing to allocate, nothing to write).

    A request short of that is raised to committed + reserve rounded up to a page (SGLang's
    `page_aligned_decode_alloc_lens` rule). When any is short, every request of the batch is also topped up
    to committed + reserve + `TOP_UP_SLOTS` (page-aligned, at most the whole pages of a req_to_token row of
    `row_len` slots), so the batch's next top-ups come together; if the pool's `free_slots()` (asked only
    then) cannot hold that, the allocation is the reserve alone.
    """

    def whole_pages(length: int) -> int:
        return -(-length // page_size) * page_size

    floor = [max(a, whole_pages(c + reserve)) for c, a in zip(committed, allocated, strict=True)]
    if floor == list(allocated):
        return None
    row_pages = row_len // page_size * page_size
    topped = [
        max(f, min(whole_pages(c + reserve + TOP_UP_SLOTS), row_pages))
        for c, f in zip(committed, floor, strict=True)
    ]
    target = topped if sum(topped) - sum(allocated) <= free_slots() else floor
    return DecodeAllocation(list(allocated), target, sum(target) - sum(allocated))


@dataclass
class BastionDraftInput(SpecInput):
    """Per-request state between decode steps, one row per request of the running batch.

    `reserve` is the KV headroom each decode step keeps allocated beyond the committed prefix: twice the
    larger of the verify width cap and the drafter block, so a step's draft block and verify window always
    find their slots (`prepare_for_decode`). The sampling walk's uniforms are a hash of the request's seed and
    the sequence position (`kernels.position_uniforms`; each request's seed is hashed once, into its
    `seed_keys`), so a seeded request samples the same tokens whatever batch it shares and whatever trees the
    controller chooses.
    """

    bonus_tokens: torch.Tensor  # [B] int64: root token of the next tree (committed, KV not written)
    new_seq_lens: torch.Tensor  # [B] int64: committed tokens with KV after the step that made this input
    # [B] int64: `kernels.seed_keys` of each request's walk seed (its sampling_seed, else drawn)
    seed_keys: torch.Tensor
    reserve: int  # KV slots kept allocated past the committed prefix, per request
    # [B] int64 req_pool indices of the future map's rows (overlap scheduler only; set by SGLang)
    future_indices: torch.Tensor | None = None
    # What SGLang's future-map relay reads from every draft input (`RelayPayload.from_draft_input`):
    # BASTION relays only the bonus tokens, so these stay None.
    topk_p: torch.Tensor | None = None
    topk_index: torch.Tensor | None = None
    hidden_states: torch.Tensor | None = None

    def __post_init__(self) -> None:
        super().__init__(spec_input_type=SpecInputType.DFLASH_DRAFT)
        # A draft input does not change token accounting: one row per request.
        self.num_tokens_per_req = 1
        self.num_tokens_for_logprob_per_req = 1

    @classmethod
    def create_idle_input(cls, device: torch.device, reserve: int) -> BastionDraftInput:
        """The empty input of an idle batch."""
        return cls(
            bonus_tokens=torch.empty((0,), dtype=torch.int64, device=device),
            new_seq_lens=torch.empty((0,), dtype=torch.int64, device=device),
            seed_keys=torch.empty((0,), dtype=torch.int64, device=device),
            reserve=reserve,
        )

    def prepare_for_decode(self, batch: ScheduleBatch) -> None:
        """Reserve KV slots for the next step: allocated length >= committed + `reserve` per request
        (`decode_allocation`: when some request falls short, the batch is topped up past that, so a run of
        one-token steps allocates once in `TOP_UP_SLOTS` steps instead of at every step).

        Sets batch.seq_lens_cpu / seq_lens_sum to the committed lengths the scheduler knows (host copies, no
        device sync). Under overlap scheduling those lag one step (the previous step's result is processed
        after this runs) and SGLang's future map replaces them before the forward; the reserve covers the lag,
        since a step commits at most the verify width cap and the next one writes at most max(γ, cap) slots.
        """
        bs = batch.batch_size()
        if bs == 0:
            return
        sgl.maybe_evict_swa(batch)
        committed = [sgl.committed_kv_len(req) for req in batch.reqs]
        allocation = decode_allocation(
            committed,
            [sgl.allocated_kv_len(req) for req in batch.reqs],
            reserve=self.reserve,
            page_size=batch.token_to_kv_pool_allocator.page_size,
            row_len=batch.req_to_token_pool.req_to_token.shape[1],
            free_slots=lambda: sgl.free_kv_slots(batch),
        )
        if allocation is not None:
            lens_cpu = torch.tensor([allocation.current, allocation.target], dtype=torch.int32)  # [2, B]
            lens = lens_cpu.to(batch.device, non_blocking=True)  # one host-to-device copy for both
            alloc_for_spec_decode(
                batch.tree_cache,
                batch.req_to_token_pool,
                reqs=batch.reqs,
                req_pool_indices=batch.req_pool_indices,
                cur_kv_lens=lens[0],
                cur_kv_lens_cpu=lens_cpu[0],
                nxt_kv_lens=lens[1],
                nxt_kv_lens_cpu=lens_cpu[1],
                num_needed_tokens=allocation.needed,
                batch=batch,
            )
        sgl.count_decode_step(batch.reqs)
        batch.seq_lens_cpu = torch.tensor(committed, dtype=torch.int64)
        batch.seq_lens_sum = sum(committed)

    def filter_batch(self, new_indices: torch.Tensor, new_indices_cpu: list[int] | None = None) -> None:
        """Keep the rows `new_indices` (device; `new_indices_cpu`, its host copy, is not needed) in order."""
        self.bonus_tokens = self.bonus_tokens[new_indices]
        self.new_seq_lens = self.new_seq_lens[new_indices]
        self.seed_keys = self.seed_keys[new_indices]
        if self.future_indices is not None:
            self.future_indices = self.future_indices[new_indices]

    def merge_batch(self, other: BastionDraftInput) -> None:
        """Append the rows of `other` (requests joining the running batch).

        Under the overlap scheduler both carry future-map indices (each was a forward's result); a batch that
        has them cannot merge one without (ValueError), since its rows would resolve from the wrong slots.
        """
        if (self.future_indices is None) != (other.future_indices is None):
            raise ValueError("merging a draft input with future-map indices and one without")
        self.bonus_tokens = torch.cat([self.bonus_tokens, other.bonus_tokens])
        self.new_seq_lens = torch.cat([self.new_seq_lens, other.new_seq_lens])
        self.seed_keys = torch.cat([self.seed_keys, other.seed_keys])
        if self.future_indices is not None and other.future_indices is not None:
            self.future_indices = torch.cat([self.future_indices, other.future_indices])


@dataclass
class BastionVerifyInput(SpecInput):
    """The target's TARGET_VERIFY forward over the flattened trees of a batch (W tokens per request).

    custom_mask follows SGLang's triton-backend layout: per request a row-major [W, L_b + W] boolean
    block (True = may attend; prefix columns all True, then the ancestor block), blocks concatenated
    in batch order (`kernels.flat_custom_mask`).
    """

    draft_token: torch.Tensor  # [B * W] int64: verify rows' tokens, row-major (column 0 = root)
    positions: torch.Tensor  # [B * W] int64: prefix + depth of each token
    draft_token_num: int  # W, tokens per request
    custom_mask: torch.Tensor | None  # [Σ_b W·(L_b + W)] bool, see above
    capture_hidden_mode: CaptureHiddenMode = CaptureHiddenMode.FULL
    topk: int = 1  # backends gate EAGLE's layered tree metadata on topk > 1; BASTION's mask is explicit

    def __post_init__(self) -> None:
        super().__init__(spec_input_type=SpecInputType.DFLASH_VERIFY)
        self.num_tokens_per_req = int(self.draft_token_num)
        self.num_tokens_for_logprob_per_req = int(self.draft_token_num)

    def prepare_for_verify(
        self, batch: ScheduleBatch, model_runner: ModelRunner
    ) -> tuple[ForwardBatch, bool]:
        """Turn `batch` into the verify ForwardBatch of the target's `model_runner` and plan its attention
        (CUDA graph or eager).

        The caller has set batch.out_cache_loc to the W slots per request. Returns (forward batch,
        whether a captured CUDA graph runs it).
        """
        batch.input_ids = self.draft_token
        batch.spec_info = self
        batch.forward_mode = ForwardMode.TARGET_VERIFY
        forward_batch = ForwardBatch.init_new(
            batch,
            model_runner,
            capture_hidden_mode=self.capture_hidden_mode,
            return_hidden_states_before_norm=False,
        )
        runner = model_runner.decode_cuda_graph_runner
        can_run_cuda_graph = bool(runner and runner.can_run_graph(forward_batch))
        if can_run_cuda_graph:
            runner.load_batch(forward_batch)
        else:
            model_runner.attn_backend.init_forward_metadata(forward_batch)
        forward_batch.mark_forward_metadata_ready()
        return forward_batch, can_run_cuda_graph

    def generate_attn_arg_prefill(
        self,
        *,
        req_pool_indices: torch.Tensor,
        paged_kernel_lens: torch.Tensor,
        paged_kernel_lens_sum: int,
        translator: KVIndexTranslator,
        plan: KVLocPlan,
        kind: IdSpaceKind,
        kv_start_idx: torch.Tensor | None = None,
        kv_indices_buf: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """CSR arguments of a paged prefill kernel (flashinfer) for this verify pass.

        paged_kernel_lens: [B] prefix lengths (the W verify tokens are added here). Returns (kv_indices
        [Σ(L_b + W)], kv_indptr [B + 1], qo_indptr [B + 1] int32, custom_mask as built by the worker).
        """
        device = req_pool_indices.device
        bs = req_pool_indices.numel()
        width = self.draft_token_num
        qo_indptr = torch.arange(0, (bs + 1) * width, step=width, dtype=torch.int32, device=device)
        kv_lens = paged_kernel_lens + width
        kv_indptr = torch.zeros((bs + 1,), dtype=torch.int32, device=device)
        kv_indptr[1:] = torch.cumsum(kv_lens, dim=0)
        kv_indices = (
            kv_indices_buf
            if kv_indices_buf is not None
            else torch.empty(paged_kernel_lens_sum + width * bs, dtype=torch.int32, device=device)
        )
        translator.pack_read_stream(
            plan,
            req_pool_indices=req_pool_indices,
            seq_lens=kv_lens,
            indptr=kv_indptr,
            out=kv_indices,
            kv_start_idx=kv_start_idx,
            kind=kind,
        )
        return kv_indices, kv_indptr, qo_indptr, self.custom_mask


def prepare_verify_forward(
    batch: ScheduleBatch,
    model_runner: ModelRunner,
    tokens: torch.Tensor,
    positions: torch.Tensor,
    custom_mask: torch.Tensor,
    slots: torch.Tensor,
    prefix_cpu: torch.Tensor,
    prefix_sum: int,
) -> tuple[ForwardBatch, bool]:
    """The target's TARGET_VERIFY ForwardBatch over W tokens per request, attention planned; the forward
    itself is the caller's (the worker's scheduler path, or calibration's bare model runner).

    tokens, positions: [B, W] int64 (verify rows, column 0 = root); custom_mask: the flat ancestor mask
    (`kernels.flat_custom_mask`); slots: [B, W] int64 KV slots the pass writes; prefix_cpu: [B] int64 host
    copy of the committed lengths, prefix_sum their sum (a host int). Sets batch.out_cache_loc, input_ids,
    spec_info and forward_mode. While the attention is planned, batch.seq_lens_cpu / seq_lens_sum bound
    what the pass attends to (prefix + W, as SGLang's backends size their metadata from them); they are
    restored before it returns. Returns (forward batch, whether a captured CUDA graph runs it).
    """
    width = int(tokens.shape[1])
    verify_input = BastionVerifyInput(
        draft_token=tokens.reshape(-1),
        positions=positions.reshape(-1),
        draft_token_num=width,
        custom_mask=custom_mask,
    )
    batch.out_cache_loc = slots.reshape(-1)
    saved = batch.seq_lens_cpu, batch.seq_lens_sum
    batch.seq_lens_cpu = prefix_cpu + width  # host bound: prefix plus this pass's tokens
    batch.seq_lens_sum = prefix_sum + width * int(tokens.shape[0])
    try:
        return verify_input.prepare_for_verify(batch, model_runner)
    finally:
        batch.seq_lens_cpu, batch.seq_lens_sum = saved


PLAIN_DECODE_FIELDS = (
    "forward_mode",
    "spec_info",
    "input_ids",
    "out_cache_loc",
    "seq_lens",
    "seq_lens_cpu",
    "orig_seq_lens",
    "seq_lens_sum",
)
"""The scheduler batch's fields `plain_decode_forward` sets for its DECODE forward and restores."""


@contextmanager
def plain_decode_forward(
    batch: ScheduleBatch,
    model_runner: ModelRunner,
    tokens: torch.Tensor,
    slots: torch.Tensor,
    seq_lens: torch.Tensor,
    prefix_cpu: torch.Tensor,
    seq_lens_sum: int,
) -> Iterator[ForwardBatch]:
    """The target's plain DECODE ForwardBatch of one token per request, as SGLang builds it without
    speculation (no tree mask, no verify layout), with every hidden state captured (the drafter's features);
    run the forward inside the block.

    tokens: [B] the roots (bonus tokens); slots: [B] KV slots at position L_b; seq_lens: [B] int64 L_b + 1,
    the lengths with the roots; prefix_cpu: [B] the committed lengths L_b on the host; seq_lens_sum:
    Σ (L_b + 1), a host int (nothing is summed here). The batch fields of PLAIN_DECODE_FIELDS are restored on
    exit.
    """
    saved = {name: getattr(batch, name) for name in PLAIN_DECODE_FIELDS}
    batch.forward_mode = ForwardMode.DECODE
    batch.spec_info = None
    batch.input_ids = tokens
    batch.out_cache_loc = slots
    batch.seq_lens = seq_lens.to(saved["seq_lens"].dtype)
    batch.seq_lens_cpu = prefix_cpu + 1
    batch.orig_seq_lens = batch.seq_lens.to(saved["orig_seq_lens"].dtype)
    batch.seq_lens_sum = seq_lens_sum
    try:
        yield ForwardBatch.init_new(
            batch,
            model_runner,
            capture_hidden_mode=CaptureHiddenMode.FULL,
            return_hidden_states_before_norm=False,
        )
    finally:
        for name, value in saved.items():
            setattr(batch, name, value)


def prepare_draft_forward(
    batch: ScheduleBatch,
    target_runner: ModelRunner,
    draft_runner: ModelRunner,
    block_ids: torch.Tensor,
    embeds: torch.Tensor,
    prefix: torch.Tensor,
    prefix_sum: int,
    rows_index: torch.Tensor,
    block_offsets: torch.Tensor,
    block_spec_info: Any,
) -> ForwardBatch:
    """The drafter's ForwardBatch over each request's block [root, MASK x (γ-1)] at positions L_b..L_b+γ-1,
    written to the drafter KV at slots req_to_token[r, L_b : L_b + γ] (overwritten by the commit later).

    target_runner: the target's model runner (its req_to_token and KV index translator plan the slots);
    draft_runner: the drafter's. block_ids: [B, γ] int64; embeds: [B, γ, H] the block's input embeddings;
    prefix: [B] int64 committed lengths L_b (prefix_sum: their sum, a host int); rows_index: [B, 1] int64
    the requests' req_to_token rows; block_offsets: [γ] int64 0..γ-1; block_spec_info: DFlash's block spec
    info (`sglang_adapter.install_draft_block_spec_info`).
    """
    bs, block = block_ids.shape
    positions = prefix[:, None] + block_offsets  # [B, γ]
    cache_loc = target_runner.req_to_token_pool.req_to_token[rows_index, positions].to(torch.int64)
    seq_lens_cpu = batch.seq_lens_cpu + block  # host bound on what the block attends to
    plan = sgl.kv_index_translator(target_runner).plan(
        req_pool_indices=batch.req_pool_indices,
        seq_lens=prefix,
        seq_lens_cpu=batch.seq_lens_cpu,
        write_virtual=cache_loc.reshape(-1),
        read_extent=block,
    )
    forward_batch = ForwardBatch(
        forward_mode=ForwardMode.TARGET_VERIFY,
        batch_size=bs,
        input_ids=block_ids.reshape(-1),
        req_pool_indices=batch.req_pool_indices,
        seq_lens=prefix,
        out_cache_loc=cache_loc.reshape(-1),
        seq_lens_sum=prefix_sum + bs * block,
        seq_lens_cpu=seq_lens_cpu,
        positions=positions.reshape(-1),
        input_embeds=embeds.reshape(bs * block, -1),
        spec_algorithm=SpeculativeAlgorithm.DFLASH,
        spec_info=block_spec_info,
        capture_hidden_mode=CaptureHiddenMode.NULL,
        num_token_non_padded=(
            torch.full((), bs * block, dtype=torch.int32, device=block_ids.device)
            if enable_num_token_non_padded()
            else None
        ),
        global_num_token_non_padded_cpu=bs * block,
        can_run_decode_cuda_graph=batch.can_run_decode_cuda_graph,
    )
    plan.bind(forward_batch, sgl.kv_index_translator(draft_runner))
    return forward_batch


def step_result(
    target_out: GenerationBatchResult,
    out_tokens: torch.Tensor,
    commit_lens: torch.Tensor,
    bonus_tokens: torch.Tensor,
    new_seq_lens: torch.Tensor,
    seed_keys: torch.Tensor,
    reserve: int,
) -> GenerationBatchResult:
    """What a decode step hands the scheduler: out_tokens [B, W] (the first commit_lens [B] int32 of each
    row are emitted), the next roots bonus_tokens [B], the committed lengths new_seq_lens [B], the requests'
    walk keys seed_keys [B] (carried on) and the KV `reserve` of the next step's draft input."""
    width = int(out_tokens.shape[1])
    return GenerationBatchResult(
        logits_output=target_out.logits_output,
        next_token_ids=out_tokens.reshape(-1),
        accept_lens=commit_lens,
        can_run_cuda_graph=target_out.can_run_cuda_graph,
        next_draft_input=BastionDraftInput(
            bonus_tokens=bonus_tokens, new_seq_lens=new_seq_lens, seed_keys=seed_keys, reserve=reserve
        ),
        speculative_num_draft_tokens=width,
        speculative_output_stride=width,
        new_seq_lens=new_seq_lens,
    )
