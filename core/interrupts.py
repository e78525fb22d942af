"""Ctrl-C between steps, not inside one: a KeyboardInterrupt raised halfway through a scheduler's or a KV cache's
bookkeeping (a sequence's blocks half freed, a fork half made) leaked blocks and left requests no step could end."""
from __future__ import annotations

import contextlib
import signal
import threading
from collections.abc import Iterator
from types import FrameType
from typing import Any


class HeldInterrupts:
    """Holds SIGINT back while the engine changes its state, then hands it to the handler that was in place.

    Only the main thread receives signals, and only a Python-level handler (the default one raises
    KeyboardInterrupt) is held back; a second Ctrl-C in the same step is handed on at once (a step that hangs can
    still be stopped, though the engine may then be inconsistent). Nested calls hold nothing more.
    """

    def __init__(self) -> None:
        self.depth = 0
        self.received: FrameType | None | bool = False  # the frame of the held signal, or False: none held
        self.previous: Any = None

    def _hold(self, signum: int, frame: FrameType | None) -> None:
        if self.received is not False:  # pressed again: stop now
            self.previous(signum, frame)
        self.received = frame

    @contextlib.contextmanager
    def held(self) -> Iterator[None]:
        """Within it, SIGINT is recorded; on leaving it normally, the recorded one reaches the previous handler."""
        previous = None if self.depth or threading.current_thread() is not threading.main_thread() \
            else signal.getsignal(signal.SIGINT)
        if not callable(previous):  # nested, off the main thread, or SIGINT ignored or the OS default's
            yield
            return
        self.previous, self.received, self.depth = previous, False, 1
        signal.signal(signal.SIGINT, self._hold)
        try:
            yield
        finally:
            signal.signal(signal.SIGINT, previous)
            self.depth, self.previous = 0, None
        if (frame := self.received) is not False:
            self.received = False
            previous(signal.SIGINT, frame)
