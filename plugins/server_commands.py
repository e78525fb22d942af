"""The `serve` and `client` commands: gRPC serving of the engine, and a command-line client for it (whose `embed`
subcommand is in client_embed.py)."""
from __future__ import annotations

import json
import os
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

import click

from ..cli.options import (chat_template_kwargs_option, sampling_options, structured_output_options, tool_choice_option,
                           tool_choice_of, tools_option)
from ..core.errors import InferError
from ..core.hookspecs import CommandFactory, hookimpl
from ..core.registry import Register

if TYPE_CHECKING:
    import grpc

    from ..core.request import StructuredOutput

TOKEN_ENV = "INFER_SERVER_TOKEN"


def quiet_grpc_core() -> None:
    """Before gRPC's first import: its core library logs events such as a failed TLS handshake at INFO level to
    stderr, raw, while these commands explain them in their own message. An explicit GRPC_VERBOSITY wins."""
    os.environ.setdefault("GRPC_VERBOSITY", "ERROR")


@click.command("serve")
@click.option("--host", default="127.0.0.1", show_default=True, help="Address to bind (0.0.0.0 for all).")
@click.option("--port", type=int, default=50051, show_default=True, help="gRPC port (0 picks a free one).")
@click.option("--max-queue", type=int, default=1024, show_default=True,
              help="Most requests in flight (running or waiting); past it calls get RESOURCE_EXHAUSTED.")
@click.option("--max-message-bytes", type=int, default=4 * 1024 * 1024, show_default=True,
              help="Largest gRPC message received or sent.")
@click.option("--grace-period", type=float, default=30.0, show_default=True,
              help="Seconds that in-flight requests get to finish after SIGTERM.")
@click.option("--token", envvar=TOKEN_ENV, default=None,
              help=f"Require 'authorization: Bearer TOKEN' metadata (or set {TOKEN_ENV}).")
@click.option("--tls-cert", type=click.Path(exists=True, dir_okay=False, path_type=Path), default=None,
              help="PEM certificate chain: serve over TLS (needs --tls-key).")
@click.option("--tls-key", type=click.Path(exists=True, dir_okay=False, path_type=Path), default=None,
              help="PEM private key of --tls-cert.")
@click.option("--metrics-port", type=int, default=None, help="Serve Prometheus metrics on this port (same host).")
@click.option("--allow-lora-loading", is_flag=True,
              help="Let clients load LoRA adapters from this machine's disk and unload them (the LoadLoraAdapter "
                   "and UnloadLoraAdapter RPCs, `infer lora load/unload`) into the group's --max-lora-adapters "
                   "slots [default: off: PERMISSION_DENIED].")
@click.option("--http-port", type=int, default=None,
              help="Also serve OpenAI's HTTP API (/v1/completions, /v1/chat/completions, /v1/embeddings, /v1/models) "
                   "on this port (0 picks a free one; same host, token and TLS) [default: off].")
@click.option("--served-model-name", default=None,
              help="The name the HTTP API's `model` field gives the model [default: the model folder's name].")
@click.option("--allowed-origins", "allowed_origins", multiple=True, metavar="ORIGIN",
              help="Let web pages of this origin (e.g. https://app.example.com; * for any) call the HTTP API from a "
                   "browser (CORS); repeat for several [default: none].")
@click.pass_context
def serve(ctx: click.Context, host: str, port: int, max_queue: int, max_message_bytes: int, grace_period: float,
          token: str | None, tls_cert: Path | None, tls_key: Path | None, metrics_port: int | None,
          allow_lora_loading: bool, http_port: int | None, served_model_name: str | None,
          allowed_origins: tuple[str, ...]) -> None:
    """Serve the model over gRPC (infer.v1.Inference, health, reflection) until SIGTERM, then drain; with
    --http-port, OpenAI's HTTP API too."""
    from ..cli.main import build_engine
    quiet_grpc_core()
    from ..server.app import InferenceServer, ServeOptions, host_port, serve as run_server

    options = ServeOptions(host, port, max_queue, max_message_bytes, grace_period, token, tls_cert, tls_key,
                           metrics_port, allow_lora_loading, http_port, served_model_name,
                           allowed_origins).validate()
    options.check_ports()  # before the model load, which can take minutes
    engine = build_engine(ctx, freeze_gc=True)  # a long-running process: no full collection should stall a step

    def ready(server: InferenceServer) -> None:
        scheme = "TLS" if tls_cert else "plaintext"
        click.echo(f"infer: serving {engine.loaded.path} on {host_port(host, server.port)} (gRPC, {scheme}"
                   f"{', token required' if token else ''})", err=True)
        if server.http_port is not None:
            click.echo(f"infer: OpenAI API on http{'s' * bool(tls_cert)}://{host_port(host, server.http_port)}/v1 "
                       f"(model {server.served_name!r})", err=True)
        if server.metrics_port is not None:
            click.echo(f"infer: metrics on http://{host_port(host, server.metrics_port)}/metrics", err=True)

    run_server(engine, options, ready)
    click.echo("infer: server stopped", err=True)


def connection_options(command: Callable[..., Any]) -> Callable[..., Any]:
    """--target, --token, --tls, --tls-ca and --timeout: how a command reaches `infer serve`."""
    options = [
        click.option("--target", default="127.0.0.1:50051", show_default=True, callback=lambda ctx, param, value:
                     checked_target(value), help="host:port of `infer serve` (or a gRPC target such as unix:PATH)."),
        click.option("--token", envvar=TOKEN_ENV, default=None, help=f"Bearer token (or set {TOKEN_ENV})."),
        click.option("--tls", is_flag=True, help="Connect over TLS with the system's root certificates."),
        click.option("--tls-ca", type=click.Path(exists=True, dir_okay=False, path_type=Path), default=None,
                     help="PEM root certificate(s) to trust (implies --tls)."),
        click.option("--timeout", type=click.FloatRange(min=0, min_open=True), default=None,
                     help="Deadline of the call in seconds.")]
    for option in reversed(options):
        command = option(command)
    return command


@click.command("client")
@click.argument("prompt")
@connection_options
@click.option("--max-tokens", type=int, default=64, show_default=True, help="Tokens to generate per completion.")
@sampling_options
@structured_output_options
@click.option("--n", type=int, default=1, show_default=True, help="Completions (more than 1 disables streaming).")
@click.option("--seed", type=int, default=None, help="Seed of the request's sampling (reproducible).")
@click.option("--stop", multiple=True, help="Stop string (repeatable).")
@click.option("--include-stop-str", is_flag=True, help="Keep the stop string, or the text of the EOS or stop token, "
              "that ended the completion in its text.")
@click.option("--ignore-eos", is_flag=True, help="Keep generating after EOS.")
@click.option("--no-speculative", is_flag=True, help="Opt this request out of the server's speculative decoding.")
@click.option("--priority", type=int, default=0, show_default=True,
              help="The request's priority: higher runs first on a server started with --scheduling-policy priority "
                   "(the priority eviction policy reads it too).")
@click.option("--lora-adapter", default=None, metavar="NAME", help="Apply the LoRA adapter the server loaded as NAME "
              "(`infer --lora NAME=DIR serve`) [default: none, the base model].")
@click.option("--beam-width", type=int, default=0, help="Beam search with this many beams (the BeamSearch RPC, "
              "which runs beside the server's other requests); prints the best beam [default: 0, off].")
@click.option("--length-penalty", type=float, default=1.0, show_default=True,
              help="Beam search: a hypothesis scores its log-probability / its length ** this.")
@click.option("--chat", is_flag=True, help="Send PROMPT as a user message, rendered by the server model's chat "
              "template; prints the reply alone.")
@click.option("--system", default=None, help="With --chat: a system message before PROMPT [default: none].")
@chat_template_kwargs_option
@tools_option
@tool_choice_option
@click.option("--stats", is_flag=True,
              help="Print the server's GetStats as JSON to stderr after a call that succeeded.")
@click.pass_context
def client(ctx: click.Context, prompt: str, target: str, token: str | None, tls: bool, tls_ca: Path | None,
           timeout: float | None, max_tokens: int, sampling: dict[str, Any],
           structured_output: StructuredOutput | None, n: int,
           seed: int | None, stop: tuple[str, ...], include_stop_str: bool, ignore_eos: bool, no_speculative: bool,
           priority: int, lora_adapter: str | None, beam_width: int, length_penalty: float, chat: bool, system: str | None,
           stats: bool, chat_template_kwargs: dict[str, Any], tools: tuple[dict[str, Any], ...], tool_choice: str
           ) -> None:
    """Send PROMPT to a running `infer serve` and print the prompt and its completion as it streams (with --chat,
    the reply alone)."""
    quiet_grpc_core()
    import grpc

    from ..cli.chat import ReplyEcho
    from ..cli.main import CommandLineError, option_error
    from ..cli.options import refuse_engine_options

    refuse_engine_options(ctx, "client", " (the server's engine is set where `infer serve` starts)")

    from ..cli.options import changed_sampling, refuse_beside_beam_search
    from ..server.client import Client

    if beam_width:
        others = {"--n": n != 1, "--stop": stop, "--include-stop-str": include_stop_str, "--seed": seed is not None,
                  "--no-speculative": no_speculative, "--priority": priority,
                  "--regex/--choice/--json-schema/--grammar": structured_output}
        refuse_beside_beam_search(changed_sampling(sampling, beam_search=True) +
                                  [name for name, value in others.items() if value])
    elif ctx.get_parameter_source("length_penalty") is not click.core.ParameterSource.DEFAULT:
        raise click.UsageError("--length-penalty scores beam search's hypotheses; add --beam-width W", ctx)
    sampling = dict(sampling, max_tokens=max_tokens, n=n, stop=list(stop), ignore_eos=ignore_eos,
                    include_stop_str_in_output=include_stop_str)
    if structured_output is not None:
        sampling["structured_output"] = structured_output
    if no_speculative:
        sampling["speculative"] = False
    if priority:
        sampling["priority"] = priority
    if seed is not None:
        sampling["seed"] = seed
    if lora_adapter is not None:
        sampling["lora_adapter"] = lora_adapter
    def given(param: str) -> bool:  # an option typed, even as '{}' or a file of no tools, is for a conversation
        return ctx.get_parameter_source(param) is not click.core.ParameterSource.DEFAULT

    for name, typed in (("--system", given("system")), ("--chat-template-kwargs", given("chat_template_kwargs")),
                        ("--tools", given("tools")), ("--tool-choice", tool_choice != "auto")):
        if typed and not chat:
            raise click.UsageError(f"{name} is for a conversation; add --chat", ctx)
    from ..core.beam_search import BeamSearchParams
    from ..core.chat import ChatPrompt
    from ..core.errors import InvalidRequestError
    from ..core.request import SamplingParams

    opening = [{"role": "system", "content": system}] if system is not None else []
    try:  # checked here, before the server sees it: a command-line error
        if beam_width:
            BeamSearchParams(beam_width, max_tokens, length_penalty, ignore_eos, lora_adapter,
                             sampling["logits_processors"]).validate()
        else:
            SamplingParams(**dict(sampling, stop=tuple(stop))).validate()
        sent = ChatPrompt.of([*opening, {"role": "user", "content": prompt}],
                             chat_template_kwargs=chat_template_kwargs, tools=tools,
                             tool_choice=tool_choice_of(tool_choice, tools)) if chat else prompt
    except InvalidRequestError as exc:
        raise option_error(exc, ctx) from None
    shown = "" if chat else prompt  # a reply is not a continuation of the user's text
    with Client(target, token=token, tls=tls, root_certificates=tls_ca, timeout=timeout) as conn:
        mid_line = False  # the prompt goes out with the first response, so that an early error stands alone
        try:
            if beam_width:
                print_best_beam(conn, sent, shown, beam_width=beam_width, max_tokens=max_tokens,
                                length_penalty=length_penalty, ignore_eos=ignore_eos,
                                logits_processors=sampling["logits_processors"],
                                **({} if lora_adapter is None else {"lora_adapter": lora_adapter}))
            elif n == 1:
                calls, echo, listed = [], ReplyEcho(), set()
                for response in conn.generate(sent, **sampling):
                    if not mid_line:
                        click.echo(shown, nl=False)
                        mid_line = True
                    for out in response.outputs:
                        echo_parts(echo, out)
                        for call in out.new_tool_calls:  # each as soon as the server's parser has read it
                            echo.note(call_line(call))
                            listed.add(call.id)
                        calls += out.tool_calls
                echo.end()
                mid_line = False
                list_tool_calls(call for call in calls if call.id not in listed)
            else:
                for out in conn.complete(sent, **sampling).outputs:
                    click.echo(shown, nl=False)
                    echo = ReplyEcho()
                    echo_parts(echo, out)
                    echo.end()
                    list_tool_calls(out.tool_calls)
            if stats:
                click.echo(json.dumps(stats_dict(conn.stats()), indent=2), err=True)
        except InferError as exc:  # an option's value the protocol cannot carry, found before anything was sent
            raise CommandLineError(str(exc)) from None
        except UnicodeEncodeError:  # a prompt argument that is not UTF-8 (a surrogate-escaped byte)
            raise click.ClickException("the prompt is not valid UTF-8 text; pass UTF-8, or token ids through the "
                                       "Python client") from None
        except grpc.RpcError as exc:
            if mid_line:
                click.echo()  # end the partial completion's line
            raise click.ClickException(rpc_error_message(exc, target, tls or tls_ca is not None, timeout)) from exc


@click.command("lora")
@click.argument("action", type=click.Choice(["load", "unload"]))
@click.argument("name")
@click.argument("path", required=False)
@connection_options
@click.pass_context
def lora(ctx: click.Context, action: str, name: str, path: str | None, target: str, token: str | None, tls: bool,
         tls_ca: Path | None, timeout: float | None) -> None:
    """`load NAME PATH`: have a running `infer serve --allow-lora-loading` serve the LoRA adapter in PATH (a folder
    on the server's machine; a relative PATH is taken from this command's working directory) as NAME; `unload
    NAME`: stop serving it. Prints the adapters served then."""
    quiet_grpc_core()
    import grpc

    from ..cli.options import refuse_engine_options
    from ..server.client import Client

    refuse_engine_options(ctx, "lora", " (the server's adapter slots are set where `infer serve` starts)")
    if (action == "load") != (path is not None):
        raise click.UsageError("load takes NAME and PATH (the adapter's folder on the server); unload takes NAME "
                               "alone", ctx)
    if path is not None:
        path = os.path.abspath(path)  # the server reads it: its own working directory would be a surprise
    with Client(target, token=token, tls=tls, root_certificates=tls_ca, timeout=timeout) as conn:
        try:
            names = conn.load_lora_adapter(name, path) if path is not None else conn.unload_lora_adapter(name)
        except grpc.RpcError as exc:
            raise click.ClickException(rpc_error_message(exc, target, tls or tls_ca is not None, timeout)) from exc
    click.echo(f"{'loaded' if path is not None else 'unloaded'} {name}; serving: {', '.join(names) or 'no adapters'}")


def echo_parts(echo: Any, out: Any) -> None:
    """A Completion message through a ReplyEcho: split into reasoning and content where the server's parsers split
    its replies as they stream, else its text."""
    split = out.HasField("reasoning_text")
    echo(out.text, out.reasoning_text if split else None, out.content_text if split else None)


def list_tool_calls(calls: Any) -> None:
    """The calls that the server's --tool-parser (or a forced --tool-choice) read in a reply, one per line on
    stderr."""
    for call in calls:
        click.echo(call_line(call), err=True)


def call_line(call: Any) -> str:
    """A gRPC ToolCall as `infer client` lists it."""
    from ..cli.chat import listed_call

    return listed_call(call.id, call.name, call.arguments)


def print_best_beam(conn: Any, prompt: Any, shown: str, **params: Any) -> None:
    """Print ``shown`` and the best beam's text. Ctrl-C aborts the search by its request id and prints the best
    beam so far (then exits 130), as `generate` prints what it has."""
    import uuid

    import grpc

    request_id = uuid.uuid4().hex
    call = conn.start_beam_search(prompt, request_id=request_id, **params)
    try:
        click.echo(shown + call.result().beams[0].text)
    except KeyboardInterrupt:
        try:
            conn.abort(request_id, timeout=10)
        except grpc.RpcError as exc:
            if exc.code() is not grpc.StatusCode.NOT_FOUND:  # NOT_FOUND: it had just finished
                call.cancel()
                raise
        best = call.result(timeout=10).beams[0]
        click.echo(shown + best.text)
        click.echo(f"interrupted: printed the best beam so far ({len(best.token_ids)} tokens)", err=True)
        raise SystemExit(130) from None


def stats_dict(stats: Any) -> dict[str, Any]:
    """A Stats message as a flat dict, every field present, with 64-bit counters as JSON numbers (protobuf's JSON
    mapping writes them as strings) and maps (``lora_requests``) as dicts."""
    def is_map(field: Any) -> bool:
        return field.message_type is not None and field.message_type.GetOptions().map_entry

    return {field.name: dict(getattr(stats, field.name)) if is_map(field) else getattr(stats, field.name)
            for field in stats.DESCRIPTOR.fields}


def checked_target(target: str) -> str:
    """``host:port`` with a port in 1-65535 (gRPC would try another port, or none, without a word); targets with
    a scheme (unix:PATH, dns:///host:port) go to gRPC as they are."""
    if target.startswith(("unix:", "unix-abstract:", "dns:", "ipv4:", "ipv6:", "vsock:")):
        return target
    host, colon, port = target.rpartition(":")
    if not colon or not host or not port.isdigit() or not 1 <= int(port) <= 65535:
        raise click.BadParameter(f"{target!r} is not HOST:PORT with a port in 1-65535 (e.g. 127.0.0.1:50051)")
    return target


def rpc_error_message(exc: grpc.RpcError, target: str, tls: bool, timeout: float | None = None) -> str:
    """``CODE: details``; a TLS/plaintext mismatch or an untrusted certificate gets a hint instead of the SSL error,
    and a refused connection, a missing token or a passed deadline say what to change."""
    details = exc.details() or ""
    code = exc.code().name
    if "WRONG_VERSION_NUMBER" in details:
        return f"UNAVAILABLE: {target} does not speak TLS (a plaintext server?); drop --tls and --tls-ca"
    if "CERTIFICATE_VERIFY_FAILED" in details:
        return (f"UNAVAILABLE: the TLS certificate of {target} is not trusted; pass its certificate or CA with "
                "--tls-ca (and check that it names the host of --target)")
    # the certificate does not name --target's host: gRPC says UNAUTHENTICATED (no token helps) or, when the
    # handshake checks it, UNAVAILABLE "failed to connect" (the server does listen)
    if "does not match SSL server name" in details or "Hostname Verification Check failed" in details:
        host = target.rpartition(":")[0] or target
        return (f"{code}: the TLS certificate of {target} does not name the host {host}; connect by a name or "
                "address that the certificate lists (its subjectAltName), or serve a certificate that names it")
    if not tls and code == "UNAVAILABLE" and "Socket closed" in details:
        return f"UNAVAILABLE: {target} closed the connection; if it serves TLS (--tls-cert), add --tls-ca or --tls"
    if code == "UNAVAILABLE" and ("Connection refused" in details or "failed to connect" in details):
        return (f"UNAVAILABLE: nothing accepts connections at {target}; is `infer serve` running there (--target "
                f"HOST:PORT; the server logs the address it serves on)? ({details})")
    if code == "UNAUTHENTICATED":
        return f"UNAUTHENTICATED: {details}; pass the server's token with --token TOKEN (or set {TOKEN_ENV})"
    if code == "DEADLINE_EXCEEDED" and timeout is not None:
        return f"DEADLINE_EXCEEDED: the call did not finish within --timeout {timeout:g} s; raise --timeout, or drop it"
    return f"{code}: {details}"


def client_group() -> click.Command:
    """`infer client`: the generation command above by default, `embed` beside it (plugins/client_embed.py)."""
    from .client_embed import ClientGroup

    return ClientGroup(client)


@hookimpl
def register_commands(register: Register[CommandFactory]) -> None:
    register("serve", lambda: serve)
    register("client", client_group)
    register("lora", lambda: lora)
