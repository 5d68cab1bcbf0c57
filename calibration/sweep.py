"""The measurement grid and the measurements: verify latency over (tree width, context), and the step costs.

Grid. Widths s (tokens per verify pass, root included): the powers of two and their midpoints
(2, 3, 4, 6, 8, 12, 16, 24, ...) below the largest width, then the largest width itself, so every captured
bucket of the default power-of-two schedule and the cap N_max + 1 are measured (`width_grid`); or an
explicit list. Width 1 (a verify of the root alone) is no speculative step: a tree with at least one draft
node verifies s >= 2 tokens, and plain decoding (no tree) is measured on its own, below. Contexts c: powers
of two from 64 up to the largest context, which is always included (`context_grid`).

Batches. A server verifies B requests' trees in one pass, B·s tokens, and a plain decode step reads B
tokens; the token-dependent parts of a pass (GEMMs below and above the ridge) are measured at B = 1 only up to
the widest pass. So besides batch 1 at every context, the grid measures each batch size B > 1 of `batches` at
the smallest context (attention is per request, measured across contexts at B = 1): the narrowest, middle and
widest widths s with B·s <= `batch_tokens`, and plain decode of B requests (`batch_widths`).

Verify latency. Per context the engine fills its KV cache with c tokens and the drafter runs once on it;
the best-first tree of the drafter's top-K (K = the server's default) at the largest budget gives, for
every width s, the first s - 1 nodes: the verify pass runs the same tokens, positions and ancestor mask as
a decode step would. The timed runs are interleaved: `repeats` rounds, each over every context (the cache
refilled) and every width, one timed run per point and round (the KV it wrote dropped before every call),
so that a slow spell of a shared machine spreads over the whole grid instead of shifting the points of one
context; the first round warms every point up `warmup` times, later rounds each refilled context once. The
median over the rounds is the sample.

Plain decode (L_AR(c)). At every context of the grid, one plain decode step of the target (one token,
greedy pick), timed in the same rounds: the samples of mode "decode" the plain decode fit is fitted on.

Step costs (BASTION eq. 7), at the middle context of the grid:
- T_draft: one drafter pass (block [bonus, MASK × (γ-1)], LM head, top-K), median;
- L_AR: one plain decode step of the target (one token, greedy pick), median;
- T_aux, t_aux_per_token: the controller and kernel calls of a decode step outside the two forwards, on
  the drafter's real top-K: `build_trees` at N_max, `plan_batch` with the adaptive policy on the fitted
  latency model, then at a given verify width W `flatten_trees`, `build_verify_layout`, `flat_custom_mask`
  where the engine needs one (SGLang), `accept_greedy` on target-shaped logits, `accepted_kv_moves`;
  median at the narrowest, the middle and the widest width of the grid, fitted as T_aux +
  t_aux_per_token·W by non-negative least squares (`aux_line`).
"""

from __future__ import annotations

import logging
import statistics
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from functools import partial
from typing import Protocol

import numpy as np
import torch
from scipy.optimize import nnls
from tqdm.auto import tqdm

from bastion_sglang import kernels
from bastion_sglang.controller.batched import DraftTreeBatch, build_trees, build_trees_unchecked
from bastion_sglang.controller.latency import LatencyModel, LatencySample, Mode
from bastion_sglang.controller.policies import AdaptivePolicy, plan_batch
from bastion_sglang.controller.profile import StepCosts
from bastion_sglang.integration.config import DEFAULT_TOPK
from bastion_sglang.kernels.types import DraftTopK, TreeBatch, VerifyLayout
from bastion_sglang.step.timing import time_op

logger = logging.getLogger(__name__)

MIN_CONTEXT = 64
"""Smallest context of the grid, tokens."""
BATCH_TOKENS = 2048
"""Most tokens (requests × width) of a batched verify pass the grid measures."""
BONUS_TOKEN = 0
"""Token id placed at the root of the measured trees (its value does not change the cost)."""


def width_grid(max_width: int) -> tuple[int, ...]:
    """The powers of two from 2 and their midpoints below max_width, then max_width (module docstring)."""
    if isinstance(max_width, bool) or not isinstance(max_width, int) or max_width < 2:
        raise ValueError(f"the largest verify width must be an int >= 2 (root + 1 node), got {max_width!r}")
    widths = {max_width}
    power = 2
    while power < max_width:
        widths.add(power)
        if power + power // 2 < max_width:
            widths.add(power + power // 2)
        power *= 2
    return tuple(sorted(widths))


def check_widths(widths: Sequence[int]) -> tuple[int, ...]:
    """An explicit width list: sorted, unique, ints >= 2 (root + 1 node; plain decoding is measured on its
    own), at least two (the fit needs two points)."""
    values = tuple(widths)
    if (
        len(values) < 2
        or any(isinstance(w, bool) or not isinstance(w, int) or w < 2 for w in values)
        or list(values) != sorted(set(values))
    ):
        raise ValueError(
            f"--widths must be at least two sorted, unique ints >= 2 (a verify holds the root and at least "
            f"one draft node; plain decoding is measured on its own), got {list(values)}"
        )
    return values


def context_grid(max_context: int) -> tuple[int, ...]:
    """Powers of two from MIN_CONTEXT up to max_context, then max_context itself."""
    if isinstance(max_context, bool) or not isinstance(max_context, int) or max_context < MIN_CONTEXT:
        raise ValueError(f"--max-context must be an int >= {MIN_CONTEXT}, got {max_context!r}")
    contexts = []
    context = MIN_CONTEXT
    while context < max_context:
        contexts.append(context)
        context *= 2
    contexts.append(max_context)
    return tuple(contexts)


class MeasurementEngine(Protocol):
    """A target + drafter pair that runs forwards on demand: the target over B requests of the same context,
    the drafter over one.

    State: a KV cache holding B requests of `context` tokens (after `set_context`) and the drafter's context
    over them.
    """

    @property
    def device(self) -> torch.device:
        """Where the models run."""

    @property
    def needs_flat_mask(self) -> bool:
        """Whether a decode step builds SGLang's flat custom mask (part of T_aux)."""

    @property
    def max_batch(self) -> int:
        """Most requests `set_context` takes (1: the engine measures batch 1 only)."""

    @property
    def draft_vocab_size(self) -> int | None:
        """The tokens the timed draft scores (a draft vocabulary's size), None: the whole vocabulary."""

    def set_context(self, context: int, batch: int = 1, width: int | None = None) -> None:
        """Reset the caches to `batch` requests of `context` committed tokens each (target KV), with room for
        a verify pass of `width` tokens each (None: the widest the engine was opened for), and the drafter's
        context to one."""

    def draft(self, k: int) -> DraftTopK:
        """One drafter pass after the context: top-k of the next D positions, DraftTopK [1, D, k]."""

    def verify(self, rows: TreeBatch, layout: VerifyLayout) -> None:
        """One target verify pass of rows [B, W] after the context (its KV is appended to the cache)."""

    def decode(self) -> None:
        """One plain decode step after the context: one token per request, greedy pick (its KV is
        appended)."""

    def discard(self) -> None:
        """Drop whatever `verify` or `decode` appended, back to `context` tokens."""

    def vocab_size(self) -> int:
        """V, rows of the target's LM head."""

    def close(self) -> None:
        """Release the models and caches."""


@dataclass(frozen=True)
class SweepSettings:
    """How to measure: the grid, the tree source and the timing counts.

    widths: verify widths s (tokens per request, root included), sorted. contexts: cached tokens c, sorted.
    topk: K candidates per draft position. warmup / repeats: untimed / timed calls per point. batches: the
    requests per pass measured (1 first, sorted); batch_tokens: the most tokens of a batched pass (module
    docstring: "Batches").
    """

    widths: tuple[int, ...]
    contexts: tuple[int, ...]
    topk: int = DEFAULT_TOPK
    warmup: int = 3
    repeats: int = 10
    batches: tuple[int, ...] = (1,)
    batch_tokens: int = BATCH_TOKENS

    def __post_init__(self) -> None:
        check_widths(self.widths)
        if not self.contexts or list(self.contexts) != sorted(set(self.contexts)) or self.contexts[0] < 0:
            raise ValueError(f"contexts must be sorted, unique and >= 0, got {list(self.contexts)}")
        if isinstance(self.topk, bool) or not isinstance(self.topk, int) or self.topk < 1:
            raise ValueError(f"topk must be a positive int, got {self.topk!r}")
        check_batches(self.batches)
        if self.batch_tokens < 2:
            raise ValueError(
                f"batch_tokens must be >= 2 (one request's root and node), got {self.batch_tokens}"
            )

    @property
    def budget(self) -> int:
        """N_max: draft nodes of the widest pass."""
        return self.widths[-1] - 1

    @property
    def mid_context(self) -> int:
        """The context the step costs are measured at: the middle of the grid."""
        return self.contexts[len(self.contexts) // 2]

    def batch_widths(self, batch: int) -> tuple[int, ...]:
        """The widths measured at `batch` requests: every width at batch 1; above it the narrowest, middle
        and widest of the widths with batch · width <= batch_tokens (none when even the narrowest is more)."""
        if batch == 1:
            return self.widths
        fitting = [w for w in self.widths if batch * w <= self.batch_tokens]
        if not fitting:
            return ()
        return tuple(sorted({fitting[0], fitting[len(fitting) // 2], fitting[-1]}))

    def cells(self) -> tuple[tuple[int, int], ...]:
        """(context, batch) of every cache state the grid measures in: batch 1 at every context, then every
        larger batch with a width to measure at the smallest context."""
        larger = tuple((self.contexts[0], b) for b in self.batches if b > 1 and self.batch_widths(b))
        return tuple((c, 1) for c in self.contexts) + larger


def check_batches(batches: Sequence[int]) -> tuple[int, ...]:
    """Batch sizes of the grid: sorted, unique ints >= 1, starting at 1 (the per-context grid)."""
    values = tuple(batches)
    if (
        not values
        or any(isinstance(b, bool) or not isinstance(b, int) or b < 1 for b in values)
        or list(values) != sorted(set(values))
        or values[0] != 1
    ):
        raise ValueError(f"batch sizes must be sorted, unique ints >= 1 starting at 1, got {list(values)}")
    return values


def draft_trees(engine: MeasurementEngine, settings: SweepSettings) -> tuple[DraftTopK, DraftTreeBatch]:
    """The drafter's top-K at the current context and its best-first tree at N_max nodes.

    Raises ValueError when the top-K lattice holds fewer nodes than the widest pass needs."""
    top = engine.draft(min(settings.topk, engine.vocab_size()))
    trees = build_trees(top.logprobs, top.token_ids, settings.budget)
    if trees.num_nodes < settings.budget:
        depth, k = top.logprobs.shape[1:]
        raise ValueError(
            f"the drafter's {depth} positions × top-{k} give {trees.num_nodes} tree nodes, fewer than the "
            f"{settings.budget} the largest width {settings.widths[-1]} needs; lower --max-width"
        )
    return top, trees


def _verify_inputs(
    trees: DraftTreeBatch, width: int, context: int, batch: int, device: torch.device
) -> tuple[TreeBatch, VerifyLayout]:
    """Verify rows [batch, width], each the first width - 1 nodes of `trees` (one tree), and their layout
    after `context` tokens each."""
    bonus = torch.full((1,), BONUS_TOKEN, dtype=torch.int64, device=device)
    one = kernels.flatten_trees(trees, bonus, width)
    rows = TreeBatch(
        tokens=one.tokens.repeat(batch, 1),
        parents=one.parents.repeat(batch, 1),
        depths=one.depths.repeat(batch, 1),
    )
    contexts = torch.full((batch,), context, dtype=torch.int64, device=device)
    return rows, kernels.build_verify_layout(rows, contexts)


GridKey = tuple[Mode, int, int, int]
"""(mode, width, context, batch) of one grid point."""


def measure_verify_grid(engine: MeasurementEngine, settings: SweepSettings) -> list[LatencySample]:
    """Median verify seconds at every (width, context, batch) of the grid, and median plain decode seconds
    in every cache state (samples of mode "decode"), timed in interleaved rounds (module docstring), with a
    progress bar. ValueError when the grid asks for more requests than the engine takes."""
    cells = settings.cells()
    widest_batch = max(batch for _, batch in cells)
    if widest_batch > engine.max_batch:
        raise ValueError(
            f"the grid measures batches of up to {widest_batch} requests; the engine takes {engine.max_batch}"
        )
    times: dict[GridKey, list[float]] = {}
    inputs: dict[int, DraftTreeBatch] = {}
    device = engine.device
    total = sum(len(settings.batch_widths(batch)) + 1 for _, batch in cells) * settings.repeats
    with tqdm(total=total, desc="verify latency", unit="point", dynamic_ncols=True) as bar:
        for round_index in range(settings.repeats):
            for context, batch in cells:
                engine.set_context(context, batch, max(settings.batch_widths(batch)))
                if context not in inputs:
                    inputs[context] = draft_trees(engine, settings)[1]
                trees = inputs[context]
                ops: list[tuple[GridKey, Callable[[], object]]] = []
                for width in settings.batch_widths(batch):
                    rows, layout = _verify_inputs(trees, width, context, batch, device)
                    ops.append((("verify", width, context, batch), partial(engine.verify, rows, layout)))
                ops.append((("decode", 1, context, batch), engine.decode))
                if round_index > 0 and settings.warmup > 0:
                    time_op(ops[0][1], device, warmup=0, repeats=1, reset=engine.discard)  # refilled cache
                for key, op in ops:
                    warmup = settings.warmup if round_index == 0 else 0
                    seconds = time_op(op, device, warmup, 1, reset=engine.discard)[0]
                    times.setdefault(key, []).append(seconds)
                    bar.set_postfix_str(f"round {round_index + 1} {_point(key)} {seconds * 1e3:.2f} ms")
                    bar.update()
    samples = [
        LatencySample(s=width, c=context, seconds=statistics.median(values), mode=mode, batch=batch)
        for (mode, width, context, batch), values in times.items()
    ]
    for context, batch in cells:
        logger.debug(
            "context %d, batch %d: %s",
            context,
            batch,
            ", ".join(
                f"{'decode' if x.mode == 'decode' else f's={x.s}'} {x.seconds * 1e3:.2f} ms"
                for x in samples
                if (x.c, x.batch) == (context, batch)
            ),
        )
    return samples


def _point(key: GridKey) -> str:
    mode, width, context, batch = key
    return f"{'decode' if mode == 'decode' else f's={width}'} c={context}" + (
        f" B={batch}" if batch > 1 else ""
    )


@dataclass(frozen=True)
class StepCostReport:
    """Measured step costs and what T_aux was measured on."""

    costs: StepCosts
    aux_nodes: int  # draft nodes the adaptive policy chose in the timed planning
    aux_widths: tuple[int, ...]  # verify widths the aux step was timed at
    aux_seconds: tuple[float, ...]  # its median seconds at each


def aux_line(widths: Sequence[int], seconds: Sequence[float]) -> tuple[float, float]:
    """(T_aux seconds, t_aux_per_token seconds per token) of seconds ≈ T_aux + t_aux_per_token·width, both
    >= 0, by non-negative least squares. ValueError unless there are as many widths as seconds, at least
    one."""
    if len(widths) != len(seconds) or not widths:
        raise ValueError(f"aux_line needs one time per width, got {len(widths)} widths, {len(seconds)} times")
    design = np.stack([np.ones(len(widths)), np.asarray(widths, dtype=np.float64)], axis=1)
    (intercept, slope), _ = nnls(design, np.asarray(seconds, dtype=np.float64))
    return float(intercept), float(slope)


def measure_step_costs(
    engine: MeasurementEngine, settings: SweepSettings, latency: LatencyModel
) -> StepCostReport:
    """T_draft, L_AR, T_aux and t_aux_per_token at the grid's middle context (module docstring). latency:
    the fitted model the adaptive policy plans with while T_aux is timed."""
    context = settings.mid_context
    device = engine.device
    engine.set_context(context)
    top, _ = draft_trees(engine, settings)
    k = int(top.logprobs.shape[-1])
    t_draft = statistics.median(time_op(lambda: engine.draft(k), device, settings.warmup, settings.repeats))
    l_ar = statistics.median(
        time_op(engine.decode, device, settings.warmup, settings.repeats, reset=engine.discard)
    )
    partial = StepCosts(t_draft=t_draft, t_aux=0.0, l_ar=l_ar)

    generator = torch.Generator(device=device).manual_seed(0)
    logits = torch.randn((1, settings.widths[-1], engine.vocab_size()), device=device, generator=generator)
    bonus = torch.full((1,), BONUS_TOKEN, dtype=torch.int64, device=device)
    ctx = torch.tensor([context], dtype=torch.int64, device=device)
    policy = AdaptivePolicy()
    chosen: list[int] = []

    def aux_step(width: int) -> None:
        trees = build_trees_unchecked(top.logprobs, top.token_ids, settings.budget)  # checked by draft_trees
        plan = plan_batch(trees, [context], latency, partial, policy)
        rows = kernels.flatten_trees(trees, bonus, width)
        layout = kernels.build_verify_layout(rows, ctx)
        if engine.needs_flat_mask:
            kernels.flat_custom_mask(layout.ancestor_mask, ctx, seq_lens_sum=context)
        accept = kernels.accept_greedy(rows, logits[:, :width])
        kernels.accepted_kv_moves(accept.accept_index, accept.accept_length, ctx)
        chosen.append(plan.node_counts[0])

    widths = settings.widths
    aux_widths = tuple(sorted({widths[0], widths[len(widths) // 2], widths[-1]}))
    aux_seconds = tuple(
        statistics.median(time_op(lambda w=width: aux_step(w), device, settings.warmup, settings.repeats))
        for width in aux_widths
    )
    t_aux, per_token = aux_line(aux_widths, aux_seconds)
    costs = StepCosts(t_draft=t_draft, t_aux=t_aux, l_ar=l_ar, t_aux_per_token=per_token)
    return StepCostReport(costs=costs, aux_nodes=chosen[-1], aux_widths=aux_widths, aux_seconds=aux_seconds)
