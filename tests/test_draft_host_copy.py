"""The drafter's draft reaches the host in ONE copy per plan (`controller.fast_tree.host_draft`): the copy is
the draft bit for bit, and the plan of a top-K draft (`StepController.plan`) or of a DFlash2 lattice
(`lattice_plan.plan_draft`), with or without a calibration, reads the draft to the host once, where it read
the log-probs and the ids in two copies before; with a calibration the same copy carries the raw log-probs,
which the raw-Â metric scores on the host. Device-built (beam) trees copy themselves to the host once and
keep the copy; `selector_logprobs` at a host temperature reads nothing. Host reads are counted by the step
anatomy (`step_anatomy.StepAnatomy`, every host read counted, as on a CPU run), each with its call site."""

from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np
import pytest
import torch

from bastion_sglang.controller.acceptance import AcceptanceCalibration, AcceptanceRecord, node_log_scores
from bastion_sglang.controller.batched import (
    DraftTreeBatch,
    build_trees,
    build_trees_auto_unchecked,
    build_trees_host,
    build_trees_host_unchecked,
    build_trees_unchecked,
)
from bastion_sglang.controller.fast_tree import build_tree_fast, host_draft, host_drafts
from bastion_sglang.controller.horizon import DraftHorizon
from bastion_sglang.controller.latency import LatencyModel
from bastion_sglang.controller.lattice_acceptance import LatticeRecord, lattice_node_log_scores
from bastion_sglang.controller.lattice_tree import (
    build_lattice_tree,
    build_lattice_trees,
    lattice_chain,
    selector_logprobs,
    weight_by_candidate_mass,
)
from bastion_sglang.controller.policies import FixedPolicy
from bastion_sglang.controller.profile import StepCosts
from bastion_sglang.controller.roofline import QWEN3_8B, RooflineModel, lookup_gpu
from bastion_sglang.controller.step_costs import StepCostTracker
from bastion_sglang.kernels.types import DraftLattice, DraftTopK
from bastion_sglang.step.lattice_plan import plan_draft
from bastion_sglang.step.step_anatomy import OUTSIDE, StepAnatomy, StepCounts
from bastion_sglang.step.step_controller import StepController, StepPlan

CALIBRATION = AcceptanceCalibration(slopes=[1.6, 1.2], offsets=[-0.3, -0.8], events=[50, 20])


def _bits(values: np.ndarray) -> np.ndarray:
    return np.ascontiguousarray(values).view(np.int64)


def awkward_values(shape: tuple[int, ...], dtype: torch.dtype, seed: int) -> torch.Tensor:
    """Random values of `dtype` with -inf, -0.0, +0.0, a subnormal and NaN among them."""
    generator = torch.Generator().manual_seed(seed)
    values = (-torch.rand(shape, generator=generator, dtype=torch.float64) * 30.0).to(dtype)
    flat = values.view(-1)
    specials = [-torch.inf, -0.0, 0.0, -torch.finfo(dtype).tiny / 4, torch.nan, torch.finfo(dtype).min]
    for i, special in enumerate(specials[: flat.numel()]):
        flat[(7 * i) % flat.numel()] = special
    return values


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16, torch.float64])
@pytest.mark.parametrize("lattice", [False, True])
def test_the_host_copy_is_the_draft_bit_for_bit(dtype: torch.dtype, lattice: bool) -> None:
    """On the CPU (tests/gpu/test_plan_syncs_cuda.py: on CUDA); `host_copy_is_the_draft_bit_for_bit`."""
    host_copy_is_the_draft_bit_for_bit("cpu", dtype, lattice)


def host_copy_is_the_draft_bit_for_bit(device: str, dtype: torch.dtype, lattice: bool) -> None:
    """Values widened to float64 exactly (NaN, -0.0, -inf and subnormals included) and ids of any int64 value
    (past 2**31 and 2**53, negative) or int32, of a top-K [B, D, K] or a lattice [B, D, K, K] beside [B, D, K]
    ids; the inputs are left as they were."""
    batch, depth, width = 3, 4, 5
    shape = (batch, depth, width, width) if lattice else (batch, depth, width)
    values = awkward_values(shape, dtype, seed=width + int(lattice)).to(device)
    generator = torch.Generator().manual_seed(1)
    ids = torch.randint(-(2**62), 2**62, (batch, depth, width), generator=generator, dtype=torch.int64)
    ids[0, 0, :3] = torch.tensor([2**53 + 1, 2**31, -1])
    before = values.clone(), ids.clone()
    for token_ids in (ids.to(device), ids.to(torch.int32).to(device)):
        host_values, host_ids = host_draft(values, token_ids)
        assert host_values.dtype == np.float64 and host_values.shape == shape
        assert host_ids.dtype == np.int64 and host_ids.shape == (batch, depth, width)
        want = values.cpu().to(torch.float64).numpy()
        assert np.array_equal(_bits(host_values), _bits(want))
        if dtype != torch.float64:  # and back to the draft's own dtype: the same bits (NaN stays NaN)
            back = torch.from_numpy(np.ascontiguousarray(host_values)).to(dtype)
            nan = values.cpu().isnan()
            assert torch.equal(back.isnan(), nan)
            as_int = torch.int16 if dtype.itemsize == 2 else torch.int32
            assert torch.equal(back.view(as_int)[~nan], values.cpu().view(as_int)[~nan])
        assert np.array_equal(host_ids, token_ids.cpu().to(torch.int64).numpy())
    assert torch.equal(values.view(torch.uint8), before[0].view(torch.uint8)) and torch.equal(ids, before[1])


def test_an_empty_batch_and_a_bad_pairing() -> None:
    host_values, host_ids = host_draft(torch.zeros(0, 3, 4, 4), torch.zeros(0, 3, 4, dtype=torch.int64))
    assert host_values.shape == (0, 3, 4, 4) and host_ids.shape == (0, 3, 4)
    with pytest.raises(ValueError, match="do not lead with token_ids"):
        host_draft(torch.zeros(2, 3, 4), torch.zeros(2, 4, 4, dtype=torch.int64))


def counted_reads(run: object, host_tensors_sync: bool = True) -> StepCounts:
    """The ops and host reads of `run()` as one step of the step anatomy, with their call sites."""
    records: list[StepCounts] = []
    anatomy = StepAnatomy(host_tensors_sync, records.append, sites=True)
    anatomy.open_step(1, ("r",))
    anatomy.set_kind("speculative")
    try:
        run()  # type: ignore[operator]
    finally:
        anatomy.close_step()
    return records[0]


def draft_reads(record: StepCounts) -> dict[str, int]:
    """The host reads issued by the code that reads a draft for the tree search (sites -> count)."""
    counts = record.stages.get(OUTSIDE)
    if counts is None:
        return {}
    builders = ("controller/batched.py", "controller/fast_tree.py", "controller/lattice_tree.py")
    return {
        site: n
        for site, n in counts.sites.items()
        if site.startswith("sync ") and any(path in site for path in builders)
    }


def one_copy(record: StepCounts) -> None:
    reads = draft_reads(record)
    assert list(reads.values()) == [1], reads
    (site,) = reads
    assert site.startswith("sync cpu @ controller/fast_tree.py:") and site.endswith(" host_drafts"), site


def top_k(batch: int, seed: int, device: str = "cpu") -> DraftTopK:
    generator = torch.Generator().manual_seed(seed)
    logits = torch.randn(batch, 5, 40, generator=generator)
    top = torch.topk(torch.log_softmax(logits, -1), 4, dim=-1)
    return DraftTopK(top.values.to(device), top.indices.to(device))


def random_lattice(batch: int, seed: int, device: str = "cpu") -> DraftLattice:
    generator = torch.Generator().manual_seed(seed)
    transitions = selector_logprobs(3.0 * torch.randn(batch, 5, 4, 4, generator=generator))
    transitions[:, 0] = transitions[:, 0, :1].clone()
    ids = torch.argsort(torch.rand(batch, 5, 40, generator=generator), -1)[..., :4]
    unary = torch.sort(torch.log_softmax(torch.randn(batch, 5, 4, generator=generator), -1), -1, True)
    return DraftLattice(DraftTopK(unary.values.to(device), ids.to(device)), transitions.to(device))


def controller(acceptance: AcceptanceCalibration | None, device: str = "cpu") -> StepController:
    return StepController(
        latency=LatencyModel(RooflineModel(QWEN3_8B, lookup_gpu("H100 SXM"))),
        costs=StepCostTracker(),
        policy=FixedPolicy(16),
        budget=16,
        horizon=DraftHorizon.full(5),
        acceptance=acceptance,
        branching=4,
        device=torch.device(device),
        fixed_costs=StepCosts(t_draft=2e-3, t_aux=4e-4, l_ar=1.8e-2),
    )


@pytest.mark.parametrize("batch", [1, 8])
@pytest.mark.parametrize("acceptance", [None, CALIBRATION])
@pytest.mark.parametrize("kind", ["top-k", "lattice"])
def test_a_plan_reads_the_draft_to_the_host_once(
    batch: int, acceptance: AcceptanceCalibration | None, kind: str
) -> None:
    """The plan of one step, as the worker asks for it (`plan_draft`), copies its draft to the host once;
    its trees are the beam's (top-K) or `build_lattice_tree`'s row by row (lattice), bit for bit."""
    planner = controller(acceptance)
    step = planner.begin([100 + 7 * b for b in range(batch)], [True] * batch, [f"r{b}" for b in range(batch)])
    draft = top_k(batch, seed=batch) if kind == "top-k" else random_lattice(batch, seed=batch)
    planned = []
    one_copy(counted_reads(lambda: planned.append(plan_draft(planner, step, draft, 4))))
    trees = planned[0].trees
    if isinstance(draft, DraftTopK):
        calibrated = draft.logprobs if acceptance is None else acceptance.apply(draft.logprobs)
        want = build_trees(calibrated, draft.token_ids, 16)
        rows = [want.row(b) for b in range(batch)]
    else:
        raw = draft.transitions  # planned on the weighted raw transitions or the calibrated ones, ties by raw
        weighted = weight_by_candidate_mass(raw, draft.unary.logprobs)
        transitions = weighted if acceptance is None else acceptance.apply(raw)
        rows = [
            build_lattice_tree(transitions[b], draft.unary.token_ids[b], 16, ties=raw[b])
            for b in range(batch)
        ]
    for b, tree in enumerate(rows):
        for field in ("tokens", "parents", "depths", "log_scores"):
            assert torch.equal(getattr(trees.row(b), field), getattr(tree, field)), field


def test_each_host_builder_and_record_reads_its_draft_once() -> None:
    top = top_k(3, seed=4)
    lattice = random_lattice(3, seed=5)
    one_copy(counted_reads(lambda: build_trees_host(top.logprobs, top.token_ids, 30)))
    one_copy(counted_reads(lambda: build_trees_auto_unchecked(top.logprobs, top.token_ids, 30)))
    one_copy(counted_reads(lambda: build_tree_fast(top.logprobs[0], top.token_ids[0], 30)))
    one_copy(counted_reads(lambda: build_lattice_trees(lattice.transitions, lattice.unary.token_ids, 30, 2)))
    one_copy(
        counted_reads(lambda: build_lattice_tree(lattice.transitions[1], lattice.unary.token_ids[1], 30))
    )
    one_copy(counted_reads(lambda: lattice_chain(lattice.transitions[2], lattice.unary.token_ids[2])))
    continuation = tuple(int(t) for t in top.token_ids[0, :, 0])
    record = AcceptanceRecord(top.logprobs[0], top.token_ids[0], continuation)
    one_copy(counted_reads(lambda: list(record.events(5))))
    path = tuple(int(t) for t in lattice.unary.token_ids[0, :, 0])
    lattice_record = LatticeRecord(lattice.transitions[0], lattice.unary.token_ids[0], path)
    one_copy(counted_reads(lambda: list(lattice_record.events(5))))


def test_several_values_share_the_one_copy() -> None:
    """`host_drafts`: a top-K's log-probs and a lattice's transitions (different trailing shapes) beside one
    set of ids, each bit for bit, in one host read; a bad leading shape names the values."""
    top, lattice = top_k(3, seed=6), random_lattice(3, seed=7)
    ids = lattice.unary.token_ids
    got: list[tuple[tuple[np.ndarray, ...], np.ndarray]] = []
    one_copy(counted_reads(lambda: got.append(host_drafts((top.logprobs, lattice.transitions), ids))))
    (values, transitions), host_ids = got[0]
    assert values.shape == (3, 5, 4) and transitions.shape == (3, 5, 4, 4)
    assert np.array_equal(_bits(values), _bits(top.logprobs.double().numpy()))
    assert np.array_equal(_bits(transitions), _bits(lattice.transitions.double().numpy()))
    assert np.array_equal(host_ids, ids.numpy())
    with pytest.raises(ValueError, match="do not lead with token_ids"):
        host_drafts((top.logprobs, torch.zeros(2, 5, 4)), ids)


class RawAccept:
    """A `StepMetrics` that keeps the raw Â of each plan it is shown and ignores the rest."""

    def __init__(self) -> None:
        self.raw: list[list[float]] = []

    def observe_plan(
        self,
        node_counts: Sequence[int],
        expected_accept: Sequence[float],
        expected_accept_raw: Sequence[float],
        estimated_speedup: float,
        calibrated: bool,
        mode: str = "speculative",
    ) -> None:
        self.raw.append(list(expected_accept_raw))

    def observe_verify(self, estimated_seconds: float, observed_seconds: float, ema_factor: float) -> None:
        return None

    def observe_stages(self, times: object, other_seconds: float | None) -> None:
        return None

    def observe_realised_speedup(self, speedup: float) -> None:
        return None

    def observe_acceptance(
        self, calibration_error: float, greedy_correction: float, sampled_correction: float
    ) -> None:
        return None

    def observe_accepted(self, accepted_drafts: Sequence[int]) -> None:
        return None

    def end_step(self) -> None:
        return None


def raw_accept_by_device_scores(planned: StepPlan) -> list[float]:
    """The raw-Â metric as it was computed before it read host data: the raw path scores of the (device)
    trees under the drafter's device draft, exp, cumsum, copied back."""
    trees, counts = planned.trees, planned.plan.node_counts
    if planned.lattice is not None:
        lattice = planned.lattice  # the raw metric sums the raw transitions weighted by in-candidate mass
        transitions = weight_by_candidate_mass(lattice.transitions, lattice.unary.logprobs)
        ids = lattice.unary.token_ids
        scores = lattice_node_log_scores(trees.tokens, trees.parents, trees.depths, transitions, ids)
    else:
        scores = node_log_scores(
            trees.tokens, trees.parents, trees.depths, planned.top.logprobs, planned.top.token_ids
        )
    gains = torch.exp(scores).cumsum(1).cpu()
    return [1.0 + (float(gains[i, n - 1]) if n > 0 else 0.0) for i, n in enumerate(counts)]


@pytest.mark.parametrize("batch", [1, 8])
@pytest.mark.parametrize("kind", ["top-k", "lattice"])
def test_a_calibrated_plan_reads_its_draft_once_and_the_metric_reads_no_device(batch: int, kind: str) -> None:
    """With a calibration the one host copy of the draft carries the raw values too: the plan and the step's
    record (raw-Â metric included) read the draft once; the metric equals the device scoring's exactly; and
    with the plan's device tensors made unreadable (the meta device) the metric reads only host data."""
    sink = RawAccept()
    planner = controller(CALIBRATION)
    planner.metrics = sink
    step = planner.begin([100 + 7 * b for b in range(batch)], [True] * batch, [f"r{b}" for b in range(batch)])
    draft = top_k(batch, seed=batch) if kind == "top-k" else random_lattice(batch, seed=batch)
    planned: list[StepPlan] = []

    def plan_and_record() -> None:
        planned.append(plan_draft(planner, step, draft, 4))
        planner.record(step, planned[0])

    one_copy(counted_reads(plan_and_record))
    plan = planned[0]
    assert sink.raw == [raw_accept_by_device_scores(plan)]
    assert plan.trees is not None and plan.trees.raw_log_scores is not None
    trees = plan.trees
    meta = DraftTreeBatch(
        *(t.to("meta") for t in (trees.tokens, trees.parents, trees.depths, trees.log_scores)),
        raw_log_scores=trees.raw_log_scores.to("meta"),
        host_copy=trees,
    )
    top = DraftTopK(plan.top.logprobs.to("meta"), plan.top.token_ids.to("meta"))
    lattice = None if plan.lattice is None else DraftLattice(top, plan.lattice.transitions.to("meta"))
    unreadable = StepPlan(plan.plan, meta, top, plan.scales, lattice)
    assert planner._raw_expected_accept(unreadable, plan.plan.node_counts) == sink.raw[0]


@pytest.mark.parametrize("acceptance", [None, CALIBRATION])
def test_beam_trees_copy_themselves_to_the_host_once(acceptance: AcceptanceCalibration | None) -> None:
    """A device-built batch's host copy (`DraftTreeBatch._read_to_host`, what `on_host` returns off the
    host): one packed read however often it is asked for, the fields bit for bit (the raw scores too)."""
    top = top_k(4, seed=9)
    calibrated = top.logprobs if acceptance is None else acceptance.apply(top.logprobs)
    raw = None if acceptance is None else top.logprobs
    trees = build_trees_unchecked(calibrated, top.token_ids, 16, raw)
    copies: list[DraftTreeBatch] = []
    record = counted_reads(lambda: copies.extend(trees._read_to_host for _ in range(3)))
    reads = draft_reads(record)
    assert list(reads.values()) == [1] and next(iter(reads)).endswith(" host_drafts"), reads
    assert copies[0] is copies[1] is copies[2]
    host = copies[0]
    for field in ("tokens", "parents", "depths"):
        assert getattr(host, field).dtype == torch.int64
        assert torch.equal(getattr(host, field), getattr(trees, field)), field
    assert torch.equal(host.log_scores.view(torch.int64), trees.log_scores.view(torch.int64))
    if acceptance is None:
        assert host.raw_log_scores is None
    else:
        want = node_log_scores(trees.tokens, trees.parents, trees.depths, top.logprobs, top.token_ids)
        assert torch.equal(host.raw_log_scores.view(torch.int64), want.view(torch.int64))
    empty = DraftTreeBatch.empty(3, "cpu")
    assert draft_reads(counted_reads(lambda: empty._read_to_host)) == {}
    assert empty._read_to_host.tokens.shape == (3, 0)


def test_the_host_builder_scores_the_raw_draft_on_its_one_copy() -> None:
    """The host builder (top-K and lattice) given raw values reads once and keeps the raw path scores,
    equal bit for bit to the device scoring of its trees."""
    top = top_k(3, seed=10)
    calibrated = CALIBRATION.apply(top.logprobs)
    built: list[DraftTreeBatch] = []
    one_copy(
        counted_reads(
            lambda: built.append(build_trees_host_unchecked(calibrated, top.token_ids, 20, top.logprobs))
        )
    )
    trees = built[0]
    assert torch.equal(trees.log_scores, build_trees(calibrated, top.token_ids, 20).log_scores)
    want = node_log_scores(trees.tokens, trees.parents, trees.depths, top.logprobs, top.token_ids)
    assert torch.equal(trees.raw_log_scores.view(torch.int64), want.view(torch.int64))
    lattice = random_lattice(3, seed=11)
    mapped = CALIBRATION.apply(lattice.transitions)
    ids = lattice.unary.token_ids
    one_copy(
        counted_reads(lambda: built.append(build_lattice_trees(mapped, ids, 20, 2, lattice.transitions)))
    )
    trees = built[1]
    assert torch.equal(trees.tokens, build_lattice_trees(mapped, ids, 20, 2).tokens)
    want = lattice_node_log_scores(trees.tokens, trees.parents, trees.depths, lattice.transitions, ids)
    assert torch.equal(trees.raw_log_scores.view(torch.int64), want.view(torch.int64))


def old_selector_logprobs(scores: torch.Tensor, temperature: float | torch.Tensor) -> torch.Tensor:
    """`selector_logprobs` as it computed before it checked host temperatures on the host."""
    temps = torch.as_tensor(temperature, dtype=torch.float32, device=scores.device)
    temps = torch.where(temps > 0, temps, torch.ones_like(temps))
    return torch.log_softmax(scores.float() / temps[..., None, None, None], dim=-1)


@pytest.mark.parametrize("temperature", [1.0, 0.0, 1 + 1e-9, 0.7, 1.5, 1, math.inf])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_selector_logprobs_at_a_host_temperature_reads_nothing(
    temperature: float, dtype: torch.dtype
) -> None:
    """A float temperature is checked on the host: no host read; the result is bit for bit the division by
    the float32 temperature on the scores' device (skipped where that temperature is 1 or 0)."""
    generator = torch.Generator().manual_seed(12)
    scores = (3.0 * torch.randn(2, 5, 4, 4, generator=generator)).to(dtype)
    scores[0, 1, 2, 3] = -torch.inf
    got: list[torch.Tensor] = []
    record = counted_reads(lambda: got.append(selector_logprobs(scores, temperature)))
    assert {site: n for site, n in record.stages[OUTSIDE].sites.items() if site.startswith("sync ")} == {}
    want = old_selector_logprobs(scores, temperature)
    assert torch.equal(got[0].view(torch.int32), want.view(torch.int32))
    per_request = selector_logprobs(scores, torch.full((2,), float(temperature)))
    assert torch.equal(got[0].view(torch.int32), per_request.view(torch.int32))
