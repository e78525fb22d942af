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
