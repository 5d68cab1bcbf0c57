"""The CPU side of BASTION's target-verify CUDA graphs (bastion_sglang.step.graphs with graph_buckets): which
buffers a capture and a replay read and write, which runner serves a pass, and what is refused.

No CUDA runs here: the runners and SGLang's triton attention backend are built without their constructors
(which capture graphs), with only the attributes the tested code reads. `tests/test_graph_buckets.py` holds
the bucket choice and padding; `tests/interpreted/sglang_verify_attention.py` runs the kernels that read the
buffers filled here.
"""

from __future__ import annotations

import logging
from types import SimpleNamespace

import pytest
import torch
from sglang.srt.layers.attention.triton_backend import TritonAttnBackend
from sglang.srt.layers.attention.verify_mask import maybe_create_verify_mask
from sglang.srt.model_executor.model_runner import ModelRunner
from sglang.srt.speculative.eagle_utils import TreeMaskMode
from verify_trees import shaped_trees

from bastion_sglang.kernels import TreeBatch
from bastion_sglang.step import graphs as graphs_module
from bastion_sglang.step.graph_buckets import EagerReason, VerifyShape, padded_verify_pass
from bastion_sglang.step.graphs import BastionVerifyGraphRunner, VerifyGraphs, capture_verify_graphs
from bastion_sglang.step.spec_input import BastionVerifyInput

MAX_BS = 4  # the largest captured batch size of the runners below
MAX_CONTEXT = 40  # the target's context length: SGLang sizes a verify mask buffer by it


def fake_runner(width: int, max_bs: int = MAX_BS) -> BastionVerifyGraphRunner:
    """A BastionVerifyGraphRunner as captured at `width` (tokens per request) for batch sizes up to `max_bs`:
    its graph input buffers, without a capture."""
    runner = BastionVerifyGraphRunner.__new__(BastionVerifyGraphRunner)
    runner.captured_req_width = width
    runner.max_bs = max_bs
    runner.capture_bs = list(range(1, max_bs + 1))
    tokens = max_bs * width
    runner.buffers = SimpleNamespace(
        input_ids=torch.zeros(tokens, dtype=torch.int64),
        positions=torch.zeros(tokens, dtype=torch.int64),
        custom_mask=torch.zeros(max_bs * width * (MAX_CONTEXT + width), dtype=torch.bool),
    )
    return runner


def two_requests() -> tuple[TreeBatch, torch.Tensor]:
    """Verify rows of two requests at W = 6 real positions (random trees) and their cached prefix lengths."""
    return shaped_trees(torch.Generator().manual_seed(0), 2, 6, "random"), torch.tensor([3, 5])


def bare_model_runner(startup: object) -> ModelRunner:
    runner = ModelRunner.__new__(ModelRunner)  # only the attributes the graphs code reads are set
    runner.decode_cuda_graph_runner = startup
    runner.device = "cpu"
    runner.gpu_id = 0
    return runner


def test_the_capture_input_is_views_of_the_runners_graph_buffers() -> None:
    """What a capture records: the verify input of `num_tokens` tokens reads the runner's input-id and
    position buffers (views, so a replay's copies into them reach the graph) and its whole mask buffer,
    at the captured width."""
    runner = fake_runner(8)
    spec = runner.get_spec_info(16)
    assert isinstance(spec, BastionVerifyInput)
    assert (
        spec.draft_token.data_ptr() == runner.buffers.input_ids.data_ptr() and spec.draft_token.numel() == 16
    )
    assert spec.positions.data_ptr() == runner.buffers.positions.data_ptr() and spec.positions.numel() == 16
    assert spec.custom_mask is runner.buffers.custom_mask
    assert (spec.draft_token_num, spec.num_tokens_per_req, spec.num_tokens_for_logprob_per_req) == (8, 8, 8)


def triton_backend_at(width: int) -> TritonAttnBackend:
    """SGLang's triton attention backend as built for graphs of `width` tokens per request (MAX_BS requests,
    MAX_CONTEXT tokens): its replay buffers (zeros, as `TritonAttnBackend.__init__` allocates them) and
    the verify mask buffer SGLang sizes, every mask cell True so that cells a replay does not write stay
    visible."""
    backend = TritonAttnBackend.__new__(TritonAttnBackend)
    backend.device = "cpu"
    backend.target_verify_num_tokens_per_req = width
    backend.sliding_window_size = None
    backend.window_kv_indptr = None
    backend.qo_indptr = torch.zeros(MAX_BS + 1, dtype=torch.int64)
    backend.mask_indptr = torch.zeros(MAX_BS + 1, dtype=torch.int64)
    backend.kv_indptr = torch.zeros(MAX_BS + 1, dtype=torch.int32)
    backend.cuda_graph_kv_indices = torch.zeros(MAX_BS * MAX_CONTEXT, dtype=torch.int64)
    verify_mask = maybe_create_verify_mask(
        is_draft_runner=False,
        skip_prefill=False,
        max_bs=MAX_BS,
        max_context_len=MAX_CONTEXT,
        num_draft_tokens=width,
        device="cpu",
        is_read=True,
    )
    assert verify_mask is not None
    verify_mask.buffer.fill_(True)
    backend._verify_mask = verify_mask
    return backend


def test_sglangs_mask_buffer_for_a_width_holds_the_largest_padded_mask_of_that_width() -> None:
    """`_capture_width` builds each width's backend while SGLang's speculative_num_draft_tokens reads that
    width; SGLang then sizes the full-mask buffer W_v·(context + W_v) per request: exactly BASTION's flat mask
    of a full graph batch at the longest context, and no batch beyond the graphs' fits (such passes run
    eagerly, `EagerReason.BATCH`)."""
    width = 8
    mask = triton_backend_at(width)._verify_mask
    assert mask.mode == TreeMaskMode.FULL_MASK
    rows, _ = two_requests()
    full = padded_verify_pass(
        TreeBatch(*(getattr(rows, f).repeat(2, 1) for f in ("tokens", "parents", "depths"))),
        torch.full((MAX_BS,), MAX_CONTEXT),
        width,
        seq_lens_sum=MAX_BS * MAX_CONTEXT,
    )
    assert full.custom_mask.numel() == mask.buffer.numel()
    assert mask.fits(MAX_BS) and not mask.fits(MAX_BS + 1)
    graphs = VerifyGraphs({width: fake_runner(width)})
    assert graphs.shape_for(6, MAX_BS + 1) == VerifyShape(6, False, EagerReason.BATCH)


def test_a_replay_writes_the_padded_mask_and_the_verify_metadata_into_the_graph_buffers() -> None:
    """What a replay of the width-8 graph reads for a pass planned at W = 6: SGLang's replay hook
    (`_update_target_verify_buffers`) copies the step's flat mask, padded to 8, into the front of the mask
    buffer and sets qo_indptr and mask_indptr from the padded width; the KV index stream is built from the
    cached prefix lengths L_b (not L_b + W_v). The rest of the mask buffer keeps stale cells, which the
    kernel never reads (mask_indptr bounds it)."""
    rows, prefix = two_requests()
    verify = padded_verify_pass(rows, prefix, 8, seq_lens_sum=int(prefix.sum()))
    spec = BastionVerifyInput(
        draft_token=verify.rows.tokens.reshape(-1),
        positions=verify.rows.positions.reshape(-1),
        draft_token_num=verify.rows.width,
        custom_mask=verify.custom_mask,
    )
    backend = triton_backend_at(8)
    stream_calls = []

    def fill_kv_stream(plan, bs, seq_lens, req_pool_indices, kv_indices, kv_indptr=None):
        stream_calls.append((bs, seq_lens.clone(), req_pool_indices.clone(), kv_indices))
        indptr = backend.kv_indptr[: bs + 1]
        indptr[1:] = torch.cumsum(seq_lens, dim=0)
        return indptr

    backend._fill_kv_indptr_and_indices = fill_kv_stream
    pool_rows = torch.tensor([3, 1])
    qo_indptr, kv_indptr, custom_mask, mask_indptr, *_ = backend._update_target_verify_buffers(
        None, 2, prefix, spec, pool_rows
    )
    written = verify.custom_mask.numel()
    assert written == 8 * (3 + 8) + 8 * (5 + 8)
    assert custom_mask is backend._verify_mask.buffer
    assert torch.equal(custom_mask[:written], verify.custom_mask)
    assert bool(custom_mask[written:].all())  # untouched
    assert qo_indptr.tolist() == [0, 8, 16] and qo_indptr.data_ptr() == backend.qo_indptr.data_ptr()
    assert mask_indptr.tolist() == [0, 88, 192] and mask_indptr.data_ptr() == backend.mask_indptr.data_ptr()
    assert kv_indptr.tolist() == [0, 3, 8]
    [(bs, seq_lens, req_pool_indices, kv_indices)] = stream_calls
    assert bs == 2 and seq_lens.tolist() == [3, 5] and req_pool_indices.tolist() == [3, 1]
    assert kv_indices is backend.cuda_graph_kv_indices


def test_a_replay_of_a_mask_longer_than_the_buffer_is_refused() -> None:
    """A pass wider than the graph's width cannot be copied into its mask buffer (SGLang raises); BASTION
    never asks it: `choose_verify_shape` picks a graph only at a width >= W with the batch in range."""
    rows, _ = two_requests()
    long_prefix = torch.full((2,), MAX_CONTEXT)
    verify = padded_verify_pass(rows, long_prefix, 16, seq_lens_sum=2 * MAX_CONTEXT)
    spec = BastionVerifyInput(
        draft_token=verify.rows.tokens.reshape(-1),
        positions=verify.rows.positions.reshape(-1),
        draft_token_num=16,
        custom_mask=verify.custom_mask,
    )
    backend = triton_backend_at(8)
    backend._fill_kv_indptr_and_indices = lambda plan, bs, *args, **kwargs: backend.kv_indptr[: bs + 1]
    with pytest.raises(RuntimeError):
        backend._update_target_verify_buffers(None, 2, long_prefix, spec, torch.tensor([1, 2]))
    graphs = VerifyGraphs({8: fake_runner(8)})
    assert graphs.shape_for(16, 2) == VerifyShape(16, False, EagerReason.WIDTH)


def test_a_graph_shape_installs_its_runner_for_the_pass_and_restores_the_startup_one() -> None:
    runners = {4: fake_runner(4), 8: fake_runner(8, max_bs=2), 16: fake_runner(16)}
    graphs = VerifyGraphs(runners)
    assert graphs.widths == (4, 8, 16) and graphs.max_batch == 2  # the smallest runner's batch bounds all
    startup = runners[16]
    model_runner = bare_model_runner(startup)
    shape = graphs.shape_for(5, 2)
    assert shape == VerifyShape(8, True, None)
    with graphs.installed(model_runner, shape):
        assert model_runner.decode_cuda_graph_runner is runners[8]
    assert model_runner.decode_cuda_graph_runner is startup
    with pytest.raises(KeyError), graphs.installed(model_runner, shape):
        raise KeyError("a failing verify forward")
    assert model_runner.decode_cuda_graph_runner is startup  # restored when the pass raises
    eager = graphs.shape_for(5, 3)
    assert eager == VerifyShape(5, False, EagerReason.BATCH)
    with graphs.installed(model_runner, eager):
        assert model_runner.decode_cuda_graph_runner is startup


def test_eager_fallbacks_and_first_replays_are_logged_once_each(caplog: pytest.LogCaptureFixture) -> None:
    graphs = VerifyGraphs({4: fake_runner(4), 8: fake_runner(8)})
    with caplog.at_level(logging.INFO, logger=graphs_module.__name__):
        for _ in range(3):
            graphs.shape_for(9, 1)
            graphs.shape_for(3, MAX_BS + 1)
            graphs.note_replay(4, 1)
            graphs.note_replay(8, 2)
    messages = [record.getMessage() for record in caplog.records]
    assert len(messages) == 4
    assert sum("exceeds the largest CUDA-graph width 8" in m for m in messages) == 1
    assert sum(f"exceeds the largest CUDA-graph batch size {MAX_BS}" in m for m in messages) == 1
    assert sum("replay at width 4" in m for m in messages) == 1
    assert sum("replay at width 8" in m for m in messages) == 1


def test_capture_reuses_the_startup_runner_and_captures_each_other_width_once(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """SGLang's startup capture made the runner of the largest bucket; BASTION captures the others, each
    with a runner of its own, and records the GPU memory they took."""
    startup = fake_runner(16)
    captured: list[int] = []

    def capture_width(model_runner: ModelRunner, width: int) -> BastionVerifyGraphRunner:
        assert model_runner.decode_cuda_graph_runner is startup
        captured.append(width)
        return fake_runner(width)

    free_gb = iter([30.0, 27.5])
    monkeypatch.setattr(graphs_module, "_capture_width", capture_width)
    monkeypatch.setattr(graphs_module, "get_available_gpu_memory", lambda device, gpu_id: next(free_gb))
    graphs = capture_verify_graphs(bare_model_runner(startup), (2, 4, 8, 16))
    assert captured == [2, 4, 8]
    assert graphs.widths == (2, 4, 8, 16) and graphs.extra_memory_gb == 2.5
    shape = graphs.shape_for(16, MAX_BS)
    model_runner = bare_model_runner(startup)
    with graphs.installed(model_runner, shape):
        assert model_runner.decode_cuda_graph_runner is startup
    with pytest.raises(ValueError, match="sorted"):
        capture_verify_graphs(bare_model_runner(startup), (8, 4))
