"""The bench's `dflash` Engines: SGLang's own DFLASH worker, on the CPU (`dflash_cpu`) and under synthetic
acceptance (`dflash_synthetic`), with nothing of BASTION's plugin.

SGLang's Engine runs its scheduler in processes it spawns, which receive the ServerArgs record pickled; the
record's bookkeeping attributes travel with it. `mark_dflash_engine` puts a `DflashEngineMarker` on a `dflash`
Engine's record: unpickling it in a scheduler process (before the scheduler builds its models) installs what
that Engine needs there. No other Engine's record carries one, and the served plugin never installs any of it.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

MARKER_ATTR = "_bastion_bench_dflash"
"""ServerArgs bookkeeping attribute holding the marker (pickled with the record)."""


class DflashEngineMarker:
    """What a scheduler process of a `dflash` Engine installs: the CPU stand-ins (`cpu`) and the synthetic
    acceptance seam over the profile file `synthetic_acceptance` (None: off)."""

    def __init__(self, cpu: bool, synthetic_acceptance: str | None) -> None:
        self.cpu = cpu
        self.synthetic_acceptance = synthetic_acceptance

    def __reduce__(self) -> tuple[Callable[..., DflashEngineMarker], tuple[bool, str | None]]:
        return install_in_scheduler_process, (self.cpu, self.synthetic_acceptance)


def install_in_scheduler_process(cpu: bool, synthetic_acceptance: str | None) -> DflashEngineMarker:
    """Install what the marker names in this process; returns the marker (the unpickled value)."""
    if cpu:
        from bastion_sglang.bench import dflash_cpu

        dflash_cpu.install_in_scheduler_process()
    if synthetic_acceptance is not None:
        from bastion_sglang.bench import dflash_synthetic

        dflash_synthetic.install(synthetic_acceptance)
    return DflashEngineMarker(cpu, synthetic_acceptance)


def prepare_bench_process(cpu: bool) -> None:
    """Before a `dflash` Engine's ServerArgs is built in this process: on the CPU, what resolving it needs."""
    if cpu:
        from bastion_sglang.bench import dflash_cpu

        dflash_cpu.install_in_bench_process()


def mark_dflash_engine(server_args: Any, *, cpu: bool, synthetic_acceptance: str | None) -> None:
    """Make the scheduler processes of an Engine built from `server_args` install the marker's parts."""
    setattr(server_args, MARKER_ATTR, DflashEngineMarker(cpu, synthetic_acceptance))
