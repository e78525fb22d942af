"""The ABCs of the plugins that read or steer a reply: tool parsers, reasoning parsers and structured-output
backends. :mod:`infer.core.interfaces` exports them with the other kinds; each method's docstring is its contract."""
from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Mapping, Sequence as Seq
from dataclasses import dataclass
from types import MappingProxyType
from typing import TYPE_CHECKING, Any

from .chat_tools import ParsedReply
from .request import StructuredOutput

if TYPE_CHECKING:
    import torch


# ---------------------------------------------------------------- tool calls
class ToolParser(ABC):
    """Reads the tool calls out of a model's reply to a chat that offered tools; the format is the model's own
    (Qwen's ``<tool_call>`` JSON, Llama 3.1's bare JSON object, ...). ``written_tags``: special tokens (id: text)
    that mark the format's calls, which the engine writes out where they stand in the text it gives the parser
    (the engine's output text, as the tokenizer's decode, leaves special tokens out)."""

    written_tags: Mapping[int, str] = MappingProxyType({})

    @abstractmethod
    def parse(self, text: str, token_ids: Seq[int]) -> ParsedReply:
        """The reply's content and calls. ``text`` is the reply as the engine output it (special tokens left
        out but ``written_tags``, cut at a stop string); ``token_ids`` its tokens. A reply without a call is all
        content, and a call that does not parse stays text of it: nothing of the text may be lost."""

    def streamed_content(self, text: str, token_ids: Seq[int]) -> int:
        """How much of the start of ``text``, a reply so far as ``parse`` gets it (``token_ids``: its tokens so
        far, which may run ahead of the text), is content whatever follows: that much streams as the outputs'
        ``content_text``, and the rest waits for the reply's last output, once ``parse`` has read it whole. So
        ``text[:n]`` must begin the content that ``parse`` gives of every reply that begins with these tokens (the
        engine checks it); an n below an earlier answer streams nothing more (nothing streamed is taken back). 0,
        the default: the content comes whole with the last output."""
        return 0

    def streamed_calls(self, text: str, token_ids: Seq[int]) -> int:
        """How many of the calls that ``parse`` reads out of ``text``, a reply so far (as ``streamed_content`` gets
        it), begin the calls of every reply that begins with these tokens: those stream, each in the first output
        after it is read (the outputs' ``new_tool_calls``), and the rest come with the reply's last output. So the
        first n calls of ``parse(text)`` must be the first calls of the whole reply, names and arguments (the engine
        checks it); a call streamed keeps the id it was given then. 0, the default: the calls come together with
        the last output."""
        return 0

    def for_prompt(self, prompt_token_ids: Seq[int]) -> ToolParser:
        """The parser of the replies to this prompt (a chat's, its template applied), for a format whose reading
        depends on it (whether the prompt opened a reasoning block, say); the engine asks once per request and
        gives that parser the request's replies. ``self``, the default."""
        return self


# ---------------------------------------------------------------- reasoning
class ReasoningParser(ABC):
    """Splits a reasoning model's reply into its reasoning (the ``<think>`` block of DeepSeek-R1, Qwen3 and their
    kin) and its content."""

    @abstractmethod
    def split(self, text: str) -> tuple[str | None, str]:
        """``(reasoning, content)`` of a finished reply, ``text`` as the engine output it (special tokens left
        out); reasoning None when the reply has none. Only the markers (and the space before an opening one) may
        be dropped: reasoning and content together hold the rest of the text."""

    def reasoning_end(self, prompt_token_ids: Seq[int]) -> ReasoningEnd | None:
        """How a structured output's grammar follows the reasoning of a reply to this prompt (a chat's, its
        template applied): the tokens that open and close the reasoning, and whether the prompt closed it already.
        None, the default (or a tokenizer without such tokens): a structured reply has no reasoning, its grammar
        holding from the first token, and is not split."""
        return None

    def stream(self, prompt_token_ids: Seq[int]) -> ReasoningStream | None:
        """A splitter of one reply to this prompt (a chat's, its template applied) as its text streams, so that
        each output carries the reasoning and content of its text; it splits the whole reply too (``split`` is
        then not called for it). None, the default: outputs are not split as they stream, only a reply's last
        output is (by ``split``)."""
        return None


class ReasoningStream(ABC):
    """Splits one reply into its reasoning and content as its text comes in (:meth:`ReasoningParser.stream`)."""

    @abstractmethod
    def feed(self, text: str, final: bool) -> tuple[str, str]:
        """``(reasoning, content)`` of the reply's next ``text``: only markers (and the space before an opening one)
        may be left out. Text that may begin a marker may be held back, to come out of a later call; with ``final``
        (the reply's last text) nothing is held back. Joined, the answers are the reply's reasoning and content."""

    @property
    @abstractmethod
    def reasoned(self) -> bool:
        """Whether the reply, as far as it was fed, has a reasoning block (maybe empty): its reasoning is then a
        string, else None."""


@dataclass(frozen=True)
class ReasoningEnd:
    """:meth:`ReasoningParser.reasoning_end`'s answer. The grammar starts after the first ``close_token`` of the
    reply; from the first token when ``closed_in_prompt`` (the template closed the block: thinking off); and
    where ``open_token`` is set (the model opens the block itself, as Qwen3 does), the first token is either it
    (the reply reasons first) or one of the grammar's (the reply has no reasoning)."""

    close_token: int
    closed_in_prompt: bool = False
    open_token: int | None = None


# ---------------------------------------------------------------- structured output
@dataclass(frozen=True)
class Vocabulary:
    """The model's vocabulary as a structured-output backend sees it."""

    tokenizer: Any
    size: int  # the logits' width (it may exceed the tokenizer's: ids past it are never allowed)
    eos_token_ids: frozenset[int]  # what ends an output: allowed once the output is complete
    device: torch.device  # where masks go: the logits' device


class StructuredOutputBackend(ABC):
    """Compiles a request's :class:`~infer.core.request.StructuredOutput` into a grammar over the vocabulary."""

    @abstractmethod
    def compile(self, spec: StructuredOutput) -> Grammar:
        """The grammar of ``spec``, shareable by every request that gives an equal spec (the engine caches it).
        Raise InvalidRequestError, saying what to change, for a spec this backend cannot follow."""


class Grammar(ABC):
    """A compiled structured output."""

    @abstractmethod
    def matcher(self) -> GrammarMatcher:
        """A new matcher at the start of an output (one per sequence)."""

    def reusable(self) -> bool:
        """Whether the engine may give this grammar to more requests (the default: always). A grammar whose memory
        grows with the outputs it follows (the fsm backend's pushdown automata keep each configuration an output
        reached) says False once it holds too much: the requests that arrive after get a new compile, and this
        one is dropped when the requests using it end."""
        return True


class GrammarMatcher(ABC):
    """The state of one sequence's output within its grammar."""

    @abstractmethod
    def allowed(self) -> torch.Tensor:
        """A bool mask [vocabulary.size] on vocabulary.device of the tokens that may come next: those that keep
        the output a prefix of a whole one, and EOS when the output is whole. Never all False (unchecked: a check
        would wait for the device every token; such a mask ends the output). The engine does not change the tensor
        (a backend may hand out the same one for the same state)."""

    @abstractmethod
    def advance(self, token_id: int) -> None:
        """Take the token the sequence sampled, one that :meth:`allowed` allowed (ValueError otherwise)."""

    def copy(self) -> GrammarMatcher | None:
        """A matcher in this one's state that advances apart from it (speculative decoding walks it along a
        sequence's draft tokens to mask each position they are verified at), or None, the default: the backend
        cannot copy one, and its requests do not speculate."""
        return None

    def forced_text(self) -> str:
        """The text every whole output continues with from this state: its characters up to the first place where
        the grammar allows a choice or the output may end; "" when the next character is not certain, and the
        default (the backend does not say). A backend may say less than is forced (fewer drafts), never more. The
        ``jump-forward`` proposer drafts its tokens."""
        return ""
