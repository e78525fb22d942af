"""`infer chat`: a conversation on stdin and stdout, rendered by the model's chat template (core/chat.py)."""
from __future__ import annotations

import json
import sys
from typing import Any

import click

from ..core.chat_tools import ToolCall
from ..core.errors import InferError, InvalidRequestError
from .options import (chat_template_kwargs_option, lora_adapter_option, sampling_options, tool_choice_of,
                      tool_choice_option, tools_option)


@click.command("chat")
@click.option("--system", default=None, help="A system message that opens the conversation [default: none].")
@click.option("--max-tokens", type=int, default=256, show_default=True, help="Tokens per reply, at most.")
@sampling_options
@click.option("--seed", type=int, default=None, help="Seed of each reply's sampling [default: the engine's random "
              "stream].")
@lora_adapter_option("to every reply")
@chat_template_kwargs_option
@tools_option
@tool_choice_option
@click.pass_context
def chat(ctx: click.Context, system: str | None, max_tokens: int, sampling: dict[str, Any], seed: int | None,
         lora_adapter: str | None, chat_template_kwargs: dict[str, Any], tools: tuple[dict[str, Any], ...],
         tool_choice: str) -> None:
    """Chat with the model: each line of stdin is your turn, and the model's reply to the whole conversation so far
    (rendered by the model's chat template) streams to stdout. End of input (Ctrl-D) or /exit ends it, /reset
    starts over, Ctrl-C during a reply stops that reply (on a terminal, while typing, it clears the line). A turn
    the engine refuses (the conversation outgrew the context, say) is dropped with the reason on stderr, and the
    exit status is then 1. With --tools, the template shows the model the tools; a reply that calls one is
    printed as the model wrote it (this loop runs no tools). With the group's --tool-parser too, the calls it reads
    are listed on stderr with their ids, kept in the conversation as calls, and `/tool ID RESULT` answers one (the
    model then replies to the result). --tool-choice required or NAME forces each reply to a turn of yours to be
    calls (read without a parser); the reply to a /tool answer is read as with auto."""
    from ..core.chat import ChatPrompt
    from ..core.request import SamplingParams
    from ..core.tool_choice import forces_calls
    from .main import CommandLineError, build_engine, option_error

    params = SamplingParams(max_tokens=max_tokens, seed=seed, lora_adapter=lora_adapter, **sampling)
    try:
        params.validate()
    except InvalidRequestError as exc:
        raise option_error(exc, ctx) from None
    opening = [{"role": "system", "content": system}] if system is not None else []
    try:
        choice = tool_choice_of(tool_choice, tools)
        first = ChatPrompt.of([*opening, {"role": "user", "content": "hello"}],
                              chat_template_kwargs=chat_template_kwargs, tools=tools, tool_choice=choice)
    except InvalidRequestError as exc:
        raise option_error(exc, ctx) from None
    engine = build_engine(ctx)
    try:  # the template, the tool choice and the options against this model, before the first turn
        engine.check_request(first, params)
    except InferError as exc:
        raise CommandLineError(f"{exc} (checked on the opening with a one-word turn)") from None
    after_results = "auto" if forces_calls(first) else choice  # the reply to a /tool answer
    eos = engine.tokenizer.eos_token_id
    if eos is not None and eos not in engine.eos_token_ids:  # HF's rule: generation_config.json's ids win
        click.echo(f"infer: warning: the tokenizer's end-of-sequence token {engine.tokenizer.eos_token!r} (id {eos}) "
                   f"does not stop generation, which stops at {sorted(engine.eos_token_ids)} (generation_config.json's "
                   "eos_token_id); if it ends the model's turns, replies run to --max-tokens: add it there", err=True)
    from .main import tolerant_stdin

    tolerant_stdin()
    interactive = sys.stdin.isatty()
    if interactive:
        click.echo(f"infer chat with {engine.loaded.path}: Ctrl-D or /exit ends, /reset starts over"
                   f"{', /tool ID RESULT answers a tool call' if tools else ''}", err=True)
    history = list(opening)
    refused = 0
    while (line := _read_turn(interactive)) is not None:
        if line == "/exit":
            break
        if line == "/reset":
            history = list(opening)
            continue
        if (line == "/tool" or line.startswith("/tool ")) and tools:
            call_id, _, result = line.removeprefix("/tool").strip().partition(" ")
            if not call_id:
                click.echo("infer: /tool ID RESULT answers a tool call by its id", err=True)
                continue
            calls = [call.id for message in history for call in message.get("tool_calls") or ()]
            if call_id not in calls:  # sent all the same: a script may not know the ids the replies make
                made = f"the calls made: {', '.join(calls)}" if calls else "no reply has made a call"
                click.echo(f"infer: warning: no tool call {call_id} in this conversation ({made}); answered as "
                           "given", err=True)
            message = {"role": "tool", "tool_call_id": call_id, "content": result.strip()}
        elif not line or (line.startswith("/") and " " not in line) or line.startswith("/tool "):
            if line.startswith("/tool") and not tools:  # no call to answer
                click.echo("infer: /tool answers a tool call, and this chat offers no tools: start it with --tools "
                           "FILE", err=True)
            elif line:  # a mistyped command is not a turn
                commands = "/reset, /exit, /tool ID RESULT" if tools else "/reset, /exit"
                click.echo(f"infer: unknown command {line.split()[0]} (the commands: {commands})", err=True)
            continue
        else:
            message = {"role": "user", "content": line}
        turn = [*history, message]
        try:
            turn_choice = choice if message["role"] == "user" else after_results
            reply = _stream_reply(engine, ChatPrompt.of(turn, chat_template_kwargs=chat_template_kwargs, tools=tools,
                                                        tool_choice=turn_choice), params)
        except InferError as exc:
            click.echo(f"infer: turn refused: {exc} (/reset starts a new conversation)", err=True)
            refused += 1
            continue
        history = [*turn, reply]
    if refused:
        raise SystemExit(1)


def _read_turn(interactive: bool) -> str | None:
    """The next turn, stripped; None at the end of input. On a terminal, Ctrl-C clears the line being typed."""
    if interactive:
        try:
            import readline  # noqa: F401 - line editing and history for input()
        except ImportError:  # a Python built without it: plain input
            pass
        try:
            return input(">>> ").strip()
        except EOFError:
            click.echo(err=True)
            return None
        except KeyboardInterrupt:
            click.echo(err=True)
            return ""
    from .main import stdin_text

    line = sys.stdin.readline()
    return stdin_text(line).strip() if line else None


def _stream_reply(engine: Any, prompt: Any, params: Any) -> dict[str, Any]:
    """Print the reply as it comes; Ctrl-C stops it (the request is aborted) and keeps what came. Returns it as an
    assistant message: its text, or the reasoning, content and calls that the parsers read (calls listed on
    stderr)."""
    parts: list[str] = []
    deltas = engine.stream(prompt, params)
    stopped, last, echo, listed = False, None, ReplyEcho(), set()
    try:
        for delta in deltas:
            if delta.outputs:
                last = delta.outputs[0]
                parts.append(last.text)
                echo(last.text, last.reasoning_text, last.content_text)
                for call in last.new_tool_calls or ():  # each as soon as the parser has read it
                    echo.note(call_line(call))
                    listed.add(call.id)
    except KeyboardInterrupt:
        deltas.close()
        stopped = True
    echo.end()
    if stopped:
        click.echo("[reply stopped]", err=True)
    for call in (last.tool_calls or []) if last is not None else []:
        if call.id not in listed:
            echo.note(call_line(call))
    return reply_message("".join(parts), last)


def call_line(call: ToolCall) -> str:
    arguments = json.dumps(call.arguments, ensure_ascii=False)
    return f"{listed_call(call.id, call.name, arguments)} (answer with /tool {call.id} RESULT)"


def listed_call(call_id: str | None, name: str, arguments: str) -> str:
    """A tool call as `infer chat` and `infer client` list it on stderr (``arguments``: its JSON text)."""
    return f"infer: tool call {call_id}: {name}({arguments})"


class ReplyEcho:
    """Prints a reply as it streams: its text to stdout; where the parsers split it as it streams (a reasoning
    parser, a tool parser), its content to stdout (tool calls left out) and its reasoning to stderr (dimmed on a
    terminal), a line break after the reasoning; the tool calls on stderr, each on a line of its own."""

    def __init__(self) -> None:
        self.reasoning_open = False  # reasoning printed on stderr, its line not ended yet
        self.text_open = False  # text printed on stdout, its line not ended yet
        self.ended = False  # a note ended the text's line, and no text came after it

    def __call__(self, text: str, reasoning: str | None, content: str | None) -> None:
        if reasoning is None:
            self._print(text)
            return
        if reasoning:
            click.echo(click.style(reasoning, dim=True), nl=False, err=True)
            self.reasoning_open = True
        if content:
            self._end_reasoning()
            self._print(content)

    def note(self, line: str) -> None:
        """``line`` on stderr, on a line of its own."""
        self._end_reasoning()
        if self.text_open:
            click.echo()
            self.text_open, self.ended = False, True
        click.echo(line, err=True)

    def end(self) -> None:
        self._end_reasoning()
        if not self.ended:
            click.echo()
        self.text_open = self.ended = False

    def _print(self, text: str) -> None:
        if text:
            click.echo(text, nl=False)
            self.text_open, self.ended = not text.endswith("\n"), False

    def _end_reasoning(self) -> None:
        if self.reasoning_open:
            click.echo(err=True)
            self.reasoning_open = False


def reply_message(text: str, last: Any) -> dict[str, Any]:
    """The assistant message of a reply whose text is ``text`` and whose last output is ``last`` (None: nothing
    came): the text, or what the parsers read of it. An empty reasoning is none (a message may not carry one)."""
    if last is None or last.content is None:  # not read (no parser, or stopped)
        return {"role": "assistant", "content": text}
    message: dict[str, Any] = {"role": "assistant", "content": last.content}
    if last.reasoning_content:
        message["reasoning_content"] = last.reasoning_content
    if last.tool_calls:
        message.update(content=last.content or None, tool_calls=last.tool_calls)
    return message
