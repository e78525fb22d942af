"""SpecDecoder: speculative decoding inside continuous batching, driven by ``Engine.step``.

One step: ``propose`` gives each decoding sequence up to K draft tokens and reserves target KV slots for them; the
engine's forward pass then verifies them in the same flat batch as the prefills and plain decodes (a verified
sequence contributes its last real token plus its drafts, K + 1 query positions, and K + 1 logits rows); ``verify``
runs the vectorized rejection sampler over those rows, rolls the rejected positions back in the target's KV (the
proposer rolls back its own), and returns each sequence's accepted drafts plus one token for the scheduler to append.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from ..core.config import EngineConfig
from ..core.errors import PluginError
from ..core.interfaces import GrammarMatcher, KVCache, Proposal, Proposer, SchedulerOutput, ScheduledSequence
from ..core.logit_controls import controls_now
from ..core.metrics import EngineStats, StepStats
from ..core.plugin_options import read_plugin_options
from ..core.request import RequestOutput, Sequence
from ..core.runner import Batch, note_no_token
from ..core.sampling import Sampler, stream_seed, to_device
from ..core.structured_output import StructuredOutputs
from .policy import ON, SPEC_DECODE_OPTIONS, SpecPolicy
from .rejection import Verified, describe_improper, greedy_accept, improper_drafts, rejection_sample


VERIFY_SEED_SALT = 0x7E51_F1ED  # verification draws must not replay the sampler's or the draft's streams


@dataclass
class _Draft:
    seq: Sequence
    tokens: list[int]
    probs: torch.Tensor | None  # [len(tokens), V] the draft's distributions; None: a point mass on each token
    states: list[GrammarMatcher] | None = None  # structured output: the matcher at each verified position


class SpecDecoder:
    """Owns the proposer, the degradation policy and this step's drafts; counts into ``EngineStats``."""

    def __init__(self, config: EngineConfig, proposer: Proposer, kv: KVCache, sampler: Sampler,
                 stats: EngineStats, vocab_size: int, structured: StructuredOutputs) -> None:
        self.k = config.num_speculative_tokens
        self.structured = structured  # the engine's: masks each position a structured sequence's drafts reach
        options = read_plugin_options(config, "spec_decode", SPEC_DECODE_OPTIONS)
        # guided drafts: only from a proposer that takes guides (else copying matchers for it is wasted)
        self.forced_only = proposer.drafts_forced_text
        self.structured_drafts = options["structured"] or self.forced_only
        self.guided = (options["guided"] or self.forced_only) and \
            type(proposer).propose_guided is not Proposer.propose_guided
        self.proposer_name, self.vocab_size = config.proposer, vocab_size
        self.token_budget = config.max_num_batched_tokens
        self.proposer, self.kv, self.sampler, self.stats = proposer, kv, sampler, stats
        self.policy = SpecPolicy.from_config(config)
        self.stats.spec_state = ON  # in force until the policy decides otherwise ("off" would say no proposer)
        self.drafts: dict[int, _Draft] = {}  # this step's, by seq_id
        self.round_generators: dict[int, torch.Generator] = {}  # seeded requests' verification draws, by seq_id
        self.step_counts = (0, 0)  # this step's (proposed, accepted)

    # ------------------------------------------------------------ before the forward pass
    def propose(self, out: SchedulerOutput) -> None:
        """Attach draft tokens to the decoding items of ``out`` and reserve their KV slots."""
        self.drafts.clear()
        self.step_counts = (0, 0)
        for seq in out.preempted:
            self.proposer.release(seq)
        if not any(self._room(item) for item in out.scheduled):  # nothing could draft (prefills, say): the step
            return  # is in no state, and no probe of the low-acceptance rule is spent on it (stops at the first)
        state = self.policy.decide(len(out.scheduled))
        self.stats.spec_state = state
        self.stats.spec_steps[state] = self.stats.spec_steps.get(state, 0) + 1
        if state != ON:
            return
        budget = self.token_budget - out.num_tokens
        room: dict[int, int] = {}
        for item in out.scheduled:
            k = min(self._room(item), budget)
            if k > 0 and self.kv.allocate(item.seq, 1 + k):  # slots for the drafts after the last real token
                room[item.seq.seq_id] = k
                budget -= k
        if not room:
            return
        items = [item for item in out.scheduled if item.seq.seq_id in room]
        try:
            proposal = self._proposal([item.seq for item in items], max(room.values()))
            self._check_proposal(proposal, items, max(room.values()))
        except BaseException:  # a proposer that raised, or broke the contract (Ctrl-C too)
            for item in items:  # give back every reserved draft slot: the step fails
                self.kv.truncate(item.seq, item.seq.num_computed_tokens + 1)
            raise
        for item in items:
            seq = item.seq
            tokens = proposal.token_ids.get(seq.seq_id, [])[: room[seq.seq_id]]
            states = None
            if tokens and seq.params.structured_output is not None:  # none after a draft the grammar refuses
                walk = self.structured.walk_drafts(seq, tokens)
                tokens, states = tokens[: walk.verified], walk.states
                self.stats.spec_grammar_refused += walk.refused
            if len(tokens) < room[seq.seq_id]:  # give back the slots of drafts not proposed
                self.kv.truncate(seq, seq.num_computed_tokens + 1 + len(tokens))
            if tokens:
                probs = proposal.probs.get(seq.seq_id)
                item.draft_token_ids = tokens
                self.drafts[seq.seq_id] = _Draft(seq, tokens, None if probs is None else probs[: len(tokens)], states)
        out.block_ops.copies.extend(self.kv.take_block_ops().copies)

    def _proposal(self, seqs: list[Sequence], k: int) -> Proposal:
        """The proposer's drafts: under the grammar (``propose_guided``) for structured sequences where it can."""
        guides = {seq.seq_id: self.structured.draft_guide(seq) for seq in seqs
                  if seq.params.structured_output is not None} if self.guided else {}
        proposal = self.proposer.propose_guided(seqs, k, guides) if guides else None
        return self.proposer.propose(seqs, k) if proposal is None else proposal

    def _check_proposal(self, proposal: Any, items: list[ScheduledSequence], k: int) -> None:
        """PluginError for a proposal that breaks the Proposer contract: a bad token id would index past the
        embedding (on CUDA a device assert that ends the process), bad probabilities would bias the sampling."""
        where = f"proposer {self.proposer_name!r}"
        if not isinstance(proposal, Proposal):
            raise PluginError(f"{where}: propose() returned {type(proposal).__name__}, not a Proposal; fix the plugin")
        for item in items:
            seq_id = item.seq.seq_id
            tokens = proposal.token_ids.get(seq_id, [])
            if not isinstance(tokens, list) or len(tokens) > k or \
                    not all(type(t) is int and 0 <= t < self.vocab_size for t in tokens):
                raise PluginError(f"{where} proposed {tokens!r} for sequence {seq_id}: drafts are a list of at most "
                                  f"k={k} token ids in [0, {self.vocab_size}); fix the plugin")
            probs = proposal.probs.get(seq_id)
            if probs is not None and tokens and (not isinstance(probs, torch.Tensor) or probs.dim() != 2
                                                 or probs.shape[0] < len(tokens) or probs.shape[1] != self.vocab_size):
                shape = tuple(probs.shape) if isinstance(probs, torch.Tensor) else type(probs).__name__
                raise PluginError(f"{where} gave probabilities of shape {shape} for {len(tokens)} draft(s) of "
                                  f"sequence {seq_id}; they must be [>= {len(tokens)}, {self.vocab_size}] (one "
                                  "distribution over the vocabulary per draft); fix the plugin")

    def _room(self, item: ScheduledSequence) -> int:
        """Drafts worth verifying for a plain decode: the emitted tokens (accepted + 1) must fit max_tokens and
        the context; for a proposer of forced text, only where the grammar forces some."""
        seq = item.seq
        decoding = item.num_new_tokens == 1 and seq.num_computed_tokens + 1 == seq.num_tokens
        if not decoding or seq.num_output_tokens == 0 or not seq.params.speculative or controls_now(seq) or \
                seq.params.logits_processors or \
                self.forced_only and seq.params.structured_output is None or \
                seq.params.structured_output is not None and not (self.structured_drafts and (
                    self.structured.in_content(seq) and self.structured.can_walk_drafts(seq))):
            return 0
        if self.forced_only and not self.structured.forced_text(seq):  # no slot for a draft that will not come
            return 0
        left = min(seq.params.max_tokens - seq.num_output_tokens, seq.max_model_len - seq.num_tokens)
        return min(self.k, left - 1)

    # ------------------------------------------------------------ after the forward pass
    def forget(self, seq_ids: set[int]) -> None:
        """Drop this step's drafts of sequences that finished after proposing (async output's stop strings)."""
        for seq_id in seq_ids:
            self.drafts.pop(seq_id, None)

    def verify(self, batch: Batch, logits: torch.Tensor) -> dict[int, list[int]]:
        """Tokens to append per verified seq_id: its accepted drafts, then a recovered or bonus token.

        ``logits`` rows follow ``batch.sample_rows``: one per sampling sequence, then every draft position.
        """
        if not self.drafts:
            return {}
        num_sampling = len(batch.sample_seq_ids)
        starts, offset = {}, num_sampling
        for sid, count in zip(batch.sample_seq_ids, batch.draft_counts):
            starts[sid], offset = offset, offset + count
        order = [(i, self.drafts[sid]) for i, sid in enumerate(batch.sample_seq_ids) if sid in self.drafts]
        drafts = [d for _, d in order]
        # structured drafts: masks built now, while the forward pass runs on the device
        masks = {b: self.structured.masks(d.states) for b, d in enumerate(drafts) if d.states is not None}
        argmax_rows = logits.argmax(dim=-1)
        if masks:
            self._masked_argmax(logits, argmax_rows, order, starts, masks)
        # the greedy rule reads one argmax per row, all in one transfer, with whether the row holds a NaN
        argmax, nan = torch.stack([argmax_rows, logits.isnan().any(dim=-1).long()]).tolist()
        accepted, next_tokens = [], []
        for i, d in order:
            first = starts[d.seq.seq_id]
            if nan[i] or any(nan[first : first + len(d.tokens)]):
                note_no_token(d.seq)
            m, token = greedy_accept(d.tokens, [argmax[i], *argmax[first : first + len(d.tokens)]])
            accepted.append(m)
            next_tokens.append(token)
        if all(d.seq.params.greedy and d.seq.params.logprobs is None for d in drafts):
            return self._finish_round(drafts, None, accepted, next_tokens)
        k = max(len(d.tokens) for d in drafts)
        # rows of each sequence: its last real token, then its drafts; short rows repeat their last row
        index = torch.tensor([[i] + [starts[d.seq.seq_id] + min(j, len(d.tokens) - 1) for j in range(k)]
                              for i, d in order], device=logits.device)
        target = logits[index]  # [B, K+1, V]: rejection sampling (a copy, masked in place)
        raw = target.clone() if any(drafts[b].seq.params.logprobs is not None for b in masks) else target
        for b, mask in masks.items():  # as a plain step masks the row it samples: refused drafts are rejected
            target[b, : len(mask)].masked_fill_(~mask, float("-inf"))
        sampled_rows = [b for b, d in enumerate(drafts) if not d.seq.params.greedy]
        if sampled_rows:
            draft = torch.tensor([d.tokens + [0] * (k - len(d.tokens)) for d in drafts], device=logits.device)
            counts = torch.tensor([len(d.tokens) for d in drafts], device=logits.device)
            exact, improper = self._rejection_sample(target, draft, counts, [drafts[b] for b in sampled_rows],
                                                     sampled_rows)
            num_accepted, tokens, bad = torch.stack([exact.num_accepted, exact.next_token, improper.long()]).tolist()
            if any(bad):
                self._refuse_probs([drafts[b] for b, is_bad in zip(sampled_rows, bad) if is_bad][0])
            for b, m, token in zip(sampled_rows, num_accepted, tokens):
                accepted[b], next_tokens[b] = m, token
        return self._finish_round(drafts, raw, accepted, next_tokens)  # logprobs: the model's own, as a plain step's

    @staticmethod
    def _masked_argmax(logits: torch.Tensor, argmax: torch.Tensor, order: list[tuple[int, _Draft]],
                       starts: dict[int, int], masks: dict[int, torch.Tensor]) -> None:
        """``argmax`` of the structured drafts' rows taken under their masks, in place (only those rows copied)."""
        rows = []
        for b, (i, d) in enumerate(order):
            if b in masks:
                first = starts[d.seq.seq_id]
                rows += [i, *range(first, first + len(d.tokens))]
        at = to_device(rows, logits.device)  # a list index would wait for the device
        allowed = torch.cat([masks[b] for b in sorted(masks)]).to(logits.device)
        argmax[at] = logits[at].masked_fill(~allowed, float("-inf")).argmax(dim=-1)

    def _rejection_sample(self, target: torch.Tensor, draft: torch.Tensor, counts: torch.Tensor,
                          drafts: list[_Draft], rows: list[int]) -> tuple[Verified, torch.Tensor]:
        """The verification of the sampled ``rows``, and which of them have improper draft probabilities."""
        b, k, vocab = len(rows), draft.shape[1], target.shape[-1]
        params = [d.seq.params for d in drafts for _ in range(k + 1)]
        p = Sampler.filtered_probs(target[rows].flatten(0, 1), params).view(b, k + 1, vocab)
        q = torch.zeros(b, k, vocab, device=target.device)
        for i, d in enumerate(drafts):
            n = len(d.tokens)
            if d.probs is None:
                q[i, torch.arange(n, device=q.device), torch.tensor(d.tokens, device=q.device)] = 1.0
            else:
                q[i, :n] = d.probs.to(q.device, q.dtype)
        uniform, noise = self._randoms([d.seq for d in drafts], k, vocab, target.device)
        improper = improper_drafts(q, draft[rows], counts[rows]) if any(d.probs is not None for d in drafts) \
            else torch.zeros(b, dtype=torch.bool, device=q.device)  # point masses only: nothing to check
        return rejection_sample(p, q, draft[rows], counts[rows], uniform, noise), improper

    def _refuse_probs(self, bad: _Draft) -> None:
        """PluginError for ``bad``'s draft probabilities (read back with the verification, so checking costs no
        wait): every draft slot of the step goes back first, as when a proposal is refused before the forward."""
        for d in self.drafts.values():
            self.kv.truncate(d.seq, d.seq.num_computed_tokens + 1)
        self.drafts.clear()
        assert bad.probs is not None  # rows without probabilities are point masses: always proper
        raise PluginError(f"proposer {self.proposer_name!r} gave sequence {bad.seq.seq_id} draft probabilities "
                          f"its drafts cannot have been drawn from: {describe_improper(bad.probs, bad.tokens)}; each "
                          "row must be the distribution (non-negative, summing to 1: softmax the logits) its draft "
                          "was sampled from, or the output is biased; fix the plugin")

    def _randoms(self, seqs: list[Sequence], k: int, vocab: int, device: torch.device
                 ) -> tuple[torch.Tensor, torch.Tensor]:
        """U(0, 1) [B, K] and Exp(1) [B, V] from the target's sampler streams (seeded requests use their own),
        independent of the draws that produced the drafts."""
        uniform = torch.empty(len(seqs), k, device=device)
        noise = torch.empty(len(seqs), vocab, device=device)
        unseeded = [i for i, s in enumerate(seqs) if s.params.seed is None]
        if unseeded:
            gen = self.sampler.generator
            uniform[unseeded] = torch.rand(len(unseeded), k, device=device, generator=gen)
            noise[unseeded] = torch.empty(len(unseeded), vocab, device=device).exponential_(generator=gen)
        for i, s in enumerate(seqs):
            if s.params.seed is not None:  # drawn from the seed and the round's position only (see _round_generator)
                gen = self._round_generator(s, device)
                noise[i].exponential_(generator=gen)  # first: the uniforms' count varies with the batch's K
                uniform[i] = torch.rand(k, device=device, generator=gen)
        return uniform, noise

    def _round_generator(self, seq: Sequence, device: torch.device) -> torch.Generator:
        """A seeded request's verification draws depend on its seed and the round's position, not on the other
        requests' K (the batch's largest K sets how many uniforms a round draws). A request whose own K changes (a
        step's token budget, the degradation policy) may still sample differently."""
        gen = self.round_generators.get(seq.seq_id)
        if gen is None:
            gen = self.round_generators[seq.seq_id] = torch.Generator(device=device)
        return gen.manual_seed(stream_seed(seq.params.seed or 0, seq.index, VERIFY_SEED_SALT, seq.num_tokens))

    def _finish_round(self, drafts: list[_Draft], target: torch.Tensor | None, num_accepted: list[int],
                      next_tokens: list[int]) -> dict[int, list[int]]:
        """Roll back rejected KV, cut at a stop token, record logprobs (``target``: [B, K+1, V], needed only when a
        request asks for them) and acceptance statistics."""
        sampled: dict[int, list[int]] = {}
        accepted_total = proposed_total = kept_total = emitted_total = judged_total = 0
        for b, (d, m, token) in enumerate(zip(drafts, num_accepted, next_tokens)):
            seq = d.seq
            tokens = d.tokens[:m] + [token]
            for j, t in enumerate(tokens):  # the scheduler would stop there: drop what follows
                if seq.stop_reason(t, seq.num_tokens + j + 1) is not None:
                    tokens = tokens[: j + 1]
                    break
            # KV holds the last real token and the m accepted drafts; positions after them are forgotten
            self.kv.truncate(seq, seq.num_computed_tokens + 1 + m)
            self.proposer.on_verified(seq, m)
            if seq.params.logprobs is not None and target is not None:
                seq.logprobs.extend(Sampler.logprobs(target[b, : len(tokens)], [seq.params] * len(tokens), tokens))
            kept = min(m, len(tokens))  # accepted drafts that reach the output (a stop token cuts the rest)
            seq.spec_proposed += len(d.tokens)
            seq.spec_accepted += kept
            seq.spec_last_round = (kept, len(tokens))
            proposed_total += len(d.tokens)
            accepted_total += m
            judged_total += m + (m < len(d.tokens))  # the first rejected draft was judged too
            kept_total += kept
            emitted_total += len(tokens)
            sampled[seq.seq_id] = tokens
        s = self.stats
        s.spec_proposed += proposed_total
        s.spec_accepted += kept_total
        s.spec_rounds += len(drafts)
        s.spec_emitted += emitted_total
        s.spec_judged += judged_total
        s.spec_judged_accepted += accepted_total
        self.policy.observe(proposed_total, accepted_total, len(drafts))  # the drafts' quality, stops aside
        self.step_counts = (proposed_total, accepted_total)
        return sampled

    # ------------------------------------------------------------ bookkeeping
    def annotate(self, step: StepStats) -> None:
        step.spec_state = self.stats.spec_state
        step.num_draft_tokens, step.num_accepted_tokens = self.step_counts

    def release_finished(self, seqs: list[Sequence]) -> None:
        """Drop the proposer's state (a draft's KV) of sequences that finished this step, before their request does
        (n > 1: the others may run on); take back from the totals what a stop string cut from their last round."""
        for seq in seqs:
            self._take_back_cut(seq)
            if seq.is_finished:
                self.proposer.release(seq)
                self.round_generators.pop(seq.seq_id, None)

    def _take_back_cut(self, seq: Sequence) -> None:
        if seq.spec_uncounted != (0, 0):
            self.stats.spec_accepted -= seq.spec_uncounted[0]
            self.stats.spec_emitted -= seq.spec_uncounted[1]
            seq.spec_uncounted = (0, 0)

    def finish(self, seqs: list[Sequence], output: RequestOutput) -> None:
        """A request finished: drop the proposer's state; report its acceptance in ``output.metrics``."""
        for seq in seqs:
            self._take_back_cut(seq)
            self.proposer.release(seq)
            self.round_generators.pop(seq.seq_id, None)
        proposed = sum(s.spec_proposed for s in seqs)
        accepted = sum(s.spec_accepted for s in seqs)
        output.metrics.update(spec_proposed=proposed, spec_accepted=accepted,
                              spec_acceptance_rate=accepted / proposed if proposed else 0.0)
