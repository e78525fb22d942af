"""The shipped logits processors (``register_logits_processors``), which requests name in
``SamplingParams.logits_processors``.

- ``no-repeat-ngram`` (args ``{"size": n}``, 1 <= n <= 64): no n-gram occurs twice in a sequence, prompt included:
  a token that would complete an n-gram already in the sequence's tokens is banned. HF transformers'
  ``no_repeat_ngram_size`` (its NoRepeatNGramLogitsProcessor) does the same; vLLM has none built in.
- ``bad-words`` (args ``{"token_ids": [[...], ...], "words": [...]}``, either or both): no listed token sequence
  occurs in the output: a word's last token is banned where the tokens before it end the sequence so far (prompt
  included; a one-token word is always banned). HF's ``bad_words_ids`` (NoBadWordsLogitsProcessor); text words as
  vLLM's ``bad_words``: tokenized as written and after a space.
- ``allowed-tokens`` (args ``{"token_ids": [...]}``): only these tokens can be sampled (vLLM's
  ``allowed_token_ids``).
"""
from __future__ import annotations

from collections.abc import Callable, Hashable, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Generic, TypeVar

from ..core.errors import InvalidRequestError
from ..core.hookspecs import hookimpl
from ..core.interfaces import LogitsProcessor, ProcessorRow
from ..core.registry import Register

if TYPE_CHECKING:
    import torch

MAX_NGRAM = 64
T = TypeVar("T")


class NoRepeatNgram(LogitsProcessor):
    """Per sequence, the n-grams of its tokens so far as (the first n - 1 tokens) -> the tokens that followed them,
    extended by the tokens added since the last step (so a step costs the new tokens, not the whole sequence)."""

    def __init__(self) -> None:
        self.seen: dict[int, tuple[int, int, dict[tuple[int, ...], set[int]]]] = {}  # seq_id -> (n, counted, grams)

    def check(self, args: Mapping[str, Any]) -> None:
        size = args.get("size")
        if set(args) != {"size"} or type(size) is not int or not 1 <= size <= MAX_NGRAM:
            raise InvalidRequestError(f"takes {{\"size\": n}}, n an integer in [1, {MAX_NGRAM}] (no n-gram repeats); "
                                      f"got {dict(args)!r}")

    def apply(self, logits: torch.Tensor, rows: list[ProcessorRow]) -> torch.Tensor:
        import torch

        banned = [(i, token) for i, row in enumerate(rows) for token in self._banned(row) if token < logits.shape[1]]
        if banned:
            at = torch.tensor(banned, device=logits.device)
            logits[at[:, 0], at[:, 1]] = float("-inf")
        return logits

    def _banned(self, row: ProcessorRow) -> set[int]:
        """The tokens that would complete an n-gram the row's sequence already holds."""
        n, tokens = row.args["size"], row.token_ids
        size, counted, grams = self.seen.get(row.seq_id, (n, 0, {}))
        if size != n or counted > len(tokens):  # not this sequence's state (a reused id): start again
            counted, grams = 0, {}
        for end in range(max(counted, n), len(tokens) + 1):  # the n-gram tokens[end - n:end]
            grams.setdefault(tuple(tokens[end - n:end - 1]), set()).add(tokens[end - 1])
        self.seen[row.seq_id] = (n, len(tokens), grams)
        return grams.get(tuple(tokens[len(tokens) - n + 1:]), set()) if len(tokens) >= n - 1 else set()

    def release(self, seq_id: int) -> None:
        self.seen.pop(seq_id, None)


MAX_WORDS, MAX_WORD_TOKENS, MAX_ALLOWED, MAX_MASKS = 1024, 64, 131072, 256


def token_id_list(args: Mapping[str, Any], most: int, what: str) -> list[int]:
    """``args["token_ids"]``, a list of 1 to ``most`` token ids (integers >= 0), the only argument."""
    ids = args.get("token_ids")
    if set(args) != {"token_ids"} or not isinstance(ids, list) or not 1 <= len(ids) <= most or \
            not all(type(t) is int and t >= 0 for t in ids):
        raise InvalidRequestError(f"takes {{\"token_ids\": [...]}}, {what}; got {str(dict(args))[:200]}")
    return ids


class PerArgs(Generic[T]):
    """Values derived from a processor's arguments once per arguments object (the rows of requests that give the
    same JSON text share one: ``parsed_args``), at most ``most`` of them. Each is kept with its arguments, so that
    no other object takes their id while it is kept."""

    def __init__(self, most: int) -> None:
        self.most = most
        self.kept: dict[tuple[int, Hashable], tuple[Mapping[str, Any], T]] = {}

    def get(self, args: Mapping[str, Any], extra: Hashable, make: Callable[[Mapping[str, Any]], T]) -> T:
        """``make(args)``, from the first call with these ``args`` and ``extra`` on."""
        if (kept := self.kept.get((id(args), extra))) is not None:
            return kept[1]
        if len(self.kept) >= self.most:
            self.kept.clear()
        value = make(args)
        self.kept[(id(args), extra)] = (args, value)
        return value


def by_args(rows: list[ProcessorRow]) -> tuple[list[Mapping[str, Any]], list[int]]:
    """The distinct arguments objects of ``rows`` (first seen first), and for each row the index of its own."""
    index: dict[int, int] = {}
    which = [index.setdefault(id(row.args), len(index)) for row in rows]
    return list({id(row.args): row.args for row in rows}.values()), which


def banned_mask(allowed: list[int], vocab: int, device: torch.device) -> torch.Tensor:
    """[vocab] bool on ``device``: False at the ``allowed`` token ids, True everywhere else."""
    import torch

    ids = torch.tensor(allowed, dtype=torch.long)
    mask = torch.ones(vocab, dtype=torch.bool)
    mask[ids[ids < vocab]] = False
    return mask.to(device)


@dataclass
class WordBans:
    """What one bad-words arguments object bans: ``always`` its one-token words (token ids on the logits' device,
    None if it has none), ``after`` its longer words by the token before their last."""

    always: torch.Tensor | None
    after: dict[int, list[list[int]]]


class BadWords(LogitsProcessor):
    """Bans the last token of each listed word whose other tokens end the sequence so far. Words given as text are
    tokenized as vLLM's ``bad_words`` are: as written and after a space (a word mid-text), both banned."""

    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer
        self.spelled: dict[tuple[str, ...], list[list[int]]] = {}  # words -> their token sequences
        self.bans: PerArgs[WordBans] = PerArgs(MAX_MASKS)

    def check(self, args: Mapping[str, Any]) -> None:
        ids, texts = args.get("token_ids", []), args.get("words", [])
        what = (f"\"token_ids\": 1 to {MAX_WORDS} words, each a list of 1 to {MAX_WORD_TOKENS} token ids (integers "
                f">= 0), and/or \"words\": 1 to {MAX_WORDS} non-empty strings")
        if not args or set(args) - {"token_ids", "words"} or not isinstance(ids, list) or \
                not isinstance(texts, list) or len(ids) > MAX_WORDS or len(texts) > MAX_WORDS or \
                not all(isinstance(text, str) and text for text in texts):
            raise InvalidRequestError(f"takes {what}; got {str(dict(args))[:200]}")
        for word in ids:
            token_id_list({"token_ids": word}, MAX_WORD_TOKENS, what)

    def words(self, args: Mapping[str, Any]) -> list[list[int]]:
        """The token sequences ``args`` bans: its token_ids, then each of its words' two spellings."""
        texts = tuple(args.get("words", ()))
        if texts not in self.spelled:
            if len(self.spelled) >= MAX_WORDS:  # a server's requests may each give their own: kept bounded
                self.spelled.clear()
            spellings = [self.tokenizer.encode(form, add_special_tokens=False) for text in texts
                         for form in (text, " " + text)]
            self.spelled[texts] = [ids for ids in spellings if ids]
        return [*args.get("token_ids", ()), *self.spelled[texts]]

    def word_bans(self, args: Mapping[str, Any], vocab: int, device: torch.device) -> WordBans:
        import torch

        words = [word for word in self.words(args) if word[-1] < vocab]
        after: dict[int, list[list[int]]] = {}
        for word in words:
            if len(word) > 1:
                after.setdefault(word[-2], []).append(word)
        single = sorted({word[0] for word in words if len(word) == 1})
        return WordBans(torch.tensor(single, device=device) if single else None, after)

    def apply(self, logits: torch.Tensor, rows: list[ProcessorRow]) -> torch.Tensor:
        import torch

        from ..core.sampling import to_device

        vocab, device = logits.shape[1], logits.device
        distinct, which = by_args(rows)
        bans = [self.bans.get(args, (vocab, device), lambda args: self.word_bans(args, vocab, device))
                for args in distinct]
        for index, ban in enumerate(bans):  # one-token words: banned in every row whose arguments list them
            if ban.always is not None and len(bans) == 1:
                logits.index_fill_(1, ban.always, float("-inf"))
            elif ban.always is not None:
                at = to_device([i for i, own in enumerate(which) if own == index], device)
                logits[at[:, None], ban.always] = float("-inf")
        banned = [(i, word[-1]) for i, row in enumerate(rows) if row.token_ids
                  for word in bans[which[i]].after.get(row.token_ids[-1], ())
                  if row.token_ids[-(len(word) - 1):] == word[:-1]]
        if banned:
            at = torch.tensor(banned, device=device)
            logits[at[:, 0], at[:, 1]] = float("-inf")
        return logits


class AllowedTokens(LogitsProcessor):
    """Keeps the logits of the listed tokens, and bans every other. Each distinct arguments' mask is built once."""

    def __init__(self) -> None:
        self.masks: PerArgs[torch.Tensor] = PerArgs(MAX_MASKS)

    def check(self, args: Mapping[str, Any]) -> None:
        token_id_list(args, MAX_ALLOWED, f"1 to {MAX_ALLOWED} token ids (integers >= 0)")

    def apply(self, logits: torch.Tensor, rows: list[ProcessorRow]) -> torch.Tensor:
        import torch

        from ..core.sampling import to_device

        vocab, device = logits.shape[1], logits.device
        distinct, which = by_args(rows)
        masks = [self.masks.get(args, (vocab, device), lambda args: banned_mask(args["token_ids"], vocab, device))
                 for args in distinct]
        if len(masks) == 1:  # one mask for every row: broadcast, nothing [rows, V] built
            return logits.masked_fill_(masks[0], float("-inf"))
        return logits.masked_fill_(torch.stack(masks)[to_device(which, device)], float("-inf"))


@hookimpl
def register_logits_processors(register: Register) -> None:
    register("no-repeat-ngram", lambda config, tokenizer: NoRepeatNgram())
    register("bad-words", lambda config, tokenizer: BadWords(tokenizer))
    register("allowed-tokens", lambda config, tokenizer: AllowedTokens())
