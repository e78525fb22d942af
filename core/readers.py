"""Who reads an engine's deltas. ``Engine.stream`` (one request) and ``Engine.generate`` (a batch) read their own
requests' deltas whoever's call steps the engine; the deltas of every other request go to ``Engine.step()``."""
from __future__ import annotations

import weakref
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Generic, TypeVar

from .outputs import append_output
from .request import RequestOutput

if TYPE_CHECKING:
    from .engine import Engine

T = TypeVar("T")


class Readers:
    """Routes each step's deltas: those of a request that a stream or generate call owns wait for it, the rest
    for the next ``step()``. Closing a reader early aborts what it still owns."""

    def __init__(self, engine: Engine) -> None:
        self.engine = engine
        self.owned: set[str] = set()
        self.waiting: dict[str, list[RequestOutput]] = {}  # owned request -> its deltas not read yet
        self.loose: list[RequestOutput] = []  # other requests' deltas made in readers' steps, for step()
        self.abandoned: list[str] = []  # requests of readers dropped unread (appended at garbage collection)

    def route(self, outputs: list[RequestOutput]) -> None:
        if not self.owned:
            self.loose += outputs
            return
        for output in outputs:
            if output.request_id in self.owned:
                self.waiting.setdefault(output.request_id, []).append(output)
            else:
                self.loose.append(output)

    def route_owned(self, outputs: list[RequestOutput]) -> None:
        """Route the outputs of a failed step that a stream or generate call reads (step()'s are dropped with
        it: a late delivery could reach a new request of the same id)."""
        self.route([output for output in outputs if output.request_id in self.owned])

    def drop_abandoned(self) -> None:
        """Abort the requests of readers dropped before their first ``next`` (a generator that never started runs
        no clean-up): at the start of a step, not at garbage collection, which may come inside one."""
        if self.abandoned:
            ids, self.abandoned = self.abandoned, []
            self.disown([rid for rid in ids if rid in self.owned], abort=True)

    def take_loose(self) -> list[RequestOutput]:
        outputs, self.loose = self.loose, []
        return outputs

    def own(self, request_ids: list[str], body: Callable[[], Iterator[T]]) -> Reader[T]:
        self.owned.update(request_ids)
        return Reader(self, request_ids, body())

    def disown(self, request_ids: list[str], abort: bool) -> None:
        """A reader is done with its requests: with ``abort``, those still running stop too."""
        if abort:
            self.engine._abort_after([rid for rid in request_ids if rid in self.owned], GeneratorExit())
        for rid in request_ids:
            self.owned.discard(rid)
            self.waiting.pop(rid, None)

    def deltas(self, rid: str) -> Iterator[RequestOutput]:
        """One request's deltas, the last one finished."""
        engine, released = self.engine, False  # released: the id is no longer this reader's to free
        try:
            while True:
                for output in self.waiting.pop(rid, ()):
                    finished = output.finished
                    if finished:  # the id is free once its request ended: a new request may take it while
                        released = True  # this reader waits at the yield (a caller's break)
                        self.disown([rid], abort=False)
                    yield output
                    if finished:
                        return
                if rid in self.waiting:  # deltas that others' steps made while this reader was not read
                    continue
                if rid not in engine.requests:  # ended without a final delta: nothing more will come
                    return
                engine._advance()
        except BaseException as exc:  # the caller stopped reading: free the request rather than decode it for nobody
            if not released:
                released = self.abort_when_safe([rid], exc)
            raise
        finally:
            if not released:
                self.disown([rid], abort=False)

    def completions(self, index: dict[str, int], results: dict[str, RequestOutput]
                    ) -> Iterator[tuple[int, RequestOutput]]:
        """(index, full output) of each request of ``results`` as it finishes."""
        engine, owned = self.engine, list(results)
        try:
            while results:
                # the requests with deltas waiting, not every pending one: an offline batch may hold thousands
                for rid in [rid for rid in self.waiting if rid in results]:
                    for delta in self.waiting.pop(rid):
                        # merged at once, so no delta outlives its step: held until the end, they made the
                        # postprocess phase about 2 us per output token slower (host_overhead.py; most likely the
                        # garbage collector scanning them)
                        append_output(results[rid], delta)
                        if delta.finished:
                            yield index[rid], results.pop(rid)
                            break
                if results and not engine._has_work():  # ended without a final delta (a failed step's)
                    for rid in [rid for rid in results if rid not in engine.requests and rid not in self.waiting]:
                        yield index[rid], results.pop(rid)
                if results:
                    engine._advance()
        except BaseException as exc:  # the caller stopped early (GeneratorExit), or an error: free what is left
            if self.abort_when_safe(list(results), exc):
                owned = [rid for rid in owned if rid not in results]
            raise
        finally:
            self.disown(owned, abort=False)

    def abort_when_safe(self, request_ids: list[str], exc: BaseException) -> bool:
        """Abort the requests of a reader that stopped; inside a step (the garbage collector closed it there: a
        reference cycle) they are aborted at the next step's start instead, still owned (returns True)."""
        if self.engine.stepping:
            self.abandoned += request_ids
            return True
        self.engine._abort_after(request_ids, exc)
        return False


class Reader(Iterator[T], Generic[T]):
    """What ``stream`` and ``generate_as_completed`` return. ``close()`` (or leaving a ``with`` block) before the
    end aborts the requests still running, even before the first ``next``."""

    def __init__(self, readers: Readers, request_ids: list[str], body: Iterator[T]) -> None:
        self.readers, self.request_ids, self.body = readers, request_ids, body
        # dropped unread: aborted at the next step (once started, the body's own clean-up runs when it is dropped)
        self.dropped: weakref.finalize | None = weakref.finalize(self, readers.abandoned.extend, request_ids)

    def __next__(self) -> T:
        if self.dropped is not None:
            self.dropped, dropped = None, self.dropped
            dropped.detach()
        return next(self.body)

    def close(self) -> None:
        started = self.dropped is None
        if self.dropped is not None:
            self.dropped.detach()
        if hasattr(self.body, "close"):
            self.body.close()  # once started, closing it aborts what is left (and frees the ids it owns)
        if not started:  # before, nothing runs, so:
            self.readers.disown(self.request_ids, abort=True)

    def __enter__(self) -> Reader[T]:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()
