"""The event-loop end of a request's outputs: :class:`RequestStream`, which merges the deltas a slow reader let
queue up."""
from __future__ import annotations

import asyncio
from collections import deque
from collections.abc import Callable

from ..core.outputs import append_output
from ..core.request import RequestOutput


ACCEPTED = object()  # put on a stream once the engine took its request (add_request passed)


class RequestStream:
    """The event-loop end of one request: an async iterator over its RequestOutput deltas.

    Raises the request's error (InferError, EngineFault, ServerUnavailable) in place of an output. Create it on
    the event loop that will read it.
    """

    def __init__(self, request_id: str, size_of: Callable[[RequestOutput], int] | None = None,
                 max_merged: int = 0) -> None:
        """``size_of(delta)``: what a delta adds to a merged message; merging stops before ``max_merged`` (with
        ``size_of`` None, queued deltas always merge)."""
        self.request_id = request_id
        self.loop = asyncio.get_running_loop()
        self._items: deque[RequestOutput | BaseException] = deque()
        self._ready = asyncio.Event()
        self.finished = False
        self.accepted = False  # the engine took the request: what it says now comes as outputs
        self.size_of, self.max_merged = size_of, max_merged

    def put(self, item: RequestOutput | BaseException | object) -> None:
        """Called on the event loop (the worker hands items over with ``call_soon_threadsafe``); ACCEPTED marks the
        request taken."""
        if item is ACCEPTED:
            self.accepted = True
        else:
            self._items.append(item)  # type: ignore[arg-type]
        self._ready.set()

    async def wait_accepted(self) -> None:
        """Until the engine has taken the request, or raise the error it refused it with (so that an answer can
        begin only once the request runs: an HTTP stream's 200)."""
        while not self.accepted:
            if self._items and isinstance(self._items[0], BaseException):
                self.finished = True
                raise self._items.popleft()
            self._ready.clear()
            await self._ready.wait()

    def __aiter__(self) -> RequestStream:
        return self

    async def __anext__(self) -> RequestOutput:
        """The next delta; deltas that queued up meanwhile (a slow reader) are merged into one, up to
        ``max_merged``."""
        if self.finished:
            raise StopAsyncIteration
        while not self._items:
            self._ready.clear()
            await self._ready.wait()
        item = self._items.popleft()
        if isinstance(item, BaseException):
            self.finished = True
            raise item
        parts, size = [item], None  # the merged size, measured only once a second delta waits
        while not parts[-1].finished and self._items and not isinstance(self._items[0], BaseException):
            if self.size_of is not None:
                size = (self.size_of(item) if size is None else size) + self.size_of(self._items[0])  # type: ignore
                if size > self.max_merged:
                    break
            parts.append(self._items.popleft())  # type: ignore[arg-type]
        item = merge_deltas(*parts) if len(parts) > 1 else item
        self.finished = item.finished
        return item


def merge_deltas(*deltas: RequestOutput) -> RequestOutput:
    """One delta equal to ``deltas`` in order (of the same request); the inputs are left alone."""
    first = deltas[0]
    return append_output(RequestOutput(first.request_id, first.prompt_token_ids, [], False), *deltas)
