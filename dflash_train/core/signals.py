"""SIGTERM and SIGINT caught as a flag, so that a loop stops at a boundary of its own choosing."""

from __future__ import annotations

import signal


class StopFlag:
    """Set by SIGTERM / SIGINT; the training loop finishes its step, saves and exits 0."""

    def __init__(self) -> None:
        self.requested: str | None = None
        self._previous = {}

    def install(self) -> "StopFlag":
        for sig in (signal.SIGTERM, signal.SIGINT):
            self._previous[sig] = signal.signal(sig, self._handle)
        return self

    def _handle(self, signum, frame) -> None:
        self.requested = signal.Signals(signum).name

    def restore(self) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)
        self._previous.clear()
