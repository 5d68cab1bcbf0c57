"""Target-verify CUDA graphs for BASTION: one captured graph runner per width bucket, one chosen per step.

Why a runner class of BASTION's own. SGLang 0.5.23 captures the DFlash family's TARGET_VERIFY graphs
without a custom mask on the triton and flashinfer backends (`DecodeCudaGraphRunner.get_spec_info` with
`resolve_dflash_verify_mask_policy`: DFlash verifies a causal chain), which bakes causal attention into the
graph. BASTION's tree needs its ancestor mask, so `BastionVerifyGraphRunner` captures with a mask buffer in
its capture-time spec input: the backend then captures its masked kernel, and each replay copies the step's
flat mask in (triton: its verify-mask buffer; flashinfer: the prefill wrapper's custom-mask buffer).

Where the runners come from:
- at startup, SGLang's `capture_decode_graph` builds the target's decode graph runner through
  `ModelRunner._decode_cuda_graph_runner_cls` (SGLang's extension point for specialised decode runners);
  `registration` hooks it so BASTION's target gets a `BastionVerifyGraphRunner`, captured at the largest
  width bucket with the model runner's own attention backend;
- `capture_verify_graphs` (from `BastionWorker.init_cuda_graphs`) adds a runner for every other bucket,
  each with an attention backend of its own (a runner sizes its backend's graph buffers and bakes their
  addresses into its graphs, so runners cannot share one), built while SGLang's
  `speculative_num_draft_tokens` reads that width (the backend sizes its verify mask by it), as SGLang's
  EAGLE adaptive runtime states are built (`EAGLEWorkerV2.build_adaptive_runtime_state`);
- each step `VerifyGraphs.shape_for` picks the width (`graph_buckets.choose_verify_shape`) and
  `VerifyGraphs.installed` makes that width's runner the target model runner's decode graph runner for the
  verify forward (SGLang's `can_run_graph` / `load_batch` / `execute` then replay it), restoring the
  startup runner afterwards.

Memory: every extra runner holds its graphs (SGLang's shared graph memory pool) and its backend's graph
buffers, which grow with captured batch size x width x context length (triton: the KV-index and verify-mask
buffers). The capture logs what the extra widths took and adds it to SGLang's `target_verify` graph memory
record; fewer buckets (`--bastion-width-buckets`) or a smaller `--cuda-graph-max-bs` take less.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from typing import TYPE_CHECKING

import torch

from bastion_sglang.integration.config import config_of
from bastion_sglang.integration.sglang_adapter import (
    Backend,
    DecodeCudaGraphRunner,
    Phase,
    attention_backend_of,
    check_cuda_graph_backend,
    get_available_gpu_memory,
    get_context,
    get_spec,
)
from bastion_sglang.step.graph_buckets import (
    EagerReason,
    VerifyShape,
    choose_verify_shape,
    validate_graph_widths,
)
from bastion_sglang.step.spec_input import BastionVerifyInput

if TYPE_CHECKING:
    from sglang.srt.layers.attention.base_attn_backend import AttentionBackend
    from sglang.srt.model_executor.model_runner import ModelRunner

logger = logging.getLogger(__name__)

OVERRIDE_SOURCE = "bastion.verify_graphs"
"""Provenance name of the temporary `speculative_num_draft_tokens` overrides made while capturing."""


class BastionVerifyGraphRunner(DecodeCudaGraphRunner):
    """SGLang's decode graph runner, capturing BASTION's TARGET_VERIFY with the tree mask (module doc).

    speculative_num_draft_tokens: the captured width (tokens per request); None: the largest width bucket
    of the run's BastionConfig (how SGLang's startup capture constructs it). The other arguments are
    `DecodeCudaGraphRunner`'s. Construction captures the graphs for every captured batch size.
    """

    def __init__(
        self,
        model_runner: ModelRunner,
        *,
        attn_backend: AttentionBackend | None = None,
        speculative_num_steps: int | None = None,
        speculative_num_draft_tokens: int | None = None,
        record_nolora_graph: bool = False,
    ) -> None:
        width = (
            config_of(model_runner.server_args).width_buckets[-1]
            if speculative_num_draft_tokens is None
            else speculative_num_draft_tokens
        )
        super().__init__(
            model_runner,
            attn_backend=attn_backend,
            speculative_num_steps=speculative_num_steps,
            speculative_num_draft_tokens=width,
            record_nolora_graph=record_nolora_graph,
        )

    def get_spec_info(self, num_tokens: int) -> BastionVerifyInput:
        """The capture-time verify input: `num_tokens` tokens at the captured width, with a mask buffer."""
        return BastionVerifyInput(
            draft_token=self.buffers.input_ids[:num_tokens],
            positions=self.buffers.positions[:num_tokens],
            draft_token_num=self.captured_req_width,
            custom_mask=self.buffers.custom_mask,
        )


def planned_graph_widths(device: torch.device, width_buckets: Sequence[int]) -> tuple[int, ...]:
    """The widths BASTION will capture target-verify graphs at: the buckets on CUDA with decode graphs on,
    none otherwise (CPU, `--disable-cuda-graph`)."""
    if device.type != "cuda" or check_cuda_graph_backend(Phase.DECODE, Backend.DISABLED):
        return ()
    return validate_graph_widths(width_buckets)


class VerifyGraphs:
    """The captured target-verify runners, by width, and the per-step choice among them.

    runners: width (tokens per request) -> its runner; empty: every step verifies eagerly.
    extra_memory_gb / capture_seconds: what capturing the widths beyond SGLang's startup runner took.
    """

    def __init__(
        self,
        runners: Mapping[int, DecodeCudaGraphRunner],
        extra_memory_gb: float = 0.0,
        capture_seconds: float = 0.0,
    ) -> None:
        self._runners = dict(sorted(runners.items()))
        self.widths = validate_graph_widths(tuple(self._runners))
        self.max_batch = min((int(runner.max_bs) for runner in self._runners.values()), default=0)
        self.extra_memory_gb = extra_memory_gb
        self.capture_seconds = capture_seconds
        self._reported: set[EagerReason] = set()
        self._replayed: set[int] = set()

    def shape_for(self, width: int, batch_size: int) -> VerifyShape:
        """The shape of a verify pass of `width` tokens per request over `batch_size` requests.

        The first eager fallback of each kind is logged once.
        """
        shape = choose_verify_shape(width, batch_size, self.widths, self.max_batch)
        reason = shape.eager_reason
        if reason is not None and reason not in self._reported:
            self._reported.add(reason)
            if reason is EagerReason.WIDTH:
                logger.info(
                    "BASTION: verify width %d exceeds the largest CUDA-graph width %d; such steps verify "
                    "eagerly (logged once; --bastion-width-buckets sets the captured widths)",
                    width,
                    self.widths[-1],
                )
            else:
                logger.info(
                    "BASTION: a batch of %d requests exceeds the largest CUDA-graph batch size %d; such "
                    "steps verify eagerly (logged once; --cuda-graph-max-bs sets the captured sizes)",
                    batch_size,
                    self.max_batch,
                )
        return shape

    @contextmanager
    def installed(self, model_runner: ModelRunner, shape: VerifyShape) -> Iterator[None]:
        """Within the block, the target model runner's decode graph runner is the one of `shape.width`
        (a graph shape); eager shapes leave it as it is. Restored on exit."""
        if not shape.graph:
            yield
            return
        previous = model_runner.decode_cuda_graph_runner
        model_runner.decode_cuda_graph_runner = self._runners[shape.width]
        try:
            yield
        finally:
            model_runner.decode_cuda_graph_runner = previous

    def note_replay(self, width: int, batch_size: int) -> None:
        """Record that a verify pass replayed the graph of `width`; the first replay per width is logged."""
        if width not in self._replayed:
            self._replayed.add(width)
            logger.info(
                "BASTION: first target-verify CUDA graph replay at width %d (batch %d)", width, batch_size
            )


def capture_verify_graphs(model_runner: ModelRunner, widths: Sequence[int]) -> VerifyGraphs:
    """One target-verify runner per width in `widths`, reusing SGLang's startup runner for its width.

    model_runner: the target's ModelRunner after SGLang's startup capture. widths: sorted, unique widths
    (tokens per request). Without a startup graph runner (CPU, graphs disabled): no runners. Logs the widths,
    batch sizes and the extra GPU memory. RuntimeError when the startup runner is not BASTION's (its
    graphs would verify trees with a causal mask).
    """
    startup = model_runner.decode_cuda_graph_runner
    if not isinstance(startup, DecodeCudaGraphRunner):  # None (or SGLang's eager runner): no graphs
        return VerifyGraphs({})
    if not isinstance(startup, BastionVerifyGraphRunner):
        raise RuntimeError(
            f"the target's verify graph runner is {type(startup).__name__}, not BastionVerifyGraphRunner: "
            "its graphs verify with a causal mask. The bastion plugin's hook on "
            "ModelRunner._decode_cuda_graph_runner_cls is missing (is SGLANG_PLUGINS excluding 'bastion'?)"
        )
    runners: dict[int, DecodeCudaGraphRunner] = {int(startup.captured_req_width): startup}
    extra = [width for width in validate_graph_widths(widths) if width not in runners]
    before_gb = get_available_gpu_memory(model_runner.device, model_runner.gpu_id)
    tic = time.perf_counter()
    for width in extra:
        runners[width] = _capture_width(model_runner, width)
    seconds = time.perf_counter() - tic
    after_gb = get_available_gpu_memory(model_runner.device, model_runner.gpu_id)
    graphs = VerifyGraphs(runners, extra_memory_gb=before_gb - after_gb, capture_seconds=seconds)
    logger.info(
        "BASTION: target-verify CUDA graphs at widths %s for batch sizes %s; the %d widths beyond SGLang's "
        "startup capture (width %d) took %.1f s and %.2f GB of GPU memory (%.2f GB left)",
        list(graphs.widths),
        list(startup.capture_bs),
        len(extra),
        startup.captured_req_width,
        seconds,
        graphs.extra_memory_gb,
        after_gb,
    )
    return graphs


def _capture_width(model_runner: ModelRunner, width: int) -> BastionVerifyGraphRunner:
    """A runner captured at `width` over a new attention backend built for that width (see the module doc).

    The backend keeps SGLang's shared flashinfer workspace (as the target's and the drafter's backends
    already share it): every forward runs on the scheduler's one forward stream, in launch order, with or
    without overlap scheduling (the overlap scheduler runs ahead on the host, not a second forward), so
    verify passes never run concurrently.
    """
    context = get_context()
    configured = int(get_spec().speculative_num_draft_tokens)
    context.override(OVERRIDE_SOURCE, speculative_num_draft_tokens=width)
    try:
        backend = attention_backend_of(model_runner)
        return BastionVerifyGraphRunner(
            model_runner, attn_backend=backend, speculative_num_draft_tokens=width
        )
    finally:
        context.override(OVERRIDE_SOURCE, speculative_num_draft_tokens=configured)
