"""CUDA graphs for decode and verification steps: one graph per (batch size of a ladder, query length), replayed
with padded static inputs; and for the other steps (prefill chunks, mixed batches) up to a token count, one graph
per token count of a ladder (:class:`MixedGraphs`).

A step qualifies when every scheduled sequence runs the same number of query tokens ``q`` (1 for a decode; K + 1
when speculative decoding verifies K drafts after each sequence's last token), ``q`` was captured, and the batch
fits the largest graph for it. Padded rows store nothing (slot -1); their context is empty for decodes and ``q``
tokens for verification (the prefill kernel needs a context at least as long as the query), read through whatever
valid block ids their rows of the static block table hold from earlier steps; their results are never read. Only
the attention backends that declare ``supports_cuda_graphs`` (their forward does no host sync and has shapes
independent of context length) are captured.
"""
from __future__ import annotations

from collections import Counter
from collections.abc import Callable
from typing import TypeVar

import torch

from .interfaces import AttentionBackend, AttentionMetadata
from .model import Model

BATCH_LADDER = (1, 2, 4, 8, 16, 24, 32, 48, 64, 96, 128, 160, 192, 224, 256)
T = TypeVar("T")


Pool = tuple[int, int]  # a CUDA graph memory pool's handle


def capture_graph(run: Callable[[], T], pool: Pool | None) -> tuple[torch.cuda.CUDAGraph, T, Pool]:
    """Run ``run`` once uncaptured (Triton compiles, allocator growth), then capture it into ``pool`` (a new one
    when None): (graph, the captured run's output, the pool for the next capture)."""
    run()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, pool=pool):
        out = run()
    return graph, out, graph.pool()


def static_meta(attention: AttentionBackend, q: int, slots: torch.Tensor, block_tables: torch.Tensor,
                query_start: torch.Tensor, context_lens: torch.Tensor, max_model_len: int, block_size: int
                ) -> AttentionMetadata:
    """The metadata of a captured step over static buffers: ``q`` query tokens for each row of ``block_tables``
    (a mixed step: at most ``q``), planned by the backend for the longest context, so that the plan is valid for
    any context a replay has."""
    rows = block_tables.shape[0]
    meta = AttentionMetadata(
        slot_mapping=slots, block_tables=block_tables, query_start=query_start, context_lens=context_lens,
        query_lens_cpu=[q] * rows, context_lens_cpu=[max_model_len] * rows, block_size=block_size, max_query_len=q,
        max_context_len=max_model_len)
    meta.backend_data = attention.prepare(meta)
    return meta


class DecodeGraphs:
    """``eager=True`` runs the same padded static-buffer forward pass without capturing it: the padding logic is
    then testable on any device."""

    def __init__(self, model: Model, attention: AttentionBackend, kv_caches: list[tuple[torch.Tensor, torch.Tensor]],
                 block_size: int, max_batch: int, device: torch.device, query_lens: dict[int, int] | None = None,
                 eager: bool = False) -> None:
        """``query_lens``: query length -> largest batch captured for it (default: decodes, up to ``max_batch``)."""
        self.model, self.attention, self.kv_caches = model, attention, kv_caches
        self.block_size, self.eager = block_size, eager
        self.max_model_len = model.spec.max_model_len
        limits = query_lens or {1: max_batch}
        self.sizes = {q: [b for b in BATCH_LADDER if b <= limit] or [1] for q, limit in limits.items()}
        n = max(sizes[-1] for sizes in self.sizes.values())
        tokens = max(q * sizes[-1] for q, sizes in self.sizes.items())
        width = -(-self.max_model_len // block_size)
        self.input_ids = torch.zeros(tokens, dtype=torch.int64, device=device)
        self.positions = torch.zeros(tokens, dtype=torch.int64, device=device)
        self.slots = torch.full((tokens,), -1, dtype=torch.int64, device=device)
        self.block_tables = torch.zeros(n, width, dtype=torch.int32, device=device)
        self.context_lens = torch.zeros(n, dtype=torch.int32, device=device)
        self.query_starts = {q: torch.arange(0, q * (sizes[-1] + 1), q, dtype=torch.int32, device=device)
                             for q, sizes in self.sizes.items()}
        self.graphs: dict[tuple[int, int], tuple[torch.cuda.CUDAGraph | None, torch.Tensor]] = {}
        self.metas: dict[tuple[int, int], AttentionMetadata] = {}
        self.replays: Counter[int] = Counter()  # replays per query length

    def _meta(self, size: int, q: int) -> AttentionMetadata:
        return static_meta(self.attention, q, self.slots[: size * q], self.block_tables[:size],
                           self.query_starts[q][: size + 1], self.context_lens[:size], self.max_model_len,
                           self.block_size)

    def _forward(self, size: int, q: int, meta: AttentionMetadata) -> torch.Tensor:
        tokens = size * q
        hidden = self.model(self.input_ids[:tokens], self.positions[:tokens], self.kv_caches, self.attention, meta)
        return self.model.compute_logits(hidden)

    @torch.inference_mode()
    def capture(self, pool: Pool | None = None) -> Pool | None:
        """Capture every graph (into ``pool``, a graph memory pool, when given); return the pool."""
        for q, sizes in sorted(self.sizes.items()):
            for size in reversed(sizes):  # largest first, so smaller graphs reuse its memory pool
                meta = self.metas[size, q] = self._meta(size, q)
                if self.eager:
                    continue
                self.context_lens[:size].fill_(q)  # the warm-up and capture runs read block 0 (slots are -1)
                graph, logits, pool = capture_graph(lambda: self._forward(size, q, meta), pool)
                self.graphs[size, q] = (graph, logits)
        if not self.eager:
            torch.cuda.synchronize()
        return pool

    def fits(self, meta: AttentionMetadata, num_tokens: int) -> bool:
        batch, q = len(meta.query_lens_cpu), meta.max_query_len
        return q in self.sizes and num_tokens == batch * q and batch <= self.sizes[q][-1]

    def replay(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        """Logits [B * q, vocab] of a batch of B sequences with q query tokens each."""
        q = meta.max_query_len
        batch, tokens = len(meta.query_lens_cpu), input_ids.shape[0]
        size = next(s for s in self.sizes[q] if s >= batch)
        self.replays[q] += 1
        width = meta.block_tables.shape[1]
        self.input_ids[:tokens].copy_(input_ids, non_blocking=True)
        self.positions[:tokens].copy_(positions, non_blocking=True)
        self.slots[:tokens].copy_(meta.slot_mapping, non_blocking=True)
        self.slots[tokens : size * q].fill_(-1)
        self.context_lens[:batch].copy_(meta.context_lens, non_blocking=True)
        self.context_lens[batch:size].fill_(0 if q == 1 else q)
        self.block_tables[:batch, :width].copy_(meta.block_tables, non_blocking=True)
        if self.eager:
            return self._forward(size, q, self.metas[size, q])[:tokens]
        graph, logits = self.graphs[size, q]
        graph.replay()
        return logits[:tokens]


def mixed_token_sizes(max_tokens: int) -> list[int]:
    """The token counts :class:`MixedGraphs` captures: 16 to 128 by doubling, then multiples of 256, then
    ``max_tokens`` itself (a step is padded to the next, so padding stays under 256 tokens)."""
    ladder = [16, 32, 64, 128, *range(256, max_tokens, 256)]
    return [t for t in ladder if t < max_tokens] + [max_tokens]


class MixedGraphs:
    """Graphs for steps of any shape up to ``max_tokens`` tokens (prefill chunks, prefills beside decodes): one per
    token count of :func:`mixed_token_sizes`, for up to ``min(tokens, max_rows)`` sequences. A step is padded to the
    next token count: its sequences, then rows of query length 0 and context 0; its tokens, then tokens that store
    nothing (slot -1) and that no sequence owns. The hidden states are returned; the runner computes the logits of
    the sampling rows eagerly. Only for backends that declare ``supports_mixed_cuda_graphs``. ``eager=True`` runs
    the padded forward pass uncaptured (tests on any device)."""

    def __init__(self, model: Model, attention: AttentionBackend, kv_caches: list[tuple[torch.Tensor, torch.Tensor]],
                 block_size: int, max_tokens: int, max_rows: int, device: torch.device, eager: bool = False) -> None:
        self.model, self.attention, self.kv_caches = model, attention, kv_caches
        self.block_size, self.eager, self.max_rows = block_size, eager, max_rows
        self.max_model_len = model.spec.max_model_len
        self.sizes = mixed_token_sizes(max_tokens)
        rows = self.rows(max_tokens)
        self.input_ids = torch.zeros(max_tokens, dtype=torch.int64, device=device)
        self.positions = torch.zeros(max_tokens, dtype=torch.int64, device=device)
        self.slots = torch.full((max_tokens,), -1, dtype=torch.int64, device=device)
        self.block_tables = torch.zeros(rows, -(-self.max_model_len // block_size), dtype=torch.int32, device=device)
        self.query_start = torch.zeros(rows + 1, dtype=torch.int32, device=device)
        self.context_lens = torch.zeros(rows, dtype=torch.int32, device=device)
        self.graphs: dict[int, tuple[torch.cuda.CUDAGraph | None, torch.Tensor | None]] = {}
        self.metas: dict[int, AttentionMetadata] = {}
        self.replays = 0

    def rows(self, tokens: int) -> int:
        return min(tokens, self.max_rows)  # each sequence of a step has a token at least

    def _forward(self, size: int) -> torch.Tensor:
        return self.model(self.input_ids[:size], self.positions[:size], self.kv_caches, self.attention,
                          self.metas[size])

    @torch.inference_mode()
    def capture(self, pool: Pool | None = None) -> Pool | None:
        """Capture every graph (into ``pool`` when given; largest first, so the smaller ones reuse its memory)."""
        for size in reversed(self.sizes):
            rows = self.rows(size)
            self.metas[size] = static_meta(self.attention, size, self.slots[:size], self.block_tables[:rows],
                                           self.query_start[: rows + 1], self.context_lens[:rows],
                                           self.max_model_len, self.block_size)
            if self.eager:
                self.graphs[size] = (None, None)
                continue
            # warm-up and capture: every row has query length 0, so attention computes nothing
            graph, hidden, pool = capture_graph(lambda: self._forward(size), pool)
            self.graphs[size] = (graph, hidden)
        if not self.eager:
            torch.cuda.synchronize()
        return pool

    def fits(self, meta: AttentionMetadata, num_tokens: int) -> bool:
        return num_tokens <= self.sizes[-1] and len(meta.query_lens_cpu) <= self.rows(num_tokens)

    def replay(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        """Final hidden states [T, hidden] of the step's T tokens."""
        tokens, batch = input_ids.shape[0], len(meta.query_lens_cpu)
        size = next(s for s in self.sizes if s >= tokens)
        rows = self.rows(size)
        self.replays += 1
        self.input_ids[:tokens].copy_(input_ids, non_blocking=True)
        self.positions[:tokens].copy_(positions, non_blocking=True)
        self.slots[:tokens].copy_(meta.slot_mapping, non_blocking=True)
        self.slots[tokens:size].fill_(-1)
        self.query_start[: batch + 1].copy_(meta.query_start, non_blocking=True)
        self.query_start[batch + 1 : rows + 1].fill_(tokens)
        self.context_lens[:batch].copy_(meta.context_lens, non_blocking=True)
        self.context_lens[batch:rows].fill_(0)
        self.block_tables[:batch, : meta.block_tables.shape[1]].copy_(meta.block_tables, non_blocking=True)
        graph, hidden = self.graphs[size]
        if graph is None or hidden is None:
            return self._forward(size)[:tokens]
        graph.replay()
        return hidden[:tokens]
