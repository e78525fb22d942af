"""Typed options of one plugin: ``EngineConfig.plugin_options[NAMESPACE]`` read against a declaration, so that a
misspelt key or a value of the wrong type is a ConfigError naming the option, never a silent default."""
from __future__ import annotations

import difflib
import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from .config import EngineConfig
from .errors import ConfigError


@dataclass(frozen=True)
class PluginOption:
    """One option. ``kind`` is bool, int, float or str (default: the default's type); ``None`` as the default means
    "unset" and is always accepted; any other default must itself be a value the option accepts. ``flag`` names an
    infer group option that sets it too (``--spec-min-acceptance``), for the errors (plugins cannot add those)."""
    default: Any
    help: str
    kind: type | None = None
    choices: tuple[Any, ...] = ()
    minimum: float | None = None
    maximum: float | None = None
    flag: str | None = None

    def __post_init__(self) -> None:
        kind = self.kind or type(self.default)
        if kind not in (bool, int, float, str):
            raise TypeError(f"PluginOption {self.help!r}: its kind must be bool, int, float or str (from kind= or the "
                            f"default), got {kind.__name__}; a default of None needs kind=")
        if self.default is not None and not self._fits(self.default):
            raise TypeError(f"PluginOption {self.help!r}: its default {self.default!r} is not {self.expected()}")

    def _fits(self, value: Any) -> bool:
        kind = self.kind or type(self.default)
        fits = (isinstance(value, bool) if kind is bool else
                isinstance(value, int) and not isinstance(value, bool) if kind is int else
                isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
                if kind is float else isinstance(value, kind))
        return fits and (not self.choices or value in self.choices) and not (kind in (int, float) and (
            (self.minimum is not None and value < self.minimum) or (self.maximum is not None and value > self.maximum)))

    def check(self, namespace: str, key: str, value: Any) -> Any:
        """``value`` as the option's kind (an int is a float where a float is asked), else ConfigError."""
        kind = self.kind or type(self.default)
        if value is None and self.default is None:
            return None
        if not self._fits(value):
            name = f"--plugin-option {namespace}.{key}" + (f" ({self.flag})" if self.flag else "")
            quote = (f" (the command line reads VALUE as JSON when it parses: quote text that looks like a number, "
                     f"--plugin-option '{namespace}.{key}=\"{value}\"')" if kind is str and not isinstance(value, str)
                     else "")
            raise ConfigError(f"{name} must be {self.expected()}, got {value!r}{quote}: {self.help}")
        return float(value) if kind is float else value

    def expected(self) -> str:
        """What the option accepts, in words."""
        kind = self.kind or type(self.default)
        if self.choices:
            return "one of " + ", ".join(map(str, self.choices))
        words = {bool: "true or false", int: "an integer", float: "a number", str: "a string"}[kind]
        if self.minimum is not None and self.maximum is not None:
            return f"{words} in [{self.minimum:g}, {self.maximum:g}]"
        if self.minimum is not None:
            return f"{words} >= {self.minimum:g}"
        if self.maximum is not None:
            return f"{words} <= {self.maximum:g}"
        return words


def read_plugin_options(config: EngineConfig, namespace: str, declared: Mapping[str, PluginOption]
                        ) -> dict[str, Any]:
    """Every declared option of ``namespace``: the value given in ``config.plugin_options``, checked, else the
    default. A key that is not declared is a ConfigError listing the declared ones."""
    given = config.plugin_options.get(namespace, {})
    for key in given:
        if key not in declared:
            close = difflib.get_close_matches(key, list(declared), n=1)
            hint = f"did you mean {namespace}.{close[0]}? " if close else ""
            listing = "; ".join(f"{name} ({option.expected()}, default {option.default!r})"
                                for name, option in declared.items())
            raise ConfigError(f"--plugin-option {namespace}.{key}: {namespace} has no option {key!r}; {hint}its "
                              f"options: {listing}")
    return {key: option.check(namespace, key, given[key]) if key in given else option.default
            for key, option in declared.items()}
