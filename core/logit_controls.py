"""Per-request logit controls, applied before sampling to the rows of the requests that ask for them.

- ``repetition_penalty`` r (HF transformers' and vLLM's rule, CTRL, arXiv 1909.05858): every token that occurs in the
  prompt or the output has its logit divided by r where positive, multiplied by r where negative.
- ``frequency_penalty`` f and ``presence_penalty`` p (OpenAI's rule): ``logit[t] -= f * c[t] + p * (c[t] > 0)``,
  c[t] the number of times t occurs in the output so far.
- ``min_tokens`` m: while fewer than m tokens are out, EOS and the stop_token_ids cannot be sampled.

The logprobs a request returns stay those of the model's raw distribution (the Sampler reads the raw logits).
"""
from __future__ import annotations

import torch

from .request import Sequence


def controlled_logits(logits: torch.Tensor, seqs: list[Sequence]) -> torch.Tensor | None:
    """``logits`` [len(seqs), V] float32 with each row's controls applied (a new tensor), or None when no row has
    any. Row i belongs to ``seqs[i]``, whose ``token_ids`` must be complete (no token in flight)."""
    rows = [i for i, seq in enumerate(seqs) if seq.params.controls_logits]
    if not rows:
        return None
    out = logits.clone()
    vocab, device = logits.shape[1], logits.device
    for i in rows:
        seq, params = seqs[i], seqs[i].params
        row = out[i]
        if params.repetition_penalty != 1.0:
            seen = torch.tensor(sorted({t for t in seq.token_ids if t < vocab}), dtype=torch.long, device=device)
            picked = row[seen]
            row[seen] = torch.where(picked > 0, picked / params.repetition_penalty,
                                    picked * params.repetition_penalty)
        if params.frequency_penalty or params.presence_penalty:
            outputs = torch.tensor(seq.token_ids[seq.num_prompt_tokens:], dtype=torch.long, device=device)
            counts = torch.bincount(outputs[outputs < vocab], minlength=vocab).to(row.dtype)
            row -= params.frequency_penalty * counts + params.presence_penalty * (counts > 0).to(row.dtype)
        if seq.num_output_tokens < params.min_tokens:
            stops = seq.params.stop_token_ids + (() if params.ignore_eos else tuple(seq.eos_token_ids))
            banned = [t for t in stops if t < vocab]
            if banned:
                row[torch.tensor(banned, dtype=torch.long, device=device)] = float("-inf")
    return out
