"""What the commands print depends on where stderr goes: progress bars only on a terminal."""
from __future__ import annotations

import contextlib
import sys
import warnings
from collections.abc import Iterator


def stderr_is_terminal() -> bool:
    return sys.stderr is not None and sys.stderr.isatty()


@contextlib.contextmanager
def transformers_bars_on_terminal_only() -> Iterator[None]:
    """transformers' tqdm progress bars ("Loading weights", "Writing model shards") in the calls inside only where
    stderr, which they draw on, is a terminal: in a log file or a pipe each redraw is noise. transformers' switch is
    process-wide (huggingface_hub's global one with it), so it is set back as it was when the block ends."""
    from huggingface_hub.utils import are_progress_bars_disabled, disable_progress_bars
    from transformers.utils import logging as hf_logging

    if stderr_is_terminal() or not hf_logging.is_progress_bar_enabled():
        yield
        return
    hub_bars_were_off = are_progress_bars_disabled()
    hf_logging.disable_progress_bar()
    try:
        yield
    finally:
        with warnings.catch_warnings():  # huggingface_hub warns that HF_HUB_DISABLE_PROGRESS_BARS keeps its own off
            warnings.simplefilter("ignore")
            hf_logging.enable_progress_bar()
        if hub_bars_were_off:
            disable_progress_bars()
