"""infer: a plugin-first LLM inference engine."""
from __future__ import annotations

from typing import TYPE_CHECKING, Any

# Absolute imports: pytest also imports the repository root's __init__.py under the checkout folder's name.
from infer.core.chat import ChatMessage, ChatPrompt
from infer.core.chat_tools import FunctionChoice, ToolCall
from infer.core.errors import (CapacityError, CheckpointError, ConfigError, InferError, InvalidRequestError,
                               NotFoundError, PluginError)
from infer.core.hookspecs import hookimpl
from infer.core.pooling import PoolingParams
from infer.core.request import SamplingParams, StructuredOutput

__version__ = "0.1.0"
__all__ = ["LLM", "SamplingParams", "PoolingParams", "StructuredOutput", "BeamSearchParams", "ChatPrompt", "ChatMessage", "ToolCall",
           "FunctionChoice",
           "hookimpl", "__version__",
           "InferError", "InvalidRequestError", "ConfigError", "CapacityError", "PluginError", "CheckpointError",
           "NotFoundError"]

if TYPE_CHECKING:
    from infer.core.beam_search import BeamSearchParams
    from infer.core.llm import LLM


def __getattr__(name: str) -> Any:  # keep `import infer` light: the engine pulls in torch models lazily
    if name == "LLM":
        from infer.core.llm import LLM

        return LLM
    if name == "BeamSearchParams":  # its module imports torch
        from infer.core.beam_search import BeamSearchParams

        return BeamSearchParams
    raise AttributeError(f"module 'infer' has no attribute {name!r}")
