"""Registry[T]: component name -> factory, with the package that provided it."""
from __future__ import annotations

import re
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Generic, Protocol, TypeVar

from .errors import PluginError, UnknownComponentError
from .plugin_options import PluginOption

F = TypeVar("F")
SHIPPED_SOURCE = "infer-engine"  # the distribution of the shipped plugins
F_contra = TypeVar("F_contra", contravariant=True)


class Register(Protocol[F_contra]):
    """The callback a registration hook receives: ``register(name, factory, aliases=(), options=None)``; ``options``
    declares the component's plugin options (``plugin_options[name]``), which ``infer plugins`` lists and the
    engine checks before it builds anything."""

    def __call__(self, name: str, factory: F_contra, aliases: Sequence[str] = (),
                 options: Mapping[str, PluginOption] | None = None) -> None: ...


@dataclass(frozen=True)
class NameRule:
    pattern: re.Pattern[str]
    description: str  # completes "use ..." in the error for a name that does not match


COMPONENT_NAMES = NameRule(re.compile(r"[a-z0-9][a-z0-9._-]*"),
                           "lowercase letters, digits, '-', '_' and '.', starting with a letter or digit (e.g. "
                           "'my-policy')")
ARCHITECTURE_NAMES = NameRule(re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]*"),
                              "the checkpoint's config.json `architectures` name (e.g. 'LlamaForCausalLM'): letters, "
                              "digits, '-', '_' and '.', starting with a letter or digit")


@dataclass(frozen=True)
class Entry(Generic[F]):
    name: str
    factory: F
    source: str  # the distribution (or plugin object) that registered it
    aliases: tuple[str, ...] = ()
    entry_point: str | None = None  # the `infer` entry point that registered it, when it came from one
    options: Mapping[str, PluginOption] = field(default_factory=dict)  # plugin_options[name], declared


class RegisterCallback(Generic[F]):
    """The ``register`` a registration hook receives. It works while the hook runs: ``close()`` (called when the
    hook returns) makes a later call, from a reference the plugin kept, an error instead of a component that
    appears after infer has read the registries."""

    def __init__(self, registry: Registry[F], source: str, entry_point: str | None, hook: str) -> None:
        self._registry, self._source, self._entry_point, self._hook = registry, source, entry_point, hook
        self._open = True

    def __call__(self, name: str, factory: F, aliases: Sequence[str] = (),
                 options: Mapping[str, PluginOption] | None = None) -> None:
        if not self._open:
            raise PluginError(f"{_who(self._source, self._entry_point)} called register({name!r}, ...) after its "
                              f"{self._hook} hook returned; infer reads registrations once, at "
                              "start-up, so call register inside the hook")
        self._registry.register(name, factory, aliases, options, source=self._source,
                                entry_point=self._entry_point)

    def close(self) -> None:
        self._open = False


def no_hint(*names: str | None) -> str:
    return ""


def plural(kind: str) -> str:
    return kind[:-1] + "ies" if kind.endswith("y") else kind + "s"


class Registry(Generic[F]):
    """Names (and aliases) of one kind of component. Duplicates are errors, never silent renames.

    ``unknown_hint(name)`` and ``duplicate_hint(entry_point, other_entry_point)`` add what the plugin manager knows
    (an allow-list that skipped plugins) to the errors for an unknown and a duplicate name.
    """

    def __init__(self, kind: str, *, names: NameRule = COMPONENT_NAMES,
                 unknown_hint: Callable[[str], str] = no_hint,
                 duplicate_hint: Callable[[str | None, str | None], str] = no_hint) -> None:
        self.kind = kind
        self.plural = plural(kind)
        self._names = names
        self._unknown_hint = unknown_hint
        self._duplicate_hint = duplicate_hint
        self._entries: dict[str, Entry[F]] = {}
        self._aliases: dict[str, str] = {}

    def register(self, name: str, factory: F, aliases: Sequence[str] = (),
                 options: Mapping[str, PluginOption] | None = None, *, source: str,
                 entry_point: str | None = None) -> None:
        who = _who(source, entry_point)
        if not isinstance(name, str) or not name:
            raise PluginError(f"{who} registered a {self.kind} with an empty or non-string name: {name!r}")
        if not callable(factory):
            raise PluginError(f"{who} registered {self.kind} {name!r} with a factory that is not callable")
        if not isinstance(aliases, (list, tuple)) or not all(isinstance(alias, str) for alias in aliases):
            raise PluginError(f"{who} registered {self.kind} {name!r} with aliases={aliases!r}; aliases must be a "
                              "list or tuple of names, e.g. aliases=('other-name',)")
        if options is not None and not (isinstance(options, Mapping) and all(
                isinstance(key, str) and key and "." not in key and isinstance(option, PluginOption)
                for key, option in options.items())):
            raise PluginError(f"{who} registered {self.kind} {name!r} with options={options!r}; options maps each "
                              "key (a non-empty name without '.', as --plugin-option NAME.KEY=VALUE needs) to an "
                              "infer.core.plugin_options.PluginOption")
        if name in aliases or len(set(aliases)) != len(aliases):
            raise PluginError(f"{who} registered {self.kind} {name!r} with aliases={aliases!r}; list each alias "
                              "once and leave out the name itself")
        for key in (name, *aliases):
            if not self._names.pattern.fullmatch(key):
                raise PluginError(f"{who} registered the {self.kind} name {key!r}, which infer cannot select by "
                                  f"name; use {self._names.description}")
        for key in (name, *aliases):
            if key in self:
                self._raise_duplicate(key, self._entries[self._aliases.get(key, key)], source, entry_point)
        self._entries[name] = Entry(name, factory, source, tuple(aliases), entry_point, dict(options or {}))
        for alias in aliases:
            self._aliases[alias] = name

    def _raise_duplicate(self, key: str, other: Entry[F], source: str, entry_point: str | None) -> None:
        if (other.source == SHIPPED_SOURCE) != (source == SHIPPED_SOURCE):
            plugin = _who(source, entry_point) if other.source == SHIPPED_SOURCE else _who(other.source,
                                                                                          other.entry_point)
            raise PluginError(f"duplicate {self.kind} name {key!r}: infer ships a {self.kind} (or alias) of that "
                              f"name, and {plugin} registers another; a shipped name is never overridden, so rename "
                              "the plugin's component in its register(...) call (and select it by its new name)")
        if (other.source, other.entry_point) == (source, entry_point):
            raise PluginError(f"duplicate {self.kind} name {key!r}: {_who(source, entry_point)} registers it twice "
                              "(as names or aliases); the plugin must rename one")
        hint = self._duplicate_hint(other.entry_point, entry_point) or (
            ", or load only one of the two plugins with INFER_PLUGINS, an allow-list of the entry point names to "
            "load (name every plugin to keep, infer's shipped ones too)")
        raise PluginError(
            f"duplicate {self.kind} name {key!r}: registered by both {_who(other.source, other.entry_point)} and "
            f"{_who(source, entry_point)}; uninstall one of them{hint}")

    def callback(self, source: str, entry_point: str | None = None,
                 hook: str = "registration") -> RegisterCallback[F]:
        """A ``register`` callback that records ``source`` (and ``entry_point``) as the provider; ``hook`` names
        the registration hook it is given to, for the error of a call after the hook returned."""
        return RegisterCallback(self, source, entry_point, hook)

    def __contains__(self, name: object) -> bool:
        return name in self._entries or name in self._aliases

    def entry(self, name: str) -> Entry[F]:
        key = self._aliases.get(name, name)
        if key not in self._entries:
            choices = ", ".join(sorted(self._entries)) or "(none registered)"
            raise UnknownComponentError(f"unknown {self.kind} {name!r}; registered {self.plural}: {choices}"
                                        f"{self.unknown_hint(name)}")
        return self._entries[key]

    def unknown_hint(self, name: str) -> str:
        """Why ``name`` may be missing (``"; INFER_PLUGINS=... limited loading ..."``), or ``""``."""
        return self._unknown_hint(name)

    def get(self, name: str) -> F:
        return self.entry(name).factory

    def names(self) -> list[str]:
        return sorted(self._entries)

    def __iter__(self) -> Iterator[Entry[F]]:
        return iter(sorted(self._entries.values(), key=lambda e: e.name))


def _who(source: str, entry_point: str | None) -> str:
    return f"{source!r} (entry point {entry_point!r})" if entry_point else repr(source)
