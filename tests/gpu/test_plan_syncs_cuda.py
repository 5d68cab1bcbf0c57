"""The draft and plan stages' device reads on CUDA, where only reads of device tensors sync: a calibrated
plan and its record (raw-Â metric included) make one sync, built on the host or by the beam; a beam batch
copies itself to the host once however often it is read; `selector_logprobs` at a host temperature makes
none, bit for bit the division it replaces; the one packed host copy of a CUDA draft is the draft bit for
bit."""

from __future__ import annotations

import pytest
import torch
from test_draft_host_copy import (
    CALIBRATION,
    RawAccept,
    controller,
    counted_reads,
    host_copy_is_the_draft_bit_for_bit,
    old_selector_logprobs,
    one_copy,
    random_lattice,
    raw_accept_by_device_scores,
    top_k,
)

from bastion_sglang.controller.batched import build_trees_unchecked, builds_on_host
from bastion_sglang.controller.lattice_tree import selector_logprobs
from bastion_sglang.step.lattice_plan import plan_draft
from bastion_sglang.step.step_anatomy import StepCounts


def syncs(record: StepCounts) -> dict[str, int]:
    """The syncs of a counted step, by call site."""
    sites: dict[str, int] = {}
    for counts in record.stages.values():
        for site, n in counts.sites.items():
            if site.startswith("sync "):
                sites[site] = sites.get(site, 0) + n
    return sites


@pytest.mark.parametrize(("kind", "batch"), [("top-k", 8), ("top-k", 40), ("lattice", 8)])
def test_a_calibrated_plan_and_its_record_sync_once(kind: str, batch: int) -> None:
    """Batch 8 builds on the host (one copy of the draft, raw values beside it), batch 40 by the beam (one
    copy of the trees, raw scores beside them); the record's raw Â and the deepest row read that copy."""
    planner = controller(CALIBRATION, "cuda")
    sink = RawAccept()
    planner.metrics = sink
    step = planner.begin([100] * batch, [True] * batch, [f"r{b}" for b in range(batch)])
    draft = top_k(batch, seed=batch, device="cuda") if kind == "top-k" else random_lattice(batch, 8, "cuda")
    planned = []

    def plan_and_record() -> None:
        planned.append(plan_draft(planner, step, draft, 4))
        planner.record(step, planned[0], planned[0].trees.deepest(planned[0].plan.width - 1))

    record = counted_reads(plan_and_record, host_tensors_sync=False)
    on_host = kind == "lattice" or builds_on_host(batch, 16, torch.device("cuda"))
    assert on_host == (batch == 8)
    assert sum(syncs(record).values()) == 1, syncs(record)
    (site,) = syncs(record)
    assert site.endswith(" host_drafts"), site  # the draft's copy on the host, or the beam trees'
    want = raw_accept_by_device_scores(planned[0])
    assert sink.raw[0] == pytest.approx(want, rel=1e-12)


def test_a_beam_batch_copies_itself_once() -> None:
    top = top_k(40, seed=3, device="cuda")
    trees = build_trees_unchecked(top.logprobs, top.token_ids, 16)
    hosts = []
    record = counted_reads(
        lambda: hosts.extend([trees.on_host(), trees.on_host(), trees.deepest(16), trees.on_host()]),
        host_tensors_sync=False,
    )
    assert list(syncs(record).values()) == [1], syncs(record)
    assert hosts[0] is hosts[1] is hosts[3]
    for field in ("tokens", "parents", "depths", "log_scores"):
        assert torch.equal(getattr(hosts[0], field), getattr(trees, field).cpu()), field


@pytest.mark.parametrize("temperature", [1.0, 0.0, 0.7])
def test_selector_logprobs_at_a_host_temperature_does_not_sync(temperature: float) -> None:
    generator = torch.Generator().manual_seed(4)
    scores = (3.0 * torch.randn(4, 5, 8, 8, generator=generator)).to("cuda", torch.bfloat16)
    got = []
    per_request = torch.full((4,), temperature)  # on the host: checked there
    record = counted_reads(
        lambda: got.extend([selector_logprobs(scores, temperature), selector_logprobs(scores, per_request)]),
        host_tensors_sync=False,
    )
    assert syncs(record) == {}
    want = old_selector_logprobs(scores, temperature)
    for result in got:
        assert torch.equal(result.view(torch.int32), want.view(torch.int32))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16, torch.float64])
@pytest.mark.parametrize("lattice", [False, True])
def test_the_host_copy_of_a_cuda_draft_is_the_draft_bit_for_bit(dtype: torch.dtype, lattice: bool) -> None:
    """tests/test_draft_host_copy.py's check, of a draft on CUDA."""
    host_copy_is_the_draft_bit_for_bit("cuda", dtype, lattice)


@pytest.mark.parametrize("kind", ["top-k", "lattice"])
def test_on_cuda_a_host_built_plan_syncs_once(kind: str) -> None:
    """On CUDA (only reads of device tensors count) the whole plan of a host-built step is one sync."""
    planner = controller(CALIBRATION, "cuda")
    step = planner.begin([100] * 8, [True] * 8, [f"r{b}" for b in range(8)])
    draft = top_k(8, seed=8, device="cuda") if kind == "top-k" else random_lattice(8, seed=8, device="cuda")
    record = counted_reads(lambda: plan_draft(planner, step, draft, 4), host_tensors_sync=False)
    assert sum(counts.sync_count for counts in record.stages.values()) == 1
    one_copy(record)
