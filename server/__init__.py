"""gRPC serving: ``infer serve`` (:mod:`.app`), the engine thread (:mod:`.worker`) and Python clients.

``from infer.server import Client`` gives the blocking client, ``AsyncClient`` the asyncio one. The API is
``infer.proto`` (package ``infer.v1``); the generated modules are ``infer_pb2`` and ``infer_pb2_grpc``.
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from .app import InferenceServer, ServeOptions, serve
    from .client import AsyncClient, Client

__all__ = ["AsyncClient", "Client", "InferenceServer", "ServeOptions", "serve"]

_HOMES = {"Client": "client", "AsyncClient": "client", "InferenceServer": "app", "ServeOptions": "app",
          "serve": "app"}


def __getattr__(name: str) -> Any:  # import grpc only when a name is used
    if name in _HOMES:
        from importlib import import_module

        return getattr(import_module(f".{_HOMES[name]}", __name__), name)
    raise AttributeError(f"module 'infer.server' has no attribute {name!r}")
