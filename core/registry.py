"""Registry[T]: component name -> factory, with the package that provided it."""
from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Generic, Protocol, TypeVar

from .errors import PluginError

F = TypeVar("F")
F_contra = TypeVar("F_contra", contravariant=True)


class Register(Protocol[F_contra]):
    """The callback a registration hook receives: ``register(name, factory, aliases=())``."""

    def __call__(self, name: str, factory: F_contra, aliases: Sequence[str] = ()) -> None: ...


@dataclass(frozen=True)
class Entry(Generic[F]):
    name: str
    factory: F
    source: str  # the distribution (or plugin object) that registered it
    aliases: tuple[str, ...] = ()


class Registry(Generic[F]):
    """Names (and aliases) of one kind of component. Duplicates are errors, never silent renames."""

    def __init__(self, kind: str) -> None:
        self.kind = kind
        self._entries: dict[str, Entry[F]] = {}
        self._aliases: dict[str, str] = {}

    def register(self, name: str, factory: F, aliases: Sequence[str] = (), *, source: str) -> None:
        if not isinstance(name, str) or not name:
            raise PluginError(f"{source} registered a {self.kind} with an empty or non-string name: {name!r}")
        if not callable(factory):
            raise PluginError(f"{source} registered {self.kind} {name!r} with a factory that is not callable")
        for key in (name, *aliases):
            if key in self._entries or key in self._aliases:
                other = self._entries[self._aliases.get(key, key)].source
                raise PluginError(
                    f"duplicate {self.kind} name {key!r}: registered by both {other!r} and {source!r}; "
                    "uninstall one of them, or leave one out with INFER_PLUGINS (an allow-list of entry point names: "
                    "list every plugin to keep, the shipped ones too, as `infer plugins` shows them)"
                )
        self._entries[name] = Entry(name, factory, source, tuple(aliases))
        for alias in aliases:
            self._aliases[alias] = name

    def callback(self, source: str) -> Register[F]:
        """A ``register`` callback that records ``source`` as the provider."""

        def register(name: str, factory: F, aliases: Sequence[str] = ()) -> None:
            self.register(name, factory, aliases, source=source)

        return register

    def __contains__(self, name: object) -> bool:
        return name in self._entries or name in self._aliases

    def entry(self, name: str) -> Entry[F]:
        key = self._aliases.get(name, name)
        if key not in self._entries:
            choices = ", ".join(sorted(self._entries)) or "(none registered)"
            raise PluginError(f"unknown {self.kind} {name!r}; registered {self.kind}s: {choices}")
        return self._entries[key]

    def get(self, name: str) -> F:
        return self.entry(name).factory

    def names(self) -> list[str]:
        return sorted(self._entries)

    def __iter__(self) -> Iterator[Entry[F]]:
        return iter(sorted(self._entries.values(), key=lambda e: e.name))
