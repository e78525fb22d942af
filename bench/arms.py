"""``--ab`` arms: each string is a full set of ``infer`` group options, or ``hf`` / ``hf:static`` / ``hf:cb``, or
``openai:URL`` (a running server of OpenAI's HTTP API, URL its API base: ``openai:http://127.0.0.1:8000/v1``).

An engine arm's options are parsed with the group's own click options (shlex splitting, click conversion and
errors) and laid over the group options given before ``bench``: ``infer --model M bench --ab "--kv-cache paged"
"--no-prefix-caching"`` compares two engines on model M.
"""
from __future__ import annotations

import dataclasses
import shlex
import string
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any
from urllib.parse import urlsplit

import click
from click.core import ParameterSource

from ..cli.options import EngineArgs, engine_options
from ..core.config import COMPONENT_FIELDS

HF_MODES = {"hf": "static", "hf:static": "static", "hf:cb": "cb"}
OPENAI_PREFIX = "openai:"


class ArmError(ValueError):
    """An arm string does not parse, or its engine refuses it; the message names the arm. ``options_refused``: the
    engine refused the arm's options (a ConfigError), a command-line error as in `generate`."""

    def __init__(self, message: str, options_refused: bool = False) -> None:
        super().__init__(message)
        self.options_refused = options_refused


@dataclass(frozen=True)
class ArmSpec:
    """One side of the comparison. ``hf_mode`` is set for the HF baseline, ``args`` for an infer engine,
    ``openai_url`` (the API base) for a server of OpenAI's HTTP API."""

    key: str  # A, B, C, ...
    text: str  # the arm string as given
    args: EngineArgs | None = None
    hf_mode: str | None = None
    openai_url: str | None = None

    @property
    def label(self) -> str:
        return f"{self.key}: {self.text or '(group options)'}"

    @property
    def is_hf(self) -> bool:
        return self.hf_mode is not None

    @property
    def is_openai(self) -> bool:
        return self.openai_url is not None

    @property
    def is_engine(self) -> bool:
        """An infer engine run in this process: neither the HF baseline nor a server."""
        return not self.is_hf and not self.is_openai


def _arm_key(index: int) -> str:
    letters = string.ascii_uppercase
    return letters[index] if index < len(letters) else f"{letters[index // len(letters) - 1]}{letters[index % 26]}"


def _option_parser() -> click.Command:
    """A throw-away command that carries exactly the group's engine options."""

    @click.command("arm", add_help_option=False)
    @engine_options
    def arm(**kwargs: Any) -> None:
        """Never invoked: only its parser is used."""

    return arm


def parse_engine_options(text: str) -> EngineArgs:
    """Parse one arm string into EngineArgs holding only the options the string names. Raises ArmError."""
    try:
        argv = shlex.split(text)
    except ValueError as exc:
        raise ArmError(f"cannot split the options: {exc}") from None
    command = _option_parser()
    try:
        ctx = command.make_context("arm", argv)
    except click.ClickException as exc:
        raise ArmError(exc.format_message()) from None
    given = {name: value for name, value in ctx.params.items()
             if ctx.get_parameter_source(name) is ParameterSource.COMMANDLINE}
    return EngineArgs.from_kwargs(given)


def merge(base: EngineArgs, arm: EngineArgs, kind_of: Callable[[str], str | None] = lambda name: None
          ) -> EngineArgs:
    """The arm's options over the group's: values replaced, --plugin names added, flags (--no-...) or-ed. A
    component the arm chooses (by its option or by --plugin) replaces the group's choice of that kind, however the
    group chose it; ``kind_of(name)`` is the config field a --plugin name sets."""
    chosen = ({kind_of(name) for name in arm.plugin_names} | {k for k in arm.values if k in COMPONENT_FIELDS.values()}
              ) - {None}
    base = dataclasses.replace(base, values={k: v for k, v in base.values.items() if k not in chosen},
                               plugin_names=[name for name in base.plugin_names if kind_of(name) not in chosen])
    merged: dict[str, Any] = {}
    for f in dataclasses.fields(EngineArgs):
        ours, theirs = getattr(base, f.name), getattr(arm, f.name)
        if isinstance(ours, dict):
            merged[f.name] = {**ours, **theirs}
        elif isinstance(ours, list):
            merged[f.name] = [*ours, *theirs]
        elif isinstance(ours, bool):
            merged[f.name] = ours or theirs
        else:
            merged[f.name] = ours if theirs is None else theirs
    return EngineArgs(**merged)


def parse_arms(texts: tuple[str, ...] | list[str], base: EngineArgs,
               kind_of: Callable[[str], str | None] = lambda name: None) -> list[ArmSpec]:
    """Every arm, in the order given; with none, one arm made of the group options. Raises ArmError."""
    if not texts:
        return [ArmSpec("A", "", base)]
    arms = []
    for index, text in enumerate(texts):
        key = _arm_key(index)
        stripped = text.strip()
        if stripped.startswith("hf"):
            if stripped not in HF_MODES:
                raise ArmError(f"arm {key} ({text!r}): the HF baseline is written 'hf', 'hf:static' or 'hf:cb' "
                               "and takes no options (it runs the model of the group options or of the first "
                               "engine arm)")
            arms.append(ArmSpec(key, stripped, hf_mode=HF_MODES[stripped]))
            continue
        if stripped.startswith(OPENAI_PREFIX):
            try:
                arms.append(ArmSpec(key, stripped, openai_url=parse_openai_url(stripped[len(OPENAI_PREFIX):])))
            except ArmError as exc:
                raise ArmError(f"arm {key} ({text!r}): {exc}") from None
            continue
        try:
            arms.append(ArmSpec(key, stripped, merge(base, parse_engine_options(text), kind_of)))
        except ArmError as exc:
            raise ArmError(f"arm {key} ({text!r}): {exc}") from None
    return arms


def parse_openai_url(url: str) -> str:
    """The API base of an ``openai:URL`` arm, checked (http or https, a host, a valid port), without a trailing
    slash. Raises ArmError."""
    example = "e.g. openai:http://127.0.0.1:8000/v1"
    try:
        parts = urlsplit(url.strip())
        parts.port  # noqa: B018 (raises ValueError for a port out of range)
    except ValueError as exc:
        raise ArmError(f"{url!r} is not a URL ({exc}); give the server's API base, {example}") from None
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise ArmError(f"{url!r} is not an http or https URL with a host; give the server's API base, {example}")
    if parts.query or parts.fragment:
        raise ArmError(f"{url!r} has a query or fragment; give the server's API base alone, {example}")
    return parts.geturl().rstrip("/")
