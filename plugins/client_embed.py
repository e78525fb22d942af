"""`infer client` as a group: `infer client [OPTIONS] PROMPT` generates (its default command, `generate`), and
`infer client embed TEXT` asks a running `infer serve` for an embedding (the Embed RPC)."""
from __future__ import annotations

import json
from pathlib import Path

import click

from ..core.errors import InferError
from .server_commands import connection_options, quiet_grpc_core, rpc_error_message

SHOWN_VALUES = 4  # what the summary line prints of a vector


class ClientGroup(click.Group):
    """`infer client`: arguments that do not begin with a subcommand's name go to `generate`, so that
    `infer client PROMPT` keeps generating; a prompt that is such a name goes as `infer client generate PROMPT`."""

    def __init__(self, generate: click.Command) -> None:
        super().__init__("client", commands={"generate": generate, "embed": embed},
                         help="Talk to a running `infer serve`: `infer client [OPTIONS] PROMPT` (or `infer client "
                              "generate ...`) streams a completion, `infer client embed TEXT` prints an embedding. "
                              "`infer client COMMAND --help` lists a command's options.")

    def parse_args(self, ctx: click.Context, args: list[str]) -> list[str]:
        if not args or (args[0] not in self.commands and args[0] not in ctx.help_option_names):
            args = ["generate", *args]
        return super().parse_args(ctx, args)


@click.command("embed")
@click.argument("text")
@connection_options
@click.option("--pooling", default=None, metavar="NAME",
              help="The server's pooler: last (the last position's hidden state), mean (the average over every "
                   "position), first, max, weighted-mean, mean-sqrt-len or a plugin's [default: the server "
                   "checkpoint's sentence-transformers pooling, else last].")
@click.option("--normalize/--no-normalize", default=None,
              help="L2-normalize the vector [default: as the server's checkpoint says, else normalized].")
@click.option("--dimensions", type=int, default=None,
              help="Keep the first N values (Matryoshka embeddings), before normalizing [default: all].")
@click.option("--priority", type=int, default=0, show_default=True,
              help="The request's priority, as `infer client --priority`.")
@click.option("--lora-adapter", default=None, metavar="NAME",
              help="Pool the hidden states of the LoRA adapter the server loaded as NAME [default: the base model].")
@click.option("--truncate", is_flag=True,
              help="Embed a prompt past the longest the server embeds by its first tokens, instead of an error.")
@click.option("--json", "as_json", is_flag=True, help="Print the whole vector as a JSON array.")
@click.pass_context
def embed(ctx: click.Context, text: str, target: str, token: str | None, tls: bool, tls_ca: Path | None,
          timeout: float | None, pooling: str | None, normalize: bool | None, dimensions: int | None, priority: int,
          lora_adapter: str | None, truncate: bool, as_json: bool) -> None:
    """Print the embedding of TEXT from a running `infer serve`: its dimensions and first values, or with --json
    the whole vector."""
    quiet_grpc_core()
    import grpc

    from ..cli.main import CommandLineError, option_error
    from ..cli.options import refuse_engine_options
    from ..core.errors import InvalidRequestError
    from ..core.pooling import PoolingParams
    from ..server.client import Client

    refuse_engine_options(ctx, "client embed", " (the server's engine is set where `infer serve` starts)")
    fields = dict(pooling=pooling, normalize=normalize, dimensions=dimensions, priority=priority,
                  lora_adapter=lora_adapter, truncate=truncate)
    try:  # checked here, before the server sees it: a command-line error
        PoolingParams(**fields)  # type: ignore[arg-type]
    except InvalidRequestError as exc:
        raise option_error(exc, ctx) from None
    with Client(target, token=token, tls=tls, root_certificates=tls_ca, timeout=timeout) as conn:
        try:
            vector = conn.embed(text, **fields)  # type: ignore[arg-type]
        except InferError as exc:  # a value the protocol cannot carry, found before anything was sent
            raise CommandLineError(str(exc)) from None
        except UnicodeEncodeError:  # a TEXT argument that is not UTF-8 (a surrogate-escaped byte)
            raise click.ClickException("the text is not valid UTF-8; pass UTF-8 text") from None
        except grpc.RpcError as exc:
            raise click.ClickException(rpc_error_message(exc, target, tls or tls_ca is not None, timeout)) from exc
    if not vector:
        raise click.ClickException("the server aborted the request (an Abort of its id): no embedding")
    click.echo(json.dumps(vector) if as_json else summary_line(vector))


def summary_line(vector: list[float]) -> str:
    """``64 dimensions: [0.0123, -0.4567, 0.0891, 0.1000, ...]``."""
    shown = ", ".join(f"{value:.4f}" for value in vector[:SHOWN_VALUES])
    return f"{len(vector)} dimensions: [{shown}{', ...' if len(vector) > SHOWN_VALUES else ''}]"
