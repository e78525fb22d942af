"""The engine's side of logits processors (``register_logits_processors``): each request names the processors its
sequences' logits go through (``SamplingParams.logits_processors``); they are built by name at first use, check each
request's arguments at admission, and change the logits rows of those sequences before each sample."""
from __future__ import annotations

import difflib
import functools
import json
import types
from collections.abc import Callable, Mapping
from typing import Any

import torch

from .errors import InvalidRequestError, PluginError, UnknownComponentError
from .interfaces import LogitsProcessor, ProcessorRow
from .request import SamplingParams, Sequence
from .sampling import to_device


@functools.lru_cache(maxsize=4096)
def parsed_args(text: str) -> Mapping[str, Any]:
    """A processor's arguments from their JSON text (validated as an object by ``SamplingParams.validate``), parsed
    once per distinct text and shared by the requests that give it: read-only at the top (nested values must be
    left as they are too)."""
    return types.MappingProxyType(json.loads(text))


class LogitsProcessors:
    """The processors requests named so far, by registered name. ``build(name)`` builds one (UnknownComponentError
    for a name nothing registered); ``plugin_code()`` is the engine's guard that names a component whose code
    raised."""

    def __init__(self, build: Callable[[str], LogitsProcessor], names: Callable[[], list[str]],
                 plugin_code: Callable[[], Any]) -> None:
        self.build, self.names, self.plugin_code = build, names, plugin_code
        self.built: dict[str, LogitsProcessor] = {}

    def processor(self, name: str) -> LogitsProcessor:
        """The processor registered as ``name``, built at its first use; InvalidRequestError naming the choices
        for a name nothing registered."""
        if (found := self.built.get(name)) is not None:
            return found
        try:
            with self.plugin_code():
                built = self.built[name] = self.build(name)
        except UnknownComponentError:
            choices = self.names()
            close = difflib.get_close_matches(name, choices, n=1)
            raise InvalidRequestError(f"unknown logits processor {name!r}"
                                      f"{f' (did you mean {close[0]!r}?)' if close else ''}; registered: "
                                      f"{', '.join(choices) or 'none'}") from None
        return built

    def check(self, params: SamplingParams) -> None:
        """Build the processors ``params`` names and have each check its arguments (InvalidRequestError)."""
        for name, args in params.logits_processors:
            processor = self.processor(name)
            try:
                with self.plugin_code():
                    processor.check(parsed_args(args))
            except InvalidRequestError as exc:
                raise InvalidRequestError(f"logits processor {name!r}: {exc}") from None

    def apply(self, logits: torch.Tensor, seqs: list[Sequence]) -> torch.Tensor | None:
        """``logits`` [len(seqs), V] float32 with each row's processors applied, in each request's order (a new
        tensor), or None when no row has any."""
        if not any(seq.params.logits_processors for seq in seqs):
            return None
        out = logits.clone()
        depth = max(len(seq.params.logits_processors) for seq in seqs)
        for position in range(depth):  # a request's first processor, then its second, ...
            groups: dict[str, list[int]] = {}
            for i, seq in enumerate(seqs):
                if position < len(calls := seq.params.logits_processors):
                    groups.setdefault(calls[position][0], []).append(i)
            for name, at in groups.items():
                rows = [ProcessorRow(seqs[i].seq_id, seqs[i].token_ids, seqs[i].num_prompt_tokens,
                                     parsed_args(seqs[i].params.logits_processors[position][1])) for i in at]
                every_row = len(at) == len(seqs)  # the whole batch: no rows to gather and scatter back
                index = None if every_row else to_device(at, logits.device)
                with self.plugin_code():
                    changed = self.built[name].apply(out if index is None else out[index], rows)
                self._check_returned(name, changed, (len(at), logits.shape[1]), logits)
                if index is None:
                    out = changed
                else:
                    out.index_copy_(0, index, changed)
        return out

    @staticmethod
    def _check_returned(name: str, changed: object, shape: tuple[int, int], logits: torch.Tensor) -> None:
        """PluginError unless ``changed`` is a ``shape`` tensor of the logits' dtype on their device."""
        if not (isinstance(changed, torch.Tensor) and changed.shape == shape and changed.dtype == logits.dtype
                and changed.device == logits.device):
            got = f"{changed.dtype} {tuple(changed.shape)} on {changed.device}" \
                if isinstance(changed, torch.Tensor) else type(changed).__name__
            raise PluginError(f"logits processor {name!r}: apply() returned {got}, not the {logits.dtype} "
                              f"{shape} on {logits.device} it was given; fix the plugin")

    def release(self, seq: Sequence) -> None:
        """``seq`` finished: its processors drop what they kept for it."""
        for name, _ in seq.params.logits_processors:
            if (processor := self.built.get(name)) is not None:
                with self.plugin_code():
                    processor.release(seq.seq_id)
