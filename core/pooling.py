"""Embeddings: a prompt's final hidden states (after the model's last norm) pooled into one vector.

An embedding request (``Engine.add_request(prompt, PoolingParams(...))``) is scheduled as a prompt and ends when
its prompt is computed: no token is sampled. A pooler, a plugin (``register_poolers``; plugins/poolers.py ships
sentence-transformers' modes), folds the hidden states into the vector as each chunk of the prompt is computed.
``last`` pools the last prompt position (a causal model's only position that has seen the whole prompt:
Qwen3-Embedding, e5-mistral, gte-Qwen2), and the prefix cache may serve the others; ``mean`` and the other poolers
that read every position compute the whole prompt, as prompt logprobs do. ``dimensions`` keeps the first N values
before the normalization (Matryoshka embeddings), and ``normalize`` divides by the L2 norm. A checkpoint written by
sentence-transformers says its pooling (``1_Pooling/config.json``) and whether it normalizes (a ``Normalize``
module in ``modules.json``); those are the defaults. A sequence classifier (a model with a score head, a reward model:
core/classification.py) returns the head's label logits of the pooled vector instead: pooled ``last`` by default,
as transformers pools it, never normalized or cut.
"""
from __future__ import annotations

import difflib
import json
from collections.abc import Callable, Sequence as Seq
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from .classification import without_trailing_pads
from .errors import CheckpointError, InvalidRequestError, PluginError, UnknownComponentError
from .request import CompletionOutput, RequestOutput, SamplingParams

if TYPE_CHECKING:
    import torch

    from .chat import Prompt
    from .interfaces import Pooler, SchedulerOutput
    from .outputs import RequestState
    from .request import Sequence

COMPUTED_MODULES = (".Transformer", ".Pooling", ".Normalize")  # sentence-transformers modules infer computes
ST_POOLING_MODES = {"pooling_mode_lasttoken": "last", "pooling_mode_mean_tokens": "mean",  # -> shipped poolers
                    "pooling_mode_cls_token": "first", "pooling_mode_max_tokens": "max",
                    "pooling_mode_weightedmean_tokens": "weighted-mean",
                    "pooling_mode_mean_sqrt_len_tokens": "mean-sqrt-len"}


@dataclass(frozen=True)
class PoolingParams:
    """An embedding request: how its prompt's hidden states become one vector."""

    pooling: str | None = None  # a pooler's name ("last", "mean", ...); None: the checkpoint's, else "last"
    normalize: bool | None = None  # L2-normalize; None: as the checkpoint's modules.json says, else True
    dimensions: int | None = None  # keep the first N values (Matryoshka), before normalizing; None: all
    priority: int = 0  # as SamplingParams.priority: the priority scheduling policy and eviction policy read it
    lora_adapter: str | None = None  # pool the adapter's hidden states (a name the engine serves)
    # embed a too-long prompt's first tokens, not refuse it (text: cut by the tokenizer, which keeps the special
    # tokens it adds, such as a closing EOS, as sentence-transformers truncates)
    truncate: bool = False

    def __post_init__(self) -> None:
        if self.pooling is not None and (not isinstance(self.pooling, str) or not self.pooling):
            raise InvalidRequestError(f"pooling must be a pooler's name (\"last\", \"mean\", ...; `infer plugins` "
                                      f"lists them) or None for the checkpoint's, got {self.pooling!r}")
        if self.normalize is not None and not isinstance(self.normalize, bool):
            raise InvalidRequestError(f"normalize must be true, false or None, got {self.normalize!r}")
        if self.dimensions is not None and (isinstance(self.dimensions, bool) or not isinstance(self.dimensions, int)
                                            or self.dimensions < 1):
            raise InvalidRequestError(f"dimensions must be a positive integer (or None for all), got "
                                      f"{self.dimensions!r}")
        if isinstance(self.priority, bool) or not isinstance(self.priority, int) or not -2**31 <= self.priority < 2**31:
            raise InvalidRequestError(f"priority must be a 32-bit integer, got {self.priority!r}")
        if self.lora_adapter is not None and (not isinstance(self.lora_adapter, str) or not self.lora_adapter):
            raise InvalidRequestError(f"lora_adapter must be a non-empty name or None, got {self.lora_adapter!r}")
        if not isinstance(self.truncate, bool):
            raise InvalidRequestError(f"truncate must be true or false, got {self.truncate!r}")


def embedding_sampling_params(params: PoolingParams) -> SamplingParams:
    """What the scheduler and KV cache see of an embedding request: a prompt of one sequence, never drafted for.
    max_tokens 1 reserves the token it never samples (the prompt fits the context with one to spare)."""
    return SamplingParams(max_tokens=1, temperature=0.0, priority=params.priority, lora_adapter=params.lora_adapter,
                          speculative=False)


@dataclass(frozen=True)
class Pooling:
    """PoolingParams resolved against the model: what the engine computes for one request."""

    method: str  # the pooler's name, as the request or the checkpoint gave it
    pooler: Pooler
    normalize: bool
    dimensions: int | None
    label_head: Callable[[torch.Tensor], torch.Tensor | None] | None = None  # a classifier's Model.label_logits

    @property
    def reads_every_position(self) -> bool:
        return bool(self.pooler.reads_every_position)


class Poolers:
    """The engine's poolers, each built at its first request (``build``: the plugin manager's, blamed from then on)."""

    def __init__(self, build: Callable[[str], Pooler], names: Callable[[], list[str]]) -> None:
        self.build, self.names = build, names
        self.built: dict[str, Pooler] = {}

    def get(self, name: str, where: str = "") -> Pooler:
        """The pooler registered as ``name``; InvalidRequestError naming the choices for one nothing registered
        (``where`` says where the name came from)."""
        if (found := self.built.get(name)) is not None:
            return found
        try:
            found = self.built[name] = self.build(name)
        except UnknownComponentError:
            choices = self.names()
            close = difflib.get_close_matches(name, choices, n=1)
            hint = f" (did you mean {close[0]!r}?)" if close else ""
            raise InvalidRequestError(f"unknown pooler {name!r}{where}{hint}; registered: "
                                      f"{', '.join(choices) or 'none'}") from None
        return found


@dataclass(frozen=True)
class PoolingDefaults:
    """What a checkpoint's sentence-transformers files say (None: they say nothing)."""

    method: str | None = None
    normalize: bool | None = None
    unapplied: tuple[str, ...] = ()  # its modules that change the vector and infer does not run (Dense, say)
    max_seq_length: int | None = None  # sentence_bert_config.json's: the longest input it was trained to embed
    lower_case: bool = False  # sentence_bert_config.json's do_lower_case: text prompts are lowercased first

    def resolve(self, params: PoolingParams, hidden_size: int | None, poolers: Poolers) -> Pooling:
        """The pooling ``params`` ask for on a model of ``hidden_size`` (None: unknown, not checked)."""
        method, normalize = self.choose(params, hidden_size, poolers.names)
        where = "" if params.pooling is not None else " (the checkpoint's sentence-transformers pooling)"
        return Pooling(method, poolers.get(method, where), normalize, params.dimensions)

    def choose(self, params: PoolingParams, hidden_size: int | None, names: Callable[[], list[str]]
               ) -> tuple[str, bool]:
        """The pooler's name and whether to normalize, for ``params`` on this checkpoint; InvalidRequestError for
        what infer cannot compute (``names``: the registered poolers, for the message)."""
        if params.dimensions is not None and hidden_size is not None and params.dimensions > hidden_size:
            raise InvalidRequestError(f"dimensions {params.dimensions} exceeds the model's hidden size "
                                      f"{hidden_size}; ask for at most {hidden_size} (or None for all)")
        if params.pooling is None and self.unapplied:
            raise InvalidRequestError(f"the checkpoint's sentence-transformers modules include "
                                      f"{', '.join(self.unapplied)}, which infer does not run, so its embedding is "
                                      f"not what infer computes; pass pooling= a pooler's name (last, mean, ...) "
                                      "for the pooled final hidden states without them")
        if params.pooling is None and self.method is not None and \
                ("+" in self.method or self.method.startswith("pooling_mode_")):
            modes = self.method.split("+")  # several: sentence-transformers concatenates their vectors
            named = " and ".join(map(repr, modes)) + (" together (concatenated)" if len(modes) > 1 else "")
            raise InvalidRequestError(f"the checkpoint's sentence-transformers pooling is {named}, which no "
                                      f"registered pooler computes; pass pooling= one of {', '.join(names())}")
        normalize = params.normalize if params.normalize is not None else self.normalize is not False
        return params.pooling or self.method or "last", normalize


def read_pooling_defaults(folder: Path) -> PoolingDefaults:
    """The pooling and normalization that ``folder``'s sentence-transformers files (``modules.json``,
    ``1_Pooling/config.json``) declare; none for a folder without them. A pooling mode infer does not compute (or
    several, joined by "+": their vectors concatenated) is an error only when it is the one asked for
    (``PoolingParams.pooling`` left None), and so is a module that changes the vector after the pooling (only
    Transformer, Pooling and Normalize are what infer computes), a Normalize before the Pooling (which pools unit
    vectors, where infer normalizes the pooled one) and a Pooling module without its config.json."""
    modules_file = folder / "modules.json"
    if not modules_file.is_file():
        return PoolingDefaults()
    max_seq_length, lower_case = read_sentence_bert_config(folder)
    try:
        modules = json.loads(modules_file.read_text(encoding="utf-8"))
        types = [str(m.get("type", "")) for m in modules]
        pooling_dirs = [str(m.get("path", "")) for m in modules if str(m.get("type", "")).endswith(".Pooling")]
    except (ValueError, AttributeError, TypeError) as exc:
        raise CheckpointError(f"{modules_file} is not a sentence-transformers module list: {exc}; fix or remove "
                              "it") from exc
    normalize = any(t.endswith(".Normalize") for t in types)
    unapplied = tuple(t.rsplit(".", 1)[-1] or "an untyped module" for t in types if not t.endswith(COMPUTED_MODULES))
    first_pooling = next((i for i, t in enumerate(types) if t.endswith(".Pooling")), len(types))
    if any(t.endswith(".Normalize") for t in types[:first_pooling]) and pooling_dirs:  # it pools unit vectors
        unapplied += ("Normalize before its Pooling",)
    method = None
    if pooling_dirs and not (config_file := folder / pooling_dirs[0] / "config.json").is_file():
        unapplied += (f"Pooling (its {Path(pooling_dirs[0]) / 'config.json'} is missing: fetch it)",)
    elif pooling_dirs:
        try:
            config = json.loads(config_file.read_text(encoding="utf-8"))
            modes = [name for name, on in config.items() if name.startswith("pooling_mode_") and on is True]
        except (ValueError, AttributeError) as exc:
            raise CheckpointError(f"{config_file} is not a sentence-transformers pooling config: {exc}") from exc
        method = ST_POOLING_MODES.get(modes[0], modes[0]) if len(modes) == 1 else "+".join(modes) or None
    return PoolingDefaults(method, normalize, unapplied, max_seq_length, lower_case)


def read_sentence_bert_config(folder: Path) -> tuple[int | None, bool]:
    """``sentence_bert_config.json``'s ``max_seq_length`` (None: no such file or field) and ``do_lower_case``;
    CheckpointError for values of the wrong kind."""
    path = folder / "sentence_bert_config.json"
    if not path.is_file():
        return None, False
    try:
        config = json.loads(path.read_text(encoding="utf-8"))
        value, lower = config.get("max_seq_length"), config.get("do_lower_case", False)
    except (ValueError, AttributeError) as exc:
        raise CheckpointError(f"{path} is not a sentence-transformers config: {exc}; fix or remove it") from exc
    if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
        raise CheckpointError(f"{path} has max_seq_length = {value!r}; it should be a positive integer (the "
                              "longest input the model embeds), or leave it out")
    if not isinstance(lower, bool):
        raise CheckpointError(f"{path} has do_lower_case = {lower!r}; it should be true or false")
    return value, lower


class Embeddings:
    """The engine's side of embedding requests: each one's pooling resolved against the model (the poolers built
    at their first request) and its prompt checked; how many are live; which finish in a step; their output."""

    def __init__(self, defaults: PoolingDefaults, poolers: Poolers, hidden_size: int | None, max_model_len: int,
                 tokenize: Callable[[Prompt], list[int]],
                 label_head: Callable[[torch.Tensor], torch.Tensor | None] | None = None,
                 truncate_text: Callable[[str, int], list[int]] | None = None, pad_token_id: int | None = None
                 ) -> None:
        self.defaults, self.poolers, self.hidden_size = defaults, poolers, hidden_size
        self.max_model_len, self.tokenize = max_model_len, tokenize
        # a text's tokens cut to a length by the tokenizer, which keeps the special tokens it adds (an EOS last)
        self.truncate_text = truncate_text
        self.label_head = label_head  # a sequence classifier's: each embedding is its label logits
        self.pad_token_id = pad_token_id  # a classifier's: pads that end a prompt are not pooled (transformers' rule)
        self.live = 0  # embedding requests under way

    def resolve(self, params: PoolingParams) -> Pooling:
        """The pooling ``params`` ask for: the checkpoint's defaults, or a classifier's (last, no normalization;
        InvalidRequestError for normalize or dimensions, which label logits have no use for)."""
        if self.label_head is None:
            return self.defaults.resolve(params, self.hidden_size, self.poolers)
        if params.normalize or params.dimensions is not None:
            raise InvalidRequestError("this model is a sequence classifier: its embedding is the label logits, which "
                                      "are neither normalized nor cut; leave normalize and dimensions unset")
        method = params.pooling or "last"
        return Pooling(method, self.poolers.get(method), False, None, self.label_head)

    def admit(self, prompt: Prompt, params: PoolingParams) -> tuple[list[int], SamplingParams, Pooling]:
        """The request's prompt as token ids, what the scheduler sees of it, and its pooling; InvalidRequestError
        for a prompt past the longest the engine embeds (unless ``truncate``: its first tokens, then; a text's
        cut by the tokenizer, its special tokens kept) or a pooling it cannot compute."""
        pooling = self.resolve(params)
        if self.defaults.lower_case and isinstance(prompt, str):  # as sentence-transformers reads such a checkpoint
            prompt = prompt.lower()
        ids = self.tokenize(prompt)
        longest, why = self.max_model_len - 1, "the model's context length less one, the token its scheduling reserves"
        if self.defaults.max_seq_length is not None and self.defaults.max_seq_length < longest:
            longest, why = self.defaults.max_seq_length, "the checkpoint's sentence-transformers max_seq_length"
        if len(ids) > longest and params.truncate and isinstance(prompt, str) and self.truncate_text is not None:
            ids = self.truncate_text(prompt, longest)  # as sentence-transformers truncates: the closing EOS stays
        elif len(ids) > longest and params.truncate:
            ids = ids[:longest]
        elif len(ids) > longest:
            raise InvalidRequestError(f"prompt ({len(ids)} tokens) is too long to embed: at most {longest} tokens "
                                      f"({why}); shorten it, or pass truncate=True (--truncate) to embed its first "
                                      f"{longest} tokens")
        if self.label_head is not None and pooling.method == "last":
            ids = without_trailing_pads(ids, self.pad_token_id)
        return ids, embedding_sampling_params(params), pooling

    def finished_in(self, out: SchedulerOutput) -> set[int]:
        """The sequences of ``out`` whose embedding this step completed: they sample nothing, and finish once the
        scheduler's update has counted (and the KV cache committed) their last prompt tokens."""
        if not self.live:
            return set()
        return {item.seq.seq_id for item in out.scheduled if item.seq.embedding is not None and
                not item.seq.is_finished}

    @staticmethod
    def output(req: RequestState) -> RequestOutput:
        """An embedding request's output: none until it finishes, then its embedding (or an abort)."""
        seq = req.seqs[0]
        if seq.embedding is not None and not isinstance(seq.embedding, list):
            seq.embedding = seq.embedding.tolist()  # read back now: with async output, while the next step runs
        done = [CompletionOutput(0, [], "", seq.finish_reason)] if seq.is_finished else []
        return RequestOutput(req.request_id, req.prompt_token_ids, done, seq.is_finished, embedding=seq.embedding)


@dataclass
class PoolRows:
    """The batch rows whose hidden states embedding requests pool this step, and whose they are."""

    rows: list[int]  # indices into the batch's tokens
    owners: list[tuple[Sequence, int, bool]]  # (sequence, its number of rows, whether its prompt is done)


def pool_rows(out: SchedulerOutput, query_lens: Seq[int], kv_cache: str) -> PoolRows | None:
    """The rows of ``out``'s batch (items of ``query_lens`` tokens, in order) that embedding requests pool; None if
    there are none. A pooler that reads only the last position gets the prompt's last row; the others every row they
    have not been given yet (a recompute after preemption gives only what is new), so a prefix cache must not have
    served any (``kv_cache`` names it)."""
    rows: list[int] = []
    owners: list[tuple[Sequence, int, bool]] = []
    offset = 0
    for item, length in zip(out.scheduled, query_lens):
        seq = item.seq
        if seq.pooling is not None and seq.embedding is None:
            start, end, total = seq.num_computed_tokens, seq.num_computed_tokens + item.num_new_tokens, \
                seq.num_prompt_tokens
            done = end >= total
            if not seq.pooling.reads_every_position:
                picked = [offset + total - 1 - start] if done else []
            else:
                if start > seq.pooled_until:
                    raise PluginError(f"KV cache {kv_cache!r} served positions {seq.pooled_until}-{start - 1} of "
                                      f"sequence {seq.seq_id} from its prefix cache, but its embedding pools "
                                      "every position: match_prefix must match nothing for a sequence whose "
                                      "needs_prompt_logits is true; fix the plugin")
                first = max(start, seq.pooled_until)
                picked = list(range(offset + first - start, offset + min(end, total) - start))
            rows += picked
            owners.append((seq, len(picked), done))
        offset += length
    return PoolRows(rows, owners) if rows or any(done for _, _, done in owners) else None  # else nothing to pool


def collect_pooled(found: PoolRows, hidden: torch.Tensor) -> None:
    """Hand each owner's rows of ``hidden`` (float32) to its pooler, and give each whose prompt is done its
    ``embedding``."""
    import torch

    from .sampling import to_device

    picked = hidden[to_device(found.rows, hidden.device)].float() if found.rows else None
    at = 0
    for seq, count, done in found.owners:
        pooling: Pooling = seq.pooling  # type: ignore[assignment]
        if count:
            first = seq.pooled_until if pooling.reads_every_position else seq.num_prompt_tokens - 1
            state = pooling.pooler.add(seq.pool_sum, picked[at : at + count], first)  # type: ignore[index]
            if not isinstance(state, torch.Tensor):
                raise PluginError(f"pooler {pooling.method!r}: add() returned {type(state).__name__}, not a tensor; "
                                  "fix the plugin")
            seq.pool_sum, seq.pooled_until, at = state, seq.pooled_until + count, at + count
        if done:
            vector = pooling.pooler.finish(seq.pool_sum, seq.pooled_until)
            seq.embedding, seq.pool_sum = finish_embedding(vector, pooling), None


def finish_embedding(vector: torch.Tensor, pooling: Pooling) -> torch.Tensor:
    """A pooler's vector, checked, cut to ``pooling.dimensions`` and L2-normalized if asked, or a classifier's label
    logits of it (on its device: the output reads it back)."""
    import torch

    wanted = pooling.dimensions or 1
    if not isinstance(vector, torch.Tensor) or vector.dim() != 1 or not vector.is_floating_point() or \
            vector.shape[0] < wanted:
        shape = tuple(vector.shape) if isinstance(vector, torch.Tensor) else type(vector).__name__
        raise PluginError(f"pooler {pooling.method!r}: finish() returned {shape}, not a float vector of at least "
                          f"{wanted} values; fix the plugin")
    vector = vector.float()
    if pooling.label_head is not None:
        return pooling.label_head(vector[None])[0].float()  # type: ignore[index]
    if pooling.dimensions is not None:
        vector = vector[: pooling.dimensions]
    if pooling.normalize:
        vector = vector / vector.norm().clamp_min(1e-12)  # as torch.nn.functional.normalize's eps
    return vector
