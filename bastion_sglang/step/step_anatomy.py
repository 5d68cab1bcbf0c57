"""What one decode step asks of torch outside the models' forwards: aten ops and host reads, per stage.

A `StepAnatomy` counts while a step is open (`open_step` .. `close_step`), with two torch modes entered:
- ops: a `TorchDispatchMode` sees every aten op the step issues (after torch's Python-level decompositions).
  `StageCounts.ops` counts the ops that are not views (on CUDA each is at most one kernel launch;
  allocations such as `aten.empty` launch none); `views` counts the view ops (`aten.view`, `aten.slice`,
  `aten.select`, ...), which launch nothing.
- syncs: the calls that block the host until a device has computed a value (`SYNC_METHODS`, `SYNC_OPS`):
  a tensor's value read into Python (`.item()`, `.tolist()`, `.numpy()`, `bool(t)`, `int(t)`, `float(t)`,
  `t` as an index), a blocking copy to the host (`.cpu()`, `.to("cpu")` without `non_blocking`; on a CPU
  run only where the call spells the host "cpu": `t.to(other.device)` moves to the device, which there is
  the host), and the ops whose output size or value depends on the data (`nonzero`, `masked_select`,
  `unique`, `equal`, boolean indexing, `repeat_interleave` without `output_size`). The Python-level ones
  never reach the dispatcher
  (`.tolist()`, `.cpu()` of a host tensor), so a `TorchFunctionMode` counts the methods and the dispatch
  mode the ops. With `host_tensors_sync` False (a CUDA run) a call counts only on a tensor that is not on
  the host: a real blocking sync. On a CPU run every tensor is a host tensor, so a call counts on any
  tensor (`host_tensors_sync` True): an upper bound of the syncs the same code makes on CUDA, where reads of
  tensors kept on the host (SGLang's `seq_lens_cpu`, say) cost none. A read chained right after a counted
  copy to the host (`t.cpu().tolist()`) is that copy's: it counts once.
  Event and stream waits (`torch.cuda.synchronize()`, `Event.synchronize()`) are not counted.

Counts go to the innermost counted region (`region(name, level)`): a region opens only inside regions of a
lower level (`Level`), so a worker's stage keeps what SGLang's helpers it calls issue, and counts outside
every region of an open step go to `OUTSIDE`. `paused(role)` stops counting while a model's forward runs
(the modes are left, so the forward runs at full speed) and counts the forward per role.

With `sites` on, every counted op and sync also names where it was issued: the first frame of the call stack
outside torch and this module (`StageCounts.sites`, keys like `sync tolist @ sglang/srt/...py:123 fn`), so a
count can be traced to the line that issues it.

No SGLang here: `step_anatomy_hooks` opens and closes the steps and the regions inside SGLang's scheduler
process, and the closed steps (`StepCounts`) go to the anatomy's sink.
"""

from __future__ import annotations

import enum
import os
import sys
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import torch
from pydantic import BaseModel, ConfigDict, Field
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode

StepKind = Literal["plain", "skipped", "declined", "speculative"]
"""plain: SGLang's own decode step (no speculation); skipped: BASTION's drafter did not run (width 1);
declined: the drafter ran and the plan chose width 1; speculative: a tree verify."""
STEP_KINDS: tuple[StepKind, ...] = ("plain", "skipped", "declined", "speculative")

OUTSIDE = "scheduler"
"""Where an open step's counts go outside every region: the scheduler loop between its hooked calls."""

SYNC_METHODS = {
    "item": "item",
    "tolist": "tolist",
    "numpy": "numpy",
    "__bool__": "bool",
    "__int__": "int",
    "__float__": "float",
    "__index__": "index",
    "cpu": "cpu",
    "to": "to",
}
"""Tensor methods that read a value to the host (torch's name -> the name counted). `to` counts only as a
blocking copy to the host."""

_aten = torch.ops.aten
SYNC_OPS = {
    _aten.nonzero: "nonzero",
    _aten.masked_select: "masked_select",
    _aten._unique2: "unique",
    _aten.unique_dim: "unique",
    _aten.unique_consecutive: "unique",
    _aten.equal: "equal",
    _aten.bincount: "bincount",
    _aten.repeat_interleave: "repeat_interleave",
    _aten.index: "bool_index",
    _aten.index_put: "bool_index",
    _aten.index_put_: "bool_index",
}
"""Aten ops whose output size or value needs the device's data on the host (-> the name counted);
`repeat_interleave` only without `output_size`, `index` and `index_put` only with a boolean index."""


class Level(enum.IntEnum):
    """How deep a region sits: a region opens only inside regions of a lower level."""

    SCHEDULER = 0  # the scheduler's calls: prepare the batch, run it, process its result
    WORKER = 1  # the model worker's forward_batch_generation
    STAGE = 2  # a stage of the worker's step


class StageCounts(BaseModel):
    """What one region of one step issued (forwards excluded)."""

    model_config = ConfigDict(extra="forbid")

    ops: int = Field(default=0, ge=0, description="aten ops that are not views")
    views: int = Field(default=0, ge=0, description="aten view ops (no kernel)")
    syncs: dict[str, int] = Field(
        default_factory=dict, description="blocking host reads by kind (`SYNC_METHODS`, `SYNC_OPS` names)"
    )
    sites: dict[str, int] = Field(
        default_factory=dict,
        description="with sites on: 'op <aten op> @ <file:line function>' or 'sync <kind> @ ...' -> count",
    )

    @property
    def sync_count(self) -> int:
        return sum(self.syncs.values())


class StepCounts(BaseModel):
    """One decode step's anatomy: its kind, batch and the counts of each region it ran."""

    model_config = ConfigDict(extra="forbid")

    index: int = Field(ge=0, description="decode steps counted before it in this process")
    kind: StepKind
    batch_size: int = Field(ge=1)
    requests: tuple[str, ...] = Field(description="the batch's request ids")
    stages: dict[str, StageCounts] = Field(
        description="region name -> its counts: every region the step entered, and `OUTSIDE` when it counted"
    )
    forwards: dict[str, int] = Field(
        description="model forwards run in the step by role (target, drafter); their ops are not counted"
    )


@dataclass
class _OpenStep:
    batch_size: int
    requests: tuple[str, ...]
    kind: StepKind | None = None
    stages: dict[str, StageCounts] = field(default_factory=dict)
    forwards: dict[str, int] = field(default_factory=dict)


class _OpMode(TorchDispatchMode):
    def __init__(self, anatomy: StepAnatomy) -> None:
        super().__init__()
        self._anatomy = anatomy

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        self._anatomy._count_op(func, args, kwargs)
        return func(*args, **kwargs)


class _ReadMode(TorchFunctionMode):
    def __init__(self, anatomy: StepAnatomy) -> None:
        super().__init__()
        self._anatomy = anatomy

    def __torch_function__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        result = func(*args, **kwargs)
        self._anatomy._after_call(SYNC_METHODS.get(getattr(func, "__name__", "")), args, kwargs, result)
        return result


def _host_copy_target(args: tuple[Any, ...], kwargs: dict[str, Any], spelled: bool) -> bool:
    """Whether `Tensor.to(*args, **kwargs)` is a blocking copy to the host. spelled: only where the call names
    the host as "cpu" (a CPU run: there `t.to(other.device)` names a device that happens to be the host)."""
    if kwargs.get("non_blocking") or any(arg is True for arg in args[1:]):
        return False
    target = kwargs.get("device")
    for arg in args[1:]:
        if isinstance(arg, str | torch.device):
            target = arg
        elif isinstance(arg, torch.Tensor):
            target = arg.device
    if target is None or (spelled and not isinstance(target, str)):
        return False
    return torch.device(target).type == "cpu"


_TORCH_DIR = os.path.dirname(torch.__file__) + os.sep
_STDLIB_DIR = os.path.dirname(os.__file__) + os.sep
_ROOTS = (os.sep + "site-packages" + os.sep, str(Path(__file__).resolve().parents[2]) + os.sep)
"""A site's path is shown from the first of these it holds: installed packages, then this repository."""


def _skipped(path: str) -> bool:
    """Frames a site is never named after: this module, torch and the standard library (contextlib, ...)."""
    if path == __file__ or path.startswith(_TORCH_DIR):
        return True
    return path.startswith(_STDLIB_DIR) and "site-packages" not in path


def call_site() -> str:
    """Where the torch call being counted was issued: 'path:line function' of the first frame outside
    `_skipped`, its path from its package's root ('sglang/srt/...', 'bastion_sglang/...')."""
    frame = sys._getframe(1)
    while frame.f_back is not None and _skipped(frame.f_code.co_filename):
        frame = frame.f_back
    path = frame.f_code.co_filename
    for root in _ROOTS:
        if root in path:
            path = path.rpartition(root)[2]
            break
    return f"{path}:{frame.f_lineno} {frame.f_code.co_name}"


class StepAnatomy:
    """Counts each open step's ops and syncs per region (module docstring).

    host_tensors_sync: whether reads of host tensors count (True on a CPU run); sink: takes each closed
    step; sites: whether each count also records its call site (`StageCounts.sites`).
    """

    def __init__(
        self, host_tensors_sync: bool, sink: Callable[[StepCounts], None], sites: bool = False
    ) -> None:
        self._host_tensors_sync = host_tensors_sync
        self._sites = sites
        self._sink = sink
        self._step: _OpenStep | None = None
        self._regions: list[tuple[str, Level]] = []
        self._pause_depth = 0
        self._modes: tuple[TorchFunctionMode, TorchDispatchMode] = (_ReadMode(self), _OpMode(self))
        self._fresh_copy: torch.Tensor | None = None  # what the last torch call copied to the host
        self._closed = 0

    @property
    def step_open(self) -> bool:
        return self._step is not None

    @property
    def kind(self) -> StepKind | None:
        """The open step's kind (None: no step open, or its kind is not known yet)."""
        return None if self._step is None else self._step.kind

    def open_step(self, batch_size: int, requests: tuple[str, ...]) -> None:
        """Start counting a decode step of `batch_size` requests (ids `requests`); a step still open is
        dropped."""
        if self._step is not None:
            self._leave_modes()
        self._step = _OpenStep(batch_size, requests)
        self._regions = []
        self._fresh_copy = None
        self._enter_modes()

    def set_kind(self, kind: StepKind) -> None:
        """Name the open step's kind (no step open: nothing)."""
        if self._step is not None:
            self._step.kind = kind

    def close_step(self) -> StepCounts | None:
        """Stop counting; the step's counts (also sent to the sink), or None when no step was open or its
        kind was never named."""
        step = self._step
        if step is None:
            return None
        self._leave_modes()
        self._step = None
        self._regions = []
        self._fresh_copy = None
        if step.kind is None:
            return None
        record = StepCounts(
            index=self._closed,
            kind=step.kind,
            batch_size=step.batch_size,
            requests=step.requests,
            stages=step.stages,
            forwards=step.forwards,
        )
        self._closed += 1
        self._sink(record)
        return record

    @contextmanager
    def region(self, name: str, level: Level) -> Iterator[None]:
        """Count the enclosed block as region `name`, unless no step is open or a region of `level` or
        deeper is open already (then the enclosing region keeps the counts)."""
        if self._step is None or (self._regions and self._regions[-1][1] >= level):
            yield
            return
        self._regions.append((name, level))
        self._step.stages.setdefault(name, StageCounts())  # a region that ran shows, if only with zeros
        try:
            yield
        finally:
            if self._regions and self._regions[-1] == (name, level):
                self._regions.pop()

    @contextmanager
    def paused(self, role: str) -> Iterator[None]:
        """Run the enclosed block (a model forward of `role`) uncounted, counting it as one forward."""
        step = self._step
        if step is None:
            yield
            return
        if self._pause_depth == 0:
            step.forwards[role] = step.forwards.get(role, 0) + 1
            self._leave_modes()
        self._pause_depth += 1
        try:
            yield
        finally:
            self._pause_depth -= 1
            if self._pause_depth == 0 and self._step is step:
                self._enter_modes()

    # ---- called by the modes ---------------------------------------------------------------------

    def _counts(self) -> StageCounts:
        assert self._step is not None
        name = self._regions[-1][0] if self._regions else OUTSIDE
        counts = self._step.stages.get(name)
        if counts is None:
            counts = self._step.stages[name] = StageCounts()
        return counts

    def _syncs_on(self, tensor: torch.Tensor) -> bool:
        """Whether reading `tensor` blocks the host (module docstring)."""
        return self._host_tensors_sync or tensor.device.type != "cpu"

    def _add_sync(self, name: str) -> None:
        counts = self._counts()
        counts.syncs[name] = counts.syncs.get(name, 0) + 1
        if self._sites:
            self._add_site(counts, f"sync {name}")

    @staticmethod
    def _add_site(counts: StageCounts, what: str) -> None:
        key = f"{what} @ {call_site()}"
        counts.sites[key] = counts.sites.get(key, 0) + 1

    def _count_op(self, func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        if self._step is None:
            return
        counts = self._counts()
        if func.is_view:
            counts.views += 1
        else:
            counts.ops += 1
            if self._sites:
                self._add_site(counts, f"op {func.overloadpacket.__name__}")
        sync = SYNC_OPS.get(func.overloadpacket)
        if sync is None or not args or not isinstance(args[0], torch.Tensor):
            return
        if sync == "repeat_interleave" and kwargs.get("output_size") is not None:
            return
        if sync == "bool_index" and not any(
            isinstance(index, torch.Tensor) and index.dtype == torch.bool for index in args[1] or ()
        ):
            return
        if self._syncs_on(args[0]):
            self._add_sync(sync)

    def _after_call(
        self, name: str | None, args: tuple[Any, ...], kwargs: dict[str, Any], result: Any
    ) -> None:
        """After a torch function or Tensor method returned: count it when it is a host read (`name`, a
        `SYNC_METHODS` name; None: another call). A read of what the call just before it copied to the host
        (`t.cpu().tolist()`) is that copy's."""
        if self._step is None:
            return
        fresh, self._fresh_copy = self._fresh_copy, None
        if name is None or not args or not isinstance(args[0], torch.Tensor) or args[0] is fresh:
            return
        if name == "to" and not _host_copy_target(args, kwargs, spelled=self._host_tensors_sync):
            return
        if not self._syncs_on(args[0]):
            return
        self._add_sync(name)
        if name in ("cpu", "to") and isinstance(result, torch.Tensor):
            self._fresh_copy = result

    def _enter_modes(self) -> None:
        for mode in self._modes:
            mode.__enter__()

    def _leave_modes(self) -> None:
        for mode in reversed(self._modes):
            mode.__exit__(None, None, None)
