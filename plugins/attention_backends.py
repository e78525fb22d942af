"""Registers the shipped attention backends: `torch` (the reference), `cpu` (a C kernel over the paged pool) and
`triton` (the GPU default). Each factory imports its backend's module when called, so loading the plugins (for
`infer --help`, say) does not import torch."""
from __future__ import annotations

from ..core.config import EngineConfig
from ..core.hookspecs import AttentionBackendFactory, hookimpl
from ..core.interfaces import AttentionBackend
from ..core.registry import Register


def torch_backend(config: EngineConfig) -> AttentionBackend:
    from .torch_attention import TorchAttention

    return TorchAttention()


def cpu_backend(config: EngineConfig) -> AttentionBackend:
    from .cpu_attention import create_backend

    return create_backend(config)


def triton_backend(config: EngineConfig) -> AttentionBackend:
    from .triton_attention import create_backend

    return create_backend(config)


@hookimpl
def register_attention_backends(register: Register[AttentionBackendFactory]) -> None:
    register("torch", torch_backend)
    register("cpu", cpu_backend)
    register("triton", triton_backend)
