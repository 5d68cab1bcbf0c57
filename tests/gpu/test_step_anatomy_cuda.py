"""`step_anatomy` on CUDA: a read of a device tensor is one sync, a read of a host tensor none, and the
aten ops of known sequences are counted as on the CPU."""

from __future__ import annotations

import pytest
import torch

from bastion_sglang.step.step_anatomy import OUTSIDE, StageCounts, StepAnatomy, StepCounts


def counted_syncs(work: object, device: torch.device) -> dict[str, int]:
    anatomy = StepAnatomy(host_tensors_sync=False, sink=lambda record: None)
    t = torch.arange(3, device=device)
    host = torch.arange(3)
    anatomy.open_step(1, ())
    anatomy.set_kind("plain")
    work(t, host)  # type: ignore[operator]
    record = anatomy.close_step()
    assert record is not None
    return record.stages.get(OUTSIDE, StageCounts()).syncs


@pytest.mark.parametrize(
    ("work", "expected"),
    [
        (lambda t, host: t[0].item(), {"item": 1}),
        (lambda t, host: t.tolist(), {"tolist": 1}),
        (lambda t, host: bool(t[1]), {"bool": 1}),
        (lambda t, host: int(t.sum()), {"int": 1}),
        (lambda t, host: t.cpu(), {"cpu": 1}),
        (lambda t, host: t.cpu().tolist(), {"cpu": 1}),
        (lambda t, host: t.to("cpu"), {"to": 1}),
        (lambda t, host: t.to(host.device), {"to": 1}),
        (lambda t, host: t.nonzero(), {"nonzero": 1}),
        (lambda t, host: t[t > 0], {"bool_index": 1}),
        (lambda t, host: t.to("cpu", non_blocking=True), {}),
        (lambda t, host: [*host.tolist(), host[0].item()], {}),
        (lambda t, host: host.to(t.device), {}),
        (lambda t, host: t + 1, {}),
    ],
)
def test_device_reads_sync_and_host_reads_do_not(
    work: object, expected: dict[str, int], device: torch.device
) -> None:
    assert counted_syncs(work, device) == expected


def test_ops_on_the_device_are_counted(device: torch.device) -> None:
    records: list[StepCounts] = []
    anatomy = StepAnatomy(host_tensors_sync=False, sink=records.append)
    x = torch.ones(4, device=device)
    anatomy.open_step(1, ())
    anatomy.set_kind("plain")
    y = x + 1
    y = y * 2
    y = y - 1
    value = y[0].item()
    anatomy.close_step()
    assert value == 3.0
    assert records[0].stages[OUTSIDE] == StageCounts(ops=4, views=1, syncs={"item": 1})
