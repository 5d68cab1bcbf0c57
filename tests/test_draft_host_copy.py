"""The drafter's draft reaches the host in ONE copy per plan (`controller.fast_tree.host_draft`): the copy is
the draft bit for bit, and the plan of a top-K draft (`StepController.plan`) or of a DFlash2 lattice
(`lattice_plan.plan_draft`), with or without a calibration, reads the draft to the host once, where it read
the log-probs and the ids in two copies before. Host reads are counted by the step anatomy
(`step_anatomy.StepAnatomy`, every host read counted, as on a CPU run), each with its call site."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from bastion_sglang.controller.acceptance import AcceptanceCalibration, AcceptanceRecord
from bastion_sglang.controller.batched import build_trees, build_trees_auto_unchecked, build_trees_host
from bastion_sglang.controller.fast_tree import build_tree_fast, host_draft
from bastion_sglang.controller.horizon import DraftHorizon
from bastion_sglang.controller.latency import LatencyModel
from bastion_sglang.controller.lattice_acceptance import LatticeRecord
from bastion_sglang.controller.lattice_tree import (
    build_lattice_tree,
    build_lattice_trees,
    lattice_chain,
    selector_logprobs,
)
from bastion_sglang.controller.policies import FixedPolicy
from bastion_sglang.controller.profile import StepCosts
from bastion_sglang.controller.roofline import QWEN3_8B, RooflineModel, lookup_gpu
from bastion_sglang.controller.step_costs import StepCostTracker
from bastion_sglang.kernels.types import DraftLattice, DraftTopK
from bastion_sglang.lattice_plan import plan_draft
from bastion_sglang.step_anatomy import OUTSIDE, StepAnatomy, StepCounts
from bastion_sglang.step_controller import StepController

DEVICES = [
    "cpu",
    pytest.param("cuda", marks=pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA")),
]
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


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16, torch.float64])
@pytest.mark.parametrize("lattice", [False, True])
def test_the_host_copy_is_the_draft_bit_for_bit(device: str, dtype: torch.dtype, lattice: bool) -> None:
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
    assert site.startswith("sync cpu @ controller/fast_tree.py:") and site.endswith(" host_draft"), site


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
        transitions = draft.transitions if acceptance is None else acceptance.apply(draft.transitions)
        rows = [build_lattice_tree(transitions[b], draft.unary.token_ids[b], 16) for b in range(batch)]
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


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA: a real device-to-host copy")
@pytest.mark.parametrize("kind", ["top-k", "lattice"])
def test_on_cuda_a_host_built_plan_syncs_once(kind: str) -> None:
    """On CUDA (only reads of device tensors count) the whole plan of a host-built step is one sync."""
    planner = controller(CALIBRATION, "cuda")
    step = planner.begin([100] * 8, [True] * 8, [f"r{b}" for b in range(8)])
    draft = top_k(8, seed=8, device="cuda") if kind == "top-k" else random_lattice(8, seed=8, device="cuda")
    record = counted_reads(lambda: plan_draft(planner, step, draft, 4), host_tensors_sync=False)
    assert sum(counts.sync_count for counts in record.stages.values()) == 1
    one_copy(record)
