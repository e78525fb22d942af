"""Plain data of a request's life: SamplingParams, Sequence (the state machine) and RequestOutput."""
from __future__ import annotations

import enum
import functools
import json
import math
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from .chat_tools import ToolCall
from .errors import InvalidRequestError, require_utf8

if TYPE_CHECKING:
    from .pooling import Pooling

GREEDY_BELOW = 1e-5  # temperatures below this sample greedily
MAX_STOP_STRINGS = 64
MAX_STOP_LENGTH = 1024
MAX_TEMPERATURE = 1e6
MAX_REPETITION_PENALTY = 1e3
MAX_STOP_TOKEN_IDS = 1024  # min_tokens bans each one on every step until then
MAX_LOGIT_BIAS = 1024  # entries; each costs a scatter element per step
MAX_LOGITS_PROCESSORS = 8
MAX_PROCESSOR_ARGS_CHARS = 100_000  # a processor's arguments as JSON text
MAX_PROCESSOR_ARGS_DEPTH = 32  # objects and arrays inside each other, the arguments' own object counted
MAX_CHOICES = 1024
MAX_STRUCTURE_CHARS = 100_000  # a regex, the choices together, a JSON schema's text or a grammar
STRUCTURE_FIELDS = ("regex", "choice", "json_schema", "grammar")  # StructuredOutput's, of which exactly one is set


def _schema_text(schema: object) -> str:
    return json.dumps(schema, ensure_ascii=False, allow_nan=False)


@dataclass(frozen=True)
class StructuredOutput:
    """What a request's output must be, whole: a match of ``regex`` (Python ``re`` syntax, a subset: see
    plugins/regex_fsm.py), one of the strings in ``choice``, a JSON document valid under ``json_schema`` (a dict
    or its JSON text), or a sentence of ``grammar`` (GBNF, llama.cpp's format, from its rule ``root``: see
    plugins/grammar_pda.py). Exactly one is given. The engine's structured-output backend
    (``--structured-output-backend``) masks every token that cannot continue such an output; EOS is allowed once the
    output is complete."""

    regex: str | None = None
    choice: tuple[str, ...] | None = None
    json_schema: str | None = None  # kept as JSON text, so that the spec is hashable (its compiled form is cached)
    grammar: str | None = None

    def __post_init__(self) -> None:
        if isinstance(self.choice, list):
            object.__setattr__(self, "choice", tuple(self.choice))
        if isinstance(self.json_schema, (dict, bool)):  # key order kept: it is the order properties are generated in
            try:
                object.__setattr__(self, "json_schema", _schema_text(self.json_schema))
            except (TypeError, ValueError, RecursionError):
                pass  # validate() names it

    @property
    def kind(self) -> str:
        """"regex", "choice", "json_schema" or "grammar": the field that is set (validated)."""
        return next(name for name in STRUCTURE_FIELDS if getattr(self, name) is not None)

    def validate(self) -> None:
        """InvalidRequestError naming what is wrong: not exactly one field, a field of the wrong type, too long."""
        def bad(msg: str) -> InvalidRequestError:
            return InvalidRequestError(f"invalid sampling parameters: structured_output {msg}")

        given = [name for name in STRUCTURE_FIELDS if getattr(self, name) is not None]
        if len(given) != 1:
            raise bad(f"takes exactly one of regex, choice, json_schema and grammar; got {', '.join(given) or 'none'}")
        for name in ("regex", "grammar"):
            if (value := getattr(self, name)) is not None and not isinstance(value, str):
                raise bad(f"{name} must be a string, got {type(value).__name__}")
        if isinstance(self.json_schema, (dict, bool)):
            try:
                _schema_text(self.json_schema)
            except (TypeError, ValueError, RecursionError) as exc:
                raise bad(f"json_schema is not JSON: {str(exc) or type(exc).__name__}") from None
        if self.json_schema is not None and not isinstance(self.json_schema, str):
            raise bad(f"json_schema must be a dict or its JSON text, got {type(self.json_schema).__name__}")
        if self.choice is not None:
            if not isinstance(self.choice, tuple) or not self.choice or \
                    any(not isinstance(c, str) or not c for c in self.choice):
                raise bad(f"choice must be a non-empty list of non-empty strings, got {self.choice!r}")
            if len(self.choice) > MAX_CHOICES:
                raise bad(f"choice may hold at most {MAX_CHOICES} strings, got {len(self.choice)}")
        size = sum(map(len, self.choice)) if self.choice is not None else len(getattr(self, given[0]))
        if size > MAX_STRUCTURE_CHARS:
            raise bad(f"{given[0]} has {size} characters, over the {MAX_STRUCTURE_CHARS} allowed; simplify it")
        for text in (self.regex, self.json_schema, self.grammar, *(self.choice or ())):
            if text is not None:
                require_utf8(text, f"structured_output's {given[0]}")


@dataclass(frozen=True)
class SamplingParams:
    """How to sample one request. ``temperature == 0`` is greedy. Validated by :meth:`validate`."""

    max_tokens: int = 16
    temperature: float = 1.0
    top_k: int = 0  # 0 disables
    top_p: float = 1.0
    min_p: float = 0.0
    seed: int | None = None  # reproducible per request when set
    stop_token_ids: tuple[int, ...] = ()
    stop: tuple[str, ...] = ()
    ignore_eos: bool = False
    logprobs: int | None = None  # also return the top-n logprobs of each sampled position
    prompt_logprobs: int | None = None  # also return the logprob (and top-n) of each prompt token given those before
    n: int = 1
    priority: int = 0  # higher is more important; read by the `priority` eviction policy
    speculative: bool = True  # False opts this request out of speculative decoding (when the engine has a proposer)
    # logit controls (core/logit_controls.py): HF's/vLLM's repetition penalty over prompt and output tokens, OpenAI's
    # frequency and presence penalties over output tokens, and EOS / stop_token_ids masked before min_tokens
    repetition_penalty: float = 1.0
    frequency_penalty: float = 0.0
    presence_penalty: float = 0.0
    min_tokens: int = 0
    # OpenAI's logit_bias: (token id, bias in [-100, 100]) pairs added to the logits; a dict is accepted
    logit_bias: tuple[tuple[int, float], ...] = ()
    # vLLM's: keep the stop string, or the text of the EOS / stop token, that ended the text (token_ids always do)
    include_stop_str_in_output: bool = False
    # the output's shape (a regex, a choice of strings, a JSON schema), enforced token by token; None: free text
    structured_output: StructuredOutput | None = None
    # the LoRA adapter (a name given to --lora NAME=DIR at start) applied to this request; None: the base model
    lora_adapter: str | None = None
    # registered logits processors (register_logits_processors) applied in order, with their arguments: given as
    # names, (name, args) pairs or a {name: args} dict; kept as (name, the args' JSON text) pairs
    logits_processors: tuple[tuple[str, str], ...] = ()

    def __post_init__(self) -> None:
        # accept lists from callers, keep the dataclass hashable; anything else is left for validate() to name
        for name in ("stop_token_ids", "stop"):
            value = getattr(self, name)
            if value is None:  # OpenAI's null: none
                object.__setattr__(self, name, ())
            elif isinstance(value, str):
                object.__setattr__(self, name, (value,))
            elif isinstance(value, (list, tuple)):
                object.__setattr__(self, name, tuple(value))
        bias = self.logit_bias
        if isinstance(bias, (dict, list, tuple)):  # pairs in token order, so that equal biases compare equal
            pairs = [tuple(p) if isinstance(p, list) else p for p in (bias.items() if isinstance(bias, dict) else bias)]
            if all(isinstance(p, tuple) and p and isinstance(p[0], int) for p in pairs):
                pairs.sort(key=lambda p: p[0])
            object.__setattr__(self, "logit_bias", tuple(pairs))
        object.__setattr__(self, "logits_processors", processor_calls(self.logits_processors))

    @property
    def greedy(self) -> bool:
        return self.temperature < GREEDY_BELOW  # dividing logits by a tinier temperature overflows to inf

    @functools.cached_property
    def penalizes(self) -> bool:
        """Whether a repetition, frequency or presence penalty changes the logits (core/logit_controls.py)."""
        return self.repetition_penalty != 1.0 or self.frequency_penalty != 0.0 or self.presence_penalty != 0.0

    @functools.cached_property
    def controls_every_token(self) -> bool:
        """Whether a penalty or a logit bias changes the logits of every token sampled (core/logit_controls.py;
        min_tokens ends when it is reached)."""
        return self.penalizes or bool(self.logit_bias)

    def validate(self) -> None:
        """Raise InvalidRequestError with a message that names the bad field and the allowed range."""

        def bad(msg: str) -> InvalidRequestError:
            return InvalidRequestError(f"invalid sampling parameters: {msg}")

        for name in ("max_tokens", "temperature", "top_k", "top_p", "min_p", "seed", "logprobs", "prompt_logprobs",
                     "n", "priority", "repetition_penalty", "frequency_penalty", "presence_penalty", "min_tokens"):
            value = getattr(self, name)
            if value is not None and not isinstance(value, (int, float)) and hasattr(value, "__float__"):
                raise bad(f"{name} must be a Python int or float, got {value!r} ({type(value).__name__}); convert it "
                          "with int() or float()")
        if not _is_int(self.max_tokens) or self.max_tokens <= 0:
            raise bad(f"max_tokens must be a positive integer, got {self.max_tokens!r}")
        if not _is_real(self.temperature) or math.isnan(self.temperature) or self.temperature < 0:
            raise bad(f"temperature must be a number >= 0 (0 means greedy), got {self.temperature!r}")
        if not self.temperature <= MAX_TEMPERATURE:  # logits / temperature would all round to 0 in float32
            raise bad(f"temperature must be at most {MAX_TEMPERATURE:g}, got {self.temperature!r}")
        if not _is_int(self.top_k) or self.top_k < 0:
            raise bad(f"top_k must be an integer >= 0 (0 disables it), got {self.top_k!r}")
        if not _is_real(self.top_p) or math.isnan(self.top_p) or not 0.0 < self.top_p <= 1.0:
            raise bad(f"top_p must be a number in (0, 1], got {self.top_p!r}")
        if not _is_real(self.min_p) or math.isnan(self.min_p) or not 0.0 <= self.min_p < 1.0:
            raise bad(f"min_p must be a number in [0, 1), got {self.min_p!r}")
        if self.seed is not None and (not _is_int(self.seed) or not 0 <= self.seed < 2**63):
            raise bad(f"seed must be an integer in [0, 2**63), got {self.seed!r}")  # a torch generator's range
        for name in ("logprobs", "prompt_logprobs"):
            if (value := getattr(self, name)) is not None and (not _is_int(value) or not 0 <= value <= 20):
                raise bad(f"{name} must be an integer in [0, 20], got {value!r}")
        if not _is_int(self.n) or not 1 <= self.n <= 64:
            raise bad(f"n must be an integer in [1, 64], got {self.n!r}")
        if isinstance(self.stop_token_ids, tuple) and len(self.stop_token_ids) > MAX_STOP_TOKEN_IDS:
            raise bad(f"stop_token_ids may hold at most {MAX_STOP_TOKEN_IDS} token ids, got "
                      f"{len(self.stop_token_ids)}")
        if not isinstance(self.stop_token_ids, tuple) or any(not _is_int(t) or t < 0 for t in self.stop_token_ids):
            raise bad(f"stop_token_ids must be a list of non-negative integers, got {self.stop_token_ids!r}")
        if not isinstance(self.stop, tuple) or any(not isinstance(s, str) or not s for s in self.stop):
            raise bad(f"stop must be a non-empty string or a list of them, got {self.stop!r}")
        if len(self.stop) > MAX_STOP_STRINGS or any(len(s) > MAX_STOP_LENGTH for s in self.stop):
            # each is searched for after every token, on the one thread that steps every request
            raise bad(f"at most {MAX_STOP_STRINGS} stop strings of at most {MAX_STOP_LENGTH} characters each; got "
                      f"{len(self.stop)}, the longest {max(map(len, self.stop))} characters")
        for index, text in enumerate(self.stop):  # a byte that is not UTF-8 (surrogateescape) never matches
            try:
                require_utf8(text, f"stop string {index + 1}")
            except InvalidRequestError as exc:
                raise bad(str(exc)) from None
        for name in ("speculative", "ignore_eos", "include_stop_str_in_output"):
            if not isinstance(getattr(self, name), bool):
                raise bad(f"{name} must be True or False, got {getattr(self, name)!r}")
        if not _is_real(self.repetition_penalty) or not 0 < self.repetition_penalty <= MAX_REPETITION_PENALTY:
            raise bad(f"repetition_penalty must be a number in (0, {MAX_REPETITION_PENALTY:g}] (1 disables it; > 1 "
                      f"discourages repeats), got {self.repetition_penalty!r}")
        for name in ("frequency_penalty", "presence_penalty"):
            value = getattr(self, name)
            if not _is_real(value) or not -2.0 <= value <= 2.0:
                raise bad(f"{name} must be a number in [-2, 2] (0 disables it; > 0 discourages repeats), got "
                          f"{value!r}")
        if not _is_int(self.min_tokens) or not 0 <= self.min_tokens <= self.max_tokens:
            raise bad(f"min_tokens must be an integer in [0, max_tokens={self.max_tokens}], got {self.min_tokens!r}")
        self._validate_logit_bias(bad)
        validate_processor_calls(self.logits_processors, bad)
        self._validate_structure(bad)
        if self.lora_adapter is not None and (not isinstance(self.lora_adapter, str) or not self.lora_adapter):
            raise bad(f"lora_adapter must be the name of a loaded LoRA adapter (a non-empty string) or None, got "
                      f"{self.lora_adapter!r}")
        if not _is_int(self.priority) or abs(self.priority) >= 2**31:
            raise bad(f"priority must be an integer in (-2**31, 2**31) (higher runs first under --scheduling-policy "
                      f"priority, and is kept longer by the priority eviction policy), got {self.priority!r}")

    def _validate_structure(self, bad: Callable[[str], InvalidRequestError]) -> None:
        spec = self.structured_output
        if spec is None:
            return
        if not isinstance(spec, StructuredOutput):
            raise bad(f"structured_output must be an infer.StructuredOutput, got {type(spec).__name__}")
        spec.validate()
        # a whole output ends at EOS: with ignore_eos nothing could follow it, and min_tokens could forbid the EOS
        # that is the only token left
        for name, value in (("ignore_eos", self.ignore_eos), ("min_tokens", self.min_tokens)):
            if value:
                raise bad(f"{name} cannot be combined with structured_output: a structured output ends at EOS as "
                          f"soon as it is complete; drop {name}")

    def _validate_logit_bias(self, bad: Callable[[str], InvalidRequestError]) -> None:
        bias = self.logit_bias
        if not isinstance(bias, tuple):
            raise bad(f"logit_bias must map token ids to biases (a dict), got {type(bias).__name__}")
        if len(bias) > MAX_LOGIT_BIAS:
            raise bad(f"logit_bias may hold at most {MAX_LOGIT_BIAS} token ids, got {len(bias)}")
        seen: set[int] = set()
        for pair in bias:
            if not isinstance(pair, tuple) or len(pair) != 2:
                raise bad(f"logit_bias must map token ids to biases, got the entry {pair!r}")
            token, value = pair
            if not _is_int(token) or token < 0:
                raise bad(f"logit_bias keys must be token ids (integers >= 0), got {token!r}")
            if not _is_real(value) or not -100.0 <= value <= 100.0:
                raise bad(f"logit_bias values must be numbers in [-100, 100], got {value!r} for token {token}")
            if token in seen:
                raise bad(f"logit_bias names token {token} twice")
            seen.add(token)


def validate_processor_calls(calls: object, bad: Callable[[str], InvalidRequestError]) -> None:
    """Refuse a ``logits_processors`` value (as ``processor_calls`` kept it) that is not at most
    MAX_LOGITS_PROCESSORS distinct names, each with a JSON object of arguments: ``bad(message)`` is raised."""
    form = "names, (name, args) pairs or a {name: args} dict, args a JSON object"
    if not isinstance(calls, tuple) or not all(
            isinstance(c, tuple) and len(c) == 2 and isinstance(c[0], str) and c[0] and isinstance(c[1], str)
            for c in calls):
        raise bad(f"logits_processors must be {form}; got {calls!r}")
    if len(calls) > MAX_LOGITS_PROCESSORS:
        raise bad(f"logits_processors may name at most {MAX_LOGITS_PROCESSORS} processors, got {len(calls)}")
    names = [name for name, _ in calls]
    if len(set(names)) != len(names):
        raise bad(f"logits_processors names a processor twice: {names}")
    for name, args in calls:
        if len(args) > MAX_PROCESSOR_ARGS_CHARS:
            raise bad(f"the arguments of logits processor {name!r} take {len(args)} characters as JSON, over "
                      f"{MAX_PROCESSOR_ARGS_CHARS}")
        try:
            parsed = json.loads(args)
        except ValueError:
            parsed = None
        except RecursionError:
            raise bad(f"the arguments of logits processor {name!r} nest too deeply as JSON; flatten them") from None
        if not isinstance(parsed, dict):
            raise bad(f"the arguments of logits processor {name!r} must be a JSON object, got {args[:80]!r}")
        if (depth := json_depth(parsed)) > MAX_PROCESSOR_ARGS_DEPTH:
            raise bad(f"the arguments of logits processor {name!r} nest {depth} objects and arrays deep, over "
                      f"{MAX_PROCESSOR_ARGS_DEPTH}; flatten them")


def json_depth(value: object) -> int:
    """How many objects and arrays a parsed JSON value holds inside each other (0 for a scalar)."""
    depth, level = 0, [value]
    while level:
        containers = [v for v in level if isinstance(v, (dict, list))]
        if not containers:
            return depth
        depth += 1
        level = [item for c in containers for item in (c.values() if isinstance(c, dict) else c)]
    return depth


def processor_args_text(args: object) -> str:
    """A logits processor's arguments as the canonical JSON text ``SamplingParams.logits_processors`` keeps (sorted
    keys, no spaces: equal arguments, equal text); TypeError or ValueError for what JSON cannot hold."""
    return json.dumps({} if args is None else args, sort_keys=True, separators=(",", ":"), allow_nan=False)


def processor_calls(value: object) -> object:
    """``SamplingParams.logits_processors`` as (name, JSON text of its args) pairs; a value of another form, or
    arguments that are no JSON, are left as they are for ``validate`` to name."""
    if value is None:
        return ()
    if isinstance(value, str):
        value = [value]
    items = list(value.items()) if isinstance(value, dict) else list(value) if isinstance(value, (list, tuple)) \
        else None
    if items is None:
        return value
    calls = []
    for item in items:
        name, args = (item, {}) if isinstance(item, str) else tuple(item) if isinstance(item, (list, tuple)) and \
            len(item) == 2 else (None, None)
        try:
            if isinstance(args, str):  # JSON text already (gRPC carries it): kept canonical, as a dict's
                args = json.loads(args)
        except (ValueError, RecursionError):  # RecursionError: nested too deeply to parse
            calls.append((name, args))  # validate names it
            continue
        try:
            calls.append((name, processor_args_text(args)))
        except (TypeError, ValueError, RecursionError):
            return value
    return tuple(calls)


def _is_int(value: object) -> bool:
    """A Python int, not a bool (numpy integers are refused: convert them with int())."""
    return isinstance(value, int) and not isinstance(value, bool)


def _is_real(value: object) -> bool:
    """A Python int or float, not a bool (numpy scalars other than float64, a float subclass, are refused)."""
    return isinstance(value, (int, float)) and not isinstance(value, bool)


class SequenceStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    PREEMPTED = "preempted"
    FINISHED = "finished"


class FinishReason(str, enum.Enum):
    STOP = "stop"  # EOS, a stop token id or a stop string
    LENGTH = "length"  # max_tokens or the model's context
    ABORT = "abort"


@dataclass(eq=False)
class Sequence:
    """One generated continuation. ``num_computed_tokens`` counts the tokens whose KV is in the cache.

    Invariant: ``0 <= num_computed_tokens <= num_tokens``; a sequence samples a token when a step brings
    ``num_computed_tokens`` up to ``num_tokens``.
    """

    seq_id: int
    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    arrival_time: float
    index: int = 0  # which of the request's n sequences
    eos_token_ids: frozenset[int] = frozenset()
    max_model_len: int = 1 << 30
    token_ids: list[int] = field(default_factory=list)
    status: SequenceStatus = SequenceStatus.WAITING
    num_computed_tokens: int = 0
    num_cached_tokens: int = 0  # prompt tokens served from a prefix cache at the first admission
    num_preemptions: int = 0
    finish_reason: FinishReason | None = None
    first_token_time: float | None = None
    token_times: list[float] = field(default_factory=list)
    logprobs: list[dict[int, float]] = field(default_factory=list)
    # with params.prompt_logprobs, on the request's first sequence: entry i for prompt token i (None for token 0)
    prompt_logprobs: list[dict[int, float] | None] = field(default_factory=list)
    spec_proposed: int = 0  # draft tokens verified for this sequence
    spec_accepted: int = 0  # of which accepted and kept in the output (a stop cuts what follows it)
    spec_last_round: tuple[int, int] = (0, 0)  # (accepted drafts, tokens) the last verification appended
    spec_uncounted: tuple[int, int] = (0, 0)  # (accepted, tokens) a stop string cut after the engine counted them
    unsampleable_steps: int = 0  # steps whose logits row had no token to sample (NaN, or every logit -inf)
    processors_yielded_steps: int = 0  # steps sampled without its logits processors (they banned every token)
    pooling: Pooling | None = None  # an embedding request's: it ends when its prompt is computed, sampling nothing
    pool_sum: Any = None  # the float32 sum of the hidden states pooled so far (a device tensor), until the end
    pooled_until: int = 0  # prompt positions summed into pool_sum (mean pooling)
    embedding: Any = None  # the finished embedding: a device tensor until its output reads it back, then a list

    def __post_init__(self) -> None:
        if not self.token_ids:
            self.token_ids = list(self.prompt_token_ids)
        if self.params.prompt_logprobs is not None and self.index == 0 and not self.prompt_logprobs:
            self.prompt_logprobs = [None]  # the first prompt token has nothing before it

    @property
    def needs_prompt_logits(self) -> bool:
        """It asks for prompt logprobs it does not have yet, or for an embedding whose pooler reads every prompt
        position: its prompt positions must be computed, not served from a prefix cache (KVCache.match_prefix
        matches nothing for it)."""
        if self.pooling is not None:
            return self.pooling.reads_every_position and self.embedding is None
        return self.collects_prompt_logprobs

    @property
    def collects_prompt_logprobs(self) -> bool:
        """It asks for prompt logprobs it does not have yet."""
        return self.params.prompt_logprobs is not None and self.index == 0 and \
            len(self.prompt_logprobs) < len(self.prompt_token_ids)

    @property
    def cache_namespace(self) -> str | None:
        """KV computed for this sequence is valid only for sequences of the same namespace, its LoRA adapter: a
        prefix cache matches within it (KVCache.isolates_namespaces)."""
        return self.params.lora_adapter

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens :]

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens

    @property
    def is_finished(self) -> bool:
        return self.status is SequenceStatus.FINISHED

    def append_token(self, token_id: int, now: float) -> None:
        self.token_ids.append(token_id)
        if self.first_token_time is None:
            self.first_token_time = now
        self.token_times.append(now)

    def check_stop_token(self) -> FinishReason | None:
        """Token-level stop checks after an append (stop strings are checked on text by the engine)."""
        return self.stop_reason(self.token_ids[-1], len(self.token_ids))

    def ends_on_stop_token(self) -> bool:
        """Finished by its last token, an EOS or stop token id, whose text the output leaves out (as vLLM's does;
        token_ids keep it)."""
        return self.finish_reason is FinishReason.STOP and self.num_output_tokens > 0 and \
            self.token_ids[-1] in self._stop_rule[0]

    def stop_reason(self, token: int, num_tokens: int) -> FinishReason | None:
        """Whether ``token``, as token number ``num_tokens`` of the sequence, stops it (speculative decoding asks
        ahead, for tokens not yet appended)."""
        stop_ids, length_limit = self._stop_rule
        if token in stop_ids:
            return FinishReason.STOP
        if num_tokens >= length_limit:
            return FinishReason.LENGTH
        return None

    @functools.cached_property
    def _stop_rule(self) -> tuple[frozenset[int], int]:
        """(the token ids that stop this sequence, the token count at which its length stops it), fixed at the
        first check: a sequence's params, prompt, EOS ids and context never change."""
        ids = frozenset(self.params.stop_token_ids) | (frozenset() if self.params.ignore_eos else self.eos_token_ids)
        return ids, min(len(self.prompt_token_ids) + self.params.max_tokens, self.max_model_len)


@dataclass
class CompletionOutput:
    """The state of one of a request's ``n`` sequences. In streams, token_ids/text hold only the delta."""

    index: int
    token_ids: list[int]
    text: str
    finish_reason: FinishReason | None = None
    logprobs: list[dict[int, float]] | None = None
    # in the last output of a chat's reply that a parser read (--tool-parser with tools, --reasoning-parser): the
    # reply's text outside its tool calls and its reasoning (None when not read; text keeps the whole reply), the
    # calls (None without a tool parser) and the reasoning (None: it has none, or no reasoning parser)
    content: str | None = None
    tool_calls: list[ToolCall] | None = None
    reasoning_content: str | None = None
    # where the parsers split a chat's replies as they stream (a reasoning parser's stream, a tool parser): the parts
    # of ``text`` (the delta in streams) that are reasoning and content, markers and tool calls left out (text that
    # may begin either comes in a later output); joined over the outputs, the last output's reasoning and content
    reasoning_text: str | None = None
    content_text: str | None = None
    # where a tool parser reads a chat's replies as they stream: the calls read since the last output (ids set), each
    # once; joined over the outputs, the last output's tool_calls (a reply aborted is not read: what it streamed
    # stands, the rest of its text comes as content)
    new_tool_calls: list[ToolCall] | None = None


@dataclass
class RequestOutput:
    """What the engine yields for a request: deltas while streaming, the whole result at the end."""

    request_id: str
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool
    num_cached_tokens: int = 0
    # with params.prompt_logprobs: {token id: logprob} of each prompt token (None for the first) and the top-n at
    # its position, in the first output after the prompt is computed (the model's raw distribution)
    prompt_logprobs: list[dict[int, float] | None] | None = None
    # on the final output: e2e_s, ttft_s and tpot_s (seconds; time per output token after the first, mean over the
    # request's sequences), num_preemptions, num_output_tokens (all its sequences'); with speculative decoding
    # spec_proposed, spec_accepted and the rate
    metrics: dict[str, float] = field(default_factory=dict)
    # an embedding request's (PoolingParams), on its one output: the pooled vector (its one completion is empty)
    embedding: list[float] | None = None
