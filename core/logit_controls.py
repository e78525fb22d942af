"""Per-request logit controls, applied before sampling to the rows of the requests that ask for them.

- ``repetition_penalty`` r (HF transformers' and vLLM's rule, CTRL, arXiv 1909.05858): every token that occurs in the
  prompt or the output has its logit divided by r where positive, multiplied by r where negative.
- ``frequency_penalty`` f and ``presence_penalty`` p (OpenAI's rule): ``logit[t] -= f * c[t] + p * (c[t] > 0)``,
  c[t] the number of times t occurs in the output so far.
- ``min_tokens`` m: while fewer than m tokens are out, EOS and the stop_token_ids cannot be sampled.
- ``logit_bias`` (OpenAI's): each listed token's bias is added to its logit, before the penalties.

The logprobs a request returns stay those of the model's raw distribution (the Sampler reads the raw logits).
"""
from __future__ import annotations

import torch

from .request import SamplingParams, Sequence


def controls_now(seq: Sequence) -> bool:
    """Whether ``seq``'s next token is sampled under a control: a penalty or a logit bias (all along), or
    min_tokens not reached (tokens in flight count as reached). Such a sequence does not speculate."""
    return seq.params.controls_every_token or seq.num_output_tokens < seq.params.min_tokens


class LogitControls:
    """Each penalized sequence keeps a row of two device tables while it lives: the tokens of its prompt (a mask)
    and the counts of its output tokens, which :meth:`record` updates on the device from the sampled ids, so
    nothing waits for tokens in flight (async scheduling) and a step costs a fixed number of batched tensor ops,
    whatever the number of controlled rows and their lengths."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.slots: dict[int, int] = {}  # seq_id -> its row of the tables
        self.free: list[int] = []
        self.prompt_mask = torch.zeros(0, 0, dtype=torch.bool, device=device)
        self.counts = torch.zeros(0, 0, device=device)

    def release(self, seq_id: int) -> None:
        if (slot := self.slots.pop(seq_id, None)) is not None:
            self.free.append(slot)

    def apply(self, logits: torch.Tensor, seqs: list[Sequence]) -> torch.Tensor | None:
        """``logits`` [len(seqs), V] float32 with each row's controls applied (a new tensor), or None when no row
        has any. Row i belongs to ``seqs[i]``; the tokens it sampled so far were recorded (:meth:`record`)."""
        rows = [i for i, seq in enumerate(seqs) if controls_now(seq)]
        if not rows:
            return None
        vocab = logits.shape[1]
        at_rows = torch.tensor(rows, device=self.device)
        picked = logits[at_rows]
        params = [seqs[i].params for i in rows]
        # the bias first, then the penalties, as HF's processor list and vLLM order them
        if biased := [(row, token, bias) for row, p in enumerate(params) for token, bias in p.logit_bias
                      if token < vocab]:
            at = torch.tensor([(row, token) for row, token, _ in biased], device=self.device)
            picked = picked.index_put((at[:, 0], at[:, 1]),
                                      torch.tensor([float(bias) for _, _, bias in biased], device=self.device),
                                      accumulate=True)
        penalized = [j for j, p in enumerate(params) if p.penalizes]
        if len(penalized) == len(rows):
            picked = self._penalize(picked, [seqs[i] for i in rows], params, vocab)
        elif penalized:  # min_tokens rows beside them: only the penalized ones take table rows
            at = torch.tensor(penalized, device=self.device)
            part = self._penalize(picked[at], [seqs[rows[j]] for j in penalized], [params[j] for j in penalized],
                                  vocab)
            picked = picked.index_copy(0, at, part)
        if any(p.min_tokens for p in params):
            banned = [(row, token) for row, seq in enumerate(seqs[i] for i in rows)
                      if seq.num_output_tokens < seq.params.min_tokens
                      for token in (*seq.params.stop_token_ids, *(() if seq.params.ignore_eos else seq.eos_token_ids))
                      if token < vocab]
            if banned:
                at = torch.tensor(banned, device=self.device)
                picked = picked.index_put((at[:, 0], at[:, 1]), torch.tensor(float("-inf"), device=self.device))
        if len(rows) == len(seqs):  # every row controlled: picked is the whole batch, in order
            return picked
        out = logits.clone()
        out[at_rows] = picked
        return out

    def _penalize(self, logits: torch.Tensor, seqs: list[Sequence], params: list[SamplingParams], vocab: int
                  ) -> torch.Tensor:
        """The penalties of ``seqs`` (each penalizes) on their rows ``logits``; a factor of 1 or 0 is an exact
        no-op, so rows with only some of the penalties share the ops."""
        index = torch.tensor([self._slot(seq, vocab) for seq in seqs], device=self.device)
        counts = self.counts[index]
        present = counts > 0
        if any(p.repetition_penalty != 1.0 for p in params):
            r = self._column([p.repetition_penalty for p in params])
            seen = self.prompt_mask[index] | present
            logits = torch.where(seen, torch.where(logits > 0, logits / r, logits * r), logits)
        if any(p.frequency_penalty or p.presence_penalty for p in params):
            frequency = self._column([p.frequency_penalty for p in params])
            presence = self._column([p.presence_penalty for p in params])
            logits = logits - (frequency * counts + presence * present.to(counts.dtype))
        return logits

    def _column(self, values: list[float]) -> torch.Tensor:
        return torch.tensor(values, dtype=torch.float32, device=self.device)[:, None]

    def record(self, tokens: torch.Tensor, seqs: list[Sequence]) -> None:
        """Count the tokens just sampled (``tokens`` [len(seqs)] on the device, row i ``seqs[i]``'s) of the
        sequences that have a row (penalized ones, from their first sample on)."""
        if not self.slots:
            return
        rows = [(i, slot) for i, seq in enumerate(seqs) if (slot := self.slots.get(seq.seq_id)) is not None]
        if rows:
            at = torch.tensor(rows, device=self.device)
            self.counts.index_put_((at[:, 1], tokens[at[:, 0]].long()), torch.ones(len(rows), device=self.device),
                                   accumulate=True)

    def _slot(self, seq: Sequence, vocab: int) -> int:
        """The sequence's row, taken at its first sample (its output is empty then, its counts zero)."""
        slot = self.slots.get(seq.seq_id)
        if slot is None:
            if not self.free:
                self._grow(vocab)
            slot = self.slots[seq.seq_id] = self.free.pop()
            self.counts[slot] = 0
            self.prompt_mask[slot] = False
            prompt = [t for t in seq.prompt_token_ids if t < vocab]
            self.prompt_mask[slot, torch.tensor(prompt, dtype=torch.long, device=self.device)] = True
        return slot

    def _grow(self, vocab: int) -> None:
        """Twice the rows (at least 8), keeping the rows in use."""
        old = self.counts.shape[0]
        new = max(8, 2 * old)
        counts = torch.zeros(new, vocab, device=self.device)
        mask = torch.zeros(new, vocab, dtype=torch.bool, device=self.device)
        if old:
            counts[:old], mask[:old] = self.counts, self.prompt_mask
        self.counts, self.prompt_mask = counts, mask
        self.free.extend(range(new - 1, old - 1, -1))
