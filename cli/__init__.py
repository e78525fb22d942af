"""The `infer` command line (click). Group options build the EngineConfig shared by every subcommand."""
from __future__ import annotations

from .main import main

__all__ = ["main"]
