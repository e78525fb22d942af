"""ModelRunner: owns the KV tensors; turns a SchedulerOutput into flat batch tensors, runs the model, samples."""
from __future__ import annotations

import array
import logging
import time
from collections.abc import Callable, MutableSequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from .errors import ConfigError, PluginError
from .interfaces import AttentionBackend, AttentionMetadata, BlockOps, KVCache, LayerKVCache, SchedulerOutput
from .logit_controls import LogitControls
from .logits_processors import LogitsProcessors
from .model import Model
from .pooling import PoolRows, collect_pooled, pool_rows
from .prompt_logprobs import PromptRows, collect, prompt_rows
from .request import FinishReason, SamplingParams, Sequence
from .sampling import PendingSample, Sampler, SampleResult, to_device
from .staging import Uploader
from .structured_output import StructuredOutputs

if TYPE_CHECKING:
    from ..models.lora import LoraStack
    from .cuda_graphs import DecodeGraphs, MixedGraphs

log = logging.getLogger("infer")


PENDING_TOKEN = -1  # async scheduling: a sampled token not read back yet, in Sequence.token_ids


@dataclass
class PendingInputs:
    """The previous step's sampled tokens, on the device, for sequences whose last token is still PENDING_TOKEN."""

    tokens: torch.Tensor  # [rows] device token ids
    row_of: dict[int, int]  # seq_id -> row in ``tokens``

    def locate(self, out: SchedulerOutput, query_start: list[int], tokens: list[int]) -> tuple[list[int], list[int]]:
        """(batch positions holding PENDING_TOKEN, the rows of ``tokens`` that fill them)."""
        at, source = [], []
        for item, first in zip(out.scheduled, query_start):
            seq, row = item.seq, self.row_of.get(item.seq.seq_id)
            start, last = seq.num_computed_tokens, seq.num_tokens - 1
            if row is not None and start <= last < start + item.num_new_tokens and seq.token_ids[last] == PENDING_TOKEN:
                at.append(first + last - start)
                source.append(row)
        if tokens.count(PENDING_TOKEN) != len(at):  # only a sequence's last token is ever pending
            raise AssertionError("a pending token outside the last position of a sequence in flight")
        return at, source


@dataclass
class InFlight:
    """Async scheduling: a step's sampled tokens on their way back, and where each goes."""

    sample: PendingSample
    seqs: list[Sequence]  # one per sampled row
    indices: list[int]  # each sequence's PENDING_TOKEN position in its token_ids

    @property
    def inputs(self) -> PendingInputs:
        return PendingInputs(self.sample.device_tokens, {seq.seq_id: row for row, seq in enumerate(self.seqs)})

    def read_back(self, finish: Callable[[Sequence, FinishReason], None]) -> list[Sequence]:
        """Wait for the tokens and write them into their sequences' PENDING places (with their times and
        logprobs); ``finish`` the sequences whose token stops them. Returns the sequences (their outputs are due)."""
        result = self.sample.result()
        now = time.perf_counter()  # when the tokens exist on the host, for TTFT and TPOT
        note_unsampleable(result, self.seqs)
        for seq, index, token, entry in zip(self.seqs, self.indices, result.token_ids, result.logprobs):
            if index >= len(seq.token_ids) or seq.token_ids[index] != PENDING_TOKEN:
                continue  # read by an earlier, interrupted call; or never placed (an interrupted update)
            seq.token_ids[index] = token
            seq.token_times[index - seq.num_prompt_tokens] = now
            if index == seq.num_prompt_tokens:
                seq.first_token_time = now
            if entry is not None:
                seq.logprobs.append(entry)
            if seq.stop_reason(token, index + 1) is FinishReason.STOP:
                if not seq.is_finished:
                    finish(seq, FinishReason.STOP)
                elif seq.finish_reason is FinishReason.LENGTH:  # its last allowed token is a stop token
                    seq.finish_reason = FinishReason.STOP
        return self.seqs


@dataclass
class Batch:
    input_ids: torch.Tensor  # [T]
    positions: torch.Tensor  # [T]
    meta: AttentionMetadata
    sample_rows: torch.Tensor  # [S + D] indices into T: the last real token of each sampling sequence, then drafts
    sample_seq_ids: list[int]
    draft_counts: list[int]  # [S] draft tokens verified after each sampling sequence's last real token (D in all)
    lora_slots: torch.Tensor | None = None  # [T] each token's LoRA adapter slot (-1: none), when adapters are loaded
    lora_in_use: frozenset[int] = frozenset()  # the adapter slots its tokens use

    @property
    def every_row_samples(self) -> bool:
        """sample_rows is 0..T-1 (one increasing sampling row per token, no drafts): the logits need no gather."""
        return len(self.sample_seq_ids) == self.input_ids.shape[0] and not any(self.draft_counts)


def add_slots(slots: list[int], table: MutableSequence[int], start: int, end: int, size: int) -> None:
    """Append the KV slots of positions ``start`` to ``end`` - 1 (blocks of ``size`` in ``table``): one range per
    block, not a computation per position. IndexError where the table is too short."""
    for b in range(start // size, -(-end // size)):
        base = table[b] * size - b * size  # position p of block b is slot base + p
        slots.extend(range(base + max(start, b * size), base + min(end, b * size + size)))


def note_unsampleable(result: SampleResult, seqs: list[Sequence]) -> None:
    """Count the steps in which a sequence's logits row had no token to sample, and warn at the first: its token
    (argmax picks 0) and what follows are meaningless, and the other rows of the step are unaffected. Warn too at
    the first step in which its logits processors yielded (they banned every token its other constraints allow)."""
    for row in result.yielded:
        seq = seqs[row]
        seq.processors_yielded_steps += 1
        if seq.processors_yielded_steps == 1:
            log.warning("request %s (sequence %d): its logits processors (%s) banned every token its other "
                        "constraints (a structured output, min_tokens) allow, so this token, and any other where "
                        "that happens, is sampled without them", seq.request_id, seq.seq_id,
                        ", ".join(name for name, _ in seq.params.logits_processors))
    for row in result.unsampleable:
        note_no_token(seqs[row])


def note_no_token(seq: Sequence) -> None:
    """Count a step in which ``seq``'s logits had no token to sample (a NaN, or every logit -inf), and warn at the
    first."""
    seq.unsampleable_steps += 1
    if seq.unsampleable_steps == 1:
        log.warning("request %s (sequence %d): its logits hold NaN or are all -inf, so it has no token to "
                    "sample and its output from here on is meaningless; the forward pass overflowed or a "
                    "component broke. A float16 model may overflow: try --dtype bfloat16 or float32; else the "
                    "attention backend, quantization method, model, LoRA adapter or a logits processor in use "
                    "computes NaN", seq.request_id, seq.seq_id)


@dataclass(frozen=True)
class Culprits:
    """Who a schedule the runner cannot build a batch from is blamed on: its scheduler and KV cache, each as
    ``"scheduler 'name' from 'package'"`` (the engine's; a draft model's runner keeps the defaults)."""

    scheduler: str = "the scheduler"
    kv_cache: str = "the KV cache"

    def unallocated(self, out: SchedulerOutput, kv: KVCache) -> PluginError:
        """The error for a schedule whose sequence computes positions its KV blocks do not cover."""
        for item in out.scheduled:
            seq, end = item.seq, item.seq.num_computed_tokens + item.num_new_tokens + len(item.draft_token_ids)
            held = len(kv.block_table(seq)) * kv.block_size
            if held < end:
                return PluginError(f"{self.scheduler} (with {self.kv_cache}) scheduled sequence {seq.seq_id} of "
                                   f"request {seq.request_id} to compute positions up to {end}, but its block table "
                                   f"covers {held}: a scheduler must KVCache.allocate before it schedules, and a KV "
                                   "cache's block_table must cover what allocate accepted; fix the plugin")
        return PluginError(f"a block table lookup failed while building the batch ({self.kv_cache} returned a bad "
                           "table); fix the plugin")

    def outside(self, out: SchedulerOutput, kv: KVCache, num_blocks: int) -> PluginError:
        """The error for a block table holding an id outside the pool ``[0, num_blocks)``."""
        for item in out.scheduled:
            bad = [block for block in kv.block_table(item.seq) if not 0 <= block < num_blocks]
            if bad:
                return PluginError(f"{self.kv_cache}: the block table of sequence {item.seq.seq_id} holds block id "
                                   f"{bad[0]}, outside the pool's [0, {num_blocks}) (the attention kernels would "
                                   "read and write other memory); fix the plugin")
        return PluginError(f"{self.kv_cache} returned a block id outside the pool's [0, {num_blocks}); fix the plugin")


class ModelRunner:
    def __init__(self, model: Model, attention: AttentionBackend, num_blocks: int, block_size: int,
                 dtype: torch.dtype, device: torch.device, seed: int, num_swap_blocks: int = 0,
                 kv_dtype: torch.dtype | None = None, kv_scales: list[tuple[torch.Tensor, torch.Tensor]] | None = None,
                 culprits: Culprits = Culprits()) -> None:
        """``kv_dtype`` is the cache element dtype (default: ``dtype``); an fp8 cache needs ``kv_scales``, one
        (k_scale, v_scale) pair of fp32 [num_kv_heads] per layer, kept next to the cache tensors. ``culprits``:
        whom a bad schedule or block table is blamed on."""
        self.model, self.attention = model, attention
        self.block_size, self.device, self.num_blocks, self.culprits = block_size, device, num_blocks, culprits
        spec = model.spec
        shape = (num_blocks, block_size, spec.num_kv_heads, spec.head_dim)
        dtype = kv_dtype or dtype
        if dtype.itemsize == 1 and (kv_scales is None or len(kv_scales) != spec.num_layers):
            raise ValueError(f"a {dtype} KV cache needs (k_scale, v_scale) for each of the {spec.num_layers} layers")
        scales = [(k.to(device, torch.float32), v.to(device, torch.float32)) for k, v in kv_scales or ()] \
            if dtype.itemsize == 1 else [(None, None)] * spec.num_layers
        self._pin = device.type == "cuda"
        host_shape = (num_swap_blocks, *shape[1:])
        try:
            self.kv_caches = [
                LayerKVCache(torch.zeros(shape, dtype=dtype, device=device),
                             torch.zeros(shape, dtype=dtype, device=device), k_scale, v_scale)
                for k_scale, v_scale in scales
            ]
            self.host_caches = [  # empty: a swap-in reads only what a swap-out wrote, and untouched pages cost nothing
                (torch.empty(host_shape, dtype=dtype, pin_memory=self._pin),
                 torch.empty(host_shape, dtype=dtype, pin_memory=self._pin))
                for _ in range(spec.num_layers if num_swap_blocks else 0)
            ]
        except (RuntimeError, MemoryError) as exc:  # out of device or host memory
            raise ConfigError(f"could not allocate the KV cache ({num_blocks} blocks on {device}, {num_swap_blocks} "
                              f"swap blocks on the host): {str(exc).splitlines()[0]}; lower --num-kv-blocks or "
                              "--kv-cache-memory-gb (or --swap-space-gb)") from exc
        self.sampler = Sampler(device, seed)
        self.controls = LogitControls(device)
        self.structured: StructuredOutputs | None = None  # the engine's, when it has a structured-output backend
        self.processors: LogitsProcessors | None = None  # the engine's: the logits processors requests name
        self.uploader = Uploader(device)
        self.graphs: DecodeGraphs | None = None
        self.mixed_graphs: MixedGraphs | None = None
        self.lora: LoraStack | None = None  # with LoRA adapters (models/lora.py, core/lora.py)
        self._rows: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}  # advance: B -> (query_start, sample_rows)

    @staticmethod
    def bytes_per_block(model: Model, block_size: int, dtype: torch.dtype) -> int:
        spec = model.spec
        return 2 * spec.num_layers * block_size * spec.num_kv_heads * spec.head_dim * dtype.itemsize

    def prepare(self, out: SchedulerOutput, kv: KVCache, pending: PendingInputs | None = None) -> Batch:
        """The batch tensors of ``out``. With ``pending``, a sequence's last token may be PENDING_TOKEN: its id is
        taken on the device from the previous step's sampled tokens (async scheduling)."""
        tokens: list[int] = []
        positions: list[int] = []
        slots: list[int] = []
        query_start = [0]
        context_lens: list[int] = []
        tables: list[list[int]] = []
        sample_rows: list[int] = []
        sample_seq_ids: list[int] = []
        draft_rows: list[int] = []
        draft_counts: list[int] = []
        size = self.block_size
        try:  # a block table too short for the positions scheduled fails its lookup (IndexError)
            for item in out.scheduled:
                seq, n, drafts = item.seq, item.num_new_tokens, item.draft_token_ids
                start = seq.num_computed_tokens
                table = kv.block_table(seq)
                tables.append(table)
                if n == 1 and not drafts and start + 1 == seq.num_tokens:  # a plain decode: the loop below, unrolled
                    tokens.append(seq.token_ids[start])
                    positions.append(start)
                    slots.append(table[start // size] * size + start % size)
                    sample_rows.append(query_start[-1])
                    query_start.append(query_start[-1] + 1)
                    context_lens.append(start + 1)
                    sample_seq_ids.append(seq.seq_id)
                    draft_counts.append(0)
                    continue
                end = start + n + len(drafts)  # speculative verification: the drafts follow the real tokens
                tokens.extend(seq.token_ids[start : start + n])
                tokens.extend(drafts)
                positions.extend(range(start, end))
                add_slots(slots, table, start, end, size)
                query_start.append(query_start[-1] + end - start)
                context_lens.append(end)
                if start + n == seq.num_tokens:
                    sample_rows.append(query_start[-1] - 1 - len(drafts))
                    sample_seq_ids.append(seq.seq_id)
                    draft_rows.extend(range(query_start[-1] - len(drafts), query_start[-1]))
                    draft_counts.append(len(drafts))
        except IndexError:
            raise self.culprits.unallocated(out, kv) from None
        width = max(map(len, tables))
        flat = array.array("i", bytes(4 * width * len(tables)))  # the block tables, zero-padded to [B, width]
        for row, table in enumerate(tables):
            start = row * width
            flat[start : start + len(table)] = table if type(table) is array.array and table.typecode == "i" \
                else array.array("i", table)
        lowest, highest = torch.frombuffer(flat, dtype=torch.int32).aminmax()
        if lowest < 0 or highest >= self.num_blocks:
            raise self.culprits.outside(out, kv, self.num_blocks)
        query_lens = [b - a for a, b in zip(query_start, query_start[1:])]
        lora_slots, lora_in_use = self._lora_slots(out, query_lens) if self.lora is not None else (None, frozenset())
        fill_at, fill_from = pending.locate(out, query_start, tokens) if pending is not None else ([], [])
        # one transfer: array.array + one copy, where torch.tensor(list) converts element by element (3-4x slower)
        uploaded = self.uploader.upload([
            (array.array("q", tokens), torch.int64), (array.array("q", positions), torch.int64),
            (array.array("q", slots), torch.int64), (array.array("q", sample_rows + draft_rows), torch.int64),
            (array.array("i", flat), torch.int32), (array.array("i", query_start), torch.int32),
            (array.array("i", context_lens), torch.int32), (array.array("q", fill_at), torch.int64),
            (array.array("q", fill_from), torch.int64), *([] if lora_slots is None else [(lora_slots, torch.int64)])])
        input_ids, positions_t, slot_mapping, rows, block_tables, query_start_t, context_lens_t, at, source = \
            uploaded[:9]
        if fill_at:
            assert pending is not None
            input_ids[at] = pending.tokens[source]
        meta = AttentionMetadata(
            slot_mapping=slot_mapping,
            block_tables=block_tables.view(len(tables), width),
            query_start=query_start_t,
            context_lens=context_lens_t,
            query_lens_cpu=query_lens,
            context_lens_cpu=context_lens,
            block_size=size,
            max_query_len=max(query_lens),
            max_context_len=max(context_lens),
        )
        meta.backend_data = self.attention.prepare(meta)
        return Batch(input_ids, positions_t, meta, rows, sample_seq_ids, draft_counts,
                     uploaded[9] if lora_slots is not None else None, lora_in_use)

    def _lora_slots(self, out: SchedulerOutput, query_lens: list[int]) -> tuple[array.array[int], frozenset[int]]:
        """Each token's LoRA adapter slot (-1: the base model), sequence by sequence as the batch lists them, and
        the slots in use."""
        assert self.lora is not None
        slots, in_use = array.array("q"), set()
        for item, count in zip(out.scheduled, query_lens):
            name = item.seq.params.lora_adapter
            slot = -1 if name is None else self.lora.tokens.slot_of[name]
            slots.extend([slot] * count)
            in_use.add(slot)
        return slots, frozenset(in_use - {-1})

    def apply_block_ops(self, ops: BlockOps) -> None:
        """Swap-outs, then swap-ins, then copy-on-write copies, as BlockOps orders them."""
        for pairs, outward in ((ops.swap_out, True), (ops.swap_in, False)):
            if not pairs:
                continue
            src = torch.tensor([a for a, _ in pairs])
            dst = torch.tensor([b for _, b in pairs])
            for device_kv, host_kv in zip(self.kv_caches, self.host_caches):
                for dev, host in zip(device_kv, host_kv):
                    dev, host = _as_bytes(dev), _as_bytes(host)  # fp8 index_put is missing on some torch builds
                    if outward:
                        host[dst] = dev[src.to(dev.device)].to("cpu", non_blocking=False)
                    else:
                        dev[dst.to(dev.device)] = host[src].to(dev.device, non_blocking=True)
        if ops.copies:
            src = to_device([s for s, _ in ops.copies], self.device)  # no wait for the device's queued work
            dst = to_device([d for _, d in ops.copies], self.device)
            for k_cache, v_cache in self.kv_caches:
                for cache in (k_cache, v_cache):
                    raw = _as_bytes(cache)
                    raw[dst] = raw[src]

    @torch.inference_mode()
    def execute(self, out: SchedulerOutput, kv: KVCache, pending: PendingInputs | None = None,
                prompt_logprobs: str | None = None, pooling: str | None = None) -> tuple[Batch, torch.Tensor]:
        """Run the forward pass; return the batch and the float32 logits of its sampling rows. ``pending`` fills
        PENDING_TOKEN ids (async scheduling). With ``prompt_logprobs`` (the KV cache's name, some request may
        ask for them), the sequences that collect prompt logprobs get this step's entries; with ``pooling`` (the
        same, some request may be an embedding's), embedding requests pool this step's hidden states."""
        self.apply_block_ops(out.block_ops)
        batch = self.prepare(out, kv, pending)
        found = prompt_rows(out, batch.meta.query_lens_cpu, prompt_logprobs) if prompt_logprobs else None
        pooled = pool_rows(out, batch.meta.query_lens_cpu, pooling) if pooling else None
        return batch, self.run(batch, found, pooled)

    @torch.inference_mode()
    def run(self, batch: Batch, prompt: PromptRows | None = None, pooled: PoolRows | None = None) -> torch.Tensor:
        """The forward pass of a prepared batch: float32 logits of its sampling rows (from a CUDA graph, maybe its
        output buffer itself, which the next replay overwrites: sample from it before the next ``run``); the
        ``prompt`` rows' logprobs go to their sequences, the ``pooled`` rows' hidden states to theirs."""
        num_tokens, rows = batch.input_ids.shape[0], None if batch.every_row_samples else batch.sample_rows
        if self.lora is not None:
            assert batch.lora_slots is not None, "a batch built without LoRA slots, on a runner with adapters"
            self.lora.tokens.set(batch.lora_slots, batch.lora_in_use)
        if self.graphs is not None and pooled is None and self.graphs.fits(batch.meta, num_tokens):  # logits only
            logits = self.graphs.replay(batch.input_ids, batch.positions, batch.meta)  # every row's
            if prompt is not None:
                collect(prompt, lambda part: logits[part.to(logits.device)])
            return logits if rows is None else logits[rows]  # the graph's buffer: the sampler reads it at once
        if self.mixed_graphs is not None and self.mixed_graphs.fits(batch.meta, num_tokens):
            hidden = self.mixed_graphs.replay(batch.input_ids, batch.positions, batch.meta)
        else:
            hidden = self.model(batch.input_ids, batch.positions, self.kv_caches, self.attention, batch.meta)
        if prompt is not None:
            collect(prompt, lambda part: self.model.compute_logits(hidden[part.to(hidden.device)]))
        if pooled is not None:
            collect_pooled(pooled, hidden)
        if not self.model.spec.has_lm_head:  # an embedding model's engine samples no row: no logits to compute
            return hidden.new_empty((num_tokens if rows is None else rows.shape[0], 0), dtype=torch.float32)
        return self.model.compute_logits(hidden if rows is None else hidden[rows])

    def advance(self, batch: Batch, next_ids: torch.Tensor) -> Batch:
        """The decode step after ``batch``: each sequence's sampled token ``next_ids[i]`` at the position after its
        last, computed on the device from ``batch`` (no per-sequence host work, no upload). The KV slots must be
        allocated already, in blocks that ``batch``'s block tables list (a draft round reserves them all first)."""
        meta, size = batch.meta, self.block_size
        positions = batch.positions[batch.sample_rows] + 1
        slots = meta.block_tables.gather(1, (positions // size).unsqueeze(1)).squeeze(1).long() * size \
            + positions % size
        rows = len(meta.query_lens_cpu)
        if rows not in self._rows:  # one token per sequence: query starts 0..B, sampling rows 0..B-1
            start = torch.arange(rows + 1, dtype=torch.int32, device=self.device)
            self._rows[rows] = start, start[:rows].long()
        query_start, sample_rows = self._rows[rows]
        lens = [n + 1 for n in meta.context_lens_cpu]
        step = AttentionMetadata(slot_mapping=slots, block_tables=meta.block_tables, query_start=query_start,
                                 context_lens=meta.context_lens + 1, query_lens_cpu=[1] * rows, context_lens_cpu=lens,
                                 block_size=size, max_query_len=1, max_context_len=meta.max_context_len + 1)
        step.backend_data = self.attention.prepare(step)
        lora_slots = None if batch.lora_slots is None else batch.lora_slots[batch.sample_rows]
        return Batch(next_ids, positions, step, sample_rows, batch.sample_seq_ids, [0] * rows, lora_slots,
                     batch.lora_in_use)

    def enable_cuda_graphs(self, max_batch: int, query_lens: dict[int, int] | None = None, eager: bool = False,
                           mixed_tokens: int = 0, mixed_rows: int = 0) -> None:
        """Capture graphs for decode steps of up to ``max_batch`` sequences and, in ``query_lens`` (query length ->
        largest batch), for steps whose sequences all run that many query tokens (speculative verification); with
        ``mixed_tokens``, for any other step of up to that many tokens and ``mixed_rows`` sequences (the backend
        must support mixed graphs). ``eager`` runs the padded forward pass without capturing (tests on any device).
        A model without an LM head gets no decode graphs (they compute logits), only the mixed ones."""
        from .cuda_graphs import DecodeGraphs, MixedGraphs

        pool, self.mixed_graphs = None, None
        if self.lora is not None:
            self.lora.tokens.prepare_capture(max(max_batch * max({1, *(query_lens or {})}), mixed_tokens))
        if mixed_tokens and not self.attention.supports_mixed_cuda_graphs:
            raise PluginError(f"attention backend {type(self.attention).__name__} does not support CUDA graphs of "
                              "mixed steps; use --cuda-graph-max-tokens 0")
        try:
            if mixed_tokens:
                self.mixed_graphs = MixedGraphs(self.model, self.attention, self.kv_caches, self.block_size,
                                                mixed_tokens, mixed_rows or max_batch, self.device, eager=eager)
                pool = self.mixed_graphs.capture()  # first: the largest activations, which the decode graphs reuse
            if not self.model.spec.has_lm_head:
                self.graphs = None
                log.info("CUDA graphs: none for decode steps, which compute logits, and this model has no LM head "
                         "(it serves embeddings)%s", "; mixed steps replay theirs" if mixed_tokens else "")
                return
            self.graphs = DecodeGraphs(self.model, self.attention, self.kv_caches, self.block_size, max_batch,
                                       self.device, {1: max_batch, **(query_lens or {})}, eager=eager)
            self.graphs.capture(pool)
        except torch.OutOfMemoryError as exc:
            self.graphs = self.mixed_graphs = None
            raise ConfigError(f"out of device memory while capturing CUDA graphs (decode steps of up to {max_batch} "
                              f"sequences{f', mixed steps of up to {mixed_tokens} tokens' if mixed_tokens else ''}); "
                              "leave more memory outside the KV pool (a lower --kv-cache-memory-gb), or capture "
                              "less: a lower --cuda-graph-max-tokens or --max-num-seqs, or --no-cuda-graphs") from exc

    def sample(self, logits: torch.Tensor, seqs: list[Sequence]) -> SampleResult:
        """One token per logits row; row i belongs to ``seqs[i]`` (a row may repeat for forked sequences), whose
        logit controls (penalties, min_tokens), logits processors and structured output apply to its row."""
        result = self.sample_pending(logits, seqs).result()
        note_unsampleable(result, seqs)
        return result

    def sample_pending(self, logits: torch.Tensor, seqs: list[Sequence]) -> PendingSample:
        """``sample`` without waiting for the device (async scheduling reads the tokens a step later)."""
        controlled = self.controls.apply(logits, seqs)
        base = logits if controlled is None else controlled
        processed = self.processors.apply(base, seqs) if self.processors is not None else None
        masked = self.structured.apply(base if processed is None else processed, seqs) \
            if self.structured is not None else None
        final = masked if masked is not None else processed if processed is not None else controlled
        yielded = None
        if processed is not None:  # processors yield where they leave a row no token (a grammar forcing a repeat)
            assert final is not None
            final, yielded = self._yield_where_no_token(final, base, masked is not None, seqs)
        pending = self.sampler.sample_pending(logits, *self._sampling_args(seqs), final, yielded)
        self.controls.record(pending.device_tokens, seqs)
        return pending

    def _yield_where_no_token(self, final: torch.Tensor, base: torch.Tensor, structured: bool,
                              seqs: list[Sequence]) -> tuple[torch.Tensor, torch.Tensor]:
        """``final`` with the rows where the processors left no token (every logit -inf or NaN) that the logits
        without them have (``base``, masked by the structured outputs if ``structured``) taken from those, and
        which rows those are [rows] bool."""
        if final.device.type == "cpu":  # reading the rows' maxima back costs nothing here
            top = final.amax(dim=-1)  # NaN where any logit is
            if bool((top > float("-inf")).all()):  # every row has a token: none yields, no full-size pass
                return final, torch.zeros(len(seqs), dtype=torch.bool)
        plain = base if not structured else self.structured.apply(base, seqs)
        assert plain is not None
        yielded = ~(final > float("-inf")).any(dim=-1) & (plain > float("-inf")).any(dim=-1)
        return torch.where(yielded[:, None], plain, final), yielded

    def _sampling_args(self, seqs: list[Sequence]) -> tuple[list[SamplingParams], list[torch.Generator | None]]:
        params = [s.params for s in seqs]
        generators = [None] * len(seqs) if all(p.greedy for p in params) else [  # greedy rows draw nothing
            None if s.params.seed is None else self.sampler.generator_for(s.seq_id, s.params.seed, s.index)
            for s in seqs
        ]
        return params, generators


def _as_bytes(cache: torch.Tensor) -> torch.Tensor:
    """One-byte (fp8) caches as raw bytes, for indexing: fp8 index_put is missing on some torch builds."""
    return cache.view(torch.uint8) if cache.element_size() == 1 else cache
