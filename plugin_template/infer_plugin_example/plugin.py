"""The hook implementations infer loads through the ``infer`` entry point (see pyproject.toml)."""
from __future__ import annotations

from infer import hookimpl
from infer.core.hookspecs import EvictionPolicyFactory
from infer.core.registry import Register

from .slru import SegmentedLRUPolicy


@hookimpl
def register_eviction_policies(register: Register[EvictionPolicyFactory]) -> None:
    """Provide ``slru``: select it with ``--eviction-policy slru`` or ``--plugin slru``."""
    register("slru", lambda config: SegmentedLRUPolicy(), aliases=("segmented-lru",))
