"""HeldInterrupts: SIGINT inside an engine call reaches the caller's handler once the call is done."""
import signal
import threading

from infer.core.interrupts import HeldInterrupts


def test_a_held_sigint_reaches_the_previous_handler_at_the_end_and_a_second_one_at_once():
    calls: list[str] = []
    previous = signal.signal(signal.SIGINT, lambda signum, frame: calls.append(f"handled {signum}"))
    try:
        held = HeldInterrupts()
        with held:
            assert signal.getsignal(signal.SIGINT) == held.handler
            signal.raise_signal(signal.SIGINT)
            calls.append("body went on")
            with held:  # nested: holds nothing more, installs nothing
                signal.raise_signal(signal.SIGINT)  # the second press: handed on now
            calls.append("body ended")
        assert calls == ["body went on", f"handled {signal.SIGINT}", "body ended", f"handled {signal.SIGINT}"]
        calls.clear()
        with held:
            calls.append("quiet call")
        assert calls == ["quiet call"]  # nothing held: the handler is not called
        assert signal.getsignal(signal.SIGINT) != held.handler
    finally:
        signal.signal(signal.SIGINT, previous)


def test_a_ctrl_c_held_through_a_call_that_raised_still_lands():
    """The call's error becomes the KeyboardInterrupt's context: a caller that catches InvalidRequestError (a
    server loop, say) would otherwise have swallowed the user's Ctrl-C with it."""
    import pytest

    held = HeldInterrupts()
    with pytest.raises(KeyboardInterrupt) as info:
        with held:
            signal.raise_signal(signal.SIGINT)
            raise ValueError("the call's own error")
    assert isinstance(info.value.__context__, ValueError)
    assert signal.getsignal(signal.SIGINT) != held.handler


def test_nothing_is_held_off_the_main_thread_or_when_sigint_is_ignored():
    held, seen = HeldInterrupts(), []

    def worker() -> None:
        with held:
            seen.append(signal.getsignal(signal.SIGINT) == held.handler)

    thread = threading.Thread(target=worker)
    thread.start()
    thread.join()
    previous = signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        with held:
            seen.append(signal.getsignal(signal.SIGINT) == held.handler)
    finally:
        signal.signal(signal.SIGINT, previous)
    assert seen == [False, False]


def test_where_handlers_cannot_be_set_nothing_is_held_and_the_engine_call_goes_on(monkeypatch):
    """signal.signal raises ValueError outside the main interpreter (mod_wsgi's subinterpreters): every engine call
    would have failed."""
    def refuse(signum, handler):
        raise ValueError("signal only works in main thread of the main interpreter")

    held, ran = HeldInterrupts(), []
    monkeypatch.setattr(signal, "signal", refuse)
    with held:
        ran.append(True)
    assert ran == [True] and held.previous is None and held.depth == 0


def test_a_ctrl_c_as_the_handler_goes_in_or_out_is_not_lost(monkeypatch):
    """A SIGINT whose Python handler runs right after ``signal.signal`` installs the holder, or right before it
    puts the previous handler back, lands once the call ends: it was lost (a `generate --stream` run under load
    ignored a Ctrl-C and ran to the end)."""
    import pytest

    real_signal = signal.signal
    held = HeldInterrupts()

    def arriving_with(moment):
        def install(signum, handler):
            if moment == "out" and handler is not held.handler:  # just before the previous handler goes back
                held.handler(signal.SIGINT, None)
            previous = real_signal(signum, handler)
            if moment == "in" and handler is held.handler:  # just after the holder went in
                held.handler(signal.SIGINT, None)
            return previous
        return install

    for moment in ("in", "out"):
        monkeypatch.setattr(signal, "signal", arriving_with(moment))
        with pytest.raises(KeyboardInterrupt):
            with held:
                pass
        monkeypatch.setattr(signal, "signal", real_signal)
        assert signal.getsignal(signal.SIGINT) is signal.default_int_handler
