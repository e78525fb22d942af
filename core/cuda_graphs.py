"""CUDA graphs for decode steps: one graph per batch size of a ladder, replayed with padded static inputs.

A step qualifies when every scheduled sequence decodes one token and the batch fits the largest graph. Padded
rows store nothing (slot -1) and attend to nothing (context length 0). Only the attention backends that declare
``supports_cuda_graphs`` (their decode forward does no host sync and has shapes independent of context length)
are captured.
"""
from __future__ import annotations

import torch

from .interfaces import AttentionBackend, AttentionMetadata, Model

BATCH_LADDER = (1, 2, 4, 8, 16, 24, 32, 48, 64, 96, 128, 160, 192, 224, 256)


class DecodeGraphs:
    def __init__(self, model: Model, attention: AttentionBackend, kv_caches: list[tuple[torch.Tensor, torch.Tensor]],
                 block_size: int, max_batch: int, device: torch.device) -> None:
        self.model, self.attention, self.kv_caches = model, attention, kv_caches
        self.block_size = block_size
        self.max_model_len = model.spec.max_model_len
        self.sizes = [b for b in BATCH_LADDER if b <= max_batch] or [1]
        n, width = self.sizes[-1], -(-self.max_model_len // block_size)
        self.input_ids = torch.zeros(n, dtype=torch.int64, device=device)
        self.positions = torch.zeros(n, dtype=torch.int64, device=device)
        self.slots = torch.full((n,), -1, dtype=torch.int64, device=device)
        self.block_tables = torch.zeros(n, width, dtype=torch.int32, device=device)
        self.context_lens = torch.zeros(n, dtype=torch.int32, device=device)
        self.query_start = torch.arange(n + 1, dtype=torch.int32, device=device)
        self.graphs: dict[int, tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}

    def _meta(self, size: int) -> AttentionMetadata:
        meta = AttentionMetadata(
            slot_mapping=self.slots[:size], block_tables=self.block_tables[:size],
            query_start=self.query_start[: size + 1], context_lens=self.context_lens[:size],
            query_lens_cpu=[1] * size, context_lens_cpu=[self.max_model_len] * size, block_size=self.block_size,
            max_query_len=1, max_context_len=self.max_model_len)
        meta.backend_data = self.attention.prepare(meta)  # planned for the longest context: valid for all
        return meta

    def _forward(self, size: int, meta: AttentionMetadata) -> torch.Tensor:
        hidden = self.model(self.input_ids[:size], self.positions[:size], self.kv_caches, self.attention, meta)
        return self.model.compute_logits(hidden)

    @torch.inference_mode()
    def capture(self) -> None:
        pool = None
        for size in reversed(self.sizes):  # largest first, so smaller graphs reuse its memory pool
            meta = self._meta(size)
            self._forward(size, meta)  # warm up: compiles the Triton kernels outside the capture
            torch.cuda.synchronize()
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=pool):
                logits = self._forward(size, meta)
            pool = graph.pool()
            self.graphs[size] = (graph, logits)
        torch.cuda.synchronize()

    def fits(self, meta: AttentionMetadata, num_tokens: int) -> bool:
        batch = len(meta.query_lens_cpu)
        return meta.max_query_len == 1 and num_tokens == batch and batch <= self.sizes[-1]

    def replay(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        """Logits [B, vocab] of a decode-only batch of B sequences."""
        batch = input_ids.shape[0]
        size = next(s for s in self.sizes if s >= batch)
        width = meta.block_tables.shape[1]
        self.input_ids[:batch].copy_(input_ids, non_blocking=True)
        self.positions[:batch].copy_(positions, non_blocking=True)
        self.slots[:batch].copy_(meta.slot_mapping, non_blocking=True)
        self.slots[batch:size].fill_(-1)
        self.context_lens[:batch].copy_(meta.context_lens, non_blocking=True)
        self.context_lens[batch:size].zero_()
        self.block_tables[:batch, :width].copy_(meta.block_tables, non_blocking=True)
        graph, logits = self.graphs[size]
        graph.replay()
        return logits[:batch]
