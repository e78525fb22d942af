"""`infer embed`: one embedding per prompt (core/pooling.py), as JSON lines."""
from __future__ import annotations

import json
import sys
from typing import Any

import click

from ..core.errors import InferError, InvalidRequestError
from .options import lora_adapter_option


@click.command("embed")
@click.argument("prompts", nargs=-1)
@click.option("--pooling", default=None, metavar="NAME",
              help="A pooler (`infer plugins` lists them): last, the last prompt position's hidden state; mean, the "
                   "average of every position's; first (cls), max, weighted-mean, mean-sqrt-len, as "
                   "sentence-transformers defines them [default: the checkpoint's sentence-transformers pooling "
                   "(1_Pooling/config.json), else last].")
@click.option("--normalize/--no-normalize", default=None,
              help="Divide each embedding by its L2 norm [default: as the checkpoint's modules.json says (a Normalize "
                   "module), else --normalize].")
@click.option("--dimensions", type=int, default=None,
              help="Keep the first N values (Matryoshka embeddings), before normalizing [default: all].")
@lora_adapter_option("to every prompt")
@click.option("--truncate", is_flag=True,
              help="Embed a prompt past the longest the model embeds (its context less one token, or the "
                   "checkpoint's sentence-transformers max_seq_length) by its first tokens, as sentence-transformers "
                   "does, instead of refusing it.")
@click.option("--chat", is_flag=True, help="Each PROMPT (or stdin line) is a conversation in JSON, rendered by the "
              "model's chat template, as generate --chat's (set \"add_generation_prompt\": false in it to leave the "
              "assistant's opening out).")
@click.pass_context
def embed(ctx: click.Context, prompts: tuple[str, ...], pooling: str | None, normalize: bool | None,
          dimensions: int | None, lora_adapter: str | None, truncate: bool, chat: bool) -> None:
    """Embed PROMPTS (or each line of stdin when none are given): the model's final hidden states, pooled. Prints
    one JSON line per prompt, in order: {"prompt_index", "prompt", "embedding", "prompt_tokens" (those embedded:
    with --truncate, fewer than the prompt's), "cached_tokens"}.
    A sequence classifier (a *ForSequenceClassification checkpoint, a reward model) prints its label logits as the
    embedding, and "labels": config.json's id2label, as transformers reads it (LABEL_0... where it names none)."""
    from ..core.classification import read_id2label
    from ..core.pooling import PoolingParams
    from .main import (CommandLineError, _chats, build_engine, option_error, print_in_order, stdin_text,
                       tolerant_stdin)

    try:
        params = PoolingParams(pooling, normalize, dimensions, lora_adapter=lora_adapter, truncate=truncate)
    except InvalidRequestError as exc:
        raise option_error(exc, ctx) from None
    if not prompts and sys.stdin.isatty():
        click.echo("infer: reading prompts from the terminal, one per line; Ctrl-D ends them (or give PROMPTS as "
                   "arguments)", err=True)
    if not prompts:
        tolerant_stdin()
    numbered = list(enumerate(prompts, 1)) if prompts else [
        (number, line) for number, line in enumerate(map(stdin_text, sys.stdin), 1) if line.strip()]
    texts = [text for _, text in numbered]
    if not texts:
        raise click.UsageError("give at least one PROMPT argument or lines on stdin")
    inputs: list[Any] = _chats(numbered, bool(prompts)) if chat else texts
    engine = build_engine(ctx)
    try:
        engine.check_requests(inputs, params)
    except InferError as exc:
        where = "" if prompts or exc.prompt_index is None else f" (stdin line {numbered[exc.prompt_index][0]})"
        raise CommandLineError(f"{exc}{where}") from None
    classifier = engine.loaded.model.spec.num_labels is not None
    labels = read_id2label(engine.loaded.path) if classifier else None
    named = {"labels": labels} if labels is not None else {}
    print_in_order(len(texts), engine.generate_as_completed(inputs, params), lambda i, result: [json.dumps({
        "prompt_index": i, "prompt": texts[i], "embedding": result.embedding,
        "prompt_tokens": len(result.prompt_token_ids), "cached_tokens": result.num_cached_tokens, **named})],
        "embedding", "embeddings")
