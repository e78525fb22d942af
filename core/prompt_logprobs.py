"""Prompt logprobs: the log-probability of each prompt token given the tokens before it, read from the logits of
the position before it while the prompt is computed (prefill chunks included), with the top-n at that position.

Row ``j`` of a sequence's prompt (absolute position ``j``) predicts prompt token ``j + 1``; the last prompt position
predicts the first output token, which the sampler's own logprobs cover. A sequence collects its entries in order
(``Sequence.prompt_logprobs``), so a recompute after preemption computes again only what it has not collected.
"""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from .errors import PluginError
from .interfaces import SchedulerOutput
from .request import Sequence
from .sampling import logprob_entries, top_logprobs

ROWS_PER_SLICE = 256  # logits of at most this many prompt rows exist at once ([rows, vocabulary] float32)


@dataclass
class PromptRows:
    """The batch rows whose logits give prompt logprobs, and whose they are."""

    rows: list[int]  # indices into the batch's tokens
    targets: list[int]  # the prompt token each row predicts
    widths: list[int]  # the top entries each row's owner asked for
    owners: list[tuple[Sequence, int]]  # (sequence, its number of rows), in row order


def prompt_rows(out: SchedulerOutput, query_lens: list[int], kv_cache: str) -> PromptRows | None:
    """The rows of ``out``'s batch (whose items hold ``query_lens`` tokens each, in order) that sequences still
    collecting prompt logprobs need; None if there are none. ``kv_cache`` names the cache a bad match is blamed on."""
    rows: list[int] = []
    targets: list[int] = []
    widths: list[int] = []
    owners: list[tuple[Sequence, int]] = []
    offset = 0
    for item, length in zip(out.scheduled, query_lens):
        seq = item.seq
        if seq.collects_prompt_logprobs:
            start, need = seq.num_computed_tokens, len(seq.prompt_logprobs) - 1  # the next position to read
            if start > need:
                raise PluginError(f"KV cache {kv_cache!r} served positions {need}-{start - 1} of sequence "
                                  f"{seq.seq_id} from its prefix cache, but the request asks for prompt logprobs, "
                                  "which need their logits: match_prefix must match nothing for a sequence whose "
                                  "needs_prompt_logits is true; fix the plugin")
            end = min(start + item.num_new_tokens, seq.num_prompt_tokens - 1)
            if end > need:
                rows.extend(range(offset + need - start, offset + end - start))
                targets.extend(seq.prompt_token_ids[need + 1 : end + 1])
                widths += [seq.params.prompt_logprobs or 0] * (end - need)
                owners.append((seq, end - need))
        offset += length
    return PromptRows(rows, targets, widths, owners) if rows else None


def collect(found: PromptRows, logits_of: Callable[[torch.Tensor], torch.Tensor]) -> None:
    """Append each owner's entries; ``logits_of(rows)`` gives the float32 logits of batch rows (an index tensor).
    The entries are read back at once: a step with prompt logprobs waits for its device work."""
    row_index = torch.tensor(found.rows, dtype=torch.long)
    targets = torch.tensor(found.targets, dtype=torch.long)
    width = max(found.widths)
    entries: list[dict[int, float] | None] = []
    for first in range(0, len(found.rows), ROWS_PER_SLICE):
        part = slice(first, first + ROWS_PER_SLICE)
        logits = logits_of(row_index[part])
        top = top_logprobs(logits, targets[part].to(logits.device), width)
        size = logits.shape[0]
        entries += logprob_entries(list(range(size)), found.widths[part], size, [t.tolist() for t in top],
                                   found.targets[part])
    at = 0
    for seq, count in found.owners:
        seq.prompt_logprobs += entries[at : at + count]
        at += count
