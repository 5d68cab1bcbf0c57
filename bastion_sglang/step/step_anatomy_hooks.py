"""The step anatomy inside SGLang's scheduler process: which calls open, name, pause and close a counted step.

`bastion step-anatomy` attaches an `AnatomyRequest` to an Engine's ServerArgs record (`attach_request`); the
record is pickled into the scheduler process with it. `register_step_anatomy` (called by the plugin entry
point, `bastion_sglang.register`) hooks `Scheduler.__init__`; in a scheduler process whose arguments carry a
request, that hook installs the hooks below (SGLang's HookRegistry, applied there and then) around one
`step_anatomy.StepAnatomy`, which appends each decode step's `StepCounts` as a JSON line to the request's
file. Without a request nothing else is hooked.

A decode step, counted from `ScheduleBatch.prepare_for_decode` to the end of `Scheduler.process_batch_result`
(without overlap scheduling these run in that order for each decode batch), in regions (`step_anatomy.Level`):
- scheduler: `schedule` (prepare_for_decode: for BASTION its draft input's KV reservation), `run`
  (`Scheduler.run_batch` around the model worker), `result` (`process_batch_result`: stop checks, output
  streaming), and `scheduler` for what runs between them;
- worker: `worker`, the model worker's `forward_batch_generation` outside its stages;
- stages: BASTION's timed stages (`timing.STAGES`: draft, plan, verify, accept, commit) and its step
  controller's `begin`, `gate` (`draft_horizon`) and `observe` (`end`); SGLang's plain decode step's
  `prepare` (`ForwardBatch.init_new`) and `sample` (`ModelRunner.sample`).
Every `ModelRunner.forward` (the target's, and the DFlash drafter's) runs paused. The step's kind: `plain`
when the scheduler's model worker is SGLang's `TpModelWorker`, else what BASTION's worker took:
`_plain_step` (skipped, or declined when it drafted) or `_tree_step` (speculative).
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import IO, Any

from pydantic import BaseModel, ConfigDict, Field

from bastion_sglang.step.step_anatomy import Level, StepAnatomy, StepCounts

logger = logging.getLogger(__name__)

REQUEST_ATTR = "_bastion_step_anatomy"
"""Attribute of the ServerArgs record that carries the `AnatomyRequest` (pickled with it)."""
SCHEDULER_INIT = "sglang.srt.managers.scheduler.Scheduler.__init__"
"""Where the anatomy is installed (a BEFORE hook)."""
_WORKER = "bastion_sglang.worker.BastionWorker"
_CONTROLLER = "bastion_sglang.step.step_controller.StepController"
BASTION_TARGETS = (
    f"{_WORKER}.forward_batch_generation",
    f"{_WORKER}._plain_step",
    f"{_WORKER}._tree_step",
    "bastion_sglang.step.timing.StageTimer.stage",
    f"{_CONTROLLER}.begin",
    f"{_CONTROLLER}.draft_horizon",
    f"{_CONTROLLER}.end",
)
"""BASTION's own calls the anatomy hooks (only where the process serves BASTION)."""
CONTROLLER_REGIONS = {"begin": "begin", "draft_horizon": "gate", "end": "observe"}
"""StepController method -> the region it counts as."""


class AnatomyRequest(BaseModel):
    """What `bastion step-anatomy` asks of a scheduler process."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    records: Path = Field(description="JSON lines file that each decode step's StepCounts is appended to")
    sites: bool = Field(default=False, description="record each op's and sync's call site (slower)")


def attach_request(server_args: Any, request: AnatomyRequest) -> None:
    """Give a ServerArgs record the anatomy request its scheduler process reads at start-up."""
    setattr(server_args, REQUEST_ATTR, request)


def request_of(server_args: Any) -> AnatomyRequest | None:
    """The record's anatomy request (None: the process counts nothing)."""
    return getattr(server_args, REQUEST_ATTR, None)


def register_step_anatomy() -> None:
    """Hook `Scheduler.__init__` so that a scheduler process whose arguments carry a request installs the
    anatomy (module docstring)."""
    from sglang.srt.plugins.hook_registry import HookRegistry, HookType

    HookRegistry.register(SCHEDULER_INIT, _install_if_requested, HookType.BEFORE)


def _install_if_requested(scheduler: Any, server_args: Any, *args: Any, **kwargs: Any) -> None:
    """BEFORE hook of `Scheduler.__init__(self, server_args, ...)`; returns None (arguments unchanged)."""
    request = request_of(server_args)
    if request is None:
        return
    from bastion_sglang.integration import sglang_adapter as sgl

    sgl.require(sgl.STEP_ANATOMY_HOOKS)
    serving_bastion = str(server_args.speculative_algorithm or "").upper() == "BASTION"
    anatomy = StepAnatomy(str(server_args.device) == "cpu", JsonLinesSink(request.records), request.sites)
    hooks = AnatomyHooks(anatomy)
    hooks.install(serving_bastion)
    logger.info("step anatomy: counting every decode step into %s", request.records)


class JsonLinesSink:
    """Appends each step's counts to a JSON lines file, flushed per line."""

    def __init__(self, path: Path) -> None:
        self._file: IO[str] = path.open("a", encoding="utf-8")

    def __call__(self, record: StepCounts) -> None:
        self._file.write(record.model_dump_json() + "\n")
        self._file.flush()


class AnatomyHooks:
    """The hooks around one `StepAnatomy` (module docstring); `install` registers and applies them."""

    def __init__(self, anatomy: StepAnatomy) -> None:
        self.anatomy = anatomy

    def targets(self, serving_bastion: bool) -> dict[str, Callable[..., Any]]:
        """Dotted target -> its AROUND hook: SGLang's (`sglang_adapter.STEP_ANATOMY_HOOKS`), and BASTION's
        own where the process serves BASTION."""
        from bastion_sglang.integration import sglang_adapter as sgl

        sglang_hooks = {
            sgl.PREPARE_FOR_DECODE.target: self.prepare_for_decode,
            sgl.RUN_BATCH.target: self.run_batch,
            sgl.PROCESS_BATCH_RESULT.target: self.process_batch_result,
            sgl.TP_WORKER_STEP.target: self.tp_worker_step,
            sgl.INIT_FORWARD_BATCH.target: self.init_forward_batch,
            sgl.MODEL_FORWARD.target: self.model_forward,
            sgl.MODEL_SAMPLE.target: self.sample,
        }
        if not serving_bastion:
            return sglang_hooks
        bastion_hooks = (
            self.bastion_worker_step,
            self.plain_step,
            self.tree_step,
            self.stage,
            *(self.controller_region(region) for region in CONTROLLER_REGIONS.values()),
        )
        return sglang_hooks | dict(zip(BASTION_TARGETS, bastion_hooks, strict=True))

    def install(self, serving_bastion: bool) -> None:
        """Register every target's hook with SGLang's HookRegistry and apply them in this process."""
        from sglang.srt.plugins.hook_registry import HookRegistry, HookType

        for target, hook in self.targets(serving_bastion).items():
            HookRegistry.register(target, hook, HookType.AROUND)
        HookRegistry.apply_hooks()

    # ---- the scheduler -----------------------------------------------------------------------------

    def prepare_for_decode(self, original: Callable[..., Any], batch: Any, *args: Any, **kwargs: Any) -> Any:
        self.anatomy.open_step(len(batch.reqs), tuple(str(req.rid) for req in batch.reqs))
        with self.anatomy.region("schedule", Level.SCHEDULER):
            return original(batch, *args, **kwargs)

    def run_batch(self, original: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        with self.anatomy.region("run", Level.SCHEDULER):
            return original(*args, **kwargs)

    def process_batch_result(self, original: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        with self.anatomy.region("result", Level.SCHEDULER):
            result = original(*args, **kwargs)
        self.anatomy.close_step()
        return result

    # ---- SGLang's model worker and model runner ----------------------------------------------------

    def tp_worker_step(self, original: Callable[..., Any], worker: Any, *args: Any, **kwargs: Any) -> Any:
        """SGLang's TpModelWorker.forward_batch_generation(batch, ...): a plain step when the scheduler
        calls it with a batch (BASTION calls it inside a stage, with a ForwardBatch)."""
        batch = kwargs.get("batch", args[0] if args else None)
        if batch is not None and self.anatomy.kind is None:
            self.anatomy.set_kind("plain")
        with self.anatomy.region("worker", Level.WORKER):
            return original(worker, *args, **kwargs)

    def init_forward_batch(self, original: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        with self.anatomy.region("prepare", Level.STAGE):
            return original(*args, **kwargs)

    def sample(self, original: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        with self.anatomy.region("sample", Level.STAGE):
            return original(*args, **kwargs)

    def model_forward(self, original: Callable[..., Any], runner: Any, *args: Any, **kwargs: Any) -> Any:
        with self.anatomy.paused("drafter" if runner.is_draft_worker else "target"):
            return original(runner, *args, **kwargs)

    # ---- BASTION's worker ------------------------------------------------------------------------

    def bastion_worker_step(self, original: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        with self.anatomy.region("worker", Level.WORKER):
            return original(*args, **kwargs)

    def plain_step(
        self, original: Callable[..., Any], worker: Any, inputs: Any, step: Any, drafted: bool
    ) -> Any:
        self.anatomy.set_kind("declined" if drafted else "skipped")
        return original(worker, inputs, step, drafted=drafted)

    def tree_step(self, original: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        self.anatomy.set_kind("speculative")
        return original(*args, **kwargs)

    @contextmanager
    def stage(self, original: Callable[..., Any], timer: Any, name: str) -> Iterator[None]:
        with self.anatomy.region(name, Level.STAGE), original(timer, name):
            yield

    def controller_region(self, region: str) -> Callable[..., Any]:
        """The hook that counts a StepController call as `region`."""

        def hook(original: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
            with self.anatomy.region(region, Level.STAGE):
                return original(*args, **kwargs)

        return hook
