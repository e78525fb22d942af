"""EngineWorker: the one thread that drives the Engine. The asyncio side talks to it only through queues.

Commands go in through a thread-safe inbox (add, cancel, abort, call, call alone); the outputs of each engine
iteration go back to the event loop in one ``call_soon_threadsafe`` batch, into the per-request
:class:`~infer.server.streams.RequestStream` queues. Every call into the engine (add_request, step, abort, kv,
scheduler, stats, beam search) happens on the worker thread. A call that needs the engine alone (beam search) waits
for the requests before it to finish, and requests that come after it wait for it.
"""
from __future__ import annotations

import asyncio
import logging
import queue
import threading
import time
from collections import deque
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Any, Protocol

from ..core.chat import Prompt
from ..core.errors import InferError, InvalidRequestError, NotFoundError
from ..core.request import RequestOutput, SamplingParams
from .snapshot import EngineSnapshot, Throughput, read_snapshot
from .streams import RequestStream

log = logging.getLogger("infer.server")

class EngineFault(Exception):
    """An unexpected exception inside the engine; the server answers INTERNAL and keeps serving."""


class ServerUnavailable(Exception):
    """The server is shutting down or not ready; gRPC: UNAVAILABLE."""


class EngineLike(Protocol):
    """What the worker needs from :class:`~infer.core.engine.Engine`."""

    def add_request(self, prompt: Prompt, params: SamplingParams | None = None,
                    request_id: str | None = None) -> str: ...

    def step(self) -> list[RequestOutput]: ...

    def abort(self, request_id: str) -> RequestOutput: ...

    def has_unfinished(self) -> bool: ...

    def check_request(self, prompt: Prompt, params: SamplingParams | None = None) -> list[int]: ...


@dataclass
class _Add:
    prompt: Prompt
    params: SamplingParams
    stream: RequestStream


@dataclass
class _Cancel:
    stream: RequestStream


@dataclass
class _Abort:
    request_id: str
    reply: Future[RequestOutput]


@dataclass
class _Call:
    fn: Callable[[Any], Any]
    reply: Future[Any]


class _Alone(_Call):
    """A call that needs the engine to itself (beam search): it waits for the requests before it to finish, and
    the requests after it wait for it."""


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
        self._waiting: deque[_Add | _Alone] = deque()  # from the first waiting _Alone on

    # ------------------------------------------------------------ any thread
    def start(self) -> None:
        self._thread.start()

    def stop(self, timeout: float = 30.0) -> None:
        """Abort what is left (its streams get UNAVAILABLE), then end the thread."""
        if self._thread.is_alive():
            self._put(_STOP)
            self._thread.join(timeout)

    def submit(self, prompt: Prompt, params: SamplingParams, stream: RequestStream) -> None:
        """Queue a request; its outputs (or its error) arrive on ``stream``."""
        self._put(_Add(prompt, params, stream))

    def cancel(self, stream: RequestStream) -> None:
        """The reader went away (client cancel, deadline): abort the request if it still runs."""
        self._put(_Cancel(stream))

    def abort(self, request_id: str) -> Future[RequestOutput]:
        """Abort by id; the stream gets the final ABORT output. The future raises NotFoundError for unknown ids."""
        reply: Future[RequestOutput] = Future()
        self._put(_Abort(request_id, reply))
        return reply

    def call(self, fn: Callable[[Any], Any]) -> Future[Any]:
        """Run ``fn(engine)`` on the worker thread, between two steps."""
        reply: Future[Any] = Future()
        self._put(_Call(fn, reply))
        return reply

    def call_alone(self, fn: Callable[[Any], Any]) -> Future[Any]:
        """Run ``fn(engine)`` on the worker thread once the engine has no requests; requests submitted after it
        wait for it (first come, first served)."""
        reply: Future[Any] = Future()
        self._put(_Alone(fn, reply))
        return reply

    def snapshot(self) -> Future[EngineSnapshot]:
        """The engine's load, read on the worker thread (consistent with the engine's own state); requests held
        behind an exclusive call count as queued."""
        return self.call(lambda engine: read_snapshot(engine, self._throughput.rate(time.monotonic()),
                                                      sum(isinstance(c, _Add) for c in self._waiting)))

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
            self._refuse_waiting(fault)
            self._flush()
            self._refusal = ServerUnavailable("the server's engine thread failed, so this server must be restarted; "
                                              "retry on another replica")
            self._stop_accepting()

    def _fail_current(self, error: BaseException) -> None:
        """The command being handled when the thread died is in no stream table and no queue: answer it."""
        cmd, self._current = self._current, None
        if isinstance(cmd, _Add):
            self._outbox.append((cmd.stream, error))
        elif isinstance(cmd, (_Abort, _Call)) and not cmd.reply.done():
            cmd.reply.set_exception(error)

    def _loop(self) -> None:
        while True:
            try:  # an idle engine with an exclusive call waiting runs it now, without waiting for a command
                cmd: object | None = self._inbox.get(block=not self.engine.has_unfinished() and not self._waiting)
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
            self._run_waiting()
            if self.engine.has_unfinished():
                self._step()
            self._flush()

    def _run_waiting(self) -> None:
        """Start the waiting commands in order, up to an exclusive call the engine is not yet free for."""
        while self._waiting:
            head = self._waiting[0]
            if isinstance(head, _Alone) and head.reply.cancelled():  # its caller gave up: it holds nobody back
                self._waiting.popleft()
                continue
            if isinstance(head, _Alone) and self.engine.has_unfinished():
                return
            self._current = self._waiting.popleft()
            if isinstance(head, _Alone):
                _resolve(head.reply, lambda: head.fn(self.engine))
            else:
                self._add(head)
            self._current = None

    def _handle(self, cmd: object) -> None:
        if isinstance(cmd, _Alone) or (isinstance(cmd, _Add) and self._waiting):
            self._hold(cmd)
        elif isinstance(cmd, _Add):
            self._add(cmd)
        elif isinstance(cmd, _Cancel):
            rid = cmd.stream.request_id
            if self._streams.get(rid) is cmd.stream:
                del self._streams[rid]
                self._abort_quietly(rid)
            else:  # still waiting behind an exclusive call: it never starts
                self._waiting = deque(c for c in self._waiting
                                                  if not (isinstance(c, _Add) and c.stream is cmd.stream))
        elif isinstance(cmd, _Abort):  # the abort happens even if its caller gave up waiting
            _resolve(cmd.reply, lambda: self._abort_and_deliver(cmd.request_id), even_if_cancelled=True)
        elif isinstance(cmd, _Call):
            _resolve(cmd.reply, lambda: cmd.fn(self.engine))

    def _hold(self, cmd: _Add | _Alone) -> None:
        """Queue a command behind an exclusive call, in arrival order. A request is checked now, as the engine will
        check it when it starts, so that a bad one (or one reusing a live id) is refused at once, not after the wait."""
        if isinstance(cmd, _Add):
            rid = cmd.stream.request_id
            try:
                if rid in self._streams or any(isinstance(c, _Add) and c.stream.request_id == rid
                                               for c in self._waiting):
                    raise InvalidRequestError(f"request id {rid!r} is already in use")
                self.engine.check_request(cmd.prompt, cmd.params)
            except InferError as exc:
                self._outbox.append((cmd.stream, exc))
                return
            except Exception as exc:
                log.exception("checking held request %s failed", rid)
                self._outbox.append((cmd.stream, EngineFault(f"internal error while checking the request: {exc!r}")))
                return
        self._waiting.append(cmd)

    def _abort_and_deliver(self, request_id: str) -> RequestOutput:
        held = next((c for c in self._waiting if isinstance(c, _Add) and c.stream.request_id == request_id), None)
        if held is not None:  # behind an exclusive call: it starts now, to end as an aborted request does
            self._waiting.remove(held)
            self._add(held)
        output = self.engine.abort(request_id)  # NotFoundError for unknown ids
        self._deliver(output)
        return output

    def _add(self, cmd: _Add) -> None:
        rid = cmd.stream.request_id
        try:
            self.engine.add_request(cmd.prompt, cmd.params, rid)
        except InferError as exc:
            self._outbox.append((cmd.stream, exc))
        except Exception as exc:
            log.exception("add_request failed for request %s", rid)
            self._outbox.append((cmd.stream, EngineFault(f"internal error while adding the request: {exc!r}")))
        else:
            self._streams[rid] = cmd.stream

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
        """Abort every request this worker serves (freeing their KV) and hand each the error."""
        for rid, stream in list(self._streams.items()):
            self._abort_quietly(rid)
            self._outbox.append((stream, error))
        self._streams.clear()

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
        self._refuse_waiting(error)
        self._flush()
        self._stop_accepting()

    def _refuse_waiting(self, error: BaseException) -> None:
        while self._waiting:
            _refuse(self._waiting.popleft(), error)

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
    if isinstance(cmd, (_Abort, _Call)) and cmd.reply.set_running_or_notify_cancel():
        cmd.reply.set_exception(error)
    elif isinstance(cmd, _Add):
        try:
            cmd.stream.loop.call_soon_threadsafe(cmd.stream.put, error)
        except RuntimeError:  # the loop is closed
            pass


def _put_all(batch: list[tuple[RequestStream, Any]]) -> None:
    for stream, item in batch:
        stream.put(item)
