"""Seeded benchmark workloads. Every arm of a round replays the same :class:`Workload`, token for token.

A workload is a list of sessions. A session is one request, or for ``multi-turn`` a conversation whose turn ``k``
prompt is the whole history (every earlier user turn and model output) followed by the new user turn; a session's
next turn starts as soon as its previous one finishes, while sessions run interleaved.

Lengths and arrival times come from ``seed`` alone, so every round has the same shape; token contents come from
``(seed, round)`` (the runner also empties an engine's prefix cache before each run: the file workload repeats).
With ``--task embed`` every request of ``random``, ``shared-prefix`` and ``file`` is an embedding request (a Turn
with ``pooling``); a ``file`` line may also make itself one (``"embed": true`` or ``{"pooling": ..., ...}``).
"""
from __future__ import annotations

import dataclasses
import json
import math
import random
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from ..core.chat import ChatPrompt, Prompt, chat_of_fields
from ..core.errors import InvalidRequestError
from ..core.pooling import PoolingParams
from ..core.request import STRUCTURE_FIELDS, SamplingParams, StructuredOutput
from ..core.tool_choice import forces_calls, reply_reading

WORKLOADS = ("random", "shared-prefix", "multi-turn", "long-prompt-arrival", "file")
TASKS = ("generate", "embed")
EMBED_FIELDS = ("pooling", "dimensions", "normalize")  # a file line's "embed" object: PoolingParams fields
NO_EMBED_WORKLOADS = {  # why --task embed refuses them
    "multi-turn": "its next turn's prompt holds the previous turn's output, and an embedding request generates none",
    "long-prompt-arrival": "it measures how a long prompt stalls steady decodes, and embedding requests decode "
                           "nothing",
}


@dataclass(frozen=True)
class RequestSampling:
    """How every request of a workload samples: SamplingParams fields over greedy (``infer bench``'s sampling
    options), and, with ``seed``, a seed per request derived from it, its round, session and turn, so that every
    arm samples each request from the same random stream."""

    fields: dict[str, float] = field(default_factory=dict)
    seed: int | None = None

    @property
    def greedy(self) -> bool:
        return not self.fields.get("temperature", 0.0)

    def request_seed(self, round_index: int, session: int, turn: int) -> int | None:
        if self.seed is None:
            return None
        value = self.seed
        for part in (round_index, session, turn):
            value = value * 1_000_003 + part
        return value % 2**63

    def params(self, max_tokens: int, round_index: int, session: int, turn: int, lora_adapter: str | None = None,
               structured_output: StructuredOutput | None = None, priority: int = 0) -> SamplingParams:
        """A request's parameters: exactly ``max_tokens`` tokens, whatever the model samples (EOS is ignored);
        min_tokens holds for a shorter request up to its end. A structured request ends at EOS once its output is
        whole (``max_tokens`` at most)."""
        fields = {"temperature": 0.0, **self.fields}
        fields["min_tokens"] = min(int(fields.get("min_tokens", 0)), max_tokens)
        return SamplingParams(max_tokens=max_tokens, ignore_eos=structured_output is None,
                              seed=self.request_seed(round_index, session, turn), lora_adapter=lora_adapter,
                              structured_output=structured_output, priority=priority, **fields)


@dataclass(frozen=True)
class WorkloadSpec:
    """The workload options of ``infer bench``; see docs/cli.md for each one's meaning per workload."""

    name: str = "random"
    num_requests: int = 32  # sessions: requests, or conversations for multi-turn, or decodes for long-prompt-arrival
    input_len: int = 128  # mean prompt length (random, long-prompt-arrival decodes), or user turn (multi-turn)
    output_len: int = 32  # mean output length
    len_sigma: float = 0.5  # lognormal sigma of the lengths; 0 makes them fixed
    prefix_len: int = 1000  # shared-prefix: the system prompt
    question_len: int = 100  # shared-prefix: the mean question length
    turns: int = 4  # multi-turn: turns per conversation
    long_len: int = 1000  # long-prompt-arrival: the long prompt
    long_delay_s: float = 0.25  # long-prompt-arrival: when the long prompt arrives
    rate: float = math.inf  # Poisson arrival rate of sessions in sessions/s; inf sends them all at once
    seed: int = 0
    file: Path | None = None
    skip_bad_lines: bool = False
    sampling: RequestSampling = field(default_factory=RequestSampling)
    lora_adapters: tuple[str, ...] = ()  # session i runs on the (i mod count)-th; none: the base model
    task: str = "generate"  # "embed": every request is an embedding request with ``pooling``
    pooling: PoolingParams = field(default_factory=PoolingParams)  # the embed task's (its --pooling, ...)

    @property
    def task_pooling(self) -> PoolingParams | None:
        """Every request's PoolingParams under --task embed; None under --task generate."""
        return self.pooling if self.task == "embed" else None


@dataclass(frozen=True)
class Turn:
    """New prompt tokens of one request (for multi-turn, appended to the history) and its output length."""

    tokens: tuple[int, ...]
    max_tokens: int
    structured_output: StructuredOutput | None = None  # the file workload's: the output ends at EOS once whole
    priority: int = 0  # the file workload's: SamplingParams.priority (read by --scheduling-policy priority)
    pooling: PoolingParams | None = None  # an embedding request's (max_tokens is then 0): it ends with its prompt

    @property
    def reserved_tokens(self) -> int:
        """Tokens the request holds beyond its prompt: its output, or the one an embedding request reserves."""
        return 1 if self.pooling is not None else self.max_tokens


@dataclass(frozen=True)
class Session:
    arrival_s: float  # offset of the first turn from the start of the run
    turns: tuple[Turn, ...]
    lora_adapter: str | None = None  # every turn's (None: the base model)


@dataclass(frozen=True)
class Workload:
    name: str
    round: int
    sessions: tuple[Session, ...]
    long_session: int | None = None  # long-prompt-arrival: the index of the long prompt's session
    sampling: RequestSampling = field(default_factory=RequestSampling)

    @property
    def num_requests(self) -> int:
        return sum(len(s.turns) for s in self.sessions)

    def priority(self, session: int, turn: int) -> int:
        return self.sessions[session].turns[turn].priority

    def longest_request(self) -> int:
        """Most tokens one request holds: its prompt (the history for multi-turn) plus its output."""
        longest = 0
        for session in self.sessions:
            history = 0
            for turn in session.turns:
                longest = max(longest, history + len(turn.tokens) + turn.reserved_tokens)
                history += len(turn.tokens) + turn.max_tokens
        return longest


@dataclass(frozen=True)
class Vocab:
    """Token ids that random prompts may use: the model's vocabulary without its special tokens."""

    size: int
    special: frozenset[int] = frozenset()
    allowed: tuple[int, ...] = field(init=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "allowed", tuple(i for i in range(self.size) if i not in self.special))
        if not self.allowed:
            raise ValueError("the vocabulary has no non-special token")


class WorkloadError(ValueError):
    """A workload option or file is invalid; the message says what to fix."""


@dataclass(frozen=True)
class FileEntry:
    prompt: str | tuple[int, ...] | ChatPrompt
    max_tokens: int
    line: int = 0
    lora_adapter: str | None = None
    structured_output: StructuredOutput | None = None  # the line's, or the reply schema of its forced tool calls
    priority: int = 0
    pooling: PoolingParams | None = None  # an embedding request's (max_tokens is then 0)


def parse_workload_file(path: Path, task_pooling: PoolingParams | None = None
                        ) -> tuple[list[FileEntry], list[str]]:
    """Read a JSONL file of ``{"prompt": str | [int, ...], "max_tokens": int}`` or, for a chat, of
    ``{"messages": [...], "max_tokens": int}`` and optionally the other fields of gRPC's ``Chat`` (``tools``,
    ``chat_template_kwargs``, ...); any line may name a LoRA adapter (``"lora_adapter": "NAME"``) and give a
    structured output (``"structured_output": {"json_schema": {...}}``, or ``"regex"``, ``"choice"`` or
    ``"grammar"``, the fields of :class:`StructuredOutput`; null: none) and a priority (``"priority": 5``, an
    integer; higher runs first under ``--scheduling-policy priority``; default 0). A line holding ``"embed": true``
    or ``"embed": {"pooling": ..., "dimensions": ..., "normalize": ...}`` is an embedding request (its
    ``max_tokens`` optional and ignored, no structured output); with ``task_pooling`` (``--task embed``) every line
    is one, with those parameters, which a line's ``"embed"`` object overrides field by field. Blank lines are
    skipped, other fields are ignored.

    Returns the good entries and one message per bad line (``line N: why``); a bad line never hides the others.
    """
    entries: list[FileEntry] = []
    errors: list[str] = []
    try:
        lines = path.read_text(encoding="utf-8").splitlines()
    except (OSError, UnicodeDecodeError) as exc:
        raise WorkloadError(f"cannot read workload file {path}: {exc}") from exc
    for number, line in enumerate(lines, start=1):
        if not line.strip():
            continue
        try:
            entries.append(_parse_line(line, number, task_pooling))
        except WorkloadError as exc:
            errors.append(f"line {number}: {exc}")
    if not entries and not errors:
        raise WorkloadError(f"workload file {path} holds no request")
    return entries, errors


def _parse_line(line: str, number: int, task_pooling: PoolingParams | None) -> FileEntry:
    try:
        item = json.loads(line)
    except json.JSONDecodeError as exc:
        raise WorkloadError(f"not valid JSON ({exc.msg} at column {exc.colno})") from None
    except RecursionError:
        raise WorkloadError("JSON nested too deep to read") from None
    if not isinstance(item, dict):
        raise WorkloadError(f"expected an object with 'prompt' and 'max_tokens', got {type(item).__name__}")
    if "prompt" in item and "messages" in item:
        raise WorkloadError("give 'prompt' or 'messages' (a chat), not both")
    if "prompt" not in item and "messages" not in item:
        raise WorkloadError("'prompt' (or 'messages', a chat) is missing")
    prompt, max_tokens = item.get("prompt"), item.get("max_tokens")
    if "messages" in item:
        try:
            prompt = chat_of_fields(item)
        except InvalidRequestError as exc:
            raise WorkloadError(str(exc)) from None
    elif isinstance(prompt, str):
        if not prompt:
            raise WorkloadError("'prompt' is an empty string")
    elif isinstance(prompt, list):
        if not prompt or not all(isinstance(t, int) and not isinstance(t, bool) and t >= 0 for t in prompt):
            raise WorkloadError("'prompt' as a list must hold at least one non-negative integer token id")
        prompt = tuple(prompt)
    else:
        raise WorkloadError("'prompt' must be a string or a list of token ids")
    pooling = _line_pooling(item.get("embed"), task_pooling)
    if pooling is not None:
        if _structured_output(item, prompt) is not None:
            raise WorkloadError("an embedding request generates nothing, so it takes no structured output (nor a "
                                "forced tool_choice); drop one of them")
        max_tokens = 0
    elif "max_tokens" not in item:
        raise WorkloadError("'max_tokens' is missing")
    elif not isinstance(max_tokens, int) or isinstance(max_tokens, bool) or max_tokens <= 0:
        raise WorkloadError(f"'max_tokens' must be a positive integer, got {max_tokens!r}")
    adapter = item.get("lora_adapter")
    if adapter is not None and (not isinstance(adapter, str) or not adapter):
        raise WorkloadError(f"'lora_adapter' must be the name of a LoRA adapter (a non-empty string), got {adapter!r}")
    priority = item.get("priority", 0)
    try:  # the engine's own check
        SamplingParams(priority=priority).validate()
    except InvalidRequestError as exc:
        raise WorkloadError(str(exc).removeprefix("invalid sampling parameters: ")) from None
    structured = None if pooling is not None else _structured_output(item, prompt)
    return FileEntry(prompt, max_tokens, number, adapter, structured, priority, pooling)


def _line_pooling(given: object, task_pooling: PoolingParams | None) -> PoolingParams | None:
    """A line's embedding request: its ``"embed"`` (true, false or an object of PoolingParams fields) over the
    task's parameters (--task embed: every line embeds); None for a generation request."""
    if given is None or given is False:
        if given is False and task_pooling is not None:
            raise WorkloadError("\"embed\": false, but --task embed makes every line an embedding request; drop "
                                "the field, or run the line with --task generate")
        return task_pooling
    base = task_pooling or PoolingParams()
    if given is True:
        return base
    if not isinstance(given, dict) or not given.keys() <= set(EMBED_FIELDS):
        raise WorkloadError(f"'embed' must be true, false or an object of {', '.join(EMBED_FIELDS)} (e.g. "
                            f"{{\"pooling\": \"mean\", \"dimensions\": 256}}), got {json.dumps(given)[:80]}")
    try:
        return dataclasses.replace(base, **given)
    except InvalidRequestError as exc:
        raise WorkloadError(str(exc)) from None


def _structured_output(item: dict[str, object], prompt: object) -> StructuredOutput | None:
    """A line's ``structured_output`` (an object of one of StructuredOutput's fields), or the reply schema of its
    chat's forced tool calls (as the engine derives it: the bench sends token ids, so the structured output goes
    with them)."""
    given = _given_structured_output(item.get("structured_output"))
    if not (isinstance(prompt, ChatPrompt) and forces_calls(prompt)):
        return given
    try:  # refuses a given structured_output beside it, as the engine does
        return reply_reading(prompt, SamplingParams(structured_output=given), None)[0].structured_output
    except InvalidRequestError as exc:
        raise WorkloadError(str(exc)) from None


def _given_structured_output(fields: object) -> StructuredOutput | None:
    if fields is None:
        return None
    if not isinstance(fields, dict) or not fields.keys() <= set(STRUCTURE_FIELDS):
        raise WorkloadError(f"'structured_output' must be an object of one of {', '.join(STRUCTURE_FIELDS)} (e.g. "
                            f"{{\"json_schema\": {{...}}}}), got {json.dumps(fields)[:80]}")
    structured = StructuredOutput(**fields)
    try:
        structured.validate()
    except InvalidRequestError as exc:
        raise WorkloadError(str(exc)) from None
    return structured


def check_task(spec: WorkloadSpec) -> None:
    """The workload and task exist and go together. Raises WorkloadError."""
    if spec.name not in WORKLOADS:
        raise WorkloadError(f"unknown workload {spec.name!r}; choose one of {', '.join(WORKLOADS)}")
    if spec.task not in TASKS:
        raise WorkloadError(f"unknown task {spec.task!r}; choose one of {', '.join(TASKS)}")
    if spec.task == "embed" and spec.name in NO_EMBED_WORKLOADS:
        raise WorkloadError(f"--task embed does not run the {spec.name} workload: {NO_EMBED_WORKLOADS[spec.name]}; "
                            "use random, shared-prefix (its system prompt is then the shared instruction) or file")


def validate_spec(spec: WorkloadSpec) -> list[FileEntry] | None:
    """Check the options before any engine is built; for ``file``, parse the file. Raises WorkloadError."""
    check_task(spec)
    positive = {"num-requests": spec.num_requests, "input-len": spec.input_len, "output-len": spec.output_len,
                "prefix-len": spec.prefix_len, "question-len": spec.question_len, "turns": spec.turns,
                "long-len": spec.long_len}
    for name, value in positive.items():
        if value <= 0:
            raise WorkloadError(f"--{name} must be a positive integer, got {value}")
    if not spec.rate > 0:
        raise WorkloadError(f"--rate must be > 0 requests/s (or inf for all at once), got {spec.rate}")
    if not (math.isfinite(spec.len_sigma) and spec.len_sigma >= 0 and math.isfinite(spec.long_delay_s)
            and spec.long_delay_s >= 0):
        raise WorkloadError(f"--len-sigma and --long-delay must be finite and >= 0, got {spec.len_sigma} and "
                            f"{spec.long_delay_s}")
    if spec.name == "long-prompt-arrival" and not math.isinf(spec.rate):
        raise WorkloadError("--rate does not apply to long-prompt-arrival: its steady decodes start together and "
                            "--long-delay sets when the long prompt arrives")
    if spec.name != "file":
        return None
    if spec.lora_adapters:
        raise WorkloadError("--lora-adapter spreads a generated workload over adapters; a --workload file names "
                            "each line's own (\"lora_adapter\": \"NAME\")")
    if spec.file is None:
        raise WorkloadError("--workload file needs --file PATH (JSONL of {\"prompt\": ..., \"max_tokens\": ...})")
    entries, errors = parse_workload_file(spec.file, spec.task_pooling)
    return good_lines(spec, entries, errors, f"bad line(s) of {len(entries) + len(errors)}")


def good_lines(spec: WorkloadSpec, good: list[FileEntry], errors: list[str], what: str) -> list[FileEntry]:
    """``good``, unless there are bad lines without --skip-bad-lines (every one listed) or no good line."""
    if errors and not spec.skip_bad_lines:
        listed = "\n  ".join(errors)
        raise WorkloadError(f"workload file {spec.file} has {len(errors)} {what}; fix them, or pass --skip-bad-lines "
                            f"to skip them ({len(good)} line(s) left):\n  {listed}")
    if not good:
        raise WorkloadError(f"workload file {spec.file} has no good line")
    return good


def _lognormal_len(rng: random.Random, mean: int, sigma: float) -> int:
    """A length with the given mean (lognormal, so a long right tail); at least 1."""
    if sigma == 0:
        return mean
    return max(1, round(rng.lognormvariate(math.log(mean) - sigma * sigma / 2, sigma)))


def _arrivals(spec: WorkloadSpec, count: int) -> list[float]:
    if math.isinf(spec.rate):
        return [0.0] * count
    rng = random.Random(f"{spec.seed}:arrivals")
    times, now = [], 0.0
    for _ in range(count):
        times.append(now)
        now += rng.expovariate(spec.rate)
    return times


def build_workload(spec: WorkloadSpec, round_index: int, vocab: Vocab,
                   tokenize: Callable[[Prompt], Sequence[int]] | None = None,
                   entries: list[FileEntry] | None = None) -> Workload:
    """The requests of one round. ``tokenize`` turns file prompts given as text or chats into token ids."""
    shape = random.Random(f"{spec.seed}:shape")
    content = random.Random(f"{spec.seed}:content:{round_index}")

    def tokens(n: int) -> tuple[int, ...]:
        return tuple(content.choices(vocab.allowed, k=n))

    def length(mean: int) -> int:
        return _lognormal_len(shape, mean, spec.len_sigma)

    turns: list[tuple[Turn, ...]]
    if spec.name == "random":
        turns = [(_turn(spec, tokens(length(spec.input_len)), length(spec.output_len)),)
                 for _ in range(spec.num_requests)]
    elif spec.name == "shared-prefix":
        system = tokens(spec.prefix_len)
        turns = [(_turn(spec, system + tokens(length(spec.question_len)), length(spec.output_len)),)
                 for _ in range(spec.num_requests)]
    elif spec.name == "multi-turn":
        turns = [tuple(Turn(tokens(length(spec.input_len)), length(spec.output_len)) for _ in range(spec.turns))
                 for _ in range(spec.num_requests)]
    elif spec.name == "long-prompt-arrival":
        decodes = [Session(0.0, (Turn(tokens(length(spec.input_len)), length(spec.output_len)),))
                   for _ in range(spec.num_requests)]
        long = Session(spec.long_delay_s, (Turn(tokens(spec.long_len), spec.output_len),))
        return Workload(spec.name, round_index, _on_adapters(spec, tuple(decodes) + (long,)),
                        long_session=len(decodes), sampling=spec.sampling)
    elif spec.name == "file":
        if entries is None:
            raise WorkloadError("the file workload needs its parsed entries (validate_spec)")
        prompts = _file_tokens(entries, vocab, tokenize)
        turns = [(Turn(p, e.max_tokens, e.structured_output, e.priority, e.pooling),)
                 for p, e in zip(prompts, entries)]
        sessions = [Session(a, t, e.lora_adapter) for a, t, e in zip(_arrivals(spec, len(turns)), turns, entries)]
        return Workload(spec.name, round_index, tuple(sessions), sampling=spec.sampling)
    else:
        raise WorkloadError(f"unknown workload {spec.name!r}; choose one of {', '.join(WORKLOADS)}")
    arrivals = _arrivals(spec, len(turns))
    sessions = tuple(Session(a, t) for a, t in zip(arrivals, turns))
    return Workload(spec.name, round_index, _on_adapters(spec, sessions), sampling=spec.sampling)


def _turn(spec: WorkloadSpec, prompt: tuple[int, ...], max_tokens: int) -> Turn:
    """A generated request of the spec's task: the same prompt either way (the output length is drawn for both, so
    a seed gives --task embed the prompts of --task generate)."""
    if spec.task_pooling is not None:
        return Turn(prompt, 0, pooling=spec.task_pooling)
    return Turn(prompt, max_tokens)


def _on_adapters(spec: WorkloadSpec, sessions: tuple[Session, ...]) -> tuple[Session, ...]:
    names = spec.lora_adapters
    if not names:
        return sessions
    return tuple(dataclasses.replace(s, lora_adapter=names[i % len(names)]) for i, s in enumerate(sessions))


def lora_adapters_used(spec: WorkloadSpec, entries: list[FileEntry] | None) -> list[str]:
    """The LoRA adapters the workload's requests name, in first-use order."""
    names = list(spec.lora_adapters) + [e.lora_adapter for e in entries or () if e.lora_adapter is not None]
    return list(dict.fromkeys(names))


def check_vocabulary(spec: WorkloadSpec, entries: list[FileEntry], vocab_size: int
                     ) -> tuple[list[FileEntry], list[str]]:
    """The entries whose token ids all fit ``vocab_size``, and an error per line that does not; without
    ``--skip-bad-lines`` any such line raises WorkloadError listing them all, as :func:`validate_spec` does."""
    good, errors = [], []
    for entry in entries:
        bad = [] if isinstance(entry.prompt, (str, ChatPrompt)) else [t for t in entry.prompt if t >= vocab_size]
        if bad:
            errors.append(f"line {entry.line}: token ids {bad[:5]} are outside the vocabulary of {vocab_size} "
                          "(the smallest of the arms' models)")
        else:
            good.append(entry)
    return good_lines(spec, good, errors, "line(s) with token ids outside the vocabulary"), errors


def _file_tokens(entries: list[FileEntry], vocab: Vocab,
                 tokenize: Callable[[Prompt], Sequence[int]] | None) -> list[tuple[int, ...]]:
    """Token ids of every file prompt (entries already checked against the vocabulary by check_vocabulary)."""
    out = []
    for entry in entries:
        if isinstance(entry.prompt, (str, ChatPrompt)):
            if tokenize is None:
                raise WorkloadError("text and chat prompts need a tokenizer")
            try:
                out.append(tuple(tokenize(entry.prompt)))
            except InvalidRequestError as exc:  # a chat the first arm's template cannot render
                raise WorkloadError(f"line {entry.line}: {exc}") from None
            continue
        if any(t >= vocab.size for t in entry.prompt):
            raise WorkloadError(f"line {entry.line}: token ids outside the vocabulary of {vocab.size}; "
                                "check_vocabulary first")
        out.append(entry.prompt)
    return out
