"""Verify widths served by captured CUDA graphs: which width a step runs at, and how its rows are padded.

Terms. The planner chooses W, the verify width (tokens per request: the root plus W - 1 best-first draft
nodes). On CUDA the worker captures one target-verify graph per width bucket (`graphs.py`); a step whose W
lies between buckets runs the graph of the smallest bucket W_v >= W, so its verify rows are padded with
W_v - W *padding positions*. Padding is invisible to the real positions and to the accept walk:

- a padding position carries the root's token at the root's position and attends to the cached prefix and
  to itself only; no real position attends to it (the ancestor mask of the real rows is kept as it is), so
  every real position's attention, hidden state and logits are those of the unpadded pass;
- padding positions sit after the real ones, are nobody's parent and are dropped (`real_rows`) before the
  accept walk, which runs on the W real positions: they are never accepted;
- their KV slots are the window slots req_to_token[r, L + W : L + W_v], inside the request's reserve: the
  commit never moves them into the committed prefix, and the next step overwrites them.

A step runs eagerly at its own W (no padding) when no graph was captured, when W exceeds the largest
bucket, or when the batch is larger than the largest captured batch size.
"""

from __future__ import annotations

import enum
from collections.abc import Sequence
from dataclasses import dataclass
from numbers import Integral

import torch

from bastion_sglang import kernels
from bastion_sglang.kernels import TreeBatch, VerifyLayout


class EagerReason(enum.Enum):
    """Why a step runs eagerly although target-verify graphs were captured."""

    WIDTH = "width"  # W exceeds the largest captured width
    BATCH = "batch"  # more requests than the largest captured batch size


@dataclass(frozen=True)
class VerifyShape:
    """How one verify pass runs: `width` tokens per request, through a captured graph or eagerly."""

    width: int  # W_v: tokens per request in the target pass (the bucket on a graph, else the planned W)
    graph: bool  # True: the graph captured at `width` serves the pass
    eager_reason: EagerReason | None  # set when graphs exist but this pass runs eagerly


def validate_graph_widths(widths: Sequence[int], cap: int | None = None) -> tuple[int, ...]:
    """`widths` as a tuple after checking them: sorted, unique ints >= 1 (and <= cap when given).

    An empty sequence is valid: no graphs. Raises ValueError naming the bad value.
    """
    values = tuple(widths)
    if any(isinstance(w, bool) or not isinstance(w, Integral) for w in values):
        raise ValueError(f"graph widths must be ints, got {list(values)!r}")
    if list(values) != sorted(set(values)) or (values and values[0] < 1):
        raise ValueError(f"graph widths must be sorted, unique and >= 1, got {list(values)!r}")
    if cap is not None and values and values[-1] > cap:
        raise ValueError(f"graph width {values[-1]} exceeds the verify width cap {cap}")
    return tuple(int(w) for w in values)


def choose_verify_shape(
    width: int, batch_size: int, graph_widths: Sequence[int], max_graph_batch: int
) -> VerifyShape:
    """The shape of a verify pass of `width` tokens per request over `batch_size` requests.

    graph_widths: the captured widths (sorted, unique; empty: no graphs). max_graph_batch: the largest
    batch size the graphs were captured for. With graphs: the smallest captured width >= `width` when the
    batch fits, else eager at `width` with the reason. Raises ValueError for a bad argument.
    """
    widths = validate_graph_widths(graph_widths)
    if isinstance(width, bool) or not isinstance(width, Integral) or width < 1:
        raise ValueError(f"verify width must be an int >= 1, got {width!r}")
    if isinstance(batch_size, bool) or not isinstance(batch_size, Integral) or batch_size < 1:
        raise ValueError(f"batch size must be an int >= 1, got {batch_size!r}")
    if not widths:
        return VerifyShape(width=int(width), graph=False, eager_reason=None)
    if isinstance(max_graph_batch, bool) or not isinstance(max_graph_batch, Integral) or max_graph_batch < 1:
        raise ValueError(f"max_graph_batch must be an int >= 1 when graphs exist, got {max_graph_batch!r}")
    if batch_size > max_graph_batch:
        return VerifyShape(width=int(width), graph=False, eager_reason=EagerReason.BATCH)
    bucket = next((w for w in widths if w >= width), None)
    if bucket is None:
        return VerifyShape(width=int(width), graph=False, eager_reason=EagerReason.WIDTH)
    return VerifyShape(width=bucket, graph=True, eager_reason=None)


def planning_widths(graph_widths: Sequence[int], cap: int) -> tuple[int, ...] | None:
    """The widths a verify of W <= cap tokens per request actually runs at, for the latency model's padding.

    With graphs: the captured widths (a W between them is padded up), then every width above the largest
    one up to the cap (those run eagerly, unpadded). Without graphs: None (every W runs as it is).
    """
    widths = validate_graph_widths(graph_widths, cap)
    if not widths:
        return None
    return widths + tuple(range(widths[-1] + 1, cap + 1))


@dataclass(frozen=True)
class VerifyRows:
    """What the target's verify pass reads for B requests at W_v tokens each (real positions first)."""

    tokens: torch.Tensor  # [B, W_v] int64: real tokens, then the root token at each padding position
    positions: torch.Tensor  # [B, W_v] int64: ctx_len + depth, the root's position at padding positions
    ancestor_mask: torch.Tensor  # [B, W_v, W_v] bool: the real ancestor block, padding rows see themselves

    @property
    def width(self) -> int:
        return int(self.tokens.shape[1])


def pad_verify_rows(rows: TreeBatch, layout: VerifyLayout, width: int) -> VerifyRows:
    """The verify rows of `rows` ([B, W] real positions) padded to `width` = W_v >= W (see the module doc).

    layout: `kernels.build_verify_layout(rows, ctx_lens)`. Returns VerifyRows whose [:, :W] tokens and
    positions and [:, :W, :W] mask are the unpadded ones, with False in the real rows' padding columns;
    padding row j holds only [j, j]. With W_v == W the unpadded tensors themselves. No host sync.
    """
    batch, real = rows.tokens.shape
    if layout.positions.shape != (batch, real) or layout.ancestor_mask.shape != (batch, real, real):
        raise ValueError(
            f"layout shapes {tuple(layout.positions.shape)} / {tuple(layout.ancestor_mask.shape)} do not "
            f"match rows [{batch}, {real}]"
        )
    if isinstance(width, bool) or not isinstance(width, Integral) or width < real:
        raise ValueError(f"padded width must be an int >= the real width {real}, got {width!r}")
    if width == real:
        return VerifyRows(rows.tokens, layout.positions, layout.ancestor_mask)
    pad = width - real
    device = rows.tokens.device
    mask = torch.zeros((batch, width, width), dtype=torch.bool, device=device)
    mask[:, :real, :real] = layout.ancestor_mask
    padding = torch.arange(real, width, device=device)
    mask[:, padding, padding] = True
    return VerifyRows(
        tokens=torch.cat([rows.tokens, rows.tokens[:, :1].expand(batch, pad)], dim=1),
        positions=torch.cat([layout.positions, layout.positions[:, :1].expand(batch, pad)], dim=1),
        ancestor_mask=mask,
    )


@dataclass(frozen=True)
class VerifyPass:
    """The layout stage's output for one verify pass: the real rows' layout, padded rows, their mask."""

    layout: VerifyLayout  # of the W real positions (tree links for the grammar walk, the ancestor mask)
    rows: VerifyRows  # [B, W_v] tokens and positions, [B, W_v, W_v] ancestor mask
    custom_mask: torch.Tensor  # [Σ_b W_v·(L_b + W_v)] bool: rows.ancestor_mask flattened for SGLang


def padded_verify_pass(rows: TreeBatch, prefix: torch.Tensor, width: int, seq_lens_sum: int) -> VerifyPass:
    """Layout, padding and flat mask of the verify rows in one call: `kernels.build_verify_layout`, then
    `pad_verify_rows` to `width` = W_v >= W, then `kernels.flat_custom_mask`.

    rows: [B, W] real verify rows; prefix: [B] int64 committed lengths L_b; seq_lens_sum: Σ_b L_b (host).
    """
    layout = kernels.build_verify_layout(rows, prefix)
    padded = pad_verify_rows(rows, layout, width)
    mask = kernels.flat_custom_mask(padded.ancestor_mask, prefix, seq_lens_sum=seq_lens_sum)
    return VerifyPass(layout, padded, mask)


def real_rows(values: torch.Tensor, batch_size: int, width: int) -> torch.Tensor:
    """Per-position outputs of a (possibly padded) verify pass, restricted to the W real positions.

    values: [B * W_v, ...] rows in batch-major order (W_v >= W inferred from the row count); batch_size: B;
    width: W. Returns [B * W, ...]: `values` itself when W_v == W, else a copy without the padding rows.
    """
    rows = int(values.shape[0])
    if batch_size < 1 or rows % batch_size or rows // batch_size < width:
        raise ValueError(f"{rows} rows do not hold {batch_size} requests of at least {width} positions")
    padded = rows // batch_size
    if padded == width:
        return values
    trailing = values.shape[1:]
    return values.reshape(batch_size, padded, *trailing)[:, :width].reshape(batch_size * width, *trailing)
