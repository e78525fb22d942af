"""Request outputs: each sequence's new tokens and text since the last output, cut at stop strings (the engine's
postprocess), and the outputs of one request accumulated into one."""
from __future__ import annotations

import uuid
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING

from .chat_tools import ParsedReply, ToolCall, json_like
from .detokenizer import Detokenizer
from .errors import InferError, InvalidRequestError, PluginError
from .interfaces import ReasoningStream
from .request import CompletionOutput, FinishReason, RequestOutput, SamplingParams, Sequence, SequenceStatus

if TYPE_CHECKING:
    from .interfaces import ReasoningParser, ToolParser


@dataclass
class RequestState:
    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    arrival: float
    seqs: list[Sequence]
    detoks: list[Detokenizer]
    sent: list[int] = field(default_factory=list)  # output tokens already emitted, per sequence
    emitted: list[int] = field(default_factory=list)  # characters of text already emitted, per sequence
    prompt_logprobs_sent: bool = False
    tool_parser: ToolParser | None = None  # a chat that offered tools, with --tool-parser: reads each whole reply
    reasoning_parser: ReasoningParser | None = None  # a chat, with --reasoning-parser: splits what the above left
    reasoned: Callable[[Sequence], bool] | None = None  # structured output after the reasoning: whether a reply had it
    reasoning_streams: list[ReasoningStream] | None = None  # the above's splitters of each reply as it streams
    splits: bool = False  # outputs carry reasoning_text and content_text: every parser above reads them as they come
    content_sent: list[int] = field(default_factory=list)  # per sequence: its text's characters sent on as content
    # by the tool parser (-1: all of its content, with its last output)
    calls_sent: list[list[ToolCall]] = field(default_factory=list)  # per sequence: the calls it streamed, with ids
    tag_marks: list[list[tuple[int, str]]] = field(default_factory=list)  # per sequence: where the tool parser's
    # written_tags stand in its text (the text's length before each), in order
    parser_names: tuple[str | None, str | None] = (None, None)  # the tool and reasoning parsers' in errors
    # ("'hermes' from 'infer-engine'"; None: the class name)
    reads_replies: bool = field(init=False)  # a parser above reads them (a field: every output asks)
    stops_from: list[int] = field(init=False)  # per sequence: a stop string counts where it ends past this many
    # characters, the text of the first min_tokens output tokens (as in vLLM, none of those can end the output)

    def __post_init__(self) -> None:
        self.reads_replies = self.tool_parser is not None or self.reasoning_parser is not None
        self.stops_from = [0] * len(self.emitted)  # beside emitted, per sequence


def build_output(req: RequestState, seq_ids: set[int], finish: Callable[[Sequence, FinishReason], None]
                 ) -> RequestOutput:
    """The delta output of a request for the sequences ``seq_ids``: new tokens and text. A stop string found in the
    text finishes its sequence through ``finish`` (the scheduler's)."""
    stops, want_logprobs = req.params.stop, req.params.logprobs is not None
    if len(req.seqs) == 1 and not stops:  # the common case, unrolled: one sequence, no text held back
        return _single_output(req, seq_ids, want_logprobs)
    deltas = []
    for i, seq in enumerate(req.seqs):
        new = seq.token_ids[len(seq.prompt_token_ids) + req.sent[i] :]  # not output_token_ids: that copies it all
        done = seq.status is SequenceStatus.FINISHED
        if seq.seq_id not in seq_ids or (not new and not done):
            continue
        detok = req.detoks[i]
        silent = done and not req.params.include_stop_str_in_output and seq.ends_on_stop_token()
        if len(new) > 1 and stops and seq.finish_reason is not FinishReason.ABORT:
            new = _add_until_stop(req, i, seq, detok, new, silent)
        else:
            _detokenize(req, i, detok, new[:-1] if silent else new)
            _pass_min_tokens(req, i, detok, req.sent[i] + len(new))
        req.sent[i] += len(new)
        if done:
            detok.flush()
        if stops:
            text = _text_delta(req, i, seq, detok, finish)
        else:  # nothing held back
            text, req.emitted[i] = detok.text[req.emitted[i] :], len(detok.text)
        logprobs = seq.logprobs[len(seq.logprobs) - len(new):] if want_logprobs else None
        deltas.append(CompletionOutput(i, new, text, seq.finish_reason, logprobs))
        if req.reads_replies:  # a stop string may have finished it just now
            read_output(req, i, deltas[-1])
    finished = all(seq.status is SequenceStatus.FINISHED for seq in req.seqs)
    return RequestOutput(req.request_id, req.prompt_token_ids, deltas, finished)


def _single_output(req: RequestState, seq_ids: set[int], want_logprobs: bool) -> RequestOutput:
    """build_output for one sequence without stop strings."""
    seq = req.seqs[0]
    done = seq.status is SequenceStatus.FINISHED
    new = seq.token_ids[len(seq.prompt_token_ids) + req.sent[0] :]
    if seq.seq_id not in seq_ids or (not new and not done):
        return RequestOutput(req.request_id, req.prompt_token_ids, [], done)
    detok = req.detoks[0]
    silent = done and not req.params.include_stop_str_in_output and seq.ends_on_stop_token()
    added = new[:-1] if silent else new  # the text of the stop token that ended it is not output
    if req.tool_parser is None:
        detok.add(added)
    else:
        _detokenize(req, 0, detok, added)
    req.sent[0] += len(new)
    if done:
        detok.flush()
    text, req.emitted[0] = detok.text[req.emitted[0] :], len(detok.text)
    logprobs = seq.logprobs[len(seq.logprobs) - len(new):] if want_logprobs else None
    completion = CompletionOutput(0, new, text, seq.finish_reason, logprobs)
    if req.reads_replies:
        read_output(req, 0, completion)
    return RequestOutput(req.request_id, req.prompt_token_ids, [completion], done)


def _detokenize(req: RequestState, i: int, detok: Detokenizer, tokens: list[int]) -> None:
    """Sequence i's new tokens into its text, marking where the tool parser's written tags stand."""
    tags = req.tool_parser.written_tags if req.tool_parser is not None else None
    if not tags or tags.keys().isdisjoint(tokens):
        detok.add(tokens)
        return
    start = 0
    for k, token in enumerate(tokens):
        if token in tags:  # decoded with the tokens after it (its text is none): the context stays the engine's
            if k > start:
                detok.add(tokens[start:k])
            req.tag_marks[i].append((len(detok.text), tags[token]))
            start = k
    detok.add(tokens[start:])


def tagged_text(text: str, marks: list[tuple[int, str]]) -> str:
    """``text`` with the tags of ``marks`` written out where they stand (those past its end left out: it was cut
    at a stop string)."""
    if not marks:
        return text
    parts, at = [], 0
    for position, tag in marks:
        if position > len(text):
            break
        parts += [text[at:position], tag]
        at = position
    return "".join(parts) + text[at:]


def read_output(req: RequestState, i: int, completion: CompletionOutput) -> None:
    """Sequence i's new output (``completion``) through the request's parsers: split into reasoning_text and
    content_text as it streams (``req.splits``), and the last output of a whole reply (not aborted) given the
    reply's content, tool_calls and reasoning_content. The tool parser reads a whole reply once, for both."""
    seq = req.seqs[i]
    whole = seq.is_finished and seq.finish_reason is not FinishReason.ABORT
    try:
        read = _read_tool_calls(req.tool_parser, tagged_text(req.detoks[i].text, req.tag_marks[i]),
                                seq.output_token_ids, req.parser_names[0]) \
            if whole and req.tool_parser is not None else None
        if read is not None and req.calls_sent[i]:
            read = read[0], _after_streamed(req, i, read[1])
        if req.splits:
            _split_delta(req, i, completion, read)
    except PluginError:
        req.splits = False  # the request fails: the output that aborts it is not split
        raise
    if whole:
        content, calls = read if read is not None else (req.detoks[i].text, None)
        splits = req.reasoned is None or req.reasoned(seq)  # a grammar held from the first token: all content
        completion.tool_calls = calls
        completion.reasoning_content, completion.content = reasoning_parts(
            content, req.reasoning_parser if splits else None, req.prompt_token_ids, req.parser_names[1])


def new_reasoning_stream(parser: ReasoningParser | None, prompt_token_ids: list[int], name: str | None = None
                         ) -> ReasoningStream | None:
    """``parser``'s splitter of a reply to this prompt as it streams; None where it has none. ``name``: the
    parser's, for errors (None: its class name)."""
    if parser is None:
        return None
    name = name or type(parser).__name__
    try:
        stream = parser.stream(prompt_token_ids)
    except InferError:
        raise
    except Exception as exc:
        raise PluginError(f"the reasoning parser {name} raised {type(exc).__name__} in stream(): "
                          f"{exc}; fix the plugin, or choose another --reasoning-parser") from exc
    if stream is not None and not isinstance(stream, ReasoningStream):
        raise PluginError(f"stream() of the reasoning parser {name} returned {stream!r:.80}, not "
                          "None or a ReasoningStream; fix the plugin")
    return stream


def _split_delta(req: RequestState, i: int, completion: CompletionOutput,
                 read: tuple[str, list[ToolCall]] | None) -> None:
    """Sequence i's new text split into ``completion``'s reasoning_text and content_text: the text outside tool
    calls (with a tool parser: see _content_delta; ``read``: the whole reply's content and calls, once it has
    ended), split by the reasoning stream (all content without one)."""
    seq = req.seqs[i]
    if req.tool_parser is None:
        text = completion.text
    else:  # the reply as far as it was output, its tags written out: what both parts read
        reply = tagged_text(req.detoks[i].text[: req.emitted[i]], req.tag_marks[i])
        completion.new_tool_calls = _new_calls(req, i, seq, reply, read)
        text = _content_delta(req, i, seq, reply, read)
    if req.reasoning_streams is None or req.reasoned is not None and not req.reasoned(seq):
        completion.reasoning_text, completion.content_text = "", text  # all content, as a grammar held throughout
    else:
        completion.reasoning_text, completion.content_text = _feed(req.reasoning_streams[i], text, seq.is_finished,
                                                                   req.parser_names[1])


def _content_delta(req: RequestState, i: int, seq: Sequence, reply: str,
                   read: tuple[str, list[ToolCall]] | None) -> str:
    """Sequence i's new content outside tool calls: its ``reply`` so far up to where the tool parser says a call
    may begin (``streamed_content``); once the reply has ended, the rest of the content ``read`` gives (an aborted
    reply, not read, is all content)."""
    assert req.tool_parser is not None
    sent, name = req.content_sent[i], _tool_parser_name(req)
    if sent < 0:  # the last output was built: read whole
        return ""
    if seq.is_finished:
        content = reply if read is None else read[0]
        if not content.startswith(reply[:sent]):
            raise PluginError(f"the tool parser {name} streamed {reply[:sent]!r:.80} as the start of the reply's "
                              f"content, but its parse() gave the content {content!r:.80}; fix its "
                              "streamed_content()")
        req.content_sent[i] = -1
        return content[sent:]
    end = _asked(req, req.tool_parser.streamed_content, reply, seq.output_token_ids)
    if type(end) is not int or not 0 <= end <= len(reply):
        raise PluginError(f"streamed_content() of the tool parser {name} returned {end!r:.40} for a reply of "
                          f"{len(reply)} characters: not an int from 0 to its length; fix the plugin")
    end = max(end, sent)  # what streamed is never taken back (the last output checks it)
    req.content_sent[i] = end
    return reply[sent:end]


def _new_calls(req: RequestState, i: int, seq: Sequence, reply: str, read: tuple[str, list[ToolCall]] | None
               ) -> list[ToolCall]:
    """Sequence i's calls that no earlier output carried: those the tool parser says every reply that begins as its
    ``reply`` so far holds (``streamed_calls``); once the reply has ended, the rest of the calls ``read`` gives
    (none for an aborted reply, not read: the calls it streamed stand)."""
    assert req.tool_parser is not None
    if req.content_sent[i] < 0:  # the last output was built
        return []
    sent, name = req.calls_sent[i], _tool_parser_name(req)
    if seq.is_finished:
        return [] if read is None else read[1][len(sent):]
    n = _asked(req, req.tool_parser.streamed_calls, reply, seq.output_token_ids)
    if type(n) is not int or n < 0:
        raise PluginError(f"streamed_calls() of the tool parser {name} returned {n!r:.40}, not a count of calls; "
                          "fix the plugin")
    if n <= len(sent):
        return []
    calls = _after_streamed(req, i, _read_tool_calls(req.tool_parser, reply, seq.output_token_ids,
                                                     req.parser_names[0])[1])
    if n > len(calls):
        raise PluginError(f"streamed_calls() of the tool parser {name} returned {n} for a reply so far whose parse() "
                          f"reads {len(calls)} call{'s' * (len(calls) != 1)}; fix the plugin")
    new = calls[len(sent):n]
    sent += new
    return new


def _after_streamed(req: RequestState, i: int, calls: list[ToolCall]) -> list[ToolCall]:
    """A whole reply's ``calls`` as ``parse`` read them, those sequence i streamed first with the ids they went out
    with; PluginError where the parser streamed calls its parse of the whole reply does not begin with."""
    sent = req.calls_sent[i]
    if [(call.name, call.arguments) for call in calls[:len(sent)]] != [(call.name, call.arguments) for call in sent]:
        raise PluginError(f"the tool parser {_tool_parser_name(req)} streamed the calls {sent!r:.120} as the reply's "
                          f"first, but its parse() read the calls {calls!r:.120}; fix its streamed_calls()")
    return sent + calls[len(sent):]


def _asked(req: RequestState, method: Callable[[str, list[int]], object], reply: str, token_ids: list[int]
           ) -> object:
    """The tool parser's ``method`` of the reply so far; an exception from it a PluginError naming the parser."""
    try:
        return method(reply, token_ids)
    except InferError:
        raise
    except Exception as exc:
        raise PluginError(f"the tool parser {_tool_parser_name(req)} raised {type(exc).__name__} in "
                          f"{method.__name__}(): {exc}; fix the plugin, or choose another --tool-parser") from exc


def _tool_parser_name(req: RequestState) -> str:
    return req.parser_names[0] or type(req.tool_parser).__name__


def _feed(stream: ReasoningStream, text: str, final: bool, parser_name: str | None = None) -> tuple[str, str]:
    name = f"of {parser_name}" if parser_name else type(stream).__name__
    try:
        split = stream.feed(text, final)
    except InferError:
        raise
    except Exception as exc:
        raise PluginError(f"the reasoning stream {name} raised {type(exc).__name__}: {exc}; fix the plugin, or "
                          "choose another --reasoning-parser") from exc
    if not (isinstance(split, tuple) and len(split) == 2 and all(isinstance(part, str) for part in split)):
        raise PluginError(f"the reasoning stream {name} returned {split!r:.80}, not (reasoning, content); fix the "
                          "plugin")
    return split


def reply_parts(text: str, token_ids: list[int], tool_parser: ToolParser | None,
                reasoning_parser: ReasoningParser | None, prompt_token_ids: list[int] | None = None,
                names: tuple[str | None, str | None] = (None, None)) -> tuple[str | None, str, list[ToolCall] | None]:
    """(reasoning, content, calls) of a whole reply. The tool parser reads the reply as it came (text and tokens
    agree) and gives each call an id (its own, else a random one, as OpenAI's); the reasoning parser then splits
    what it left as content (see reasoning_parts), so the reasoning never holds a call."""
    calls = None
    if tool_parser is not None:
        text, calls = _read_tool_calls(tool_parser, text, token_ids, names[0])
    return *reasoning_parts(text, reasoning_parser, prompt_token_ids, names[1]), calls


def reasoning_parts(text: str, parser: ReasoningParser | None, prompt_token_ids: list[int] | None,
                    name: str | None = None) -> tuple[str | None, str]:
    """(reasoning, content) of a whole reply's ``text`` (outside its tool calls): by the parser's stream of a reply
    to ``prompt_token_ids`` fed that text at once where it has one (as the reply's outputs were split), else by
    ``split``; (None, text) without a parser."""
    if parser is None:
        return None, text
    stream = None if prompt_token_ids is None else new_reasoning_stream(parser, prompt_token_ids, name)
    if stream is None:
        return _split_reasoning(parser, text, name)
    reasoning, content = _feed(stream, text, True, name)
    return reasoning if stream.reasoned else None, content


def _split_reasoning(parser: ReasoningParser, text: str, name: str | None = None) -> tuple[str | None, str]:
    name = name or type(parser).__name__
    try:
        split = parser.split(text)
    except InferError:
        raise
    except Exception as exc:  # here too on paths outside a step (an abort's output)
        raise PluginError(f"the reasoning parser {name} raised {type(exc).__name__}: {exc}; fix the plugin, or "
                          "choose another --reasoning-parser") from exc
    if not (isinstance(split, tuple) and len(split) == 2 and isinstance(split[1], str)
            and (split[0] is None or isinstance(split[0], str))):
        raise PluginError(f"the reasoning parser {name} returned {split!r:.80}, not (reasoning or None, content); "
                          "fix the plugin")
    return split


def _read_tool_calls(parser: ToolParser, text: str, token_ids: list[int], name: str | None = None
                     ) -> tuple[str, list[ToolCall]]:
    name = name or type(parser).__name__
    try:
        reply = parser.parse(text, token_ids)
    except InferError:
        raise
    except Exception as exc:  # here too on paths outside a step (an abort's output)
        raise PluginError(f"the tool parser {name} raised {type(exc).__name__}: {exc}; fix the plugin, or choose "
                          "another --tool-parser") from exc
    if not isinstance(reply, ParsedReply) or not isinstance(reply.content, str) or not all(
            isinstance(c, ToolCall) for c in reply.tool_calls):
        raise PluginError(f"the tool parser {name} returned {type(reply).__name__}, not a ParsedReply of a str and "
                          "ToolCalls; fix the plugin")
    for call in reply.tool_calls:
        try:
            json_like([call.name, call.id, dict(call.arguments)], "a tool call")
        except (InvalidRequestError, TypeError, ValueError) as exc:
            raise PluginError(f"the tool parser {name} returned a malformed call {call!r} ({exc}); fix the "
                              "plugin") from None
        if not isinstance(call.name, str) or not call.name:
            raise PluginError(f"the tool parser {name} returned a call without a name ({call!r}); fix the plugin")
    return reply.content, [call if call.id else ToolCall(call.name, call.arguments, f"call_{uuid.uuid4().hex[:24]}")
                           for call in reply.tool_calls]


def with_every_sequence(req: RequestState, final: RequestOutput) -> RequestOutput:
    """A request's ``final`` output (a delta) with an entry for each of its sequences, in index order: one that
    finished in an earlier step gets an empty delta with its finish reason (what ``on_request_finished`` sees)."""
    present = {c.index for c in final.outputs}
    earlier = [CompletionOutput(i, [], "", seq.finish_reason, [] if req.params.logprobs is not None else None)
               for i, seq in enumerate(req.seqs) if i not in present]
    if not earlier:
        return final
    return replace(final, outputs=sorted(final.outputs + earlier, key=lambda c: c.index))


def append_output(full: RequestOutput, *deltas: RequestOutput) -> RequestOutput:
    """``full`` extended in place by ``deltas``, the next outputs of the same request in order: each completion's
    tokens, text and logprobs appended (the text joined once, so many deltas cost their length, not its square),
    its finish reason and the request's finish state taken from the last. A completion new to ``full`` is copied
    in, so the deltas are left as they were (``full``'s own lists are extended in place)."""
    outputs = full.outputs
    if len(deltas) == 1 and _in_place(outputs, deltas[0].outputs):  # the common case: one delta, nothing new
        for d in deltas[0].outputs:
            c = outputs[d.index]
            _append_completion(c, d, c.text + d.text)
    else:
        _append_completions(full, deltas)
    for delta in deltas:  # the first prompt logprobs given; an embedding request's one embedding
        if full.prompt_logprobs is None:
            full.prompt_logprobs = delta.prompt_logprobs
        if delta.embedding is not None:
            full.embedding = delta.embedding
    if deltas:
        last = deltas[-1]
        full.finished, full.num_cached_tokens, full.metrics = last.finished, last.num_cached_tokens, last.metrics
    return full


def _in_place(outputs: list[CompletionOutput], new: list[CompletionOutput]) -> bool:
    """Whether ``outputs`` holds completions 0, 1, ... in order and the ``new`` ones among them."""
    for i, c in enumerate(outputs):
        if c.index != i:
            return False
    for d in new:
        if not 0 <= d.index < len(outputs):
            return False
    return True


def _append_completions(full: RequestOutput, deltas: tuple[RequestOutput, ...]) -> None:
    """append_output's completions, any number of deltas, any completions (new ones copied in, in index order)."""
    by_index = {c.index: c for c in full.outputs}
    texts: dict[int, list[str]] = {}
    for delta in deltas:
        for d in delta.outputs:
            c = by_index.get(d.index)
            if c is None:
                by_index[d.index] = CompletionOutput(d.index, list(d.token_ids), d.text, d.finish_reason,
                                                     None if d.logprobs is None else list(d.logprobs), d.content,
                                                     d.tool_calls, d.reasoning_content, d.reasoning_text,
                                                     d.content_text,
                                                     None if d.new_tool_calls is None else list(d.new_tool_calls))
                continue
            texts.setdefault(d.index, [c.text]).append(d.text)
            _append_completion(c, d, c.text)
    for index, parts in texts.items():
        by_index[index].text = "".join(parts)
    full.outputs = [by_index[i] for i in sorted(by_index)]


def _append_completion(c: CompletionOutput, d: CompletionOutput, text: str) -> None:
    """``c`` followed by ``d``: its tokens and logprobs appended, its text set to ``text``, d's finish reason."""
    c.token_ids += d.token_ids
    c.text, c.finish_reason = text, d.finish_reason
    if d.reasoning_text is not None:
        c.reasoning_text = (c.reasoning_text or "") + d.reasoning_text
        c.content_text = (c.content_text or "") + (d.content_text or "")
    if d.new_tool_calls is not None:
        c.new_tool_calls = (c.new_tool_calls or []) + d.new_tool_calls
    if d.content is not None:  # the reply read (its last output)
        c.content, c.tool_calls, c.reasoning_content = d.content, d.tool_calls, d.reasoning_content
    if d.logprobs is not None:
        if c.logprobs is None:
            c.logprobs = []
        c.logprobs += d.logprobs


def _add_until_stop(req: RequestState, i: int, seq: Sequence, detok: Detokenizer, new: list[int],
                    silent_last: bool) -> list[int]:
    """Several new tokens (speculative decoding): detokenize them one at a time and drop those after the one that
    completes a stop string, as a one-token-per-step run would have stopped there. ``silent_last``: the last token
    is the stop token that ended the sequence, whose text is not output."""
    for count, token in enumerate(new, 1):
        if silent_last and count == len(new):
            break
        _detokenize(req, i, detok, [token])
        _pass_min_tokens(req, i, detok, req.sent[i] + count)
        if count < len(new) and _first_stop(req, i, detok) is not None:
            drop = len(new) - count
            _uncount_spec_round(seq, drop)
            del seq.token_ids[-drop:], seq.token_times[-drop:]
            if req.params.logprobs is not None:
                del seq.logprobs[-drop:]
            seq.num_computed_tokens = min(seq.num_computed_tokens, seq.num_tokens)
            if seq.is_finished:  # by a length or stop token that was just dropped: the stop string ends it
                seq.finish_reason = FinishReason.STOP
            return new[:count]
    return new


def _uncount_spec_round(seq: Sequence, drop: int) -> None:
    """The last ``drop`` tokens, appended by the last verification round, leave the output: so do their counts."""
    accepted, appended = seq.spec_last_round
    if not appended:
        return
    kept = max(appended - drop, 0)
    lost = accepted - min(accepted, kept)
    seq.spec_accepted -= lost
    seq.spec_last_round = (accepted - lost, kept)
    seq.spec_uncounted = (seq.spec_uncounted[0] + lost, seq.spec_uncounted[1] + appended - kept)


def _text_delta(req: RequestState, i: int, seq: Sequence, detok: Detokenizer,
                finish: Callable[[Sequence, FinishReason], None]) -> str:
    """New text of sequence i. With stop strings, the last (longest stop - 1) characters are held back until they
    cannot start a stop string, so that streamed text never has to be taken back."""
    stops = req.params.stop
    hold = max(map(len, stops)) - 1 if stops else 0
    if stops and seq.finish_reason is not FinishReason.ABORT and (found := _first_stop(req, i, detok)) is not None:
        detok.text = detok.text[:found[1] if req.params.include_stop_str_in_output else found[0]]
        finish(seq, FinishReason.STOP)
        if seq.finish_reason is FinishReason.LENGTH:  # the last allowed token completed the stop string: it stopped
            seq.finish_reason = FinishReason.STOP
    end = len(detok.text) if seq.is_finished else max(req.emitted[i], len(detok.text) - hold)
    text, req.emitted[i] = detok.text[req.emitted[i] : end], end
    return text


def _pass_min_tokens(req: RequestState, i: int, detok: Detokenizer, num_output_tokens: int) -> None:
    """While sequence i's text is that of at most min_tokens tokens, no stop string may end in it."""
    if num_output_tokens <= req.params.min_tokens:
        req.stops_from[i] = len(detok.text)


def _first_stop(req: RequestState, i: int, detok: Detokenizer) -> tuple[int, int] | None:
    """Where the first stop string starts and ends in sequence i's text (of two starting there, the longer),
    searching from the held-back tail of what was emitted (a stop string may begin there), among those that end
    past ``stops_from``, or None."""
    start, floor = max(0, req.emitted[i] - (max(map(len, req.params.stop)) - 1)), req.stops_from[i]
    hits = [(j, j + len(stop)) for stop in req.params.stop
            if (j := detok.text.find(stop, max(start, floor - len(stop) + 1))) != -1]
    return min(hits, key=lambda hit: (hit[0], -hit[1])) if hits else None
