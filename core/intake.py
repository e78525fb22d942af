"""Request intake: a prompt and its sampling parameters checked, and turned into the state of a request (its
sequences, detokenizers and reply readers) that the engine queues. Shared by add_request and check_request."""
from __future__ import annotations

import itertools
from collections.abc import Callable
from contextlib import AbstractContextManager
from dataclasses import dataclass

from .admission import RequestChecker, check_reasoning_end
from .chat import ChatPrompt, Prompt
from .detokenizer import Detokenizer
from .errors import InvalidRequestError, PluginError
from .interfaces import ReasoningEnd, ReasoningParser, ToolParser
from .logits_processors import LogitsProcessors
from .outputs import RequestState, new_reasoning_stream
from .plugins import Blame
from .request import SamplingParams, Sequence
from .structured_output import StructuredOutputs
from .tool_choice import reply_reading, schema_errors


@dataclass
class Checked:
    """A request that passed the checks: its prompt ids, the parameters it runs with (a forced tool_choice adds a
    structured output) and what reads its replies' calls (None: nothing)."""

    ids: list[int]
    params: SamplingParams
    reader: ToolParser | None


class Intake:
    """Checks requests and builds their state; holds none of them (the engine does)."""

    def __init__(self, checker: RequestChecker, structured: StructuredOutputs, eos_token_ids: frozenset[int],
                 max_model_len: int, new_detokenizer: Callable[[list[int]], Detokenizer],
                 tool_parser: ToolParser | None, reasoning_parser: ReasoningParser | None,
                 reasoning_parser_name: str | None, blame: Blame,
                 plugin_code: Callable[[], AbstractContextManager[None]], processors: LogitsProcessors) -> None:
        """``plugin_code()``: the engine's guard around calls into components (their errors become PluginErrors);
        ``processors``: the logits processors requests name (their arguments are checked here)."""
        self.checker, self.structured, self.eos_token_ids = checker, structured, eos_token_ids
        self.processors = processors
        self.max_model_len, self.new_detokenizer = max_model_len, new_detokenizer
        self.tool_parser, self.reasoning_parser, self.reasoning_parser_name = \
            tool_parser, reasoning_parser, reasoning_parser_name
        self.blame, self.plugin_code = blame, plugin_code
        self.seq_ids = itertools.count()

    def check(self, prompt: Prompt, params: SamplingParams) -> Checked:
        """The checks of add_request before the scheduler's: InvalidRequestError for a bad prompt or parameters
        (logits processors' arguments included), or for a structured output the backend cannot follow."""
        ids = self.checker.check(prompt, params)
        self.processors.check(params)
        params, reader = reply_reading(prompt, params, self.tool_parser)
        with schema_errors(reader):
            self.check_structured_output(params)
        return Checked(ids, params, reader)

    def check_structured_output(self, params: SamplingParams) -> None:
        """Compile the structured output of ``params`` now (cached): InvalidRequestError for one the backend cannot
        follow, or for any on a model without EOS."""
        if params.structured_output is None:
            return
        if not self.eos_token_ids:
            raise InvalidRequestError("structured_output needs an EOS token to end the output with, and this model "
                                      "has none (generation_config.json, config.json and the tokenizer name none)")
        with self.plugin_code():
            self.structured.grammar(params.structured_output)

    def probe(self, checked: Checked) -> Sequence:
        """A sequence of ``checked`` for the scheduler's ``check``, never queued."""
        return Sequence(-1, "", checked.ids, checked.params, 0.0, eos_token_ids=self.eos_token_ids,
                        max_model_len=self.max_model_len)

    def request(self, prompt: Prompt, params: SamplingParams, request_id: str, now: float
                ) -> tuple[RequestState, ReasoningEnd | None]:
        """The checked request's state, its n sequences among it (none queued yet), and where its own structured
        output's grammar starts after its reasoning (None: from the first token, or no structured output)."""
        checked = self.check(prompt, params)
        ids, reader = checked.ids, checked.reader
        # of the request's own structured output (a forced tool_choice's holds from the first token)
        reasoning_end = self._reasoning_end(prompt, params, ids)
        params = checked.params
        seqs = [Sequence(next(self.seq_ids), request_id, ids, params, now, index=i, eos_token_ids=self.eos_token_ids,
                         max_model_len=self.max_model_len) for i in range(params.n)]
        splitter = self._reasoning_parser_of(prompt, params, reasoning_end)
        names = (self.blame.name(reader), self.blame.name(splitter))
        reader = None if reader is None else self._reader_of(reader, ids, names[0])
        streams = None if splitter is None else [new_reasoning_stream(splitter, ids, names[1]) for _ in seqs]
        if streams is not None and None in streams:  # the reasoning parser splits whole replies only
            streams = None
        splits = (reader is not None or splitter is not None) and (splitter is None or streams is not None)
        # outputs carry a copy of the prompt: a caller that extends theirs must not change the sequences' prompt
        state = RequestState(request_id, list(ids), params, now, seqs, [self.new_detokenizer(ids) for _ in seqs],
                             [0] * len(seqs), [0] * len(seqs), tool_parser=reader, reasoning_parser=splitter,
                             reasoned=self.structured.reasoned if reasoning_end is not None else None,
                             reasoning_streams=streams, splits=splits, content_sent=[0] * len(seqs),
                             calls_sent=[[] for _ in seqs], tag_marks=[[] for _ in seqs], parser_names=names)
        return state, reasoning_end

    def _reader_of(self, parser: ToolParser, prompt_token_ids: list[int], name: str | None) -> ToolParser:
        """The tool parser of the replies to this prompt (``for_prompt``)."""
        with self.plugin_code():
            reader = parser.for_prompt(prompt_token_ids)
        if not isinstance(reader, ToolParser) or reader.written_tags != parser.written_tags:
            raise PluginError(f"for_prompt() of the tool parser {name or type(parser).__name__} returned "
                              f"{reader!r:.80}, not a ToolParser with the same written_tags; fix the plugin")
        return reader

    def _reasoning_parser_of(self, prompt: Prompt, params: SamplingParams, reasoning_end: ReasoningEnd | None
                             ) -> ReasoningParser | None:
        """What splits ``prompt``'s replies into reasoning and content: the engine's parser for a chat, but not
        for structured output whose grammar holds from the first token (a forced tool_choice's, or where the
        parser cannot say where the reasoning ends): such a reply has no reasoning."""
        if not isinstance(prompt, ChatPrompt) or params.structured_output is not None and reasoning_end is None:
            return None
        return self.reasoning_parser

    def _reasoning_end(self, prompt: Prompt, params: SamplingParams, ids: list[int]) -> ReasoningEnd | None:
        """Where the grammar of a chat's own structured output starts, its reasoning first (None: from the
        first token)."""
        if self.reasoning_parser is None or params.structured_output is None or not isinstance(prompt, ChatPrompt):
            return None
        with self.plugin_code():
            end = self.reasoning_parser.reasoning_end(ids)
        return check_reasoning_end(end, self.structured.vocab_size, self.reasoning_parser_name)
