"""Verify widths served by CUDA graphs (bastion_sglang.step.graph_buckets): bucket choice, padded verify rows.

The padding must be invisible: on the real positions the padded layout and flat mask equal the unpadded
ones, a one-layer attention "target" gives the real positions the same outputs with or without padding,
and the accept walk (on the real positions) never returns a padding position. Without captured graphs
(bastion_sglang.step.graphs on CPU) every step verifies eagerly at its own width.
"""

from __future__ import annotations

import pytest
import torch
from calibration_profiles import QWEN3_8B
from test_kernels_tree import HAND_BONUS, HAND_DEPTHS, HAND_PARENTS, HAND_TOKENS, StackedTrees

from bastion_sglang.controller import AdaptivePolicy, BucketedAdaptivePolicy, build_trees, plan_batch
from bastion_sglang.controller.latency import LatencyFit, LatencyModel
from bastion_sglang.controller.profile import StepCosts
from bastion_sglang.controller.roofline import HardwareSpec, RooflineModel
from bastion_sglang.kernels import (
    TreeBatch,
    accept_greedy,
    build_verify_layout,
    flat_custom_mask,
    flatten_trees,
    tree_attention,
)
from bastion_sglang.step.graph_buckets import (
    EagerReason,
    VerifyShape,
    choose_verify_shape,
    pad_verify_rows,
    padded_verify_pass,
    planning_widths,
    real_rows,
    validate_graph_widths,
)

BUCKETS = (4, 8, 16)
CAP = 17  # N_max 16: the largest bucket is below the cap, so widths 17 run eagerly

H100 = HardwareSpec(name="H100 SXM", peak_flops=989e12, bandwidth=3.35e12)
COSTS = StepCosts(t_draft=2.5e-3, t_aux=0.5e-3, l_ar=18e-3)


def latency_model(widths: tuple[int, ...] | None) -> LatencyModel:
    fit = LatencyFit(beta_fixed=4e-3, alpha_gemm=1.4, alpha_tok=2e-6, alpha_attn=1.1, alpha_kv=1.5)
    return LatencyModel(RooflineModel(QWEN3_8B, H100), fit=fit, width_buckets=widths)


@pytest.mark.parametrize(
    ("width", "bucket"), [(1, 4), (2, 4), (4, 4), (5, 8), (8, 8), (9, 16), (15, 16), (16, 16)]
)
def test_the_smallest_captured_width_at_least_w_serves_the_pass(width: int, bucket: int) -> None:
    assert choose_verify_shape(width, 3, BUCKETS, max_graph_batch=8) == VerifyShape(bucket, True, None)


def test_widths_beyond_the_largest_bucket_run_eagerly_unpadded() -> None:
    assert choose_verify_shape(17, 3, BUCKETS, max_graph_batch=8) == VerifyShape(17, False, EagerReason.WIDTH)


def test_batches_beyond_the_largest_graph_batch_run_eagerly_unpadded() -> None:
    assert choose_verify_shape(5, 8, BUCKETS, max_graph_batch=8) == VerifyShape(8, True, None)
    assert choose_verify_shape(5, 9, BUCKETS, max_graph_batch=8) == VerifyShape(5, False, EagerReason.BATCH)


def test_without_graphs_every_width_runs_as_planned() -> None:
    assert choose_verify_shape(11, 64, (), max_graph_batch=0) == VerifyShape(11, False, None)


@pytest.mark.parametrize(
    "widths", [(8, 4), (4, 4, 8), (0, 4), (-2, 4), (4.0, 8), (True, 4), ("4", 8)], ids=repr
)
def test_bad_graph_widths_are_refused(widths: tuple[object, ...]) -> None:
    with pytest.raises(ValueError, match="graph widths"):
        choose_verify_shape(3, 1, widths, max_graph_batch=8)  # type: ignore[arg-type]


def test_bad_shape_arguments_are_refused() -> None:
    with pytest.raises(ValueError, match="verify width"):
        choose_verify_shape(0, 1, BUCKETS, max_graph_batch=8)
    with pytest.raises(ValueError, match="batch size"):
        choose_verify_shape(3, 0, BUCKETS, max_graph_batch=8)
    with pytest.raises(ValueError, match="max_graph_batch"):
        choose_verify_shape(3, 1, BUCKETS, max_graph_batch=0)
    with pytest.raises(ValueError, match="exceeds the verify width cap"):
        validate_graph_widths((4, 8, 32), cap=CAP)


def test_planning_widths_pad_like_the_graphs() -> None:
    widths = planning_widths(BUCKETS, CAP)
    assert widths == (4, 8, 16, 17)
    assert planning_widths((2, 4, 8), 12) == (2, 4, 8, 9, 10, 11, 12)
    assert planning_widths((), CAP) is None
    model = latency_model(widths)
    for w in range(1, CAP + 1):
        assert model.padded_width(w) == choose_verify_shape(w, 1, BUCKETS, max_graph_batch=1).width


@pytest.mark.parametrize("seed", range(6))
@pytest.mark.parametrize("topk", [4, 1])
def test_planning_with_padded_costs_fills_the_graph_width(seed: int, topk: int) -> None:
    """With the padded costs the adaptive and bucketed widths are captured widths (the nodes that fill a
    bucket are free), or the whole tree: only a tree smaller than its bucket gets padding positions (with
    K = 1 the 6-node chain is verified at W = 7, padded to 8)."""
    generator = torch.Generator().manual_seed(seed)
    logits = (1.0 + seed) * torch.randn(2, 6, 40, generator=generator)
    top = torch.log_softmax(logits, -1).topk(topk, -1)
    trees = build_trees(top.values, top.indices, CAP - 1)
    widths = planning_widths(BUCKETS, CAP)
    assert widths is not None
    model = latency_model(widths)
    for policy in (AdaptivePolicy(), BucketedAdaptivePolicy(BUCKETS)):
        for ctx in (64, 2048, 32768):
            plan = plan_batch(trees, [ctx, ctx], model, COSTS, policy)
            assert plan.width in {*widths, trees.num_nodes + 1}, (policy, ctx, plan.width)


def two_requests() -> tuple[TreeBatch, torch.Tensor]:
    """A batch of two requests at W = 6 real positions each: the hand-built 5-node tree, and a second one
    (root 7; children 40 and 50; 41 below 40, 51 below 50; 42 below 41). Returns (rows, prefix lengths)."""
    draft = StackedTrees(
        tokens=torch.tensor([HAND_TOKENS, [40, 50, 41, 51, 42]]),
        parents=torch.tensor([HAND_PARENTS, [-1, -1, 0, 1, 2]]),
        depths=torch.tensor([HAND_DEPTHS, [1, 1, 2, 2, 3]]),
    )
    rows = flatten_trees(draft, torch.tensor([HAND_BONUS, 7]), width=6)
    return rows, torch.tensor([3, 5])  # cached prefix lengths L_b


def test_padded_rows_equal_the_unpadded_ones_on_the_real_positions() -> None:
    rows, prefix = two_requests()
    layout = build_verify_layout(rows, prefix)
    padded = pad_verify_rows(rows, layout, 8)
    assert padded.width == 8
    assert torch.equal(padded.tokens[:, :6], rows.tokens)
    assert torch.equal(padded.positions[:, :6], layout.positions)
    assert torch.equal(padded.ancestor_mask[:, :6, :6], layout.ancestor_mask)
    assert not padded.ancestor_mask[:, :6, 6:].any()  # no real position sees a padding position
    assert torch.equal(padded.ancestor_mask[:, 6:], torch.eye(8, dtype=torch.bool)[6:].expand(2, 2, 8))
    assert torch.equal(padded.tokens[:, 6:], torch.tensor([[HAND_BONUS] * 2, [7] * 2]))
    assert torch.equal(padded.positions[:, 6:], prefix[:, None].expand(2, 2))  # the root's position


def test_the_padded_flat_mask_holds_the_unpadded_blocks() -> None:
    rows, prefix = two_requests()
    layout = build_verify_layout(rows, prefix)
    real, width = 6, 8
    flat = flat_custom_mask(layout.ancestor_mask, prefix)
    padded_flat = flat_custom_mask(pad_verify_rows(rows, layout, width).ancestor_mask, prefix)
    start, padded_start = 0, 0
    for b, length in enumerate(prefix.tolist()):
        block = flat[start : start + real * (length + real)].view(real, length + real)
        padded_block = padded_flat[padded_start : padded_start + width * (length + width)]
        padded_block = padded_block.view(width, length + width)
        assert torch.equal(padded_block[:real, : length + real], block), b
        assert not padded_block[:real, length + real :].any()
        assert padded_block[real:, :length].all()  # padding attends to the prefix ...
        assert torch.equal(
            padded_block[real:, length:], torch.eye(width, dtype=torch.bool)[real:]
        )  # ... + self
        start += real * (length + real)
        padded_start += width * (length + width)


def test_no_padding_returns_the_unpadded_tensors() -> None:
    rows, prefix = two_requests()
    layout = build_verify_layout(rows, prefix)
    same = pad_verify_rows(rows, layout, 6)
    assert same.tokens is rows.tokens
    assert same.positions is layout.positions
    assert same.ancestor_mask is layout.ancestor_mask


def test_bad_padding_is_refused() -> None:
    rows, prefix = two_requests()
    layout = build_verify_layout(rows, prefix)
    with pytest.raises(ValueError, match="padded width"):
        pad_verify_rows(rows, layout, 5)
    first = TreeBatch(rows.tokens[:1], rows.parents[:1], rows.depths[:1])
    other = build_verify_layout(first, prefix[:1])  # one request's layout for two requests' rows
    with pytest.raises(ValueError, match="do not match rows"):
        pad_verify_rows(rows, other, 8)


class OneLayerTarget:
    """A one-layer attention model standing in for the target: embeddings with a position term, one
    grouped-query attention over the cached prefix and the verify tokens (the flat custom mask decides
    who sees whom, as in SGLang's TARGET_VERIFY), a residual, and a tied LM head. float64."""

    def __init__(self, vocab: int = 64, hidden: int = 16, seed: int = 0) -> None:
        generator = torch.Generator().manual_seed(seed)
        self.embed = torch.randn(vocab, hidden, generator=generator, dtype=torch.float64)
        self.position = torch.randn(256, hidden, generator=generator, dtype=torch.float64)
        # two query heads and one key/value head of hidden / 2 features each
        self.wq = torch.randn(hidden, hidden, generator=generator, dtype=torch.float64) / hidden**0.5
        self.wk, self.wv = (
            torch.randn(hidden, hidden // 2, generator=generator, dtype=torch.float64) / hidden**0.5
            for _ in range(2)
        )

    def states(self, tokens: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """[T] tokens at [T] positions -> [T, hidden] input states."""
        return self.embed[tokens] + self.position[positions]

    def verify_logits(
        self,
        prefix_tokens: list[torch.Tensor],
        tokens: torch.Tensor,
        positions: torch.Tensor,
        flat_mask: torch.Tensor,
    ) -> torch.Tensor:
        """Logits [B * W, vocab] of a verify pass over tokens/positions [B, W] after each request's
        prefix (its cached tokens at positions 0..L-1); flat_mask: the pass's flat custom mask."""
        batch, width = tokens.shape
        out, start = [], 0
        for b in range(batch):
            length = prefix_tokens[b].shape[0]
            cached = self.states(prefix_tokens[b], torch.arange(length))
            fresh = self.states(tokens[b], positions[b])
            keys = torch.cat([cached, fresh])
            mask = flat_mask[start : start + width * (length + width)].view(width, length + width)
            start += width * (length + width)
            q = (fresh @ self.wq).view(width, 2, -1)
            k = (keys @ self.wk).view(length + width, 1, -1)
            v = (keys @ self.wv).view(length + width, 1, -1)
            attended = tree_attention(q, k, v, mask, scale=0.5).reshape(width, -1)
            out.append((fresh + attended) @ self.embed.T)
        return torch.cat(out)


def test_padding_changes_nothing_the_real_positions_compute_and_is_never_accepted() -> None:
    rows, prefix = two_requests()
    layout = build_verify_layout(rows, prefix)
    target = OneLayerTarget()
    prefix_tokens = [torch.arange(1, 1 + length) for length in prefix.tolist()]
    real = rows.width
    logits = target.verify_logits(
        prefix_tokens, rows.tokens, layout.positions, flat_custom_mask(layout.ancestor_mask, prefix)
    )
    for width in (7, 8, 16):
        padded = pad_verify_rows(rows, layout, width)
        padded_logits = target.verify_logits(
            prefix_tokens, padded.tokens, padded.positions, flat_custom_mask(padded.ancestor_mask, prefix)
        )
        assert padded_logits.shape == (2 * width, 64)
        kept = real_rows(padded_logits, 2, real)
        torch.testing.assert_close(kept, logits, rtol=1e-12, atol=1e-12)
        accept = accept_greedy(rows, kept.view(2, real, -1))
        expected = accept_greedy(rows, logits.view(2, real, -1))
        assert torch.equal(accept.accept_index, expected.accept_index)
        assert torch.equal(accept.bonus_tokens, expected.bonus_tokens)
        assert int(accept.accept_index.max()) < real  # padding positions are never accepted


def test_a_mask_that_let_real_positions_see_padding_would_change_their_logits() -> None:
    """The check above can fail: with the real rows seeing the padding positions the logits move."""
    rows, prefix = two_requests()
    layout = build_verify_layout(rows, prefix)
    target = OneLayerTarget()
    prefix_tokens = [torch.arange(1, 1 + length) for length in prefix.tolist()]
    logits = target.verify_logits(
        prefix_tokens, rows.tokens, layout.positions, flat_custom_mask(layout.ancestor_mask, prefix)
    )
    padded = pad_verify_rows(rows, layout, 8)
    leaky = padded.ancestor_mask.clone()
    leaky[:, :6, 6:] = True
    leaky_logits = target.verify_logits(
        prefix_tokens, padded.tokens, padded.positions, flat_custom_mask(leaky, prefix)
    )
    assert not torch.allclose(real_rows(leaky_logits, 2, 6), logits)


def test_real_rows_keeps_the_real_positions_of_each_request() -> None:
    values = torch.arange(2 * 5 * 3).view(10, 3)  # B = 2 requests, W_v = 5 positions, 3 features
    kept = real_rows(values, 2, 3)
    assert torch.equal(kept, torch.cat([values[0:3], values[5:8]]))
    assert real_rows(values, 2, 5) is values
    hidden = torch.arange(8.0)  # one feature per row, 1-D
    assert torch.equal(real_rows(hidden, 2, 1), torch.tensor([0.0, 4.0]))
    with pytest.raises(ValueError, match="do not hold"):
        real_rows(values, 3, 3)
    with pytest.raises(ValueError, match="do not hold"):
        real_rows(values, 2, 6)


def test_without_a_startup_graph_runner_every_step_verifies_eagerly() -> None:
    """On CPU (or with --disable-cuda-graph) no graph widths are planned, and a target whose startup capture
    left no graph runner gets no runners: each step verifies at its own width, the runner left as it is."""
    from sglang.srt.model_executor.model_runner import ModelRunner

    from bastion_sglang.step.graphs import capture_verify_graphs, planned_graph_widths

    assert planned_graph_widths(torch.device("cpu"), BUCKETS) == ()
    runner = ModelRunner.__new__(ModelRunner)  # only the attribute capture_verify_graphs reads is set
    runner.decode_cuda_graph_runner = None
    graphs = capture_verify_graphs(runner, BUCKETS)
    assert (graphs.widths, graphs.max_batch, graphs.extra_memory_gb) == ((), 0, 0.0)
    shape = graphs.shape_for(11, 64)
    assert shape == VerifyShape(11, False, None)
    with graphs.installed(runner, shape):
        assert runner.decode_cuda_graph_runner is None


def test_a_startup_runner_with_sglangs_causal_verify_graphs_is_refused() -> None:
    """SGLang's own DecodeCudaGraphRunner captures the DFlash family's verify without the tree mask; BASTION
    refuses to add widths beside it rather than replay causal graphs."""
    from sglang.srt.model_executor.model_runner import ModelRunner
    from sglang.srt.model_executor.runner.decode_cuda_graph_runner import DecodeCudaGraphRunner

    from bastion_sglang.step.graphs import capture_verify_graphs

    runner = ModelRunner.__new__(ModelRunner)
    runner.decode_cuda_graph_runner = DecodeCudaGraphRunner.__new__(DecodeCudaGraphRunner)  # never captured
    with pytest.raises(RuntimeError, match="causal mask"):
        capture_verify_graphs(runner, BUCKETS)


def test_padded_verify_pass_is_layout_then_padding_then_flat_mask() -> None:
    rows, prefix = two_requests()
    verify = padded_verify_pass(rows, prefix, 8, seq_lens_sum=int(prefix.sum()))
    layout = build_verify_layout(rows, prefix)
    padded = pad_verify_rows(rows, layout, 8)
    assert torch.equal(verify.layout.ancestor_mask, layout.ancestor_mask)
    assert torch.equal(verify.layout.first_child, layout.first_child)
    assert torch.equal(verify.rows.tokens, padded.tokens)
    assert torch.equal(verify.rows.positions, padded.positions)
    assert torch.equal(verify.custom_mask, flat_custom_mask(padded.ancestor_mask, prefix))
    assert verify.rows.width == 8 and verify.layout.positions.shape == (2, 6)
