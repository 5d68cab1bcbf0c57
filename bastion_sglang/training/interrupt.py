"""Stopping a training run on SIGTERM or SIGINT with a checkpoint, not losing the steps since the last one.

A run that is killed between checkpoints loses up to `--checkpoint-minutes` of training; a run stopped with
`kill PID` or Ctrl-C inside `StopOnSignal` finishes the step it is in, writes its checkpoint (the export
and its measurements first) and returns, so `--resume` goes on from that step. A second signal while the
checkpoint is written gets the signal's previous handler (Ctrl-C twice ends the process at once).
"""

from __future__ import annotations

import logging
import signal
import threading
from types import FrameType, TracebackType

logger = logging.getLogger(__name__)

STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT)


class StopOnSignal:
    """Context manager: while inside, SIGTERM and SIGINT set `requested` instead of ending the process.

    Handlers are installed only in the main thread (the only one Python delivers signals to); elsewhere
    `requested` stays False. The previous handlers are restored on exit.
    """

    def __init__(self, activity: str) -> None:
        self.activity = activity
        self.received: signal.Signals | None = None
        self._previous: dict[signal.Signals, signal.Handlers | object] = {}

    @property
    def requested(self) -> bool:
        return self.received is not None

    def __enter__(self) -> StopOnSignal:
        if threading.current_thread() is threading.main_thread():
            for signum in STOP_SIGNALS:
                self._previous[signum] = signal.signal(signum, self._handle)
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        for signum, handler in self._previous.items():
            signal.signal(signum, handler)  # type: ignore[arg-type]
        self._previous.clear()

    def _handle(self, signum: int, frame: FrameType | None) -> None:
        received = signal.Signals(signum)
        if self.received is not None:
            signal.signal(received, self._previous.get(received, signal.SIG_DFL))  # type: ignore[arg-type]
            signal.raise_signal(received)
            return
        self.received = received
        logger.warning(
            "%s: %s received; finishing this step and writing a checkpoint (send it again to stop at once)",
            self.activity,
            received.name,
        )
