"""infer-plugin-example: the ``slru`` eviction policy for infer's cached KV blocks, as a third-party plugin.

``plugin.py`` holds the hook implementation that infer finds through the ``infer`` entry point in
pyproject.toml; ``slru.py`` holds the component itself.
"""
from __future__ import annotations

from .slru import SegmentedLRUPolicy

__version__ = "0.1.0"
__all__ = ["SegmentedLRUPolicy", "__version__"]
