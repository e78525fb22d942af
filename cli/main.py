"""`infer` group and built-in subcommands: generate, chat, plugins, make-tiny-model (plugins add more)."""
from __future__ import annotations

import io
import json
import logging
import re
import sys
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Any

import click

from ..core.errors import ConfigError, InferError, InvalidRequestError
from ..core.plugins import PluginManager
from .chat import chat
from .embed import embed
from .options import (EngineArgs, changed_sampling, engine_options, lora_adapter_option, refuse_beside_beam_search,
                      refuse_engine_options, sampling_options, structured_output_options)

if TYPE_CHECKING:
    from ..core.beam_search import BeamSearchParams
    from ..core.request import StructuredOutput


class CommandLineError(click.ClickException):
    """An option's value, or options together, that the engine refuses: ``Error: ...`` and exit status 2, as click's
    own usage errors (without their usage banner, so the message is the Python API's and gRPC's; ``option_error``
    adds the option that sets a field it names)."""
    exit_code = 2


def option_error(exc: InvalidRequestError, ctx: click.Context) -> CommandLineError:
    """The engine's refusal of a parameter, naming the option of ``ctx``'s command that sets it after the field:
    ``invalid sampling parameters: max_tokens (--max-tokens) must be ...``."""
    message = str(exc)
    match = re.match(r"(invalid sampling parameters: )?([a-z_]+) ", message)
    options = {param.name: param.opts[0] for param in ctx.command.params if getattr(param, "opts", None)}
    field = match[2] if match else ""
    option = options.get(field) or options.get(field.removesuffix("_in_output"))  # --include-stop-str
    if match is None or option is None:
        return CommandLineError(message)
    return CommandLineError(f"{message[:match.end(2)]} ({option}){message[match.end(2):]}")


class InferGroup(click.Group):
    """Adds the subcommands registered by plugins (register_commands) and prints InferErrors without tracebacks."""

    def list_commands(self, ctx: click.Context) -> list[str]:
        return sorted(set(super().list_commands(ctx)) | {entry.name for entry in _plugins(ctx).registry("command")})

    def get_command(self, ctx: click.Context, name: str) -> click.Command | None:
        if (command := super().get_command(ctx, name)) is not None:
            return command
        plugins = _plugins(ctx)
        if name not in plugins.registry("command"):
            return None
        try:
            return plugins.build("command", name, click.Command)
        except InferError as exc:
            if ctx.meta.get("infer.listing"):  # --help lists the commands that work, and says which one does not
                click.echo(f"infer: warning: {exc}", err=True)
                return None
            raise click.ClickException(str(exc)) from exc

    def format_commands(self, ctx: click.Context, formatter: click.HelpFormatter) -> None:
        ctx.meta["infer.listing"] = True
        try:
            super().format_commands(ctx, formatter)
        finally:
            del ctx.meta["infer.listing"]

    def invoke(self, ctx: click.Context) -> Any:
        # before click resolves the subcommand, whose plugin factory may fail and log why (-v shows the traceback)
        logging.basicConfig(level=logging.INFO if ctx.params.get("verbose") else logging.WARNING,
                            format="infer: %(message)s")
        try:
            return super().invoke(ctx)
        except ConfigError as exc:  # an option's value or a combination of options: a usage error, as click's own
            raise CommandLineError(str(exc)) from exc
        except InferError as exc:
            raise click.ClickException(str(exc)) from exc
        except KeyboardInterrupt:  # a command that can say what was done says so itself, with the same exit status
            click.echo("\ninterrupted", err=True)
            raise SystemExit(130) from None


def _log_verbosely(on: bool) -> bool:
    """-v, as soon as it is parsed: eager, so that `infer -v --help` (--help answers while parsing, before the
    command runs) logs the traceback of a plugin command that fails to build, as its warning says."""
    if on:
        logging.basicConfig(level=logging.INFO, format="infer: %(message)s")
    return on


def _plugins(ctx: click.Context) -> PluginManager:
    root = ctx.find_root()
    root.meta.setdefault("infer.plugins", None)
    if root.meta["infer.plugins"] is None:
        try:
            plugins = PluginManager.from_entry_points().collect()
        except InferError as exc:
            raise click.ClickException(str(exc)) from exc
        for entry in plugins.registry("command"):
            for name in (entry.name, *entry.aliases):  # the built-in runs; the plugin's name is unreachable: say so
                if name in main.commands:
                    what = "a command" if name == entry.name else f"the command {entry.name!r} with an alias"
                    click.echo(f"infer: warning: {entry.source} registers {what} {name!r}, the name of a built-in "
                               "infer command, so it cannot run by that name; the plugin must rename it", err=True)
        root.meta["infer.plugins"] = plugins
    return root.meta["infer.plugins"]


@click.group(cls=InferGroup)
@engine_options
@click.option("-v", "--verbose", is_flag=True, is_eager=True, callback=lambda ctx, param, on: _log_verbosely(on),
              help="Log engine details to stderr.")
@click.version_option(package_name="infer-engine")
@click.pass_context
def main(ctx: click.Context, verbose: bool, **kwargs: Any) -> None:
    """infer: a plugin-first LLM inference engine."""
    ctx.obj = EngineArgs.from_kwargs(kwargs)


def build_engine(ctx: click.Context, **defaults: Any) -> Any:
    """The engine of the group options; ``defaults``: the command's own defaults (see EngineArgs.build). On a
    terminal, a progress bar on stderr while the weights load (gone once loaded)."""
    from rich.console import Console
    from rich.progress import BarColumn, DownloadColumn, Progress, TextColumn, TimeRemainingColumn

    from ..core.engine import Engine

    plugins = _plugins(ctx)
    config = ctx.find_object(EngineArgs).build(plugins, **defaults)
    console = Console(stderr=True)
    with Progress(TextColumn("loading weights"), BarColumn(), DownloadColumn(), TimeRemainingColumn(),
                  console=console, transient=True, disable=not console.is_terminal) as progress:
        task = progress.add_task("loading weights", total=None)
        return Engine(config, plugins, lambda read, total: progress.update(task, completed=read, total=total))


@main.command()
@click.argument("prompts", nargs=-1)
@click.option("--max-tokens", type=int, default=64, show_default=True, help="Tokens to generate per prompt.")
@sampling_options
@structured_output_options
@click.option("--n", type=int, default=1, show_default=True, help="Completions per prompt.")
@click.option("--logprobs", type=int, default=None, help="With --json: each output token's logprob and the top N "
              "at its position, N in [0, 20] [default: none].")
@click.option("--prompt-logprobs", type=int, default=None, help="With --json: each prompt token's logprob given the "
              "tokens before it, and the top N there (the prompt is computed in full: no prefix-cache hits) "
              "[default: none].")
@click.option("--stop", multiple=True, help="Stop string (repeatable).")
@click.option("--include-stop-str", is_flag=True, help="Keep the stop string, or the text of the EOS or stop token, "
              "that ended a completion in its text.")
@click.option("--ignore-eos", is_flag=True, help="Keep generating after EOS.")
@click.option("--seed", type=int, default=None, help="Seed of each prompt's sampling: the same seed gives the same "
              "text, whatever else runs in the batch (with speculative decoding, as long as the prompt gets the same "
              "drafts per step, which a full step budget or the degradation rules can change) [default: the "
              "engine's random stream].")
@lora_adapter_option("to every prompt")
@click.option("--beam-width", type=int, default=0, help="Beam search with this many beams per prompt (their KV "
              "shared by fork); prints the best beam, --json every beam [default: 0, off].")
@click.option("--length-penalty", type=float, default=1.0, show_default=True,
              help="Beam search: a hypothesis scores its log-probability / its length ** this.")
@click.option("--stream", is_flag=True, help="Print text as it is generated (one prompt at a time).")
@click.option("--stats", is_flag=True, help="Print engine metrics (KV usage, prefix hit rate, speculation, ...) as "
              "JSON at the end (each field in docs/cli.md).")
@click.option("--json", "as_json", is_flag=True,
              help="Print one JSON object per completion and line (prompt_index, prompt, index, text, token_ids, "
                   "finish_reason, num_cached_tokens, metrics) instead of prompt + text: unambiguous for scripts, "
                   "and for --n > 1 or multi-line completions.")
@click.option("--chat", is_flag=True, help="Each PROMPT (or stdin line) is a conversation in JSON, rendered by the "
              "model's chat template: a list of OpenAI messages, or an object of 'messages' and optionally 'tools', "
              "'tool_choice', 'chat_template_kwargs', 'add_generation_prompt', 'continue_final_message'. Prints each "
              "reply alone.")
@click.pass_context
def generate(ctx: click.Context, prompts: tuple[str, ...], max_tokens: int, sampling: dict[str, Any],
             structured_output: StructuredOutput | None, n: int,
             logprobs: int | None, prompt_logprobs: int | None, stop: tuple[str, ...], include_stop_str: bool,
             ignore_eos: bool, seed: int | None, lora_adapter: str | None, beam_width: int, length_penalty: float,
             stream: bool, stats: bool, as_json: bool, chat: bool) -> None:
    """Generate text for PROMPTS (or for each line of stdin when none are given). Each completion prints as the
    prompt followed by its text (with --chat, the reply alone); with several prompts or --n > 1, --json keeps them
    apart."""
    from ..core.beam_search import BeamSearchParams
    from ..core.chat import check_has_chat_template
    from ..core.request import SamplingParams

    if stream and n > 1:
        raise click.UsageError("--stream prints one completion at a time; use it with --n 1")
    if stream and as_json:
        raise click.UsageError("--stream prints text as it comes; --json prints whole completions: choose one")
    if not prompts and sys.stdin.isatty():  # else it would wait without a word
        click.echo("infer: reading prompts from the terminal, one per line; Ctrl-D ends them (or give PROMPTS as "
                   "arguments)", err=True)
    if not prompts:
        tolerant_stdin()
    numbered = list(enumerate(prompts, 1)) if prompts else [
        (number, line) for number, line in enumerate(map(stdin_text, sys.stdin), 1) if line.strip()]
    texts = [text for _, text in numbered]
    if not texts:
        raise click.UsageError("give at least one PROMPT argument or lines on stdin")
    inputs: list[Any] = _chats(numbered, bool(prompts)) if chat else texts  # what the engine gets
    shown = [""] * len(texts) if chat else texts  # printed before each completion: a reply is not a continuation
    if (logprobs is not None or prompt_logprobs is not None) and not as_json and not beam_width:  # else: refused
        raise click.UsageError("--logprobs and --prompt-logprobs print with --json; add it")
    params = SamplingParams(max_tokens=max_tokens, n=n, stop=stop, ignore_eos=ignore_eos, seed=seed,
                            logprobs=logprobs, prompt_logprobs=prompt_logprobs,
                            include_stop_str_in_output=include_stop_str, structured_output=structured_output,
                            lora_adapter=lora_adapter, **sampling)
    try:
        params.validate()
    except InvalidRequestError as exc:  # the options' values
        raise option_error(exc, ctx) from None
    if not beam_width and ctx.get_parameter_source("length_penalty") is not click.core.ParameterSource.DEFAULT:
        raise click.UsageError("--length-penalty scores beam search's hypotheses; add --beam-width W", ctx)

    def refused(exc: InferError, index: int | None) -> click.ClickException:
        where = "" if prompts or index is None else f" (stdin line {numbered[index][0]})"
        return click.ClickException(f"{exc}{where}")

    if beam_width:
        others = {"--n": n != 1, "--stop": stop, "--regex/--choice/--json-schema/--grammar": structured_output,
                  "--include-stop-str": include_stop_str, "--seed": seed is not None,
                  "--stream": stream,
                  "--logprobs": logprobs is not None, "--prompt-logprobs": prompt_logprobs is not None}
        refuse_beside_beam_search(changed_sampling(sampling, beam_search=True) +
                                  [name for name, value in others.items() if value])
        if stats:
            raise click.UsageError("--stats reports the engine's scheduled requests, which beam search bypasses; "
                                   "drop --stats (--json shows each beam's log-probability and score)")
        _beam_search(ctx, inputs, texts, shown, BeamSearchParams(beam_width, max_tokens, length_penalty, ignore_eos,
                                                                 lora_adapter, sampling["logits_processors"]),
                     as_json, refused)
        return

    streamed = 0
    try:
        engine = build_engine(ctx)
        try:  # the options' values against this model (token ids, --chat's template), before any prompt runs
            engine.checker.check_params(params)
            engine.check_structured_output(params)
            if chat:
                check_has_chat_template(engine.tokenizer)
        except InvalidRequestError as exc:
            raise CommandLineError(str(exc)) from None
        if stream:
            try:  # every prompt is checked, capacity included, before the first is generated
                engine.check_requests(inputs, params)
            except InferError as exc:
                raise refused(exc, exc.prompt_index) from exc
            for prompt, text in zip(inputs, shown):
                click.echo(text, nl=False)
                for delta in engine.stream(prompt, params):
                    for out in delta.outputs:
                        click.echo(out.text, nl=False)
                click.echo()
                streamed += 1
        else:
            try:
                completed = engine.generate_as_completed(inputs, params)
            except InferError as exc:
                raise refused(exc, exc.prompt_index) from exc
            print_in_order(len(texts), completed, lambda i, result: [
                json.dumps(_completion_json(i, texts[i], result, out)) if as_json else shown[i] + out.text
                for out in result.outputs], "generating", "completions")
    except KeyboardInterrupt:  # while loading or streaming (print_in_order reports its own)
        click.echo(f"\ninterrupted: printed {streamed} of {len(texts)} prompts' completions in full", err=True)
        raise SystemExit(130) from None
    if stats:
        summary = engine.stats.summary()
        click.echo(json.dumps(summary, indent=2), err=True)


def tolerant_stdin() -> None:
    """Read stdin as UTF-8 whatever the locale, its invalid bytes kept as surrogate escapes, so that the prompt's
    check names the line (a strict decoder, as a UTF-8 locale's, failed the read itself with a traceback). A stdin
    that cannot be reconfigured (not a text stream, or read from already) is read as it is."""
    try:
        sys.stdin.reconfigure(encoding="utf-8", errors="surrogateescape")  # type: ignore[union-attr]
    except (AttributeError, ValueError, io.UnsupportedOperation):
        pass


def _check_tiny_model_fits(hidden_size: int, num_layers: int, tied: bool, arch: str) -> None:
    """A usage error before any allocation for a model whose float32 weights, held twice while written, pass the
    host memory available (it allocated until the machine ran out). Counted as a llama's, Mixtral's MLP four times
    (its 4 experts; the Qwen MoE ones' experts are narrower than the llama's MLP)."""
    from ..core.loader import host_memory_available
    from ..models.tiny import ARCH_CONFIGS, parameter_count

    experts = ARCH_CONFIGS[arch].get("num_local_experts", 0)
    params = parameter_count(hidden_size, num_layers, 2 * hidden_size, tied, experts=experts)
    needed, available = 2 * 4 * params, host_memory_available()
    if available is not None and needed > available:
        raise click.UsageError(f"a model of hidden size {hidden_size} x {num_layers} layers has {params:,} parameters "
                               f"and needs about {needed / 2**30:.1f} GiB to write, more than the "
                               f"{available / 2**30:.1f} GiB available; lower --hidden-size or --num-layers")


def stdin_text(line: str) -> str:
    """A line of stdin without its line ending, nor a byte-order mark before it (editors put one before UTF-8)."""
    return line.rstrip("\r\n").removeprefix("\ufeff")


def _chats(numbered: list[tuple[int, str]], from_arguments: bool) -> list[Any]:
    """generate --chat: each prompt's conversation; a usage error naming the first prompt or line that is not one
    (all are read before anything runs)."""
    from ..core.chat import CHAT_FIELDS, chat_of_fields
    from ..core.chat_tools import load_json

    chats = []
    for number, text in numbered:
        where = f"prompt {number}" if from_arguments else f"stdin line {number}"
        try:
            value = load_json(text, f"--chat: {where}", "a JSON list of messages, or {\"messages\": [...], ...}")
            if isinstance(value, list):
                value = {"messages": value}
            if not isinstance(value, dict):
                raise InvalidRequestError(f"--chat: {where} is not a list of messages or an object of "
                                          f"{', '.join(CHAT_FIELDS)}")
            if unknown := sorted(set(value) - set(CHAT_FIELDS)):
                raise InvalidRequestError(f"--chat: {where} has keys {unknown}; a conversation has "
                                          f"{', '.join(CHAT_FIELDS)}")
            chats.append(chat_of_fields(value))
        except InvalidRequestError as exc:
            message = str(exc) if str(exc).startswith("--chat") else f"--chat: {where}: {exc}"
            raise CommandLineError(message) from None
    return chats


def _beam_search(ctx: click.Context, inputs: list[Any], texts: list[str], shown: list[str], params: BeamSearchParams,
                 as_json: bool, refused: Callable[[InferError, int | None], Exception]) -> None:
    """generate --beam-width: the best beam after each prompt, or --json one line per beam, best first. Every
    prompt is checked first; then they run in groups that fill --max-num-seqs, each printed when it is done (a
    progress bar on a terminal's stderr), so Ctrl-C keeps what was printed."""
    from rich.console import Console
    from rich.progress import Progress

    from ..core.beam_search import check_prompts

    try:
        params.validate()
    except InvalidRequestError as exc:
        raise option_error(exc, ctx) from None
    printed = 0
    try:
        engine = build_engine(ctx)
        try:
            prompts = check_prompts(engine, inputs, params)
        except InferError as exc:
            raise refused(exc, exc.prompt_index) from exc
        group = max(1, engine.config.max_num_seqs // params.beam_width)
        console = Console(stderr=True)
        with Progress(console=console, transient=True,
                      disable=len(texts) <= group or not console.is_terminal) as progress:
            task = progress.add_task("beam search", total=len(texts))
            for start in range(0, len(texts), group):
                for result in engine.beam_search(prompts[start : start + group], params):
                    for rank, beam in enumerate(result.beams if as_json else result.beams[:1]):
                        click.echo(json.dumps({
                            "prompt_index": printed, "prompt": texts[printed], "index": rank, "text": beam.text,
                            "token_ids": beam.token_ids, "finish_reason": beam.finish_reason.value,
                            "cumulative_logprob": beam.cumulative_logprob, "score": beam.score})
                            if as_json else shown[printed] + beam.text)
                    printed += 1
                sys.stdout.flush()
                progress.advance(task, len(prompts[start : start + group]))
    except KeyboardInterrupt:
        click.echo(f"\ninterrupted: printed {printed} of {len(texts)} prompts' beams", err=True)
        raise SystemExit(130) from None


def print_in_order(total: int, completed: Iterator[tuple[int, Any]], lines: Callable[[int, Any], list[str]],
                   doing: str, what: str) -> None:
    """Print each of ``total`` prompts' ``lines(index, result)`` once it and every earlier prompt finished (so
    Ctrl-C keeps what is done; then exit 130, saying how many prompts' ``what`` were printed); a progress bar
    (``doing``) on stderr when it is a terminal and there are several prompts."""
    from rich.console import Console
    from rich.progress import Progress

    ready: dict[int, Any] = {}
    printed = 0
    console = Console(stderr=True)
    with Progress(console=console, transient=True, disable=total < 2 or not console.is_terminal) as progress:
        task = progress.add_task(doing, total=total)
        try:
            for index, result in completed:
                ready[index] = result
                progress.advance(task)
                while printed in ready:
                    for line in lines(printed, ready.pop(printed)):
                        click.echo(line)
                    printed += 1
                sys.stdout.flush()
        except KeyboardInterrupt:
            click.echo(f"interrupted: printed {printed} of {total} prompts' {what}", err=True)
            raise SystemExit(130) from None


def _completion_json(prompt_index: int, prompt: str, result: Any, out: Any) -> dict[str, Any]:
    """generate --json's line for one completion; logprobs as [{"token_id", "logprob"}, ...] per position (null: the
    first prompt token), only when asked for."""
    def positions(entries: list[dict[int, float] | None]) -> list[list[dict[str, float]] | None]:
        return [None if e is None else [{"token_id": t, "logprob": lp} for t, lp in e.items()] for e in entries]

    line = {"prompt_index": prompt_index, "prompt": prompt, "index": out.index, "text": out.text,
            "token_ids": out.token_ids, "finish_reason": out.finish_reason and out.finish_reason.value,
            "num_cached_tokens": result.num_cached_tokens, "metrics": result.metrics}
    if out.content is not None:  # --reasoning-parser or --tool-parser read the reply of a chat
        line["content"] = out.content
    if out.reasoning_content is not None:
        line["reasoning_content"] = out.reasoning_content
    if out.tool_calls is not None:  # OpenAI's shape
        line["tool_calls"] = [{"id": call.id, "type": "function", "function": {
            "name": call.name, "arguments": json.dumps(call.arguments, ensure_ascii=False)}} for call in out.tool_calls]
    if out.logprobs is not None:
        line["logprobs"] = positions(out.logprobs)
    if result.prompt_logprobs is not None:  # entry i holds prompt token i (and the top N before it)
        line["prompt_token_ids"] = result.prompt_token_ids
        line["prompt_logprobs"] = positions(result.prompt_logprobs)
    return line


@main.command("plugins")
@click.option("--json", "as_json", is_flag=True, help="Print JSON instead of a table.")
@click.option("--options", "show_options", is_flag=True,
              help="Also list each component's declared plugin options (--plugin-option NAME.KEY=VALUE): what each "
                   "accepts, its default and what it does.")
@click.pass_context
def plugins_command(ctx: click.Context, as_json: bool, show_options: bool) -> None:
    """List every registered component: kind, name and providing package (and its declared options)."""
    from ..core.plugins import explicit_options

    refuse_engine_options(ctx, "plugins", " (INFER_PLUGINS=a,b limits the entry points that load)")
    plugins = _plugins(ctx)
    rows = plugins.components()
    for name in sorted({name for r in rows for name in (r.name, *r.aliases)}):
        if len(kinds := plugins.kinds_of(name)) > 1:  # `--plugin NAME` then asks for the explicit option
            what = " and ".join(("an " if k[0] in "aeiou" else "a ") + k.replace("_", " ") for k in kinds)
            click.echo(f"infer: warning: {name!r} names {what}; --plugin {name} is ambiguous, so select it with "
                       f"{explicit_options(name, kinds)}", err=True)
    def options(r: Any) -> dict[str, dict[str, Any]]:
        return {key: {"accepts": o.expected(), "default": o.default, "help": o.help} for key, o in r.options.items()}

    if as_json:
        click.echo(json.dumps([{"kind": r.kind, "name": r.name, "source": r.source, "aliases": list(r.aliases),
                                "options": options(r)} for r in rows], indent=2))
        return
    from rich.console import Console
    from rich.table import Table

    table = Table()
    for column in ("kind", "name", "aliases", "package", "options"):
        table.add_column(column, overflow="fold")  # a long name wraps, never cut short with an ellipsis
    for r in rows:
        table.add_row(r.kind, r.name, ", ".join(r.aliases), r.source, ", ".join(r.options))
    console = Console(width=120)
    console.print(table)
    if show_options:
        listed = Table("option", "accepts", "default", "what it does")
        from ..spec_decode.policy import SPEC_DECODE_OPTIONS

        namespaces = [(r.name, r.options) for r in rows] + [("spec_decode", SPEC_DECODE_OPTIONS)]  # any proposer's
        for namespace, declared in namespaces:
            for key, o in declared.items():
                listed.add_row(f"{namespace}.{key}", o.expected(), repr(o.default), o.help)
        console.print(listed)


@main.command("make-tiny-model")
@click.argument("directory", type=click.Path(file_okay=False))
@click.option("--arch", type=click.Choice(["llama", "mistral", "qwen2", "qwen3", "phi3", "gemma2", "gemma3",
                                           "mixtral", "qwen2moe", "qwen3moe"]),
              default="llama", show_default=True, help="Architecture (the MoE ones: 4 experts, 2 per token).")
@click.option("--hidden-size", type=int, default=64, show_default=True, help="Hidden size; the MLP is twice as wide.")
@click.option("--num-layers", type=int, default=2, show_default=True, help="Decoder layers.")
@click.option("--tie-word-embeddings", is_flag=True, help="Share the input embedding and the output head.")
@click.option("--seed", type=click.IntRange(0, 2**63 - 1), default=0, show_default=True,
              help="Seed of the random weights.")
@click.pass_context
def make_tiny_model_command(ctx: click.Context, directory: str, arch: str, hidden_size: int, num_layers: int,
                            tie_word_embeddings: bool, seed: int) -> None:
    """Write a random-weight model with a locally trained byte-level BPE tokenizer to DIRECTORY (written to a
    temporary folder beside it and moved into place, so a failed or interrupted run leaves no partial model)."""
    import shutil
    import tempfile
    from pathlib import Path

    from ..core.files import chmod_as_umask
    from ..models.tiny import make_tiny_model
    from .terminal import transformers_bars_on_terminal_only

    refuse_engine_options(ctx, "make-tiny-model", " (its own options follow the command: --arch, --hidden-size, ...)")
    out = Path(directory)
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise click.UsageError(f"{directory} already exists and is not an empty folder; choose a new folder (or "
                               "remove it)")
    if blocking := next((p for p in out.parents if p.exists() and not p.is_dir()), None):
        raise click.UsageError(f"{blocking} is a file, so {directory} cannot be a folder inside it; choose another "
                               "path")
    _check_tiny_model_fits(hidden_size, num_layers, tie_word_embeddings, arch)
    try:
        out.parent.mkdir(parents=True, exist_ok=True)  # (folders it creates above DIRECTORY stay on a failure)
        partial = Path(tempfile.mkdtemp(prefix=f".{out.name}.partial-", dir=out.parent))
    except OSError as exc:
        raise click.ClickException(f"cannot write {directory}: {exc.strerror or exc}") from None
    try:
        with transformers_bars_on_terminal_only():  # save_pretrained's "Writing model shards" bar
            make_tiny_model(partial, arch, hidden_size=hidden_size, num_layers=num_layers,
                            intermediate_size=2 * hidden_size, tie_word_embeddings=tie_word_embeddings, seed=seed)
        for path in (partial, *partial.iterdir()):
            chmod_as_umask(path)
        if out.exists():
            out.rmdir()  # empty, checked above
        partial.rename(out)
    except OSError as exc:
        raise click.ClickException(f"cannot write {directory}: {exc.strerror or exc}") from None
    except (RuntimeError, MemoryError) as exc:  # torch's allocator: "can't allocate memory"
        raise click.ClickException(f"cannot build a model of hidden size {hidden_size} x {num_layers} layers in "
                                   f"memory ({str(exc).splitlines()[0]}); lower --hidden-size or --num-layers"
                                   ) from None
    finally:
        shutil.rmtree(partial, ignore_errors=True)  # gone already after the rename
    click.echo(f"wrote a random-weight {arch} model to {out}")


main.add_command(chat)
main.add_command(embed)
