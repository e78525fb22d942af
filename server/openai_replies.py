"""OpenAI's response bodies and stream chunks, made from the engine's RequestOutputs: text completions, chat
completions (content, reasoning_content as vLLM names it, tool_calls) and embeddings."""
from __future__ import annotations

import base64
import json
import struct
import time
import uuid
from collections.abc import Awaitable, Callable, Iterable
from typing import Any

from ..core.chat_tools import ToolCall
from ..core.request import CompletionOutput, RequestOutput
from .openai_params import OpenAIRequest

LOWEST_LOGPROB = -9999.0


class TokenText:
    """Token texts for logprobs (each token decoded alone, as vLLM names them), asked of the engine's thread once
    per token id."""

    def __init__(self, decode: Callable[[list[int]], Awaitable[list[str]]]) -> None:
        self.decode, self.known = decode, {}  # type: ignore[var-annotated]

    async def of(self, positions: Iterable[dict[int, float]]) -> dict[int, str]:
        wanted = sorted({token for entry in positions for token in entry} - self.known.keys())
        if wanted:
            self.known.update(zip(wanted, await self.decode(wanted)))
        return self.known


class Reply:
    """One body's answer: whole (:meth:`whole`) or as stream chunks (:meth:`opening`, :meth:`chunks`,
    :meth:`usage_chunk`). Choice ``i * n + j`` is completion j of prompt i."""

    def __init__(self, kind: str, reply_id: str, model: str, body: OpenAIRequest, tokens: TokenText) -> None:
        self.chat, self.body, self.tokens = kind == "chat.completion", body, tokens
        self.head = {"id": reply_id, "object": kind, "created": int(time.time()), "model": model}
        self.n = body.params.n  # type: ignore[union-attr]
        self.top = body.params.logprobs  # type: ignore[union-attr]  # the top-n logprobs asked for; None: none
        self.echoed: list[str] | None = None  # completions with echo: each prompt's text
        self.prompt_tokens: dict[int, int] = {}
        self.cached_tokens: dict[int, int] = {}
        self.completion_tokens = 0
        self.calls: dict[int, int] = {}  # a chat choice's tool calls streamed so far
        self.offsets: dict[int, int] = {}  # a completion choice's text so far (logprobs' text_offset)
        self.opened: set[int] = set()  # completion choices streamed from (their echo went first)
        self.ids_sent: set[int] = set()  # choices whose prompt token ids went (return_token_ids)
        self.prompt_logprobs: dict[int, tuple[list[int], list[dict[int, float] | None]]] = {}  # echo with logprobs
        self.prompt_sent: set[int] = set()  # completion choices whose prompt logprobs went

    async def whole(self, outputs: list[RequestOutput]) -> dict[str, Any]:
        choices = []
        for prompt_index, out in enumerate(outputs):
            self._count(prompt_index, out)
            for c in out.outputs:
                index = prompt_index * self.n + c.index
                if self.chat:
                    calls = (c.tool_calls or [])[:1 if self.body.one_call else None]
                    content = c.content if c.content is not None else c.text
                    message: dict[str, Any] = {"role": "assistant", "content": None if calls and not content
                                               else content}
                    if c.reasoning_content is not None:
                        message["reasoning_content"] = c.reasoning_content
                    if calls:
                        message["tool_calls"] = [_call(call) for call in calls]
                    choice = {"index": index, "message": message, "logprobs": await self._logprobs(index, c),
                              "finish_reason": _finish(c, bool(calls))}
                else:
                    choice = {"index": index, "text": self._echo(prompt_index) + c.text,
                              "logprobs": await self._logprobs(index, c), "finish_reason": _finish(c, False)}
                choices.append(choice | self._ids(index, out, c))
        return {**self.head, "choices": sorted(choices, key=lambda choice: choice["index"]), "usage": self._usage()}

    def opening(self) -> list[dict[str, Any]]:
        """A chat stream's first chunks: each choice's role. Completions open with none."""
        if not self.chat:
            return []
        return [self._chunk({"index": i, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                             "finish_reason": None}) for i in range(self.n * len(self.body.prompts))]

    async def chunks(self, prompt_index: int, delta: RequestOutput) -> list[dict[str, Any]]:
        """The chunks of one delta of prompt ``prompt_index``'s request: one per completion with news."""
        self._count(prompt_index, delta)
        chunks = []
        for c in delta.outputs:
            index = prompt_index * self.n + c.index
            logprobs = await self._logprobs(index, c) if c.token_ids else None
            quiet = c.finish_reason is None and logprobs is None and not (self.body.token_ids and c.token_ids)
            if self.chat:
                news = self._chat_delta(index, c, delta.finished)
                if not news and quiet:
                    continue
                choice = {"index": index, "delta": news, "logprobs": logprobs,
                          "finish_reason": _finish(c, self.calls.get(index, 0) > 0)}
            else:
                text = c.text if index in self.opened else self._echo(prompt_index) + c.text
                self.opened.add(index)
                if not text and quiet:
                    continue
                choice = {"index": index, "text": text, "logprobs": logprobs, "finish_reason": _finish(c, False)}
            chunks.append(self._chunk(choice | self._ids(index, delta, c)))
        return chunks

    def _ids(self, index: int, out: RequestOutput, c: CompletionOutput) -> dict[str, list[int]]:
        """With return_token_ids: the choice's token ids (a stream's: the chunk's), and its prompt's ids with the
        choice's first."""
        if not self.body.token_ids:
            return {}
        first = index not in self.ids_sent
        self.ids_sent.add(index)
        return ({"prompt_token_ids": list(out.prompt_token_ids)} if first else {}) | {"token_ids": list(c.token_ids)}

    def usage_chunk(self) -> dict[str, Any] | None:
        """With stream_options.include_usage: the last chunk, no choices and the usage."""
        return {**self.head, "object": self._chunk_kind(), "choices": [], "usage": self._usage()} \
            if self.body.include_usage else None

    def _chat_delta(self, index: int, c: CompletionOutput, finished: bool) -> dict[str, Any]:
        split = c.reasoning_text is not None  # a parser splits the reply: markers and calls left out of the text
        news: dict[str, Any] = {}
        if split and c.reasoning_text:
            news["reasoning_content"] = c.reasoning_text
        if content := (c.content_text if split else c.text):
            news["content"] = content
        calls = c.new_tool_calls or []
        if not calls and c.finish_reason is not None and c.tool_calls and not self.calls.get(index):
            calls = c.tool_calls  # a parser that reads the whole reply: its calls come with the last delta
        first = self.calls.get(index, 0)
        if self.body.one_call:  # parallel_tool_calls false: the reply's first call alone
            calls = calls[:max(0, 1 - first)]
        if calls:
            news["tool_calls"] = [{"index": first + k, **_call(call)} for k, call in enumerate(calls)]
            self.calls[index] = first + len(calls)
        return news

    async def _logprobs(self, index: int, c: CompletionOutput) -> dict[str, Any] | None:
        """The choice's logprobs in OpenAI's shape (a chat's ``content`` entries; a completion's parallel lists),
        a completion's with echo preceded by its prompt's (the first token's logprob null, as OpenAI's)."""
        if self.top is None or c.logprobs is None:
            return None
        pairs: list[tuple[int, dict[int, float] | None]] = list(zip(c.token_ids, c.logprobs))
        if self.body.echo and index not in self.prompt_sent:
            self.prompt_sent.add(index)
            ids, entries = self.prompt_logprobs.get(index // self.n, ([], []))
            pairs = list(zip(ids, entries)) + pairs
        names = await self.tokens.of([{token: 0.0 for token, _ in pairs}, *(e for _, e in pairs if e)])
        chosen = [(names[token], None if entry is None else _finite(entry[token])) for token, entry in pairs]
        tops = [None if entry is None else [(t, _finite(lp)) for t, lp in list(entry.items())[:self.top]]
                for _, entry in pairs]
        if self.chat:
            return {"content": [{**_token(name, logprob), "top_logprobs": [_token(names[t], lp) for t, lp in top]}
                                for (name, logprob), top in zip(chosen, tops)]}  # type: ignore[arg-type,union-attr]
        offsets, start = [], self.offsets.get(index, 0)
        for name, _ in chosen:
            offsets.append(start)
            start += len(name)
        self.offsets[index] = start
        return {"tokens": [name for name, _ in chosen], "token_logprobs": [logprob for _, logprob in chosen],
                "top_logprobs": [None if top is None else {names[t]: lp for t, lp in top} for top in tops],
                "text_offset": offsets}

    def _count(self, prompt_index: int, out: RequestOutput) -> None:
        self.prompt_tokens[prompt_index] = len(out.prompt_token_ids)
        if out.prompt_logprobs is not None:  # with the first output after the prompt (echo with logprobs)
            self.prompt_logprobs[prompt_index] = (list(out.prompt_token_ids), list(out.prompt_logprobs))
        self.completion_tokens += sum(len(c.token_ids) for c in out.outputs)
        if out.finished:
            self.cached_tokens[prompt_index] = out.num_cached_tokens

    def _usage(self) -> dict[str, Any]:
        prompt = sum(self.prompt_tokens.values())
        return {"prompt_tokens": prompt, "completion_tokens": self.completion_tokens,
                "total_tokens": prompt + self.completion_tokens,
                "prompt_tokens_details": {"cached_tokens": sum(self.cached_tokens.values())}}

    def _echo(self, prompt_index: int) -> str:
        return self.echoed[prompt_index] if self.echoed is not None else ""

    def _chunk_kind(self) -> str:
        return "chat.completion.chunk" if self.chat else "text_completion"

    def _chunk(self, choice: dict[str, Any]) -> dict[str, Any]:
        usage = {"usage": None} if self.body.include_usage else {}
        return {**self.head, "object": self._chunk_kind(), "choices": [choice], **usage}


def embeddings_reply(outputs: list[RequestOutput], encoding: str, model: str) -> dict[str, Any]:
    """``/v1/embeddings``' answer: each input's vector as floats, or base64 of little-endian float32 values."""
    def encoded(vector: list[float]) -> list[float] | str:
        return vector if encoding == "float" else base64.b64encode(struct.pack(f"<{len(vector)}f", *vector)).decode()

    prompt = sum(len(out.prompt_token_ids) for out in outputs)
    return {"object": "list", "model": model, "usage": {"prompt_tokens": prompt, "total_tokens": prompt},
            "data": [{"object": "embedding", "index": i, "embedding": encoded(out.embedding or [])}
                     for i, out in enumerate(outputs)]}


def _finish(c: CompletionOutput, called: bool) -> str | None:
    """OpenAI's finish reason: stop, length, tool_calls (a reply that ended in calls), or vLLM's abort."""
    if c.finish_reason is None:
        return None
    return "tool_calls" if called and c.finish_reason.value == "stop" else c.finish_reason.value


def _call(call: ToolCall) -> dict[str, Any]:
    return {"id": call.id or f"call_{uuid.uuid4().hex[:24]}", "type": "function",
            "function": {"name": call.name, "arguments": json.dumps(dict(call.arguments), ensure_ascii=False)}}


def _finite(logprob: float) -> float:
    """A logprob JSON can carry: -inf (a token the model rules out) as -9999.0, as vLLM sends it."""
    return max(logprob, LOWEST_LOGPROB)


def _token(name: str, logprob: float) -> dict[str, Any]:
    return {"token": name, "logprob": logprob, "bytes": list(name.encode("utf-8"))}
