"""The plugin manager: load entry points (allow-list INFER_PLUGINS), fill one Registry per kind."""
from __future__ import annotations

import os
from dataclasses import dataclass
from importlib import metadata
from typing import Any

import pluggy

from . import hookspecs
from .config import COMPONENT_FIELDS, EngineConfig
from .errors import PluginError
from .registry import Registry

ENTRY_POINT_GROUP = "infer"
ALLOW_LIST_ENV = "INFER_PLUGINS"

# kind -> registration hook name
KINDS: dict[str, str] = {
    "scheduler": "register_schedulers",
    "kv_cache": "register_kv_caches",
    "eviction_policy": "register_eviction_policies",
    "attention_backend": "register_attention_backends",
    "quant_method": "register_quant_methods",
    "proposer": "register_proposers",
    "model": "register_models",
    "command": "register_commands",
}


@dataclass(frozen=True)
class Component:
    kind: str
    name: str
    source: str
    aliases: tuple[str, ...]


class PluginManager:
    """Holds the pluggy manager and the registries. Create one per engine or CLI invocation; no globals."""

    def __init__(self) -> None:
        self.pm = pluggy.PluginManager("infer")
        self.pm.add_hookspecs(hookspecs)
        self.registries: dict[str, Registry[Any]] = {kind: Registry(kind.replace("_", " ")) for kind in KINDS}
        self._sources: dict[str, str] = {}  # plugin name -> distribution
        self._collected = False

    @classmethod
    def from_entry_points(cls, allow: str | None = None) -> PluginManager:
        """Load the ``infer`` entry points, keeping only those named in ``allow`` (comma-separated) when given.

        ``allow`` defaults to the INFER_PLUGINS environment variable; unset or empty loads everything.
        """
        manager = cls()
        manager.load_entry_points(os.environ.get(ALLOW_LIST_ENV) if allow is None else allow)
        return manager

    def load_entry_points(self, allow: str | None) -> None:
        wanted = {name.strip() for name in allow.split(",") if name.strip()} if allow else None
        found: dict[str, metadata.EntryPoint] = {}
        for ep in metadata.entry_points(group=ENTRY_POINT_GROUP):
            other = found.setdefault(ep.name, ep)
            if _dist_name(other) != _dist_name(ep) and (wanted is None or ep.name in wanted):
                first, second = sorted((_dist_name(other), _dist_name(ep)))
                raise PluginError(
                    f"two installed packages name their infer entry point {ep.name!r}: {first!r} and "
                    f"{second!r}; rename it under [project.entry-points.infer] in one package's "
                    "pyproject.toml and reinstall that package, or uninstall one of them")
        for name, ep in sorted(found.items()):
            if wanted is not None and name not in wanted:
                continue
            try:
                module = ep.load()
            except Exception as exc:  # a broken third-party package must say who it is
                raise PluginError(f"plugin {name!r} from package {_dist_name(ep)!r} failed to import: {exc}") from exc
            self.register(module, name=name, source=_dist_name(ep))
        if wanted is not None and wanted - found.keys():
            raise PluginError(
                f"{ALLOW_LIST_ENV} names plugins that are not installed: {', '.join(sorted(wanted - found.keys()))}; "
                f"installed: {', '.join(sorted(found)) or '(none)'}"
            )

    def register(self, plugin: object, name: str | None = None, source: str | None = None) -> None:
        """Register a plugin object (module or instance) at run time; it takes part in the next collection."""
        if self._collected:
            raise PluginError("plugins must be registered before components are collected; create a new manager")
        try:
            registered = self.pm.register(plugin, name=name)
        except ValueError as exc:  # pluggy: the name or the object is taken
            raise PluginError(f"plugin {name!r} is already registered ({exc})") from exc
        if registered is None:
            raise PluginError(f"plugin {name!r} is already registered")
        self._sources[registered] = source or registered
        self.pm.check_pending()

    def collect(self) -> PluginManager:
        """Call every registration hook once, each implementation with its own source-tagged callback."""
        if self._collected:
            return self
        self._collected = True
        for kind, hook_name in KINDS.items():
            for impl in getattr(self.pm.hook, hook_name).get_hookimpls():
                source = self._sources.get(impl.plugin_name, impl.plugin_name)
                impl.function(register=self.registries[kind].callback(source))
        return self

    def registry(self, kind: str) -> Registry[Any]:
        self.collect()
        return self.registries[kind]

    def components(self) -> list[Component]:
        self.collect()
        return [
            Component(kind, e.name, e.source, e.aliases) for kind, reg in self.registries.items() for e in reg
        ]

    def resolve_plugin_names(self, config: EngineConfig, names: list[str]) -> EngineConfig:
        """Apply ``--plugin NAME`` selections: each name sets the config field of the one kind that has it."""
        self.collect()
        changes: dict[str, str] = {}
        for name in names:
            kinds = [k for k in COMPONENT_FIELDS if name in self.registries[k]]
            if not kinds:
                every = sorted({c.name for c in self.components() if c.kind in COMPONENT_FIELDS})
                raise PluginError(f"unknown plugin {name!r}; registered components: {', '.join(every)}")
            if len(kinds) > 1:
                options = " or ".join(f"--{COMPONENT_FIELDS[k].replace('_', '-')} {name}" for k in kinds)
                raise PluginError(f"plugin name {name!r} is registered as {' and '.join(kinds)}; use {options}")
            field, chosen = COMPONENT_FIELDS[kinds[0]], self.registries[kinds[0]].entry(name).name
            if changes.get(field, chosen) != chosen:
                raise PluginError(f"--plugin {changes[field]} and --plugin {name} both choose the "
                                  f"{kinds[0].replace('_', ' ')}; keep one")
            changes[field] = chosen
        return config.replace(**changes)

    @property
    def hook(self) -> Any:
        """The pluggy hook relay, for event hooks (``on_step``, ``on_request_finished``)."""
        return self.pm.hook


def _dist_name(ep: metadata.EntryPoint) -> str:
    return ep.dist.name if ep.dist else ep.value
