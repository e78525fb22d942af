"""The small ABCs that plugins implement. Each method's docstring is its contract."""
from __future__ import annotations

import inspect
from abc import ABC, abstractmethod
from collections.abc import Hashable, Mapping, MutableSequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, ClassVar

from .errors import CheckpointError, PluginError, shape_mismatch
from .reply_interfaces import (
    Grammar, GrammarMatcher, ReasoningEnd, ReasoningParser, ReasoningStream, StructuredOutputBackend, ToolParser,
    Vocabulary,
)
from .request import FinishReason, Sequence, SequenceStatus

__all__ = [
    "KVStats", "BlockOps", "KVCache", "EvictionPolicy", "not_evictable", "ScheduledSequence", "SchedulerOutput",
    "Scheduler", "AttentionMetadata", "LayerKVCache", "kv_cache_scales", "AttentionBackend", "QUANTIZED_TENSOR_NAMES",
    "check_float", "QuantMethod", "ProcessorRow", "LogitsProcessor", "Pooler", "Proposal", "Proposer", "ToolParser",
    "ReasoningParser", "ReasoningStream", "ReasoningEnd", "Vocabulary", "StructuredOutputBackend", "Grammar",
    "GrammarMatcher", "ModelSpec", "Model",
    "Sequence", "SequenceStatus", "FinishReason",  # what a scheduler reads and sets (from core/request.py)
]

if TYPE_CHECKING:
    import torch

    from .model import Model


# ---------------------------------------------------------------- KV cache (the block allocator)
@dataclass
class KVStats:
    """A snapshot of a KV cache. ``free + used + cached == total`` always holds."""

    total_blocks: int
    free_blocks: int
    used_blocks: int  # referenced by at least one live sequence
    cached_blocks: int  # unreferenced, kept for prefix reuse, evictable
    prefix_queries: int = 0  # prompt tokens looked up in the prefix cache
    prefix_hits: int = 0  # of which served from cache
    evictions: int = 0

    def count_prompt_lookup(self, seq: Sequence, matched_tokens: int) -> None:
        """Count an admitted prompt's prefix-cache lookup. A recompute after preemption that finds its own earlier
        blocks is not a prompt cache hit, so only a sequence's first admission counts."""
        if seq.num_preemptions == 0:
            self.prefix_queries += seq.num_tokens
            self.prefix_hits += matched_tokens


@dataclass
class BlockOps:
    """Data movement the runner must perform before the next forward pass, in this order. A copy may not read or
    write a block that a swap-in of the same step fills (the engine refuses such a schedule): the copy would see
    the swapped-in KV, not the KV it was queued for."""

    swap_out: list[tuple[int, int]] = field(default_factory=list)  # (device block, host block)
    swap_in: list[tuple[int, int]] = field(default_factory=list)  # (host block, device block)
    copies: list[tuple[int, int]] = field(default_factory=list)  # (src block, dst block), copy-on-write

    def __bool__(self) -> bool:
        return bool(self.swap_out or self.swap_in or self.copies)

    def extend(self, other: BlockOps) -> None:
        """Append ``other``'s operations after this one's, kind by kind."""
        self.swap_out += other.swap_out
        self.swap_in += other.swap_in
        self.copies += other.copies


class KVCache(ABC):
    """Logical KV blocks: which physical block holds which sequence's tokens. Owns no tensors.

    Blocks hold ``block_size`` consecutive token positions of one sequence. A block is free XOR referenced by
    live sequences XOR cached (unreferenced but kept for prefix reuse).
    """

    block_size: int
    num_blocks: int
    # True when match_prefix matches only blocks computed for sequences of the same ``seq.cache_namespace`` (KV
    # computed under one LoRA adapter is wrong under another); the engine refuses --lora with a cache that does not
    # say so. A cache without prefix reuse isolates trivially.
    isolates_namespaces: bool = False
    # True when match_prefix may return blocks that other sequences computed (a prefix cache that is on): the shipped
    # schedulers then hold a waiting request back for a step when the first block of its prompt past its cache hit
    # is one that a sequence computes in this step, so that it reuses that block instead of computing it again
    reuses_prefixes: bool = False

    @abstractmethod
    def match_prefix(self, seq: Sequence) -> int:
        """Find cached blocks holding a prefix of ``seq.token_ids``; return how many tokens they cover.

        Called at each admission attempt, on a sequence holding no blocks, and followed at once by :meth:`allocate`,
        or by :meth:`free` when allocation is refused or not attempted (a prompt over the step budget). The result
        is a multiple of ``block_size`` and leaves at least one token to compute; :meth:`block_table` lists the
        matched blocks from here on. The shipped caches take hold of them (reference, lock, a use for the eviction
        policy) only when ``allocate`` succeeds, so that a request that waits at the head of the queue, matched and
        refused every step, changes nothing. Caches without prefix reuse return 0, and so must every cache for a
        sequence whose ``needs_prompt_logits`` is true (it asks for prompt logprobs, which need every prompt
        position's logits, or for an embedding that averages every position's hidden state; the engine raises a
        PluginError naming the cache otherwise).
        """

    @abstractmethod
    def allocate(self, seq: Sequence, num_tokens: int) -> bool:
        """Make room for ``num_tokens`` more positions after ``seq.num_computed_tokens``.

        The request is absolute, not cumulative: afterwards positions ``[num_computed_tokens, num_computed_tokens +
        num_tokens)`` are backed, whatever earlier calls made room for; it may be called again in the same step
        (speculative decoding widens a decode's 1 to ``1 + k`` after ``schedule``). Returns False, changing nothing,
        when there are not enough blocks (after evicting cached ones). Writing
        into a block shared with another sequence copies it first (recorded for :meth:`take_block_ops`).
        """

    @abstractmethod
    def free(self, seq: Sequence) -> None:
        """Drop the sequence's references. Full blocks with known tokens may stay cached for reuse."""

    @abstractmethod
    def fork(self, parent: Sequence, child: Sequence) -> None:
        """Give ``child`` the parent's blocks by reference (no copy). ``child`` must hold no blocks."""

    @abstractmethod
    def truncate(self, seq: Sequence, num_tokens: int) -> None:
        """Forget positions ``>= num_tokens`` (speculative rollback); frees blocks that become unused."""

    @abstractmethod
    def commit(self, seq: Sequence) -> None:
        """The KV of ``seq.token_ids[:seq.num_computed_tokens]`` is now computed; full blocks become shareable."""

    @abstractmethod
    def block_table(self, seq: Sequence) -> MutableSequence[int]:
        """Physical block ids of the sequence, in position order; callers only read it. An ``array("i")`` goes
        into a batch's block table as one copy (the shipped caches keep theirs so); a list is converted."""

    @abstractmethod
    def num_blocks_needed(self, num_tokens: int) -> int:
        """Blocks one sequence of ``num_tokens`` tokens needs, ignoring sharing (for admission checks)."""

    @abstractmethod
    def num_free_blocks(self) -> int:
        """Blocks that an allocation could get now, counting evictable cached ones."""

    @abstractmethod
    def take_block_ops(self) -> BlockOps:
        """Return and clear the pending copies/swaps; the runner executes them before the next forward. The
        engine takes what is left after each ``Scheduler.schedule`` (a scheduler may take them first, to put its
        swaps beside them in ``SchedulerOutput.block_ops``)."""

    @abstractmethod
    def stats(self) -> KVStats:
        """A snapshot of usage and prefix-cache counters."""

    def reset_prefix_cache(self) -> bool:
        """Drop every cached block that no live sequence holds (not counted as evictions), so that later requests
        find no earlier prefix: a benchmark run's cold start. Optional: this default cannot and returns False."""
        return False

    def drop_namespace(self, namespace: str) -> bool:
        """Drop every cached block of ``seq.cache_namespace == namespace`` (not counted as evictions), so that no
        later sequence of that namespace matches them: its LoRA adapter was unloaded, and a new one may take its
        name. No live sequence has that namespace. Other namespaces' blocks stay. Optional: this default cannot and
        returns False (the engine then calls ``reset_prefix_cache``, which drops every namespace's)."""
        return False


class EvictionPolicy(ABC):
    """Chooses which unreferenced cached item (block or radix node) to evict first.

    The policy holds only the evictable keys: those inserted and not yet removed or popped. ``touch`` is the one
    method the cache also calls for keys it does not hold.
    """

    @abstractmethod
    def insert(self, key: Hashable, priority: int = 0) -> None:
        """``key`` became evictable. ``priority`` comes from the request's SamplingParams."""

    @abstractmethod
    def touch(self, key: Hashable) -> None:
        """``key`` was reused (a prefix hit); it may stay evictable or be removed right after.

        ``key`` need not be evictable: it may never have been inserted (the paged cache touches a block that another
        sequence still holds; the radix cache touches locked and interior nodes), or it may have been removed or
        popped already. Record the use if the policy tracks uses (a later ``insert`` of the key may count it), but
        never fail and never make the key evictable: ``len()`` does not change.
        """

    @abstractmethod
    def remove(self, key: Hashable) -> None:
        """``key`` is no longer evictable (referenced again, or gone). Unknown keys are an error."""

    @abstractmethod
    def pop(self) -> Hashable:
        """Remove and return the next victim. Raises IndexError when empty. Keep what the policy remembers of
        the key's uses: the cache may evict only part of its content (a radix node's last block) and ``restore``
        the rest; it calls ``forget`` once the content is gone."""

    def restore(self, key: Hashable, priority: int = 0) -> None:
        """``key`` is evictable again without having been used since it was last evictable or touched: the cache
        held it back while other cached items depended on it (a prefix of cached blocks, a radix node with
        children), and the last of them was evicted. Rank it as its last use ranks it, not as a fresh use: a prefix
        is used whenever its descendants are, so it should go soon after them, not outlive newer items.
        Default: ``insert`` (a policy without a memory of uses ranks it as new)."""
        self.insert(key, priority)

    def derive(self, new_key: Hashable, from_key: Hashable) -> None:
        """``new_key`` holds content cut from ``from_key``'s and served every use of it (a radix node split in two:
        the new head served each use of the whole): a policy that counts uses starts ``new_key`` at ``from_key``'s
        count, one that orders by recency at its last use. ``new_key`` is not evictable. Default: nothing."""

    def forget(self, key: Hashable) -> None:
        """``key``'s content is gone for good: evicted after ``pop``, or dropped without it (a paged block whose
        prefix was evicted). A policy that remembers uses of a key beyond ``remove`` drops them, so that new content
        under the same key starts fresh. ``key`` is not evictable here (popped, removed, or never inserted).
        Default: nothing."""

    @abstractmethod
    def __len__(self) -> int:
        """Number of evictable keys."""


def not_evictable(policy: EvictionPolicy, key: object, name: str | None = None) -> PluginError:
    """The error a cache raises when ``policy.pop()`` returns a key it may not evict: trusting it would hand a
    block that a sequence still holds to another one (wrong tokens, no error). ``name``: the policy's registered
    name (``config.eviction_policy``), which the user selected it by."""
    kind = type(policy)
    who = f"{name!r} ({kind.__module__}.{kind.__qualname__})" if name else f"{kind.__module__}.{kind.__qualname__}"
    return PluginError(f"eviction policy {who}: pop() returned {key!r}, which is not evictable (only keys inserted "
                       "and not removed or popped since are); fix the policy's bookkeeping, or choose another with "
                       "--eviction-policy")


# ---------------------------------------------------------------- scheduler
@dataclass
class ScheduledSequence:
    """Compute ``num_new_tokens`` positions of ``seq`` starting at ``seq.num_computed_tokens``."""

    seq: Sequence
    num_new_tokens: int
    draft_token_ids: list[int] = field(default_factory=list)  # speculative tokens to verify, appended after


@dataclass
class SchedulerOutput:
    """One step's plan: the sequences to compute (and how many tokens each), those preempted to make room, and the
    KV block copies and swaps the runner applies before the forward pass."""

    scheduled: list[ScheduledSequence]
    preempted: list[Sequence] = field(default_factory=list)
    block_ops: BlockOps = field(default_factory=BlockOps)

    @property
    def num_tokens(self) -> int:
        return sum(s.num_new_tokens for s in self.scheduled)


class Scheduler(ABC):
    """Decides, each step, which sequences run and how many tokens each computes.

    A scheduler owns these fields of each :class:`~infer.core.request.Sequence` it holds; the engine and the
    metrics read them: ``status`` (RUNNING on admission, PREEMPTED, FINISHED: a request ends when all of its
    sequences are FINISHED), ``finish_reason``, ``num_computed_tokens`` (set from ``KVCache.match_prefix`` on
    admission, 0 when preempted), ``num_cached_tokens`` (the prompt tokens the cache served, set at the first
    admission only: a recompute finding its own blocks is no prompt cache hit) and ``num_preemptions`` (+1 per
    preemption; the KV caches' prefix-hit counters tell recomputes apart by it). Subclassing the shipped
    ``ContinuousScheduler`` keeps all of that.

    ``scheduling_policies`` names the values of ``EngineConfig.scheduling_policy`` (``--scheduling-policy``) that
    the scheduler follows; the engine refuses any other. ``fcfs``: requests in arrival order. ``priority``: by
    ``SamplingParams.priority``, higher first, ties in arrival order. ``lpm``: the longest cached prefix first.
    ``follows_priority_aging``: whether, under ``priority``, it follows ``EngineConfig.priority_aging_s``
    (``--priority-aging-s``): the order of ``arrival_time - priority * priority_aging_s``, earliest first, so a
    request gains a level per that many seconds; the engine refuses the option for a scheduler that does not.
    """

    scheduling_policies: tuple[str, ...] = ("fcfs",)
    follows_priority_aging: bool = False

    @abstractmethod
    def add(self, seq: Sequence) -> None:
        """Queue a validated WAITING sequence. Raises CapacityError if it could never fit in the KV cache."""

    def check(self, seq: Sequence) -> None:
        """Raise CapacityError if ``seq`` (WAITING, not queued) could never run under this scheduler's limits, as
        ``add`` would; queue nothing. The engine calls it to refuse a request before any work (``infer generate
        --stream`` checks every prompt first). Default: accept."""

    @abstractmethod
    def schedule(self) -> SchedulerOutput:
        """Pick this step's work within the token and sequence budgets, allocating KV (preempting if short).

        The engine holds a scheduler to this (a PluginError names it otherwise): something is scheduled whenever
        a sequence waits or runs (an empty schedule would never end), at most ``max_num_seqs`` sequences (forked
        children count: each is a sequence), and each one's KV blocks cover the positions it computes
        (``KVCache.allocate`` first). ``block_ops`` carries swaps the scheduler decided; the KV cache's own
        copy-on-write copies reach the runner either way (the engine takes what the cache still holds)."""

    @abstractmethod
    def update(self, output: SchedulerOutput, sampled: dict[int, list[int]], now: float) -> list[Sequence]:
        """Apply a step: advance computed tokens, append ``sampled[seq_id]``, stop checks; return the sequences it
        finished (FINISHED, with their finish_reason, as ``finish`` does; the engine reads their status).

        ``output`` is what ``schedule`` returned, less the sequences the engine finished in between (a stop found
        in an earlier step's tokens, an abort): every sequence in it is live. For each: add ``num_new_tokens`` to
        ``num_computed_tokens``; append the sampled tokens in order (``Sequence.append_token``), where with
        speculative decoding all but the last are accepted drafts whose KV this step computed, so each of those
        also adds one computed token; stop at the first stop token (``Sequence.check_stop_token``); then call
        ``KVCache.commit(seq)`` before finishing it, else its full blocks never enter the prefix cache. A sequence
        with no entry in ``sampled`` appends nothing: a prompt chunk that does not end its prompt, or the last chunk
        of an embedding request's (``seq.pooling`` set), which samples nothing; the engine finishes that one right
        after this update, through ``finish``.

        With async scheduling a sampled token may be ``PENDING_TOKEN`` (-1, core/runner.py): append it like any
        other; the engine writes the real id in place before the next update and applies its stop check itself.

        Finished sequences have released their KV blocks. The shipped ``ContinuousScheduler``
        (plugins/continuous_scheduler.py) is a complete example.
        """

    @abstractmethod
    def fork(self, parent: Sequence, child: Sequence) -> None:
        """Make ``child`` a RUNNING copy of ``parent`` (token_ids, num_computed_tokens) sharing its KV blocks by
        reference through ``KVCache.fork``; the first write into a shared partial block copies it.

        The engine calls it for an ``n > 1`` request when the first sequence (the only one ``add`` received)
        samples its first token, after ``schedule`` and before ``update`` of that step, once per other sequence;
        it cannot refuse, so admit such a request only with ``params.n`` of ``max_num_seqs`` seats free."""

    @abstractmethod
    def finish(self, seq: Sequence, reason: FinishReason) -> None:
        """Finish (or abort) a sequence now, wherever it is (waiting, running or never added: a child not forked
        yet), and release its blocks: set ``seq.status = FINISHED`` and ``seq.finish_reason = reason`` (the engine
        refuses a scheduler that does not). Idempotent: a finished sequence stays as it was."""

    @abstractmethod
    def has_unfinished(self) -> bool:
        """True while any sequence waits or runs."""

    @abstractmethod
    def num_waiting(self) -> int:
        """Sequences queued (including preempted ones)."""

    @abstractmethod
    def num_running(self) -> int:
        """Sequences holding KV blocks."""

    @property
    @abstractmethod
    def num_preemptions(self) -> int:
        """Preemptions since start."""


# ---------------------------------------------------------------- attention
@dataclass
class AttentionMetadata:
    """Per-step description of a flat batch of ``T`` tokens from ``B`` sequences (prefill and decode mixed).

    Sequence ``i`` contributes tokens ``query_start[i]:query_start[i+1]`` at positions
    ``context_lens[i] - query_lens[i] ... context_lens[i] - 1``; each attends causally to its whole context.
    """

    slot_mapping: torch.Tensor  # [T] int64: block * block_size + offset where each token's K/V is stored
    block_tables: torch.Tensor  # [B, max_blocks] int32, padded with 0
    query_start: torch.Tensor  # [B + 1] int32
    context_lens: torch.Tensor  # [B] int32
    query_lens_cpu: list[int]
    context_lens_cpu: list[int]
    block_size: int
    max_query_len: int
    max_context_len: int
    backend_data: Any = None  # whatever AttentionBackend.prepare returned


class LayerKVCache(tuple):
    """One layer's paged cache. It unpacks as ``(k_cache, v_cache)``, like the plain tuple it extends.

    A quantized (fp8) cache also carries fp32 dequantization scales ``k_scale``/``v_scale`` of shape
    [num_kv_heads]: an element of KV head ``h`` stores ``x / scale[h]`` and reads back as ``stored * scale[h]``.
    They are None for a cache in the model dtype. Read them with :func:`kv_cache_scales`.
    """

    def __new__(cls, k_cache: torch.Tensor, v_cache: torch.Tensor, k_scale: torch.Tensor | None = None,
                v_scale: torch.Tensor | None = None) -> LayerKVCache:
        self = super().__new__(cls, (k_cache, v_cache))
        self.k_scale, self.v_scale = k_scale, v_scale
        return self


def kv_cache_scales(kv_cache: tuple[torch.Tensor, torch.Tensor]) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """``(k_scale, v_scale)`` of a layer's cache; ``(None, None)`` for a plain tuple or an unscaled cache."""
    return getattr(kv_cache, "k_scale", None), getattr(kv_cache, "v_scale", None)


class AttentionBackend(ABC):
    """Stores new K/V into the paged cache and computes attention for a mixed batch."""

    # True when a decode-only forward does no host sync and its shapes do not depend on context lengths, so
    # that the runner may capture it in a CUDA graph (with metadata planned for the longest context).
    supports_cuda_graphs: bool = False
    # True when, beyond that, a mixed batch's forward has shapes that depend only on the token count and the
    # metadata tensors' lengths, and it skips padding: rows of query length 0 and context 0 after the real
    # sequences (stale block tables), tokens after ``query_start[B]`` (slot -1: store nothing; output rows finite,
    # e.g. 0, since a layer may reduce over rows). Then prefill and mixed steps are captured too
    # (``--cuda-graph-max-tokens``).
    supports_mixed_cuda_graphs: bool = False
    # True when forward takes ``window=W`` (an int, only where W < meta.max_context_len): each query token attends
    # to the keys of the last W positions up to its own, itself included (HF's sliding window). A model that slides
    # runs on a backend without it with its context cut to the window.
    supports_sliding_window: bool = False
    # True when forward takes ``softcap=C`` (a positive float): each score (q . k * scale) becomes C * tanh(score / C)
    # before the mask and the softmax (Gemma 2's attn_logit_softcapping). A model that softcaps needs a backend with it.
    supports_softcap: bool = False

    def prepare(self, meta: AttentionMetadata) -> Any:
        """Once per step, before any layer: precompute what every layer shares (indices, masks, splits)."""
        return None

    @abstractmethod
    def forward(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        kv_cache: LayerKVCache,
        meta: AttentionMetadata,
        scale: float,
    ) -> torch.Tensor:
        """q [T, Hq, D], k/v [T, Hkv, D]; write k/v at ``meta.slot_mapping`` into the cache
        ([num_blocks, block_size, Hkv, D] each), then return causal attention output [T, Hq, D] (GQA: Hq % Hkv == 0).
        When the cache is fp8 (``--kv-cache-dtype fp8``), quantize on write and dequantize on read with the scales
        of :func:`kv_cache_scales`; a backend that cannot must raise PluginError in its factory.
        """

    def takes_window(self) -> bool:
        """``supports_sliding_window``, held to ``forward``'s signature: a subclass of a shipped backend that
        overrides forward without a ``window`` parameter (as written before backends had one) inherits the flag but
        cannot take it, so the engine runs it as one without."""
        return self.supports_sliding_window and self._forward_takes("window")

    def takes_softcap(self) -> bool:
        """``supports_softcap``, held to ``forward``'s signature (as :meth:`takes_window`)."""
        return self.supports_softcap and self._forward_takes("softcap")

    def _forward_takes(self, name: str) -> bool:
        parameters = inspect.signature(self.forward).parameters.values()
        return any(p.name == name or p.kind is inspect.Parameter.VAR_KEYWORD for p in parameters)

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kv_cache: LayerKVCache,
               meta: AttentionMetadata, scale: float, window: int | None = None, softcap: float | None = None
               ) -> torch.Tensor:
        """What a model calls: :meth:`forward`, with its output checked against the contract (a tensor of q's
        shape and dtype), so that a backend's wrong output is reported as the backend's, not the model's.
        ``window``: the layer's sliding window, passed on where a context may be longer; ``softcap``: the layer's
        score cap, passed on when set (the engine refuses a softcapping model on a backend without it)."""
        options: dict[str, Any] = {}
        if window is not None and window < meta.max_context_len:
            if not self.supports_sliding_window:
                raise PluginError(f"attention backend {type(self).__name__} has no sliding window (a context of "
                                  f"{meta.max_context_len} tokens, a window of {window}); the engine cuts the "
                                  "context to the window for such a backend, so this is a bug: report it")
            options["window"] = window
        if softcap is not None:
            if not self.supports_softcap:
                raise PluginError(f"attention backend {type(self).__name__} cannot softcap attention scores; the "
                                  "engine refuses a softcapping model on such a backend, so this is a bug: report it")
            options["softcap"] = softcap
        out = self.forward(q, k, v, kv_cache, meta, scale, **options)
        if getattr(out, "shape", None) != q.shape or getattr(out, "dtype", None) != q.dtype:
            got = f"shape {list(out.shape)}, {out.dtype}" if hasattr(out, "dtype") else type(out).__name__
            raise TypeError(f"forward returned {got}; it must return q's shape {list(q.shape)} and dtype {q.dtype}")
        return out


# ---------------------------------------------------------------- quantization
QUANTIZED_TENSOR_NAMES = ("qweight", "qzeros", "scales", "weight_scale", "input_scale", "g_idx", "weight_packed")


def check_float(name: str, tensor: torch.Tensor) -> None:
    """A float parameter takes only 16- or 32-bit float tensors: integer or fp8 data means a quantized layout that
    the quantization_config does not describe."""
    if not tensor.is_floating_point() or tensor.element_size() == 1:
        raise CheckpointError(f"tensor {name!r} is {str(tensor.dtype).removeprefix('torch.')}, where infer expects "
                              "float weights; a quantized checkpoint needs a quantization_config in config.json that "
                              "covers this tensor")


class QuantMethod(ABC):
    """How a linear layer stores and applies its weights. One instance serves all the model's linears: in the
    Llama family each layer's q/k/v/o and gate/up/down projections, and an untied ``lm_head``; a tied lm_head and
    the embedding stay in the model dtype unless ``quantizes_tied_head``. ``name`` appears in load errors (set it
    to the registered name)."""

    name: str = "none"
    # True: a tied lm_head becomes a linear of this method of its own (when applies_to('lm_head')), loaded from the
    # embedding's tensor as "weight"; the embedding keeps its float weight for lookups
    quantizes_tied_head: bool = False

    def applies_to(self, prefix: str) -> bool:
        """Whether the linear at module path ``prefix`` (e.g. 'model.layers.0.mlp.up_proj', 'lm_head') uses this
        method; False gives it an unquantized linear. Default: every linear, the untied lm_head included."""
        return True

    def method_for(self, prefix: str) -> QuantMethod | None:
        """The method of the linear at module path ``prefix``, None for an unquantized linear. Default: this one
        where :meth:`applies_to`. A checkpoint that quantizes its linears by several schemes (GPTQModel's
        ``dynamic`` overrides, compressed-tensors groups of other bits) answers with the method of the linear's
        own scheme: linears of one method class then merge where that class's :meth:`merge` accepts their
        tensors (the same group size, say)."""
        return self if self.applies_to(prefix) else None

    @abstractmethod
    def create_weights(
        self, layer: torch.nn.Module, in_features: int, out_features: int, bias: bool, dtype: torch.dtype
    ) -> None:
        """Register the parameters/buffers the checkpoint will fill (e.g. ``weight`` or ``qweight``) on ``layer``,
        and a ``bias`` of ``out_features`` when ``bias`` is True (a checkpoint tensor with nowhere to go is a
        CheckpointError)."""

    def load_weight(self, layer: torch.nn.Module, name: str, tensor: torch.Tensor) -> None:
        """Copy checkpoint tensor ``name`` (the attribute name) into ``layer``; raise CheckpointError on mismatch."""
        import torch

        target = getattr(layer, name, None)
        where = f"{getattr(layer, 'prefix', 'a linear layer')}.{name}"
        if not isinstance(target, torch.Tensor):
            kind = "an unquantized" if self.name == "none" else f"a {self.name}"
            hint = ("; the checkpoint looks quantized here, but config.json's quantization_config (with its "
                    "modules_to_not_convert, targets or ignore list) does not make this layer quantized"
                    if name in QUANTIZED_TENSOR_NAMES and self.name == "none" else "")
            if hint and where.split(".")[-2] == "lm_head":
                hint = "; the checkpoint's lm_head is quantized, which infer does not load: use one whose head is not"
            raise CheckpointError(f"unexpected tensor {where!r} for {kind} linear layer{hint}")
        if tuple(target.shape) != tuple(tensor.shape):
            raise shape_mismatch(repr(where), tuple(tensor.shape), tuple(target.shape))
        if target.is_floating_point() and target.element_size() > 1:  # copy_ would cast quantized codes silently
            check_float(where, tensor)
        with torch.no_grad():
            target.copy_(tensor)

    def process_after_loading(self, layer: torch.nn.Module) -> None:
        """Repack or quantize after all of the layer's tensors are loaded. On-load quantization may live here, or in
        load_weight as each weight arrives, which keeps the float model from being held whole (the shipped awq and
        fp8 methods do that: quant/common.py ``deferred_weight``)."""

    def merge(self, parts: list[torch.nn.Module], merged: torch.nn.Module) -> bool:
        """Give ``merged`` (a linear layer with no tensors yet; its ``out_features`` the parts' sum) tensors whose
        ``apply`` computes the parts' outputs side by side, in order, with this method; called after every part's
        ``process_after_loading``. Return False, leaving ``merged`` untouched, when the parts cannot be merged
        exactly (the model then keeps them apart). The caller concatenates the biases (activation-dtype tensors
        in every method). The default merges nothing."""
        return False

    @abstractmethod
    def apply(self, layer: torch.nn.Module, x: torch.Tensor) -> torch.Tensor:
        """Return ``x @ W.T (+ bias)`` for x [..., in_features]."""


# ---------------------------------------------------------------- logits processors
@dataclass(frozen=True)
class ProcessorRow:
    """One logits row handed to a :class:`LogitsProcessor`: the sequence it samples the next token of."""

    seq_id: int  # stable while the sequence lives (forked sequences have their own): key per-sequence state by it
    token_ids: list[int]  # the prompt's tokens, then the output's so far (read it, never change it)
    num_prompt_tokens: int
    args: Mapping[str, Any]  # the request's arguments for this processor (JSON values; shared: never change them)


class LogitsProcessor(ABC):
    """Changes the next-token logits of the sequences whose request names it (``SamplingParams.logits_processors``,
    with its arguments), after the logit bias and penalties and before a structured output's mask and sampling.
    Sequences with a processor do not speculate. The logprobs a request returns stay the model's raw ones. A beam
    search that names it (``BeamSearchParams.logits_processors``) hands it a row per live beam holding that beam's
    next-token log-probabilities, as HF's beam search does; its changed rows score the beams' continuations."""

    def check(self, args: Mapping[str, Any]) -> None:
        """Refuse a request's ``args`` (a JSON object) before any work: raise InvalidRequestError saying what is
        wrong and what is allowed. The default accepts any."""

    @abstractmethod
    def apply(self, logits: torch.Tensor, rows: list[ProcessorRow]) -> torch.Tensor:
        """``logits`` [len(rows), V] float32 (row i: the next token of ``rows[i]``) changed by this processor:
        ``logits`` itself, changed in place, or a new tensor of the same shape, dtype and device. A logit of -inf
        bans a token; none may be NaN. Where the processors leave a row no token its other constraints allow, they
        yield for that token (the engine warns)."""

    def release(self, seq_id: int) -> None:
        """The sequence ``seq_id`` finished (a beam: dropped, its prompt done, or its search over): drop any state
        kept for it. The default keeps none."""


# ---------------------------------------------------------------- embeddings
class Pooler(ABC):
    """Pools an embedding request's final hidden states (after the model's last norm) into one vector. A prompt may
    be computed over several steps (chunked prefill; a recompute after preemption), so the pooler folds the rows of
    each step into a running state of its own making, then finishes it. Stateless itself: one instance serves every
    request that names it."""

    reads_every_position: ClassVar[bool] = True  # False: it reads only the prompt's last position (the prefix
    # cache may then serve the others; True computes the whole prompt, as prompt logprobs do)

    @abstractmethod
    def add(self, state: torch.Tensor | None, rows: torch.Tensor, first_position: int) -> torch.Tensor:
        """Fold ``rows`` [n, H] float32, the hidden states of prompt positions ``first_position`` to
        ``first_position + n - 1``, into ``state`` (None before the first rows) and return the new state, a tensor
        on the rows' device (``rows`` are the pooler's to keep). Every position comes once, in order, from 0; with
        ``reads_every_position`` False only the last one comes."""

    @abstractmethod
    def finish(self, state: torch.Tensor, num_positions: int) -> torch.Tensor:
        """The pooled vector, [H'] float32 (H' >= the request's ``dimensions``), from the state after the prompt's
        ``num_positions`` rows (1 for a pooler that reads only the last position); the engine then cuts it to
        ``dimensions`` and L2-normalizes it as the request asks."""


# ---------------------------------------------------------------- speculative decoding
@dataclass
class Proposal:
    """Draft tokens per sequence id, and the draft's probabilities for each ([drafts, vocab]: row j the
    distribution draft j was sampled from; for a sampled request, a row that cannot be one is a PluginError). A
    missing or None entry is a deterministic draft (a point mass on each token, as the ngram proposer's): exact for
    sampled requests too, since rejection sampling then accepts a draft token x with probability p(x)."""

    token_ids: dict[int, list[int]]
    probs: dict[int, torch.Tensor | None] = field(default_factory=dict)


class Proposer(ABC):
    """Proposes up to ``k`` draft tokens per running sequence for the target to verify.

    ``drafts_forced_text`` (a class attribute, default False): True for a proposer that drafts only the text a
    structured-output sequence's grammar forces (``GrammarMatcher.forced_text()``, through ``propose_guided``'s
    guides), as ``jump-forward`` does: only sequences whose grammar forces some text get draft slots, and they
    speculate whatever ``spec_decode.structured`` and ``spec_decode.guided`` say."""

    drafts_forced_text: ClassVar[bool] = False

    @abstractmethod
    def propose(self, seqs: list[Sequence], k: int) -> Proposal:
        """Draft tokens continuing each sequence's ``token_ids``. May propose fewer than k (or none)."""

    def propose_guided(self, seqs: list[Sequence], k: int, guides: dict[int, GrammarMatcher]) -> Proposal | None:
        """``propose``, with the drafts of each sequence in ``guides`` (by seq_id: those under structured output)
        drawn under its grammar: before each draft, the guide's ``allowed()`` masks the proposer's logits (its
        ``probs`` are then the masked, renormalized distribution the draft was drawn from); after it,
        ``advance(token)``. Returns None, the default, when the proposer cannot: the engine then calls ``propose``
        and cuts the drafts after the first one the grammar refuses."""
        return None

    def on_verified(self, seq: Sequence, num_accepted: int) -> None:
        """After verification: roll back any draft state past the accepted tokens."""

    def release(self, seq: Sequence) -> None:
        """The sequence finished or was preempted: drop its state."""


# ---------------------------------------------------------------- models
@dataclass(frozen=True)
class ModelSpec:
    """What the engine must know about a model to size the KV cache and validate requests."""

    num_layers: int
    num_kv_heads: int
    head_dim: int
    vocab_size: int
    max_model_len: int
    eos_token_ids: tuple[int, ...]
    sliding_window: int | None = None  # the smallest window of the layers that slide (None: no layer slides)
    attn_softcap: float | None = None  # attention scores pass through cap * tanh(score / cap) (Gemma 2; None: not)
    graph_blocker: str | None = None  # what keeps CUDA graphs from capturing the forward (a host sync), or None
    # False for a checkpoint without an output head (an embedding model: a bare backbone, or no lm_head.weight and
    # untied embeddings): compute_logits raises, and the engine serves embedding requests only
    has_lm_head: bool = True
    # a sequence classifier's (HF's *ForSequenceClassification, reward models) number of labels: its score head maps
    # a pooled hidden state to that many logits (Model.label_logits), which embedding requests return; None: no head
    num_labels: int | None = None


def __getattr__(name: str) -> Any:
    """``Model`` subclasses ``torch.nn.Module``, so it lives in :mod:`infer.core.model`; importing it from here
    stays possible without making every importer of these interfaces (plugin loading, the CLI) import torch."""
    if name == "Model":
        from .model import Model

        return Model
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
