"""CUDA graphs of whole greedy draft rounds: the draft model's k steps in one replay.

In a steady-state round every shadow runs two query tokens first (the new tail; see ``DraftModelProposer._reserve``)
and then k - 1 one-token steps, each fed the previous step's argmax on the device. A small draft's steps are
host-bound on a GPU (launching a step costs more than the kernels it queues), so one replay of the round replaces k
forward launches, k argmaxes and k - 1 batch advances. A graph is captured per batch size of the ladder, for one k;
a round of another shape (a new shadow's prefill, a request that samples, a shorter k near the context's end) takes
the step-by-step path. Padded rows store nothing (slot -1), attend to two keys of block 0 in the first step and to
none after it, and their tokens are never read.
"""
from __future__ import annotations

import torch

from ..core.cuda_graphs import BATCH_LADDER, capture_graph, static_meta
from ..core.interfaces import AttentionBackend, AttentionMetadata
from ..core.model import Model
from ..core.runner import Batch


class DraftRoundGraphs:
    """``eager=True`` runs the same static-buffer round without capturing it (the padding is testable on a CPU)."""

    def __init__(self, model: Model, attention: AttentionBackend, kv_caches: list[tuple[torch.Tensor, torch.Tensor]],
                 block_size: int, max_batch: int, k: int, device: torch.device, eager: bool = False) -> None:
        self.model, self.attention, self.kv_caches = model, attention, kv_caches
        self.block_size, self.k, self.eager = block_size, k, eager
        self.max_model_len = model.spec.max_model_len
        self.sizes = [b for b in BATCH_LADDER if b <= max_batch] or [1]
        n = self.sizes[-1]
        self.input_ids = torch.zeros(2 * n, dtype=torch.int64, device=device)
        self.positions = torch.zeros(2 * n, dtype=torch.int64, device=device)
        self.slots = torch.full((2 * n,), -1, dtype=torch.int64, device=device)
        self.block_tables = torch.zeros(n, -(-self.max_model_len // block_size), dtype=torch.int32, device=device)
        self.context_lens = torch.zeros(n, dtype=torch.int32, device=device)  # of the first step
        self.live = torch.zeros(n, dtype=torch.bool, device=device)  # rows below the batch size
        self.query_starts = {q: torch.arange(0, q * (n + 1), q, dtype=torch.int32, device=device) for q in (1, 2)}
        self.graphs: dict[int, tuple[torch.cuda.CUDAGraph | None, torch.Tensor]] = {}
        self.replays = 0

    def fits(self, batch: Batch) -> bool:
        """Whether ``batch`` (a round's first step) is a steady-state round this object can replay."""
        meta = batch.meta
        return len(meta.query_lens_cpu) <= self.sizes[-1] and all(q == 2 for q in meta.query_lens_cpu)

    def _meta(self, size: int, q: int, slots: torch.Tensor, context_lens: torch.Tensor) -> AttentionMetadata:
        return static_meta(self.attention, q, slots, self.block_tables[:size], self.query_starts[q][: size + 1],
                           context_lens, self.max_model_len, self.block_size)

    def _round(self, size: int) -> torch.Tensor:
        """The round over the static buffers' first ``size`` rows: draft tokens [size, k]."""
        meta = self._meta(size, 2, self.slots[: 2 * size], self.context_lens[:size])
        hidden = self.model(self.input_ids[: 2 * size], self.positions[: 2 * size], self.kv_caches, self.attention,
                            meta)
        tokens = self.model.compute_logits(hidden[1::2]).argmax(dim=-1)  # each sequence's last query row
        steps = [tokens]
        last, live, size_ = self.positions[1 : 2 * size : 2], self.live[:size], self.block_size
        for step in range(1, self.k):
            positions = last + step
            slots = self.block_tables[:size].gather(1, (positions // size_).unsqueeze(1)).squeeze(1).long() * size_ \
                + positions % size_
            lens = torch.where(live, self.context_lens[:size] + step, 0).to(torch.int32)
            meta = self._meta(size, 1, torch.where(live, slots, -1), lens)
            hidden = self.model(tokens, positions, self.kv_caches, self.attention, meta)
            tokens = self.model.compute_logits(hidden).argmax(dim=-1)
            steps.append(tokens)
        return torch.stack(steps, dim=1)

    @torch.inference_mode()
    def capture(self) -> None:
        if self.eager:
            return
        pool = None
        for size in reversed(self.sizes):  # largest first, so smaller graphs reuse its memory pool
            self.context_lens[:size].fill_(2)  # warm-up and capture read block 0 and store nothing (slots -1)
            self.live[:size].fill_(False)
            graph, out, pool = capture_graph(lambda: self._round(size), pool)
            self.graphs[size] = (graph, out)
        torch.cuda.synchronize()

    @torch.inference_mode()
    def run(self, batch: Batch) -> torch.Tensor:
        """Draft tokens [B, k] of a round whose first step is ``batch`` (each of its B sequences runs two query
        tokens, with KV reserved for all k steps), still on the device."""
        meta = batch.meta
        rows = len(meta.query_lens_cpu)
        size = next(s for s in self.sizes if s >= rows)
        self.replays += 1
        self.input_ids[: 2 * rows].copy_(batch.input_ids, non_blocking=True)
        self.positions[: 2 * rows].copy_(batch.positions, non_blocking=True)
        self.positions[2 * rows : 2 * size].fill_(0)  # padded rows' later positions stay inside the block table
        self.slots[: 2 * rows].copy_(meta.slot_mapping, non_blocking=True)
        self.slots[2 * rows : 2 * size].fill_(-1)
        self.context_lens[:rows].copy_(meta.context_lens, non_blocking=True)
        self.context_lens[rows:size].fill_(2)
        self.live[:rows].fill_(True)
        self.live[rows:size].fill_(False)
        self.block_tables[:rows, : meta.block_tables.shape[1]].copy_(meta.block_tables, non_blocking=True)
        if self.eager:
            return self._round(size)[:rows]
        graph, out = self.graphs[size]
        assert graph is not None
        graph.replay()
        return out[:rows]
