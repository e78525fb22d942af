"""The one exception hierarchy of infer. Every message tells the user what to do next."""


class InferError(Exception):
    """Base class: the CLI prints these without a traceback, gRPC maps them to status codes."""

    prompt_index: int | None = None  # which prompt of a batch caused it (Engine.add_requests), when one did


class InvalidRequestError(InferError, ValueError):
    """The request (prompt, sampling parameters, options) is malformed. gRPC: INVALID_ARGUMENT."""


class ConfigError(InvalidRequestError):
    """An engine option is invalid or inconsistent. gRPC: INVALID_ARGUMENT."""


class CapacityError(InferError):
    """The request can never fit this engine's configuration (KV pool, max-num-seqs, step budget). gRPC:
    FAILED_PRECONDITION, as retrying cannot help until the configuration changes (a server that is full right now
    answers RESOURCE_EXHAUSTED itself)."""


class PluginError(InferError):
    """A plugin is unknown, duplicated, or broke its contract. gRPC: FAILED_PRECONDITION."""


class UnknownComponentError(ConfigError, PluginError):
    """A component name (an option's value) that no installed plugin registers: a typo, or a plugin not installed.
    Both a ConfigError (the command line names it: exit status 2) and, as before it had its own class, a
    PluginError."""


class CheckpointError(InferError):
    """A model folder is missing, unsupported or unsafe to load. gRPC: FAILED_PRECONDITION."""


class NotFoundError(InferError, KeyError):
    """An id (request, component) does not exist. gRPC: NOT_FOUND."""

    def __str__(self) -> str:  # KeyError would quote the message
        return str(self.args[0]) if self.args else ""


def require_utf8(text: str, what: str) -> None:
    """InvalidRequestError when ``text`` (``what``: "the prompt", ...) holds lone surrogates: bytes that were not
    UTF-8, decoded leniently (Python's surrogateescape), which no tokenizer can encode."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as exc:
        raise InvalidRequestError(f"{what} is not valid UTF-8 text (character {exc.start + 1} is {text[exc.start]!r}, "
                                  "which stands for a byte that is not UTF-8); convert the input to UTF-8 first"
                                  ) from None


def shape_mismatch(name: str, checkpoint: tuple[int, ...], model: tuple[int, ...]) -> CheckpointError:
    """A checkpoint tensor whose shape is not the one config.json's sizes give the model's parameter."""
    return CheckpointError(f"shape mismatch for {name}: checkpoint {checkpoint}, model {model}: the sizes in "
                           "config.json (hidden_size, intermediate_size, num_attention_heads, num_key_value_heads, "
                           "head_dim, vocab_size, the experts' sizes; a quantized tensor's quantization_config "
                           "too) do not describe these weights; correct config.json, or fetch the checkpoint again")
