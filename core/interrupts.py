"""Ctrl-C between steps, not inside one: a KeyboardInterrupt raised halfway through a scheduler's or a KV cache's
bookkeeping (a sequence's blocks half freed, a fork half made) leaked blocks and left requests no step could end."""
from __future__ import annotations

import signal
import threading
from types import FrameType, TracebackType
from typing import Any


class HeldInterrupts:
    """A context manager that holds SIGINT back while the engine changes its state, then hands it to the handler
    that was in place (Python's default raises KeyboardInterrupt).

    Only the main thread receives signals, and only a Python-level handler is held back (SIGINT ignored, or left
    to the OS, stays so). A held Ctrl-C lands when the call ends, also when it raised (that error is then the
    KeyboardInterrupt's ``__context__``). A second Ctrl-C in the same call is handed on at once, so a step that hangs
    can still be stopped (the engine may then be inconsistent). Nested entries hold nothing more. Its cost is two
    ``signal.signal`` calls per call into the engine (microseconds: the handler installed and put back).
    """

    def __init__(self) -> None:
        self.depth = 0
        self.previous: Any = None  # the handler in place while one is held back; None: nothing held back
        self.received: FrameType | None | bool = False  # the frame of the held signal, or False: none held
        self.handler = self._hold  # one bound method: installed and compared as the same object

    def _hold(self, signum: int, frame: FrameType | None) -> None:
        if self.received is not False and self.previous is not None:  # pressed again: stop now
            self.previous(signum, frame)
        self.received = frame

    def __enter__(self) -> None:
        self.depth += 1
        if self.depth == 1 and threading.current_thread() is threading.main_thread():
            self.received = False  # before the handler goes in: a Ctrl-C that comes as it goes in is kept
            try:
                previous = signal.signal(signal.SIGINT, self.handler)
            except ValueError:  # a subinterpreter's main thread (mod_wsgi, say) may not set handlers: hold nothing
                return
            if callable(previous):
                self.previous = previous
            else:  # ignored, or the OS default's: no Python exception can come of it
                signal.signal(signal.SIGINT, previous)
                if self.received is not False and previous == signal.SIG_DFL:  # one came as the handler went in
                    signal.raise_signal(signal.SIGINT)

    def __exit__(self, kind: type[BaseException] | None, error: BaseException | None,
                 traceback: TracebackType | None) -> None:
        self.depth -= 1
        if self.depth or (previous := self.previous) is None:
            return
        signal.signal(signal.SIGINT, previous)  # first: from here a Ctrl-C goes to it, and none lands unseen below
        frame, self.previous, self.received = self.received, None, False
        if frame is not False and not (kind is not None and issubclass(kind, KeyboardInterrupt)):
            previous(signal.SIGINT, frame)  # the Ctrl-C it held lands now; a call that raised has the error as the
            # KeyboardInterrupt's __context__ (a caller that caught the error would have lost the Ctrl-C)
