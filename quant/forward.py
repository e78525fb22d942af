"""Cache-free forward passes over whole sequences, for calibration: no paged KV, plain causal attention."""
from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from ..core.interfaces import AttentionBackend, AttentionMetadata
from ..core.model import Model
from ..plugins.torch_attention import attention, sliding_mask

KVObserver = Callable[[int, torch.Tensor, torch.Tensor], None]  # (layer index, k [T, Hkv, D], v [T, Hkv, D])


@dataclass
class _LayerCounter:
    next_layer: int = 0


class DenseCausalAttention(AttentionBackend):
    """Causal attention for fresh prefills (each sequence's queries are its whole context); the KV cache is unused.

    ``observe(layer, k, v)`` sees every layer's new K/V, layers in call order (the model's layer order).
    """

    supports_sliding_window = True
    supports_softcap = True

    def __init__(self, observe: KVObserver | None = None) -> None:
        self.observe = observe

    def prepare(self, meta: AttentionMetadata) -> _LayerCounter:
        return _LayerCounter()

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kv_cache: tuple[torch.Tensor, torch.Tensor],
                meta: AttentionMetadata, scale: float, window: int | None = None, softcap: float | None = None
                ) -> torch.Tensor:
        counter: _LayerCounter = meta.backend_data
        if self.observe is not None:
            self.observe(counter.next_layer, k, v)
        counter.next_layer += 1
        out = torch.empty_like(q)
        starts = meta.query_start.tolist()
        for start, end in zip(starts, starts[1:]):
            qs, ks, vs = (t[start:end].transpose(0, 1).unsqueeze(0) for t in (q, k, v))  # [1, H, n, D]
            n = end - start
            mask = sliding_mask(n, n, window, q.device) if window is not None and window < n else None
            res = attention(qs, ks, vs, mask, scale, softcap)
            out[start:end] = res[0].transpose(0, 1)
        return out


@torch.inference_mode()
def dense_forward(model: Model, samples: Sequence[Sequence[int]], device: torch.device,
                  observe: KVObserver | None = None) -> torch.Tensor:
    """Final hidden states [sum of lengths, hidden] of ``samples`` (token id lists), each a fresh sequence."""
    lengths = [len(s) for s in samples]
    if not lengths or min(lengths) < 1:
        raise ValueError("dense_forward needs at least one non-empty sample")
    ids = torch.tensor([t for s in samples for t in s], dtype=torch.int64, device=device)
    positions = torch.cat([torch.arange(n, device=device) for n in lengths])
    query_start = torch.tensor([0, *lengths], dtype=torch.int32, device=device).cumsum(0, dtype=torch.int32)
    none = torch.zeros(0, dtype=torch.int64, device=device)
    meta = AttentionMetadata(
        slot_mapping=none, block_tables=none.view(0, 0).int(), query_start=query_start,
        context_lens=torch.tensor(lengths, dtype=torch.int32, device=device), query_lens_cpu=lengths,
        context_lens_cpu=lengths, block_size=1, max_query_len=max(lengths), max_context_len=max(lengths))
    attention = DenseCausalAttention(observe)
    meta.backend_data = attention.prepare(meta)
    placeholders = [(none, none)] * model.spec.num_layers  # never read: this backend keeps no cache
    return model(ids, positions, placeholders, attention, meta)
