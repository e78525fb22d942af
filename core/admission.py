"""What the engine checks at its doors: a user's request (RequestChecker), a scheduler plugin's schedule
(check_schedule) and a reasoning parser's grammar start (check_reasoning_end). Each refusal says what to change."""
from __future__ import annotations

from collections.abc import Callable, Sequence as Seq
from dataclasses import dataclass
from typing import Any

from .chat import ChatPrompt, Prompt
from .config import EngineConfig
from .errors import InferError, InvalidRequestError, PluginError, require_utf8
from .interfaces import BlockOps, ReasoningEnd, Scheduler, SchedulerOutput
from .request import SamplingParams, Sequence


@dataclass(frozen=True)
class RequestChecker:
    """Validates prompts and sampling parameters against one model's tokenizer, vocabulary and context length."""
    tokenizer: Any
    vocab_size: int
    max_model_len: int
    max_prompt_chars: int | None = None  # longer text cannot fit: refused before it is tokenized
    chat_defaults: dict[str, Any] | None = None  # the engine's default chat template variables
    sanitize_chat: bool = False  # control tokens typed in chat messages are encoded as text
    lora_adapters: frozenset[str] = frozenset()  # the names SamplingParams.lora_adapter may give
    eos_token_ids: frozenset[int] = frozenset()  # what min_tokens bans beside the stop ids

    @classmethod
    def for_model(cls, tokenizer: Any, vocab_size: int, max_model_len: int,
                  chat_defaults: dict[str, Any] | None = None, sanitize_chat: bool = False,
                  lora_adapters: frozenset[str] = frozenset(),
                  eos_token_ids: frozenset[int] = frozenset()) -> RequestChecker:
        """A token spells at most as many characters as its vocabulary string has (byte-level BPE: one per byte),
        and Unicode normalization can merge a few characters into one (x4 covers it), so a text longer than
        ``max_model_len * 4 * longest token`` characters cannot fit: refusing it costs no tokenization, which
        would hold the engine thread for seconds on a multi-MB text."""
        try:
            longest = max(map(len, tokenizer.get_vocab()))
        except (AttributeError, TypeError, ValueError):  # a tokenizer without a vocabulary listing: no bound
            return cls(tokenizer, vocab_size, max_model_len, None, chat_defaults, sanitize_chat, lora_adapters,
                       eos_token_ids)
        return cls(tokenizer, vocab_size, max_model_len, max_model_len * 4 * max(longest, 1), chat_defaults,
                   sanitize_chat, lora_adapters, eos_token_ids)

    def tokenize(self, prompt: Prompt) -> list[int]:
        """A prompt's token ids; InvalidRequestError for an empty, non-UTF-8 or out-of-vocabulary prompt, or chat
        messages the model's template cannot render."""
        if isinstance(prompt, ChatPrompt):
            chat = prompt.checked()  # one built directly is checked here
            self._check_length(chat.text_length(), "the chat's messages and tools have")
            return self._in_vocabulary(chat.render(self.tokenizer, self.chat_defaults, self.sanitize_chat),
                                       "the rendered chat")
        if isinstance(prompt, str):
            if not prompt:
                raise InvalidRequestError("prompt is empty; give at least one character or token")
            self._check_length(len(prompt), "the prompt has")
            require_utf8(prompt, "the prompt")
            return self._in_vocabulary(list(self.tokenizer.encode(prompt)), "the prompt")
        if not isinstance(prompt, (list, tuple)):
            raise InvalidRequestError(f"a prompt is a string, a list of token ids or a ChatPrompt, got "
                                      f"{type(prompt).__name__}"
                                      f"{' (decode the bytes to text first)' if isinstance(prompt, bytes) else ''}")
        ids = list(prompt)
        if not ids:
            raise InvalidRequestError("prompt is empty; give at least one character or token")
        vocab = self.vocab_size
        bad = [t for t in ids if not isinstance(t, int) or isinstance(t, bool) or not 0 <= t < vocab]
        if bad:
            raise InvalidRequestError(f"prompt token ids must be integers in [0, {vocab}); got {bad[:5]}")
        return ids

    def _check_length(self, chars: int, what: str) -> None:
        """``what``: "the prompt has", "the chat's messages and tools have"."""
        if self.max_prompt_chars is not None and chars > self.max_prompt_chars:
            raise InvalidRequestError(f"{what} {chars} characters, more than the model's context of "
                                      f"{self.max_model_len} tokens can hold with this tokenizer (at most "
                                      f"{self.max_prompt_chars}); shorten the prompt")

    def _in_vocabulary(self, ids: list[int], what: str) -> list[int]:
        """``ids``, unless the tokenizer produced ids the model's vocabulary lacks (a tokenizer larger than it)."""
        if not ids:
            raise InvalidRequestError(f"{what} encodes to no tokens; give at least one character or token")
        if max(ids) >= self.vocab_size:
            bad = sorted({t for t in ids if t >= self.vocab_size})
            raise InvalidRequestError(f"{what} encodes to token ids {bad[:5]} that the model's vocabulary "
                                      f"({self.vocab_size}) lacks: its tokenizer has more tokens than the model; "
                                      f"remove the text of {self.tokenizer.convert_ids_to_tokens(bad[:5])}")
        return ids

    def check_params(self, params: SamplingParams) -> None:
        """Raises InvalidRequestError for parameters this model cannot take (token ids included)."""
        if not isinstance(params, SamplingParams):
            raise InvalidRequestError(f"sampling parameters must be an infer.SamplingParams, got "
                                      f"{type(params).__name__}")
        params.validate()
        if params.lora_adapter is not None and params.lora_adapter not in self.lora_adapters:
            loaded = ", ".join(sorted(self.lora_adapters)) or "none (start the engine with --lora NAME=DIR)"
            raise InvalidRequestError(f"lora_adapter {params.lora_adapter!r} is not loaded; the loaded adapters: "
                                      f"{loaded}")  # no "sampling parameters": beam search's are checked here too
        biased = [token for token, _ in params.logit_bias]
        for name, tokens in (("stop_token_ids", params.stop_token_ids), ("logit_bias's token ids", biased)):
            if bad := [t for t in tokens if t >= self.vocab_size]:
                raise InvalidRequestError(f"invalid sampling parameters: {name} must be below the model's "
                                          f"vocabulary size {self.vocab_size}; got {bad[:5]}")
        if params.min_tokens and len(set(params.stop_token_ids).union(
                () if params.ignore_eos else self.eos_token_ids)) >= self.vocab_size:
            raise InvalidRequestError(f"invalid sampling parameters: min_tokens bans EOS and the stop_token_ids until "
                                      f"that many tokens are out, and together they are the whole vocabulary "
                                      f"({self.vocab_size} tokens), so no token could be sampled; drop min_tokens "
                                      "or some stop_token_ids")

    def check(self, prompt: Prompt, params: SamplingParams) -> list[int]:
        """Raises InvalidRequestError, else returns the prompt's ids."""
        self.check_params(params)
        ids = self.tokenize(prompt)
        if len(ids) + params.max_tokens > self.max_model_len:
            raise InvalidRequestError(
                f"prompt ({len(ids)} token{'' if len(ids) == 1 else 's'}) + max_tokens ({params.max_tokens}) exceeds "
                f"the model's context length {self.max_model_len}; shorten the prompt or lower max_tokens (or raise "
                "--max-model-len, where it was set below the model's own)")
        return ids


def check_prompt_list(prompts: object) -> Seq[Prompt]:
    """``prompts`` if it is a list (sequence) of prompts, else InvalidRequestError (a lone string is one)."""
    if isinstance(prompts, (str, bytes)) or not isinstance(prompts, Seq):
        raise InvalidRequestError(f"prompts must be a list of prompts (strings, token-id lists or ChatPrompts), "
                                  f"got {type(prompts).__name__}")
    return prompts


def at_prompt(exc: InferError, index: int, total: int) -> InferError:
    """Mark ``exc`` as caused by prompt ``index`` of ``total`` (``prompt_index``; "prompt i of n: " when several)."""
    exc.prompt_index = index
    if total > 1:
        exc.args = (f"prompt {index + 1} of {total}: {exc}",)
    return exc


def check_reasoning_end(end: object, vocab_size: int, parser_name: str | None) -> ReasoningEnd | None:
    """``end``, a reasoning parser's ``reasoning_end`` answer, if it is None or a ReasoningEnd of distinct token
    ids in the vocabulary; else PluginError naming the parser."""
    if end is not None and not (isinstance(end, ReasoningEnd) and isinstance(end.closed_in_prompt, bool) and all(
            type(t) is int and 0 <= t < vocab_size
            for t in (end.close_token, end.open_token if end.open_token is not None else 0))
            and end.open_token != end.close_token):
        raise PluginError(f"reasoning parser {parser_name!r}: reasoning_end() returned {end!r}, not None or a "
                          "ReasoningEnd of token ids in the vocabulary; fix the plugin")
    return end


def check_schedule(out: SchedulerOutput, config: EngineConfig, scheduler: Scheduler, settled: bool,
                   count_open: Callable[[], int], searching: bool = False,
                   is_live: Callable[[Sequence], bool] | None = None) -> bool:
    """Whether ``out`` has work (``settled``: no step's tokens in flight or outputs unbuilt; ``count_open``: the
    engine's sequences not finished; ``searching``: beam searches hold KV blocks, so an empty schedule while
    sequences wait is no fault of the scheduler's: the searches free their blocks when they end; ``is_live``:
    whether a sequence is one of the engine's requests'); PluginError for a scheduler that broke its contract (each
    breach checked here would otherwise change tokens without an error, hang, or fail deep inside the runner)."""
    name = config.scheduler
    if not isinstance(out, SchedulerOutput):
        raise PluginError(f"scheduler {name!r}: schedule() returned {type(out).__name__}, not a SchedulerOutput; "
                          "fix the plugin")
    if clash := swapped_in_under_copies(out.block_ops):
        raise PluginError(f"scheduler {name!r}: its swap-ins write device block(s) {clash[:8]} that this step's "
                          "copy-on-write copies also read or write (block ops run swap-outs, then swap-ins, then "
                          "copies, so a copy would move the swapped-in KV instead of the KV it was queued for: a "
                          "block freed and taken again within one step); swap sequences in only in a step that "
                          "preempts nothing, as the shipped schedulers do, or fix the plugin")
    if not out.scheduled:
        if settled and scheduler.has_unfinished():
            if searching:
                return False
            raise PluginError(f"scheduler {name!r} scheduled nothing while {scheduler.num_waiting()} sequence(s) "
                              f"wait and {scheduler.num_running()} run: the engine would never finish them (a "
                              "scheduler must schedule work whenever any waits or runs; a KV cache "
                              f"({config.kv_cache!r}) or eviction policy ({config.eviction_policy!r}) that "
                              "misreports free blocks can cause it too); fix the plugin")
        if settled and (left := count_open()):
            raise PluginError(f"scheduler {name!r} has no sequence waiting or running, but {left} sequence(s) of the "
                              "engine's requests are not finished: the engine would wait for them forever (a "
                              "scheduler ends a sequence by setting seq.status = SequenceStatus.FINISHED and "
                              "seq.finish_reason, in update() and finish(); fix the plugin")
        return False
    if len(out.scheduled) > config.max_num_seqs:  # what CUDA graphs and buffers are sized for
        raise PluginError(f"scheduler {name!r} scheduled {len(out.scheduled)} sequences, over "
                          f"max_num_seqs={config.max_num_seqs} (forked children count: an n > 1 request's other "
                          "n - 1 sequences fork from its first when that samples its first token, so admit it only "
                          "with params.n seats free); fix the plugin")
    if len(out.scheduled) > 1 and out.num_tokens > config.max_num_batched_tokens:  # what bounds a step's activations
        raise PluginError(f"scheduler {name!r} scheduled {out.num_tokens} tokens in {len(out.scheduled)} sequences, "
                          f"over max_num_batched_tokens={config.max_num_batched_tokens} (only a sequence alone may "
                          "go over it, one that can never fit it); fix the plugin")
    for item in out.scheduled:
        if item.seq.is_finished:  # finish() and update() end a sequence for good: it must leave the scheduler
            raise PluginError(f"scheduler {name!r} scheduled sequence {item.seq.seq_id}, which is finished "
                              f"({item.seq.finish_reason}); a sequence that finish() or update() ended must leave "
                              "the scheduler (and its KV blocks be freed), else it runs in every step; fix the plugin")
        if is_live is not None and not is_live(item.seq):
            raise PluginError(f"scheduler {name!r} scheduled sequence {item.seq.seq_id} (request "
                              f"{item.seq.request_id!r}), which is none of the engine's live requests' sequences (a "
                              "scheduler schedules the sequences it was given by add() and fork()); fix the plugin")
        uncomputed = item.seq.num_tokens - item.seq.num_computed_tokens
        if not 1 <= item.num_new_tokens <= uncomputed:
            raise PluginError(f"scheduler {name!r} (with KV cache {config.kv_cache!r}, whose match_prefix sets the "
                              f"computed tokens) scheduled sequence {item.seq.seq_id} with {item.num_new_tokens} "
                              f"new token(s) where {uncomputed} are uncomputed (it must be 1 to that); fix the plugin")
    if len({item.seq.seq_id for item in out.scheduled}) != len(out.scheduled):
        raise PluginError(f"scheduler {name!r} scheduled a sequence twice; fix the plugin")
    return True


def swapped_in_under_copies(ops: BlockOps) -> list[int]:
    """The device blocks that a swap-in writes and a copy of the same step reads or writes. Run in BlockOps' order
    the copy sees the swapped-in KV; no schedule means that (a block a swap-in fills was free: no copy queued
    before could name it, unless the block was freed and taken again within the step)."""
    if not (ops.swap_in and ops.copies):
        return []
    filled = {device for _, device in ops.swap_in}
    return sorted(filled & {block for pair in ops.copies for block in pair})
