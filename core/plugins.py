"""The plugin manager: load entry points (allow-list INFER_PLUGINS), fill one Registry per kind."""
from __future__ import annotations

import difflib
import inspect
import logging
import os
import signal
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from importlib import metadata
from typing import Any, TypeVar

import pluggy

from . import hookspecs
from .config import COMPONENT_FIELDS, EngineConfig
from .errors import CapacityError, ConfigError, InferError, PluginError, UnknownComponentError
from .plugin_options import PluginOption, read_plugin_options
from .registry import ARCHITECTURE_NAMES, COMPONENT_NAMES, SHIPPED_SOURCE, Registry

log = logging.getLogger("infer")
T = TypeVar("T")

ENTRY_POINT_GROUP = "infer"
ALLOW_LIST_ENV = "INFER_PLUGINS"

ENGINE_OPTION_NAMESPACES = frozenset({"spec_decode"})  # read by the engine, not named after a component
KINDS: dict[str, str] = {  # kind -> registration hook name
    "scheduler": "register_schedulers",
    "kv_cache": "register_kv_caches",
    "eviction_policy": "register_eviction_policies",
    "attention_backend": "register_attention_backends",
    "quant_method": "register_quant_methods",
    "proposer": "register_proposers",
    "tool_parser": "register_tool_parsers",
    "reasoning_parser": "register_reasoning_parsers",
    "structured_output_backend": "register_structured_output_backends",
    "logits_processor": "register_logits_processors",
    "pooler": "register_poolers",
    "model": "register_models",
    "command": "register_commands",
}


@dataclass(frozen=True)
class Component:
    kind: str
    name: str
    source: str
    aliases: tuple[str, ...]
    options: Mapping[str, PluginOption] = field(default_factory=dict)


class PluginManager:
    """Holds the pluggy manager and the registries. Create one per engine or CLI invocation; no globals."""

    def __init__(self) -> None:
        self.pm = pluggy.PluginManager("infer")
        self.pm.add_hookspecs(hookspecs)
        self.registries: dict[str, Registry[Any]] = {kind: self._new_registry(kind) for kind in KINDS}
        self._sources: dict[str, str] = {}  # plugin name -> distribution
        self._entry_points: list[str] = []  # the names of the entry points loaded
        self._way_outs: dict[str, str] = {}  # entry point -> how a user gets infer running without it
        self._allow_list: list[str] | None = None  # INFER_PLUGINS, when it limited loading
        self._skipped_shipped: dict[str, metadata.EntryPoint] = {}  # infer's own entry points it left out
        self._collected = False

    def _new_registry(self, kind: str) -> Registry[Any]:
        return Registry(kind.replace("_", " "), names=ARCHITECTURE_NAMES if kind == "model" else COMPONENT_NAMES,
                        unknown_hint=lambda name: self._allow_list_hint((kind,), name),
                        duplicate_hint=self._duplicate_hint)

    @classmethod
    def from_entry_points(cls, allow: str | None = None) -> PluginManager:
        """Load the ``infer`` entry points, keeping only those named in ``allow`` (comma-separated) when given.

        ``allow`` defaults to the INFER_PLUGINS environment variable; unset or empty loads everything.
        """
        manager = cls()
        manager.load_entry_points(os.environ.get(ALLOW_LIST_ENV) if allow is None else allow)
        return manager

    def load_entry_points(self, allow: str | None) -> None:
        wanted = list(dict.fromkeys(name.strip() for name in allow.split(",") if name.strip())) if allow else None
        found: dict[str, metadata.EntryPoint] = {}
        for ep in metadata.entry_points(group=ENTRY_POINT_GROUP):
            other = found.setdefault(ep.name, ep)
            if _dist_name(other) != _dist_name(ep) and (wanted is None or ep.name in wanted):
                first, second = sorted((_dist_name(other), _dist_name(ep)))
                raise PluginError(
                    f"two installed packages name their infer entry point {ep.name!r}: {first!r} and "
                    f"{second!r}; rename it under [project.entry-points.infer] in one package's "
                    "pyproject.toml and reinstall that package, or uninstall one of them")
        if wanted is not None:
            self._allow_list = wanted
            self._skipped_shipped = {name: ep for name, ep in found.items() if name not in wanted and _is_shipped(ep)}
        loading = sorted(name for name in found if wanted is None or name in wanted)
        for name in loading:
            ep = found[name]
            way_out = _way_out(ep, [other for other in loading if other != name])
            try:
                module = ep.load()
            except Exception as exc:  # a broken third-party package must say who it is
                log.info("plugin %r failed to import", name, exc_info=exc)
                raise PluginError(f"plugin {name!r} from package {_dist_name(ep)!r} failed to import: "
                                  f"{type(exc).__name__}: {exc}{_import_cause(ep, exc)} (-v logs the traceback); "
                                  f"{way_out}") from exc
            try:
                self.register(module, name=name, source=_dist_name(ep))
            except PluginError as exc:
                raise PluginError(f"{exc}; {way_out}") from exc
            if not self.pm.get_hookcallers(module):
                log.warning("plugin %r from package %r implements no infer hook: mark its hook functions with "
                            "`from infer import hookimpl` / `@hookimpl`", name, _dist_name(ep))
            self._entry_points.append(name)
            self._way_outs[name] = way_out
        missing = sorted(set(wanted or ()) - found.keys())
        if missing:
            raise PluginError(
                f"{ALLOW_LIST_ENV} names plugins that are not installed: {', '.join(missing)}; "
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
        except pluggy.PluginValidationError as exc:
            raise self._invalid_hooks(plugin, name, source, exc) from exc
        if registered is None:
            raise PluginError(f"plugin {name!r} is already registered")
        try:
            self.pm.check_pending()  # hooks that match no hookspec
        except pluggy.PluginValidationError as exc:
            raise self._invalid_hooks(plugin, name, source, exc) from exc
        self._sources[registered] = source or registered

    def _invalid_hooks(self, plugin: object, name: str | None, source: str | None, exc: Exception) -> PluginError:
        """Unregister ``plugin`` (pluggy keeps a half-registered one) and say what is wrong with its hooks."""
        if self.pm.is_registered(plugin):
            self.pm.unregister(plugin)
        who = f"plugin {name!r}" if name else f"plugin {plugin!r}"
        if source and source != name:
            who += f" from package {source!r}"
        hooks = sorted(attr for attr in dir(hookspecs) if self.pm.parse_hookspec_opts(hookspecs, attr))
        for attr in dir(plugin):
            opts = self.pm.parse_hookimpl_opts(plugin, attr)
            hook = (opts or {}).get("specname") or attr
            if opts is None or (hook not in hooks and opts.get("optionalhook")):
                continue
            if hook not in hooks:
                guess = "".join(f" (did you mean {close!r}?)" for close in difflib.get_close_matches(hook, hooks, n=1))
                return PluginError(f"{who} implements {hook!r}, which is not an infer hook{guess}; the hooks are: "
                                   f"{', '.join(hooks)} (docs/plugin-hooks.md)")
            expected = list(inspect.signature(getattr(hookspecs, hook)).parameters)
            taken = _required_arguments(getattr(plugin, attr))
            if not set(taken) <= set(expected):
                return PluginError(f"{who} implements {hook}({', '.join(taken)}), but infer calls "
                                   f"{hook}({', '.join(expected)}): name its arguments as the hook does")
        return PluginError(f"{who} has an invalid hook implementation: {exc}")

    def collect(self) -> PluginManager:
        """Call every registration hook once, each implementation with its own source-tagged callback."""
        if self._collected:
            return self
        self._collected = True
        for kind, hook_name in KINDS.items():
            # infer's own first: a third-party name that clashes with a shipped one fails in the third party's hook,
            # whose way out is then the one given (not the shipped plugin's, which would drop infer's component)
            impls = sorted(getattr(self.pm.hook, hook_name).get_hookimpls(),
                           key=lambda impl: self._sources.get(impl.plugin_name) != SHIPPED_SOURCE)
            for impl in impls:
                source = self._sources.get(impl.plugin_name, impl.plugin_name)
                entry_point = impl.plugin_name if impl.plugin_name in self._entry_points else None
                who = f"plugin {impl.plugin_name!r}" + (
                    f" from package {source!r}" if source != impl.plugin_name else "")
                way_out = self._way_outs.get(impl.plugin_name, "fix the plugin")
                if "register" not in (*impl.argnames, *impl.kwargnames):  # pluggy lets an implementation take fewer
                    raise PluginError(f"{who} implements {hook_name}() without arguments, but infer calls "
                                      f"{hook_name}(register) and the hook registers through it: add the parameter "
                                      f"`register`; {way_out}")
                register = self.registries[kind].callback(source, entry_point, hook_name)
                try:
                    returned = impl.function(register=register)
                except PluginError as exc:  # the registry's: a duplicate (its message has the way out) or a bad name
                    if ALLOW_LIST_ENV in str(exc):
                        raise
                    raise PluginError(f"{exc}; {way_out}") from exc
                except Exception as exc:  # a broken hook must not break every command without saying whose it is
                    log.info("%s failed in its %s hook", who, hook_name, exc_info=exc)
                    raise PluginError(f"{who} failed in its {hook_name} hook: {type(exc).__name__}: {exc} (-v "
                                      f"logs the traceback); {way_out}") from exc
                finally:
                    register.close()
                if returned is not None:
                    if inspect.iscoroutine(returned) or inspect.isgenerator(returned):
                        returned.close()
                    raise PluginError(f"{who}: its {hook_name} hook returned a value of type "
                                      f"{type(returned).__name__}, which "
                                      "infer ignores: a registration hook is a plain function that calls "
                                      f"register(name, factory) for each component and returns None; {way_out}")
        declared: dict[str, Component] = {}
        for component in self.components():
            if component.options and (other := declared.setdefault(component.name, component)) is not component:
                raise PluginError(f"{component.name!r} declares plugin options as a {other.kind} (from "
                                  f"{other.source!r}) and as a {component.kind} (from {component.source!r}), but a "
                                  "name's options are one namespace, plugin_options[name]: declare them under one "
                                  "kind only")
        return self

    def registry(self, kind: str) -> Registry[Any]:
        self.collect()
        return self.registries[kind]

    def named(self, kind: str, name: str) -> str:
        """``'name' from 'package'``: how errors name a registered component."""
        return f"{name!r} from {self.registry(kind).entry(name).source!r}"

    def build(self, kind: str, name: str, expected: type[T], *args: Any) -> T:
        """Call the factory registered as ``name`` and check that it kept its contract (it returns an instance of
        the kind's ABC). A factory that raises anything but an InferError (or running out of memory: the device's
        error, or a CapacityError for the host's) becomes a PluginError that names it; -v logs the traceback."""
        entry = self.registry(kind).entry(name)
        what = f"the {kind.replace('_', ' ')} factory {name!r} from {entry.source!r}"
        shipped = getattr(entry.factory, "__module__", "").partition(".")[0] == __name__.partition(".")[0]
        try:
            built = entry.factory(*args)
        except InferError as exc:  # a refusal with its own message; a third party's says whose it is
            if not shipped:
                exc.args = (f"the {kind.replace('_', ' ')} {name!r} from {entry.source!r}: {exc}",)
            raise
        except MemoryError:
            raise
        except Exception as exc:
            if "OutOfMemory" in type(exc).__name__:  # torch.OutOfMemoryError: the device, not the plugin
                raise
            log.info("%s failed", what, exc_info=True)
            if "can't allocate memory" in str(exc):  # torch's CPU allocator: a RuntimeError, not a MemoryError
                asked = str(exc).partition("you tried to allocate ")[2].partition(" bytes")[0]
                size = f" ({int(asked) / 2**30:,.1f} GiB at once)" if asked.isdigit() else ""
                raise CapacityError(f"{what} ran out of host memory{size}: the sizes it was given (for a model, "
                                    "config.json's vocab_size, hidden_size, intermediate_size, num_hidden_layers) "
                                    "need more than this machine has; check them against the checkpoint, or use a "
                                    "machine with more memory") from exc
            todo = ("a bug in infer, or an input it should have refused with a clear message: please report it with "
                    "the traceback that -v logs") if shipped else \
                f"fix the plugin, or choose another {kind.replace('_', ' ')} (-v logs the traceback)"
            raise PluginError(f"{what} failed: {type(exc).__name__}: {exc}; {todo}") from exc
        if not isinstance(built, expected):
            raise PluginError(f"{what} returned {type(built).__name__}, not an instance of {expected.__name__}; fix "
                              "the plugin (its factory must build and return the component)")
        return built

    def components(self) -> list[Component]:
        self.collect()
        return [
            Component(kind, e.name, e.source, e.aliases, e.options) for kind, reg in self.registries.items()
            for e in reg
        ]

    def kinds_of(self, name: str) -> list[str]:
        """The kinds that ``--plugin NAME`` selects from (COMPONENT_FIELDS) with ``name`` registered, or aliased."""
        self.collect()
        return [k for k in COMPONENT_FIELDS if name in self.registries[k]]

    def resolve_plugin_names(self, config: EngineConfig, names: list[str]) -> EngineConfig:
        """Apply ``--plugin NAME`` selections: each name sets the config field of the one kind that has it."""
        self.collect()
        changes: dict[str, str] = {}
        for name in names:
            kinds = self.kinds_of(name)
            if not kinds and name in self.registries["logits_processor"]:
                raise ConfigError(f"{name!r} is a logits processor, which each request chooses, not the engine: "
                                  f"SamplingParams(logits_processors=[{name!r}]), or `infer generate "
                                  f"--logits-processor {name}`")
            if not kinds and name in self.registries["pooler"]:
                raise ConfigError(f"{name!r} is a pooler, which each embedding request chooses, not the engine: "
                                  f"PoolingParams(pooling={name!r}), or `infer embed --pooling {name}`")
            if not kinds:
                every = sorted({c.name for c in self.components() if c.kind in COMPONENT_FIELDS})
                close = difflib.get_close_matches(name, every, n=1)
                hint = f" (did you mean {close[0]!r}?)" if close else ""
                raise UnknownComponentError(f"unknown plugin {name!r}{hint}; registered components: "
                                            f"{', '.join(every)}{self._allow_list_hint(COMPONENT_FIELDS, name)}")
            if len(kinds) > 1:
                raise PluginError(f"plugin name {name!r} is registered as "
                                  f"{' and '.join(k.replace('_', ' ') for k in kinds)}; use "
                                  f"{explicit_options(name, kinds)}")
            field, chosen = COMPONENT_FIELDS[kinds[0]], self.registries[kinds[0]].entry(name).name
            if changes.get(field, chosen) != chosen:
                raise PluginError(f"--plugin {changes[field]} and --plugin {name} both choose the "
                                  f"{kinds[0].replace('_', ' ')}; keep one")
            changes[field] = chosen
        return config.replace(**changes)

    def select_components(self, config: EngineConfig, names: list[str], explicit: dict[str, Any]) -> EngineConfig:
        """``--plugin NAME`` selections, then the component fields given explicitly (they win), as the CLI and
        ``LLM(plugin=...)`` both choose. Refuses an eviction policy chosen for a cache that caches nothing."""
        by_plugin = self.resolve_plugin_names(config, names)
        chosen = by_plugin.replace(**explicit)
        for name, value in explicit.items():
            if getattr(by_plugin, name) != getattr(config, name) and value != getattr(by_plugin, name):
                log.warning("--%s %s overrides --plugin %s", name.replace("_", "-"), value, getattr(by_plugin, name))
        chose_eviction = "eviction_policy" in explicit or any(
            name in self.registry("eviction_policy") for name in names)
        if chose_eviction and not chosen.enable_prefix_caching:
            raise ConfigError("an eviction policy picks the cached prefix blocks to drop; with --no-prefix-caching "
                              "(enable_prefix_caching=False) nothing is cached, so drop the eviction policy or "
                              "--no-prefix-caching")
        self.check_plugin_options(chosen)
        return chosen

    def check_plugin_options(self, config: EngineConfig, warn_unknown: bool = True) -> None:
        """The options of components that declare theirs are checked now, before anything is built (an engine's
        assembly checks them again, for a config that did not come through select_components); a namespace that no
        registered component is named after is most likely a typo (a warning, unless ``warn_unknown`` is False)."""
        if not isinstance(config.plugin_options, dict) or not all(
                isinstance(options, dict) for options in config.plugin_options.values()):
            return  # EngineConfig.validate names the malformed value
        components = self.components()
        for component in components:
            if component.options and component.name in config.plugin_options:
                read_plugin_options(config, component.name, component.options)
            for alias in component.aliases:
                if alias in config.plugin_options:
                    raise ConfigError(f"--plugin-option {alias}.*: {alias!r} is an alias of the {component.kind} "
                                      f"{component.name!r}, whose options are read under its name only: use "
                                      f"--plugin-option {component.name}.KEY=VALUE")
        if "spec_decode" in config.plugin_options:  # ENGINE_OPTION_NAMESPACES: the speculative decoder's
            from ..spec_decode.policy import SPEC_DECODE_OPTIONS

            read_plugin_options(config, "spec_decode", SPEC_DECODE_OPTIONS)
        names = {c.name for c in components} | ENGINE_OPTION_NAMESPACES
        declared = sorted({c.name for c in components if c.options} | ENGINE_OPTION_NAMESPACES)
        for namespace in sorted(set(config.plugin_options) - names) if warn_unknown else ():
            log.warning("--plugin-option %s.* (plugin_options[%r]): no registered component is named %r, so no "
                        "plugin may read it (namespaces with declared options: %s)", namespace, namespace, namespace,
                        ", ".join(declared))

    @property
    def hook(self) -> Any:
        """The pluggy hook relay, for event hooks (``on_step``, ``on_request_finished``)."""
        return self.pm.hook

    def observe(self, hook: str, **kwargs: Any) -> None:
        """Call every observer of event hook ``hook``, in pluggy's order, even after one raised (its error must not
        hide the event from the others); then the first error is a PluginError naming its plugin and package (the
        original chained), as a component's error is."""
        caller = getattr(self.pm.hook, hook)
        impls = caller.get_hookimpls()
        if any(impl.hookwrapper or impl.wrapper for impl in impls):  # a wrapper wraps the rest: pluggy calls them
            try:
                caller(**kwargs)
            except Exception as exc:
                if (error := self._observer_error(hook, exc, impls)) is exc:
                    raise
                raise error from exc
            return
        first: Exception | None = None
        for impl in reversed(impls):  # pluggy calls the last registered first
            try:
                impl.function(*(kwargs[name] for name in impl.argnames))
            except Exception as exc:
                first = first or self._observer_error(hook, exc, [impl])
        if first is not None:
            raise first

    def _observer_error(self, hook: str, exc: Exception, impls: list[Any]) -> Exception:
        """The PluginError of observer ``exc`` came from among ``impls`` (``exc`` itself when none ran)."""
        frames, tb = [], exc.__traceback__
        while tb is not None:
            frames.append(tb.tb_frame)
            tb = tb.tb_next

        def ran(impl: Any, own: bool) -> bool:  # its code ran (own: on its own instance, when it has one)
            owner = getattr(impl.function, "__self__", None)
            code = getattr(impl.function, "__code__", None)
            return any(f.f_code is code and (not own or owner is None or (
                f.f_code.co_argcount > 0 and f.f_locals.get(f.f_code.co_varnames[0]) is owner)) for f in frames)

        impl = next((i for i in impls if ran(i, True)), None) or next((i for i in impls if ran(i, False)), None) \
            or (impls[0] if len(impls) == 1 else None)  # called alone: its error, wherever it was raised
        if impl is None:
            return exc
        source = self._sources.get(impl.plugin_name, impl.plugin_name)
        log.info("observer %r failed in %s", impl.plugin_name, hook, exc_info=exc)
        way_out = self._way_outs.get(impl.plugin_name, "fix the plugin")
        error = PluginError(f"the observer {impl.plugin_name!r} from {source!r} raised {type(exc).__name__} in "
                            f"{hook}: {exc} (-v logs the traceback); {way_out}")
        error.__cause__ = exc
        return error

    def _allow_list_hint(self, kinds: Iterable[str], name: str) -> str:
        """Why ``name`` may be missing when INFER_PLUGINS limited loading; ``""`` without an allow-list."""
        if self._allow_list is None:
            return ""
        allow = ",".join(self._allow_list)
        provider = self._shipped_provider(kinds, name)
        if provider is None:
            return (f"; {ALLOW_LIST_ENV}={allow} limited loading to those entry points: if a plugin left out "
                    f"provides {name!r}, add its entry point, or unset {ALLOW_LIST_ENV}")
        return (f"; {ALLOW_LIST_ENV}={allow} limited loading to those entry points, and infer's own entry point "
                f"{provider!r} provides {name!r}: use {ALLOW_LIST_ENV}={allow},{provider}, or unset {ALLOW_LIST_ENV}")

    def _shipped_provider(self, kinds: Iterable[str], name: str) -> str | None:
        """The entry point of infer's own, left out by the allow-list, that registers ``name`` (if any)."""
        for entry_point, ep in sorted(self._skipped_shipped.items()):
            probe = PluginManager()
            try:
                probe.register(ep.load(), name=entry_point)
                if any(name in probe.registry(kind) for kind in kinds):
                    return entry_point
            except Exception:  # a hint must never hide the error it explains
                continue
        return None

    def _duplicate_hint(self, first: str | None, second: str | None) -> str:
        """Allow-lists that leave out one of two entry points that register the same name."""
        options = [",".join(name for name in self._entry_points if name != left_out)
                   for left_out in (first, second) if left_out in self._entry_points]
        options = [f"{ALLOW_LIST_ENV}={option}" for option in options if option]
        if not options:
            return ""
        return (f", or leave one of them out with the allow-list {ALLOW_LIST_ENV}, which must name every plugin to "
                f"keep, infer's shipped ones too: {' or '.join(options)}")


def explicit_options(name: str, kinds: list[str]) -> str:
    """The options that select ``name`` of each kind: ``--scheduler NAME or --kv-cache NAME``."""
    return " or ".join(f"--{COMPONENT_FIELDS[k].replace('_', '-')} {name}" for k in kinds)


class Blame:
    """Names the component a run-time error came from: the innermost traceback frame that runs a component's method
    (its own or one it inherits: ``self`` is the component) or code of a component's module."""

    def __init__(self, plugins: PluginManager, components: dict[str, tuple[str | None, object]]) -> None:
        """``components``: kind -> (registered name, instance); a None name or instance is skipped."""
        self.plugins = plugins
        self.instances: dict[int, tuple[object, str, str]] = {}  # id -> (component, its kind, "'name' from 'pkg'")
        self.modules: dict[str, list[str]] = {}  # module -> who, for each component defined there
        for kind, (name, component) in components.items():
            self.add(kind, name, component)

    def add(self, kind: str, name: str | None, component: object) -> None:
        """Blame ``component`` (of ``kind``, registered as ``name``) too, from now on: one built after the others."""
        if name is None or component is None:
            return
        self.instances[id(component)] = (component, kind.replace("_", " "), self.plugins.named(kind, name))
        self.modules.setdefault(type(component).__module__, []).append(self._who(component))

    def name(self, component: object) -> str | None:
        """``'name' from 'package'`` of a component built from a registry, for the errors that check its answers
        (None for one that is not: an engine's own)."""
        found = self.instances.get(id(component))
        return found[2] if found is not None and found[0] is component else None

    def _who(self, component: object) -> str:
        _, kind, name = self.instances[id(component)]
        return f"the {kind} {name}"

    def error(self, exc: BaseException) -> PluginError | None:
        """A PluginError naming the component ``exc`` came from, or None when no component's code raised it."""
        who, tb = None, exc.__traceback__
        handlers = {handler.__code__ for handler in map(signal.getsignal, signal.valid_signals())
                    if hasattr(handler, "__code__")}
        while tb is not None:
            frame = tb.tb_frame
            if frame.f_code in handlers:  # the caller's signal handler raised (a SIGALRM timeout) in the step
                return None
            owner = frame.f_locals.get("self") if "self" in frame.f_code.co_varnames[:1] else None
            if owner is not None and self.name(owner) is not None:
                who = self._who(owner)
            elif names := self.modules.get(frame.f_globals.get("__name__", "")):
                who = " or ".join(names)  # a helper function of a module that defines several components
            tb = tb.tb_next
        if who is None:
            return None
        return PluginError(f"{who} raised {type(exc).__name__}: {exc}; fix the plugin or choose another (this engine "
                           "may be inconsistent now: start a new one; the CLI shows the traceback with -v)")


def checked_manager(plugins: Any) -> PluginManager | None:
    """``plugins`` as given to Engine or LLM: a PluginManager or None; anything else is refused."""
    if plugins is not None and not isinstance(plugins, PluginManager):
        raise ConfigError(f"plugins= takes a PluginManager, not {type(plugins).__name__}; to pick components by "
                          "name pass LLM(plugin=[...names]) or the fields (kv_cache=..., scheduler=...)")
    return plugins


def _dist_name(ep: metadata.EntryPoint) -> str:
    return ep.dist.name if ep.dist else ep.value


def _is_shipped(ep: metadata.EntryPoint) -> bool:
    return ep.module.partition(".")[0] == __name__.partition(".")[0]


def _import_cause(ep: metadata.EntryPoint, exc: Exception) -> str:
    """Why a third-party plugin's module is missing: its own package (an editable install whose folder moved), or a
    dependency of it."""
    if _is_shipped(ep) or not isinstance(exc, ModuleNotFoundError) or not exc.name:
        return ""
    if exc.name.partition(".")[0] == ep.module.partition(".")[0]:
        return " (the usual cause is an editable install whose folder was renamed or deleted: reinstall the plugin)"
    return f" (the plugin imports {exc.name!r}, which is not installed: install the plugin's dependencies)"


def _way_out(ep: metadata.EntryPoint, others: list[str]) -> str:
    """How a user gets infer running again despite the broken plugin behind ``ep``."""
    dist = _dist_name(ep)
    if _is_shipped(ep):
        advice = f"reinstall {dist!r}"
    else:
        advice = f"fix the plugin, or uninstall it: `pip uninstall {dist}`"
    if others:
        advice += f"; or load only the other plugins: {ALLOW_LIST_ENV}={','.join(others)}"
    return advice


def _required_arguments(function: Callable[..., Any]) -> list[str]:
    """The arguments pluggy passes by name: positional ones without a default (a method's ``self`` is bound)."""
    return [p.name for p in inspect.signature(function).parameters.values()
            if p.default is p.empty and p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
