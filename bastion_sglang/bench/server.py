"""One policy's Engine in a process of its own, driven batch by batch over a pipe.

`PolicyServer.start` spawns the process (`serve_policy`): it starts a fresh `sglang.Engine` with the policy's
server arguments, answers one warm-up request, says it is ready, then streams each batch the parent sends
(`BatchCommand`) and sends back its requests' chunk arrivals and the seconds the generate call took
(`BatchResult`), until `close`. One process per Engine because an Engine with metrics registers its
tokenizer-side series in its process's default registry, so a second one in the same process fails on
duplicated series. The Engine's processes write their Prometheus samples into the server's `metrics_dir`
(prometheus_client's multiprocess mode is configured only by PROMETHEUS_MULTIPROC_DIR, which the scheduler
process inherits when the Engine starts it); the parent reads the histograms there.
"""

from __future__ import annotations

import contextlib
import logging
import os
import time
from dataclasses import dataclass
from multiprocessing.connection import Connection
from multiprocessing.context import SpawnContext, SpawnProcess
from pathlib import Path
from typing import Any

from bastion_sglang.bench.plan import BenchPlan, BenchPolicy, server_args_for
from bastion_sglang.bench.streaming import StreamedRequest, stream_batch

logger = logging.getLogger(__name__)

PROMETHEUS_DIR_ENV = "PROMETHEUS_MULTIPROC_DIR"
WARMUP_TOKENS = 4
"""New tokens of each Engine's warm-up request (one prompt, T = 0), excluded from every measurement."""
LOG_FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"
"""Log format of the policy processes (the `bastion` command's own)."""
ABANDON_SECONDS = 60.0
"""How long `PolicyServer.abandon` waits for a clean Engine shutdown before it kills the process."""


@dataclass(frozen=True)
class BatchCommand:
    """Stream prompts [start, end) of the plan with these per-request sampling parameters."""

    start: int
    end: int
    params: tuple[dict[str, Any], ...]


@dataclass(frozen=True)
class BatchResult:
    """One streamed batch: every request's chunk arrivals, and the generate call's wall seconds."""

    requests: tuple[StreamedRequest, ...]
    seconds: float


@dataclass(frozen=True)
class ServerFailure:
    """What the policy process sends instead of a result when it fails: the error, as text."""

    message: str


def serve_policy(
    plan: BenchPlan, policy: BenchPolicy, metrics_dir: Path, log_level: int, conn: Connection
) -> None:
    """Body of one policy's process: start the Engine, warm up, send the start-up seconds, then answer every
    `BatchCommand` with a `BatchResult` until None arrives; shut the Engine down.

    Any error is sent as a `ServerFailure` before the process exits with status 1.
    """
    import sglang

    os.environ[PROMETHEUS_DIR_ENV] = str(metrics_dir)  # read by this process's Engine and its children
    engine = None
    try:
        began = time.perf_counter()
        engine = sglang.Engine(server_args=server_args_for(plan, policy))
        # The Engine set this process's root logger to its own level and format; restore the command's.
        logging.basicConfig(level=log_level, format=LOG_FORMAT, force=True)
        logging.getLogger("sglang").setLevel(plan.sglang_log_level.upper())
        # greedy, seeded and of a fixed length: every policy serves it (synthetic acceptance refuses others)
        first = {"temperature": 0.0, "max_new_tokens": WARMUP_TOKENS, "ignore_eos": True}
        stream_batch(engine, plan.prompt_ids[:1], [first | {"sampling_seed": plan.settings.seed}])
        conn.send(time.perf_counter() - began)
        while (command := conn.recv()) is not None:
            began = time.perf_counter()
            requests = stream_batch(engine, plan.prompt_ids[command.start : command.end], command.params)
            conn.send(BatchResult(tuple(requests), time.perf_counter() - began))
    except Exception as error:
        logger.exception("%s: the benchmark process failed", policy.name)
        conn.send(ServerFailure(f"{type(error).__name__}: {error}"))
        raise SystemExit(1) from None
    finally:
        if engine is not None:
            engine.shutdown()


class PolicyServer:
    """The parent's handle on one policy's process and Engine (`serve_policy`)."""

    def __init__(
        self, policy: BenchPolicy, label: str, process: SpawnProcess, conn: Connection, metrics_dir: Path
    ) -> None:
        self.policy = policy
        self.label = label
        self.metrics_dir = metrics_dir
        self._process = process
        self._conn = conn

    @classmethod
    def start(
        cls, context: SpawnContext, plan: BenchPlan, policy: BenchPolicy, label: str, scratch: Path
    ) -> PolicyServer:
        """Spawn the process and wait until its Engine answered the warm-up; RuntimeError naming `label` if it
        fails. `scratch` (new) gets the Engine's Prometheus folder."""
        metrics_dir = scratch / "metrics"
        metrics_dir.mkdir(parents=True)
        parent_end, child_end = context.Pipe()
        process = context.Process(
            target=serve_policy,
            args=(plan, policy, metrics_dir, logging.getLogger().getEffectiveLevel(), child_end),
            name=f"bastion-bench-{label.replace(' ', '-')}",
        )
        process.start()
        child_end.close()
        server = cls(policy, label, process, parent_end, metrics_dir)
        logger.info("%s: engine ready in %.1f s", label, server._receive())
        return server

    def stream(self, start: int, end: int, params: tuple[dict[str, Any], ...]) -> BatchResult:
        """Stream prompts [start, end) of the plan through the Engine; RuntimeError naming the policy if it
        fails."""
        self._conn.send(BatchCommand(start, end, params))
        return self._receive()

    def close(self) -> None:
        """Shut the Engine down and wait for the process; RuntimeError if it exits with an error."""
        if self._process.is_alive():
            self._conn.send(None)
        self._process.join()
        self._conn.close()
        if self._process.exitcode != 0:
            raise RuntimeError(
                f"{self.label}: its benchmark process exited with status {self._process.exitcode}"
            )
        logger.info("%s: engine shut down", self.label)

    def abandon(self) -> None:
        """Shut down after another failure: ask the Engine to stop, wait up to `ABANDON_SECONDS`, then kill
        the process (the Engine's own processes die with it). Raises nothing."""
        if self._process.is_alive():
            with contextlib.suppress(OSError):
                self._conn.send(None)
            self._process.join(ABANDON_SECONDS)
        if self._process.is_alive():
            self._process.kill()
            self._process.join()
        self._conn.close()

    def _receive(self) -> Any:
        try:
            reply = self._conn.recv()
        except EOFError:
            self._process.join()
            raise RuntimeError(
                f"{self.label}: its benchmark process exited with status {self._process.exitcode} before "
                "answering (its error is logged above)"
            ) from None
        if isinstance(reply, ServerFailure):
            self._process.join()
            raise RuntimeError(f"{self.label}: {reply.message}")
        return reply
