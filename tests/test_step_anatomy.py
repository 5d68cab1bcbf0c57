"""The step anatomy: `step_anatomy`'s counts of known op sequences, each kind of host sync, the regions and
the pause around a forward; `step_anatomy_hooks` driven by stand-ins in the order SGLang and the worker call
them; the hook targets."""

from __future__ import annotations

import contextlib
import inspect
import pickle
import pkgutil
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from bastion_sglang.step.step_anatomy import OUTSIDE, Level, StageCounts, StepAnatomy, StepCounts
from bastion_sglang.step.step_anatomy_hooks import (
    BASTION_TARGETS,
    SCHEDULER_INIT,
    AnatomyHooks,
    AnatomyRequest,
    JsonLinesSink,
    attach_request,
    request_of,
)


def counted(host_tensors_sync: bool = True) -> tuple[StepAnatomy, list[StepCounts]]:
    records: list[StepCounts] = []
    return StepAnatomy(host_tensors_sync, records.append), records


def one_step(anatomy: StepAnatomy) -> StepCounts:
    record = anatomy.close_step()
    assert record is not None
    return record


def test_three_adds_and_an_item_are_three_ops_and_one_sync() -> None:
    anatomy, records = counted()
    x = torch.ones(4)
    anatomy.open_step(1, ("r0",))
    anatomy.set_kind("plain")
    y = x + 1
    y = y + 1
    y = y + 1
    value = y[0].item()
    record = one_step(anatomy)
    assert value == 4.0
    assert record.stages == {OUTSIDE: StageCounts(ops=4, views=1, syncs={"item": 1})}
    # the fourth op is item's own aten._local_scalar_dense; y[0] is the view
    assert records == [record] and record.kind == "plain" and record.batch_size == 1
    assert record.requests == ("r0",) and record.forwards == {} and record.index == 0


@pytest.mark.parametrize(
    ("read", "name"),
    [
        (lambda t: t.tolist(), "tolist"),
        (lambda t: t.numpy(), "numpy"),
        (lambda t: bool(t[0]), "bool"),
        (lambda t: int(t[0]), "int"),
        (lambda t: float(t[0]), "float"),
        (lambda t: [0, 1, 2][t[1]], "index"),
        (lambda t: 1 if t[1] else 0, "bool"),
        (lambda t: t.cpu(), "cpu"),
        (lambda t: t.to("cpu"), "to"),
        (lambda t: t.to(device="cpu", dtype=torch.float64), "to"),
        (lambda t: t.nonzero(), "nonzero"),
        (lambda t: torch.nonzero(t), "nonzero"),
        (lambda t: t[t > 0], "bool_index"),
        (lambda t: torch.equal(t, t), "equal"),
        (lambda t: t.unique(), "unique"),
        (lambda t: t.masked_select(t > 0), "masked_select"),
        (lambda t: torch.repeat_interleave(t, t), "repeat_interleave"),
    ],
)
def test_each_host_read_is_one_sync(read: object, name: str) -> None:
    anatomy, _ = counted()
    t = torch.arange(3)
    anatomy.open_step(1, ())
    anatomy.set_kind("plain")
    read(t)  # type: ignore[operator]
    assert one_step(anatomy).stages[OUTSIDE].syncs == {name: 1}


@pytest.mark.parametrize(
    "work",
    [
        lambda t: t.to(torch.float32),
        lambda t: t.to("cpu", non_blocking=True),
        lambda t: t.to(t.device),  # to the device, which on a CPU run is the host
        lambda t: t.to(torch.device("cpu")),
        lambda t: torch.repeat_interleave(t, t, output_size=3),
        lambda t: t[torch.tensor([0, 1])],
        lambda t: t.view(3, 1).sum(),
        lambda t: len(t),
        lambda t: t.shape[0],
    ],
)
def test_what_needs_no_value_on_the_host_is_no_sync(work: object) -> None:
    anatomy, _ = counted()
    t = torch.arange(3)
    anatomy.open_step(1, ())
    anatomy.set_kind("plain")
    work(t)  # type: ignore[operator]
    assert one_step(anatomy).stages.get(OUTSIDE, StageCounts()).syncs == {}


def test_a_copy_to_the_host_then_read_is_one_sync() -> None:
    anatomy, _ = counted()
    t = torch.arange(3)
    anatomy.open_step(1, ())
    anatomy.set_kind("plain")
    t.cpu().tolist()
    t.to("cpu").tolist()
    assert one_step(anatomy).stages[OUTSIDE].syncs == {"cpu": 1, "to": 1}


def test_on_the_cpu_a_host_copy_read_after_another_call_counts_again() -> None:
    """On a CPU run `.cpu()` returns the tensor itself, so only a read chained right after the copy is the
    copy's; on CUDA the copy is a host tensor and no read of it counts."""
    for host_tensors_sync, expected in ((True, {"cpu": 1, "tolist": 1}), (False, {})):
        anatomy, _ = counted(host_tensors_sync)
        anatomy.open_step(1, ())
        anatomy.set_kind("plain")
        host = torch.arange(3).cpu()
        host + 1
        host.tolist()
        assert one_step(anatomy).stages[OUTSIDE].syncs == expected


def test_on_a_device_run_host_tensors_do_not_sync() -> None:
    """With host_tensors_sync False (a CUDA run) only reads of tensors off the host count."""
    anatomy, _ = counted(host_tensors_sync=False)
    t = torch.arange(3)
    anatomy.open_step(1, ())
    anatomy.set_kind("plain")
    t.tolist()
    t[0].item()
    t.nonzero()
    assert one_step(anatomy).stages[OUTSIDE].syncs == {}


def test_regions_take_their_counts_and_deeper_levels_stay_in_the_enclosing_region() -> None:
    anatomy, _ = counted()
    x = torch.ones(2)
    anatomy.open_step(2, ("a", "b"))
    anatomy.set_kind("skipped")
    with anatomy.region("run", Level.SCHEDULER):
        x + 1
        with anatomy.region("worker", Level.WORKER):
            with anatomy.region("verify", Level.STAGE):
                x * 2
                with anatomy.region("worker", Level.WORKER), anatomy.region("prepare", Level.STAGE):
                    x - 1  # a worker call and its helper inside a stage: the stage's
            with anatomy.region("accept", Level.STAGE):
                x.tolist()
            x.sum()
    x / 2
    record = one_step(anatomy)
    assert {name: (c.ops, c.sync_count) for name, c in record.stages.items()} == {
        "run": (1, 0),
        "verify": (2, 0),
        "accept": (0, 1),
        "worker": (1, 0),
        OUTSIDE: (1, 0),
    }


def test_a_paused_forward_is_not_counted_but_its_calls_are() -> None:
    anatomy, _ = counted()
    x = torch.ones(3)
    anatomy.open_step(1, ())
    anatomy.set_kind("declined")
    with anatomy.region("draft", Level.STAGE):
        x + 1
        with anatomy.paused("drafter"):
            (x * 2).tolist()
            with anatomy.paused("drafter"):  # nested: still one forward
                x.sum().item()
        x + 1
    with anatomy.paused("target"):
        x + 1
    with anatomy.paused("target"):
        x + 1
    record = one_step(anatomy)
    assert record.stages == {"draft": StageCounts(ops=2)}
    assert record.forwards == {"drafter": 1, "target": 2}


def test_nothing_counts_outside_an_open_step_and_an_unnamed_step_is_dropped() -> None:
    anatomy, records = counted()
    x = torch.ones(3)
    with anatomy.region("run", Level.SCHEDULER), anatomy.paused("target"):
        x + 1
    assert anatomy.close_step() is None
    anatomy.open_step(1, ())
    x + 1
    assert anatomy.close_step() is None  # no kind: not a decode step of a known kind
    anatomy.open_step(1, ())
    anatomy.set_kind("speculative")
    x + 1
    assert one_step(anatomy).index == 0
    x + 1  # the modes are gone after the close
    assert len(records) == 1


def test_sites_name_the_line_that_issued_each_op_and_sync() -> None:
    records: list[StepCounts] = []
    anatomy = StepAnatomy(True, records.append, sites=True)
    x = torch.ones(3)
    anatomy.open_step(1, ("r0",))
    anatomy.set_kind("skipped")
    with anatomy.region("commit", Level.STAGE):
        line = inspect.currentframe().f_lineno + 1  # type: ignore[union-attr]
        y = x * 2
        y.tolist()
    stage = one_step(anatomy).stages["commit"]
    here = "tests/test_step_anatomy.py:{} test_sites_name_the_line_that_issued_each_op_and_sync"
    assert stage.sites == {f"op mul @ {here.format(line)}": 1, f"sync tolist @ {here.format(line + 1)}": 1}
    assert stage.ops == 1 and stage.syncs == {"tolist": 1}


def test_without_sites_no_site_is_recorded() -> None:
    anatomy, _ = counted()
    anatomy.open_step(1, ("r0",))
    anatomy.set_kind("plain")
    (torch.ones(2) + 1).tolist()
    assert one_step(anatomy).stages[OUTSIDE].sites == {}


def test_the_record_round_trips_through_json() -> None:
    anatomy, _ = counted()
    anatomy.open_step(1, ("r",))
    anatomy.set_kind("plain")
    torch.ones(2).tolist()
    record = one_step(anatomy)
    assert StepCounts.model_validate_json(record.model_dump_json()) == record


# ---- the scheduler-process hooks, driven by stand-ins in the order SGLang and the worker call them ----


class Calls:
    """Stand-ins for the hooked calls: each issues known ops (x + 1: one op) and reads (x.tolist())."""

    def __init__(self) -> None:
        self.x = torch.ones(3)

    def op(self, *args: object, **kwargs: object) -> torch.Tensor:
        return self.x + 1

    def read(self, *args: object, **kwargs: object) -> list[float]:
        return self.x.tolist()


def timer_stage(timer: object, name: str) -> contextlib.AbstractContextManager[None]:
    return contextlib.nullcontext()


TARGET = SimpleNamespace(is_draft_worker=False)
DRAFTER = SimpleNamespace(is_draft_worker=True)
BATCH = SimpleNamespace(reqs=[SimpleNamespace(rid="c2-0"), SimpleNamespace(rid="c2-1")])


def bastion_step(hooks: AnatomyHooks, calls: Calls, drafted: bool, tree: bool) -> None:
    """One BASTION decode step as the scheduler and `BastionWorker._decode_step` run it."""

    def verify() -> None:
        # TargetForward: SGLang's TpModelWorker with a ForwardBatch, its init_new, the target's forward
        hooks.init_forward_batch(calls.op)
        hooks.tp_worker_step(lambda worker, **kw: hooks.model_forward(calls.op, TARGET), None, batch=None)

    def width_one_or_tree(*args: object, **kwargs: object) -> None:
        with hooks.stage(timer_stage, None, "verify"):
            verify()
        with hooks.stage(timer_stage, None, "accept"):
            calls.read()
        with hooks.stage(timer_stage, None, "commit"):
            calls.op()
        hooks.controller_region("observe")(calls.op)

    def decode_step() -> None:
        hooks.controller_region("begin")(calls.read)
        hooks.controller_region("gate")(calls.op)
        if drafted:
            with hooks.stage(timer_stage, None, "draft"):
                hooks.model_forward(calls.read, DRAFTER)
                calls.op()  # the draft head, outside the drafter's forward
        with hooks.stage(timer_stage, None, "plan"):
            calls.op()
        if tree:
            hooks.tree_step(width_one_or_tree, None)
        else:
            hooks.plain_step(width_one_or_tree, None, None, None, drafted=drafted)
        calls.op()  # the step's result

    hooks.prepare_for_decode(calls.op, BATCH)
    hooks.run_batch(lambda: hooks.bastion_worker_step(decode_step))
    hooks.process_batch_result(calls.read)


def plain_step(hooks: AnatomyHooks, calls: Calls) -> None:
    """SGLang's own decode step: the scheduler calls TpModelWorker with the ScheduleBatch."""

    def forward_batch_generation(worker: object, batch: object) -> None:
        hooks.init_forward_batch(calls.op)
        hooks.model_forward(calls.op, TARGET)
        calls.op()
        hooks.sample(calls.op)

    hooks.prepare_for_decode(calls.op, BATCH)
    hooks.run_batch(lambda: hooks.tp_worker_step(forward_batch_generation, None, BATCH))
    hooks.process_batch_result(calls.read)


def ops_and_syncs(record: StepCounts) -> dict[str, tuple[int, int]]:
    return {name: (counts.ops, counts.sync_count) for name, counts in record.stages.items()}


def test_hooks_name_each_step_kind_and_count_its_regions() -> None:
    records: list[StepCounts] = []
    hooks = AnatomyHooks(StepAnatomy(True, records.append))
    calls = Calls()
    plain_step(hooks, calls)
    bastion_step(hooks, calls, drafted=False, tree=False)
    bastion_step(hooks, calls, drafted=True, tree=False)
    bastion_step(hooks, calls, drafted=True, tree=True)
    assert [r.kind for r in records] == ["plain", "skipped", "declined", "speculative"]
    assert all(r.batch_size == 2 and r.requests == ("c2-0", "c2-1") for r in records)
    plain, skipped, declined, speculative = records
    assert ops_and_syncs(plain) == {
        "schedule": (1, 0),
        "run": (0, 0),  # entered, and nothing issued outside the worker: a region that ran shows
        "prepare": (1, 0),
        "worker": (1, 0),
        "sample": (1, 0),
        "result": (0, 1),
    }
    assert plain.forwards == {"target": 1}
    shared = {
        "schedule": (1, 0),
        "run": (0, 0),
        "begin": (0, 1),
        "gate": (1, 0),
        "plan": (1, 0),
        "verify": (1, 0),  # init_new and TpModelWorker inside the verify stage stay the stage's
        "accept": (0, 1),
        "commit": (1, 0),
        "observe": (1, 0),
        "worker": (1, 0),
        "result": (0, 1),
    }
    assert ops_and_syncs(skipped) == shared and skipped.forwards == {"target": 1}
    for drafted in (declined, speculative):
        assert ops_and_syncs(drafted) == shared | {"draft": (1, 0)}  # the drafter's read is its forward's
        assert drafted.forwards == {"drafter": 1, "target": 1}


def test_a_request_travels_on_the_server_arguments(tmp_path: Path) -> None:
    server_args = SimpleNamespace()
    assert request_of(server_args) is None
    request = AnatomyRequest(records=tmp_path / "steps.jsonl")
    attach_request(server_args, request)
    assert request_of(pickle.loads(pickle.dumps(server_args))) == request


def test_the_sink_appends_one_json_line_per_step(tmp_path: Path) -> None:
    path = tmp_path / "steps.jsonl"
    anatomy = StepAnatomy(True, JsonLinesSink(path))
    for kind in ("skipped", "speculative"):
        anatomy.open_step(1, ("c1-0",))
        anatomy.set_kind(kind)  # type: ignore[arg-type]
        torch.ones(1).tolist()
        anatomy.close_step()
    lines = path.read_text().splitlines()
    assert [StepCounts.model_validate_json(line).kind for line in lines] == ["skipped", "speculative"]


def test_every_hook_target_is_declared_and_resolves() -> None:
    """SGLang's targets are the adapter's STEP_ANATOMY_HOOKS (all resolve); BASTION's own resolve too, so a
    renamed worker method fails here instead of silently counting nothing."""
    from bastion_sglang.integration import sglang_adapter as sgl
    from bastion_sglang.integration.sglang_adapter import Internal

    targets = AnatomyHooks(StepAnatomy(True, lambda record: None)).targets(serving_bastion=True)
    declared = {hook.target for hook in sgl.STEP_ANATOMY_HOOKS}
    assert sgl.missing_internals(sgl.STEP_ANATOMY_HOOKS) == []
    assert {t for t in targets if t.startswith("sglang.")} == declared
    assert set(targets) - declared == set(BASTION_TARGETS)
    for target in BASTION_TARGETS:
        owner, _, attribute = target.rpartition(".")
        assert hasattr(pkgutil.resolve_name(owner), attribute), target
    assert Internal("sglang.srt.managers.scheduler", "Scheduler", "__init__").target == SCHEDULER_INIT
    assert SCHEDULER_INIT in {hook.target for hook in sgl.REGISTRATION_HOOKS}
