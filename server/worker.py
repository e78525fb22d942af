"""EngineWorker: the one thread that drives the Engine. The asyncio side talks to it only through queues.

Commands go in through a thread-safe inbox (add, cancel, abort, call, beam search); the outputs of each engine
iteration go back to the event loop in one ``call_soon_threadsafe`` batch, into the per-request
:class:`~infer.server.streams.RequestStream` queues. Every call into the engine (add_request, step, abort, kv,
scheduler, stats, beam search) happens on the worker thread. A beam search starts at once and runs beside the
requests, a token per engine step; its future gets its result when it ends, and cancelling the future stops it.
"""
from __future__ import annotations

import asyncio
import logging
import queue
import threading
import time
from collections.abc import Callable, Sequence as Seq
from concurrent.futures import Future
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

from ..core.chat import Prompt
from ..core.errors import InferError, InvalidRequestError, NotFoundError
from ..core.pooling import PoolingParams
from ..core.request import RequestOutput, SamplingParams
from .snapshot import EngineSnapshot, Throughput, read_snapshot
from .streams import ACCEPTED, RequestStream

if TYPE_CHECKING:  # core.beam_search imports torch, which the server's clients do not need
    from ..core.beam_search import BeamSearchOutput, BeamSearchParams

log = logging.getLogger("infer.server")

class EngineFault(Exception):
    """An unexpected exception inside the engine; the server answers INTERNAL and keeps serving."""


class ServerUnavailable(Exception):
    """The server is shutting down or not ready; gRPC: UNAVAILABLE."""


class ServerFull(Exception):
    """More requests are in flight than --max-queue allows; gRPC: RESOURCE_EXHAUSTED, HTTP: 429 (retry later)."""


class SearchLike(Protocol):
    """What the worker needs from :class:`~infer.core.beam_search.BeamSearch`."""

    @property
    def done(self) -> bool: ...

    def result(self) -> list[BeamSearchOutput]: ...


class EngineLike(Protocol):
    """What the worker needs from :class:`~infer.core.engine.Engine`."""

    def add_request(self, prompt: Prompt, params: SamplingParams | PoolingParams | None = None,
                    request_id: str | None = None, arrival_time: float | None = None) -> str: ...

    def step(self) -> list[RequestOutput]: ...

    def abort(self, request_id: str) -> RequestOutput: ...

    def has_unfinished(self) -> bool: ...  # requests or beam searches under way

    def start_beam_search(self, prompts: Seq[Prompt], params: BeamSearchParams | None = None) -> SearchLike: ...

    def abort_beam_search(self, search: SearchLike) -> None: ...


@dataclass
class _Add:
    prompt: Prompt
    params: SamplingParams | PoolingParams  # a generation request's, or an embedding request's
    stream: RequestStream
    arrival: float  # time.perf_counter() when the call came in: the engine counts TTFT and aging from there


@dataclass
class _Cancel:
    stream: RequestStream


@dataclass
class _Abort:
    request_id: str
    reply: Future[RequestOutput | None]


@dataclass
class _Call:
    fn: Callable[[Any], Any]
    reply: Future[Any]


@dataclass
class _Search:
    prompts: Seq[Prompt]
    params: BeamSearchParams
    reply: Future[list[BeamSearchOutput]]
    request_id: str = ""


@dataclass(eq=False)
class _RunningSearch:
    reply: Future[list[BeamSearchOutput]]
    search: SearchLike
    request_id: str  # "": none given, so only cancelling its call stops it


_STOP = object()


class EngineWorker:
    """Owns an engine and drives it from one background thread. Methods are safe to call from any thread."""

    def __init__(self, engine: EngineLike, on_fatal: Callable[[BaseException], None] | None = None) -> None:
        self.engine = engine
        self.on_fatal = on_fatal  # called on the worker thread if it dies (the server turns NOT_SERVING)
        self._inbox: queue.SimpleQueue[object] = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._run, name="infer-engine", daemon=True)
        self._lock = threading.Lock()  # orders puts against the shutdown
        self._stopped = False
        # owned by the worker thread
        self._streams: dict[str, RequestStream] = {}
        self._current: object | None = None  # the command being handled
        self._refusal: BaseException = ServerUnavailable("the server is shutting down")  # after the stop
        self._outbox: list[tuple[RequestStream, RequestOutput | BaseException]] = []
        self._throughput = Throughput()
        self._searches: list[_RunningSearch] = []  # started, not yet answered

    # ------------------------------------------------------------ any thread
    @property
    def serving(self) -> bool:
        """Whether the engine thread runs and takes requests: False before start, after a stop and after it failed."""
        return self._thread.is_alive() and not self._stopped

    def start(self) -> None:
        self._thread.start()

    def stop(self, timeout: float = 30.0) -> None:
        """Abort what is left (its streams get UNAVAILABLE), then end the thread."""
        if self._thread.is_alive():
            self._put(_STOP)
            self._thread.join(timeout)

    def submit(self, prompt: Prompt, params: SamplingParams | PoolingParams, stream: RequestStream) -> None:
        """Queue a request (an embedding request with PoolingParams); its outputs (or its error) arrive on
        ``stream``."""
        self._put(_Add(prompt, params, stream, time.perf_counter()))

    def cancel(self, stream: RequestStream) -> None:
        """The reader went away (client cancel, deadline): abort the request if it still runs."""
        self._put(_Cancel(stream))

    def abort(self, request_id: str) -> Future[RequestOutput | None]:
        """Abort a request by id (its stream gets the final ABORT output, the future too) or a beam search (it
        answers with its best beams so far; the future gets None). The future raises NotFoundError for unknown
        ids."""
        reply: Future[RequestOutput | None] = Future()
        self._put(_Abort(request_id, reply))
        return reply

    def call(self, fn: Callable[[Any], Any]) -> Future[Any]:
        """Run ``fn(engine)`` on the worker thread, between two steps."""
        reply: Future[Any] = Future()
        self._put(_Call(fn, reply))
        return reply

    def beam_search(self, prompts: Seq[Prompt], params: BeamSearchParams,
                    request_id: str = "") -> Future[list[BeamSearchOutput]]:
        """Start a beam search now, beside the requests (a bad prompt, or a ``request_id`` in use, fails the
        future at once); the future gets its outputs when it ends. Cancelling the future (the caller gave up) stops
        the search and frees its KV; ``abort(request_id)`` stops it too, its outputs the best beams so far."""
        reply: Future[list[BeamSearchOutput]] = Future()
        self._put(_Search(prompts, params, reply, request_id))
        return reply

    def snapshot(self) -> Future[EngineSnapshot]:
        """The engine's load, read on the worker thread (consistent with the engine's own state)."""
        return self.call(lambda engine: read_snapshot(engine, self._throughput.rate(time.monotonic()),
                                                      len(self._searches)))

    def _put(self, cmd: object) -> None:
        with self._lock:
            if not self._stopped:
                self._inbox.put(cmd)
                return
        _refuse(cmd, self._refusal)

    # ------------------------------------------------------------ worker thread
    def _run(self) -> None:
        try:
            self._loop()
        except BaseException as exc:  # a bug here, not in the engine (whose errors _step contains)
            log.exception("the engine thread failed; failing every request and refusing new ones")
            if self.on_fatal is not None:  # first: no client hears of the failure before the health check does
                try:
                    self.on_fatal(exc)
                except Exception:
                    log.exception("reporting the engine thread's failure failed")
            fault = EngineFault(f"the server's engine thread failed ({exc!r}); the server must be restarted")
            self._fail_all(fault)
            self._fail_current(fault)
            self._flush()
            self._refusal = ServerUnavailable("the server's engine thread failed, so this server must be restarted; "
                                              "retry on another replica")
            self._stop_accepting()

    def _fail_current(self, error: BaseException) -> None:
        """The command being handled when the thread died is in no stream table and no queue: answer it."""
        cmd, self._current = self._current, None
        if isinstance(cmd, _Add):
            self._outbox.append((cmd.stream, error))
        elif isinstance(cmd, (_Abort, _Call, _Search)) and not cmd.reply.done():
            cmd.reply.set_exception(error)

    def _loop(self) -> None:
        while True:
            try:
                cmd: object | None = self._inbox.get(block=not self.engine.has_unfinished())
            except queue.Empty:
                cmd = None
            while cmd is not None:
                if cmd is _STOP:
                    self._shutdown()
                    return
                self._current = cmd  # answered by _run if the thread dies handling it
                self._handle(cmd)
                self._current = None
                try:
                    cmd = self._inbox.get_nowait()
                except queue.Empty:
                    cmd = None
            self._stop_abandoned_searches()
            if self.engine.has_unfinished():
                self._step()
            self._answer_searches()
            self._flush()

    def _handle(self, cmd: object) -> None:
        if isinstance(cmd, _Add):
            self._add(cmd)
        elif isinstance(cmd, _Cancel):
            rid = cmd.stream.request_id
            if self._streams.get(rid) is cmd.stream:
                del self._streams[rid]
                self._abort_quietly(rid)
        elif isinstance(cmd, _Abort):  # the abort happens even if its caller gave up waiting
            _resolve(cmd.reply, lambda: self._abort_and_deliver(cmd.request_id), even_if_cancelled=True)
        elif isinstance(cmd, _Call):
            _resolve(cmd.reply, lambda: cmd.fn(self.engine))
        elif isinstance(cmd, _Search):
            self._start_search(cmd)

    def _start_search(self, cmd: _Search) -> None:
        if cmd.reply.cancelled():  # its caller gave up before it started
            return
        try:
            if cmd.request_id and self._in_use(cmd.request_id):
                raise InvalidRequestError(f"request id {cmd.request_id!r} is already in use")
            search = self.engine.start_beam_search(cmd.prompts, cmd.params)
        except Exception as exc:  # a bad prompt or parameters: refused before any work
            if cmd.reply.set_running_or_notify_cancel():
                cmd.reply.set_exception(exc)
            return
        self._searches.append(_RunningSearch(cmd.reply, search, cmd.request_id))

    def _in_use(self, request_id: str) -> bool:
        return request_id in self._streams or self._search_named(request_id) is not None

    def _search_named(self, request_id: str) -> _RunningSearch | None:
        """The search under way with that id; one that ended (an Abort earlier in this round) is answered as this
        round ends, and no longer holds its id."""
        return next((s for s in self._searches if request_id and s.request_id == request_id and not s.search.done),
                    None)

    def _stop_abandoned_searches(self) -> None:
        """Abort the searches whose callers gave up (client cancel, deadline): their KV blocks go back now."""
        for running in [s for s in self._searches if s.reply.cancelled()]:
            self._searches.remove(running)
            self._abort_search(running.search)

    def _answer_searches(self) -> None:
        for running in [s for s in self._searches if s.search.done]:
            self._searches.remove(running)
            _resolve(running.reply, running.search.result)

    def _abort_search(self, search: SearchLike) -> None:
        try:
            self.engine.abort_beam_search(search)
        except Exception:
            log.exception("abort of a beam search failed")

    def _abort_and_deliver(self, request_id: str) -> RequestOutput | None:
        if (running := self._search_named(request_id)) is not None:  # answered with its best beams so far as
            self.engine.abort_beam_search(running.search)  # this loop round ends
            return None
        output = self.engine.abort(request_id)  # NotFoundError for unknown ids
        self._deliver(output)
        return output

    def _add(self, cmd: _Add) -> None:
        rid = cmd.stream.request_id
        try:
            if self._search_named(rid) is not None:
                raise InvalidRequestError(f"request id {rid!r} is already in use (by a beam search)")
            self.engine.add_request(cmd.prompt, cmd.params, rid, arrival_time=cmd.arrival)
        except InferError as exc:
            self._outbox.append((cmd.stream, exc))
        except Exception as exc:
            log.exception("add_request failed for request %s", rid)
            self._outbox.append((cmd.stream, EngineFault(f"internal error while adding the request: {exc!r}")))
        else:
            self._streams[rid] = cmd.stream
            self._outbox.append((cmd.stream, ACCEPTED))

    def _step(self) -> None:
        try:
            outputs = self.engine.step()
        except InferError as exc:  # a plugin that broke its contract: mapped to its status, its message intact
            log.error("engine step failed; failing the requests in flight: %s", exc)
            self._fail_all(exc)
            return
        except Exception as exc:
            log.exception("engine step failed; failing the requests in flight")
            self._fail_all(EngineFault(f"internal error in the engine step: {exc!r}"))
            return
        self._throughput.add(time.monotonic(), sum(len(c.token_ids) for output in outputs for c in output.outputs))
        for output in outputs:
            self._deliver(output)

    def _deliver(self, output: RequestOutput) -> None:
        stream = self._streams.get(output.request_id)
        if stream is None:
            return
        self._outbox.append((stream, output))
        if output.finished:
            del self._streams[output.request_id]

    def _fail_all(self, error: BaseException) -> None:
        """Abort every request and beam search this worker serves (freeing their KV) and hand each the error."""
        for rid, stream in list(self._streams.items()):
            self._abort_quietly(rid)
            self._outbox.append((stream, error))
        self._streams.clear()
        searches, self._searches = self._searches, []
        for running in searches:
            self._abort_search(running.search)
            if running.reply.set_running_or_notify_cancel():
                running.reply.set_exception(error)

    def _abort_quietly(self, rid: str) -> None:
        try:
            self.engine.abort(rid)
        except NotFoundError:
            pass
        except Exception:
            log.exception("abort of request %s failed", rid)

    def _flush(self) -> None:
        """Hand this iteration's outputs to the event loop(s) in one thread-safe call per loop."""
        if not self._outbox:
            return
        batches: dict[asyncio.AbstractEventLoop, list[tuple[RequestStream, Any]]] = {}
        for stream, item in self._outbox:
            batches.setdefault(stream.loop, []).append((stream, item))
        self._outbox = []
        for loop, batch in batches.items():
            try:
                loop.call_soon_threadsafe(_put_all, batch)
            except RuntimeError:  # the loop is closed: nobody reads these streams any more
                pass

    def _shutdown(self) -> None:
        error = ServerUnavailable("the server is shutting down and aborted the request; retry it on another replica "
                                  "or once the server is back")
        self._fail_all(error)
        self._flush()
        self._stop_accepting()

    def _stop_accepting(self) -> None:
        with self._lock:
            self._stopped = True
        while True:  # commands that came after the stop: nobody will run them
            try:
                _refuse(self._inbox.get_nowait(), self._refusal)
            except queue.Empty:
                return


def _resolve(reply: Future[Any], fn: Callable[[], Any], even_if_cancelled: bool = False) -> None:
    """Run fn and put its result or error in ``reply``. A caller that gave up (deadline, cancel) has cancelled it:
    then fn runs only ``even_if_cancelled``, and nothing is set (setting a cancelled future raises, and used to
    kill the engine thread). Marked running first, so it can no longer be cancelled meanwhile."""
    wanted = reply.set_running_or_notify_cancel()
    if not wanted and not even_if_cancelled:
        return
    try:
        result = fn()
    except BaseException as exc:
        if wanted:
            reply.set_exception(exc)
        elif not isinstance(exc, NotFoundError):  # nobody waits for this answer: the log is all that is left of it
            log.warning("a command whose caller gave up failed: %s: %s", type(exc).__name__, exc)
        return
    if wanted:
        reply.set_result(result)


def _refuse(cmd: object, error: BaseException) -> None:
    """Answer a command that arrived after the worker stopped."""
    if isinstance(cmd, (_Abort, _Call, _Search)) and cmd.reply.set_running_or_notify_cancel():
        cmd.reply.set_exception(error)
    elif isinstance(cmd, _Add):
        try:
            cmd.stream.loop.call_soon_threadsafe(cmd.stream.put, error)
        except RuntimeError:  # the loop is closed
            pass


def _put_all(batch: list[tuple[RequestStream, Any]]) -> None:
    for stream, item in batch:
        stream.put(item)
