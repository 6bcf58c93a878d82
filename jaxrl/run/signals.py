"""SIGTERM and SIGINT (preemption, Ctrl-C, `jaxrl stop`) turned into "finish the step, checkpoint, then
exit": `stop_on_signals` hands the run loop a `StopRequest` to poll.
"""

from __future__ import annotations

import signal
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any


class StopRequest:
    """Set by SIGTERM/SIGINT while `stop_on_signals` is active. `on_signal` (if set) is called from the
    handler, for example to cancel the rollouts in flight through their event loop."""

    def __init__(self) -> None:
        self.signal: str | None = None
        self.on_signal: Callable[[], None] | None = None

    @property
    def requested(self) -> bool:
        return self.signal is not None


@contextmanager
def stop_on_signals() -> Iterator[StopRequest]:
    """Within the block, SIGTERM and SIGINT set the yielded `StopRequest` instead of killing the
    process; a second signal of the same kind gets the previous handler (a second Ctrl-C still
    interrupts). Previous handlers are restored on exit. Outside the main thread it does nothing."""
    stop = StopRequest()
    if threading.current_thread() is not threading.main_thread():
        yield stop
        return
    previous = {s: signal.getsignal(s) for s in (signal.SIGTERM, signal.SIGINT)}

    def handle(signum: int, frame: Any) -> None:
        if stop.requested:
            signal.signal(signum, previous[signum])
            signal.raise_signal(signum)
            return
        stop.signal = signal.Signals(signum).name
        if stop.on_signal is not None:
            stop.on_signal()

    for s in previous:
        signal.signal(s, handle)
    try:
        yield stop
    finally:
        for s, h in previous.items():
            signal.signal(s, h)
