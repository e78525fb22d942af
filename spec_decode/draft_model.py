"""The `draft-model` proposer: a small checkpoint, run by infer's own loader, ModelRunner and paged KV cache.

Each target sequence has a shadow :class:`Sequence` in the draft's cache. ``propose`` first rolls the shadow back to
the longest prefix it shares with the target's tokens (rejected drafts, and a preemption's recompute, leave nothing
stale), reserves draft KV for the whole round, catches its KV up with one batched forward over the new tokens, then
decodes k - 1 more tokens one batched forward at a time. Each step's tokens stay on the device and feed the next
step, and the round reads them back once at the end, so on a GPU the host queues the k steps without waiting for any
of them; with CUDA graphs, a steady-state greedy round is one replay (draft_rounds.py). The draft samples with the
request's own temperature and filters, so that its distribution q is close to the target's p; greedy requests draft
greedily (a point mass). A structured-output sequence drafts under its grammar (``propose_guided``): its logits are
masked before each draft, q is the masked distribution, and its tokens are read back every step to walk its guide.

The proposer factory receives the config and the target only, so the draft's architecture, attention backend,
eviction policy and the `paged` KV cache come from a plugin manager over the installed entry points.
"""
from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path
import torch

from ..core.config import EngineConfig
from ..core.errors import CheckpointError, ConfigError
from ..core.interfaces import GrammarMatcher, KVCache, Proposal, Proposer, ScheduledSequence, SchedulerOutput
from ..core.loader import LoadedModel, load_model
from ..core.model import check_capturable, check_softcap, fit_sliding_window
from ..core.plugin_options import read_plugin_options
from ..core.plugins import PluginManager
from ..core.request import Sequence
from ..core.runner import Batch, ModelRunner
from ..core.sampling import Sampler, stream_seed, to_device
from .draft_rounds import DraftRoundGraphs
from .policy import SPEC_DECODE_OPTIONS

DRAFT_SEED_SALT = 0x5EED_D4AF  # draft draws must not replay the target sampler's streams
log = logging.getLogger("infer")

UNREAD_TOKEN = -1  # stands in a shadow's token list for a draft still on the device, until the round's one read


@dataclass
class _Shadow:
    seq: Sequence  # the draft's copy: target tokens, then this step's drafts
    synced: int  # how many leading tokens are known to equal the target's


class DraftModelProposer(Proposer):
    def __init__(self, draft: LoadedModel, runner: ModelRunner, kv: KVCache, seed: int,
                 token_budget: int | None = None, target_vocab: int | None = None) -> None:
        self.draft, self.runner, self.kv = draft, runner, kv
        # a draft may have fewer ids than its target (gemma-3-1b's 262144 for the 4B's 262208, one tokenizer): its
        # logits are widened to the target's, and a sequence holding an id past the draft's decodes without drafts
        self.draft_vocab = draft.model.spec.vocab_size
        self.target_vocab = target_vocab or self.draft_vocab
        self.foreign: set[int] = set()  # seq ids holding a token the draft has no embedding for
        self.token_budget = token_budget  # most tokens in a round's first draft forward (new shadows' prefills)
        self.max_len = draft.model.spec.max_model_len
        self.shadows: dict[int, _Shadow] = {}
        device = draft.device
        self.generator = torch.Generator(device=device).manual_seed(seed ^ DRAFT_SEED_SALT)
        self.seeded: dict[int, torch.Generator] = {}
        self.warned_kv_full = False
        self.round_graphs: DraftRoundGraphs | None = None

    @classmethod
    def load(cls, config: EngineConfig, target: LoadedModel, plugins: PluginManager) -> DraftModelProposer:
        """Load ``config.draft_model`` (the shipped draft when the target is the shipped default) next to ``target``,
        with the components of ``plugins`` (the engine's, collected)."""
        round_graphs = round_graphs_option(config)  # checked on any device, not only where graphs are built
        path = config.draft_model or default_draft_for(target.path)
        if path is None:
            raise ConfigError("the draft-model proposer needs --draft-model DIR: a small checkpoint that shares the "
                              "target's tokenizer")
        if not Path(path).is_dir():
            raise CheckpointError(f"draft model folder {str(path)!r} does not exist; pass --draft-model DIR with a "
                                  "local HF folder of a small model that shares the target's tokenizer")
        draft = load_draft(config.replace(model=str(path), quant=None, num_kv_blocks=None), target, plugins)
        check_same_vocab(target, draft)
        attention_name = config.attention or (  # the engine passes its own, resolved
            "triton" if draft.device.type == "cuda" and "triton" in plugins.registry("attention_backend") else "torch")
        # the draft's KV is never fp8 (its runner stores the draft's dtype): a backend sized for fp8 would be slower
        attention = plugins.registry("attention_backend").get(attention_name)(config.replace(kv_cache_dtype="auto"))
        fit_sliding_window(draft.model, attention, None, "the draft model")
        check_softcap(draft.model, attention, "the draft model")
        draft_len, target_len = draft.model.spec.max_model_len, target.model.spec.max_model_len
        if draft_len < min(target_len, config.max_model_len or target_len):
            log.warning("the draft model's context (%d tokens) is shorter than the target's (%d): sequences longer "
                        "than it decode without drafts", draft_len, target_len)
        blocks = draft_kv_blocks(config, draft)
        eviction = plugins.registry("eviction_policy").get(config.eviction_policy)(config)
        kv = plugins.registry("kv_cache").get("paged")(config.replace(enable_prefix_caching=False), blocks, eviction)
        runner = ModelRunner(draft.model, attention, blocks, config.block_size, draft.dtype, draft.device, config.seed)
        proposer = cls(draft, runner, kv, config.seed, config.max_num_batched_tokens, target.model.spec.vocab_size)
        if config.cuda_graphs and draft.device.type == "cuda" and attention.supports_cuda_graphs:
            check_capturable(draft.model, "the draft model")
            # the k - 1 one-token draft steps, and the two-token first step of each round after the first
            runner.enable_cuda_graphs(min(config.max_num_seqs, 256), {2: min(config.max_num_seqs, 64)})
            if round_graphs:  # and whole greedy rounds
                proposer.enable_round_graphs(min(config.max_num_seqs, 64), config.num_speculative_tokens)
        return proposer

    # ------------------------------------------------------------ Proposer
    def propose(self, seqs: list[Sequence], k: int) -> Proposal:
        return self._propose(seqs, k, {})

    def propose_guided(self, seqs: list[Sequence], k: int, guides: dict[int, GrammarMatcher]) -> Proposal:
        return self._propose(seqs, k, guides)

    def _propose(self, seqs: list[Sequence], k: int, guides: dict[int, GrammarMatcher]) -> Proposal:
        active = self._admit(seqs, k)
        if not active:
            return Proposal({})
        rows = [i for i, seq in enumerate(active) if not seq.params.greedy]  # temperature > 0: a draw from q
        sampled = [active[i] for i in rows]
        self._reseed(sampled)
        sampled_rows = to_device(rows, self.draft.device) if rows else None
        guided = _Guided.of(active, guides, self.draft.device)
        items = [ScheduledSequence(seq, seq.num_tokens - seq.num_computed_tokens) for seq in active]
        out = SchedulerOutput(items, block_ops=self.kv.take_block_ops())
        self.runner.apply_block_ops(out.block_ops)
        batch = self.runner.prepare(out, self.kv)
        rounds = self.round_graphs
        if rounds is not None and not rows and guided is None and k == rounds.k and rounds.fits(batch):
            drafted, step_dists = rounds.run(batch), []  # the whole greedy round in one replay
        else:
            drafted, step_dists = self._step_by_step(batch, k, sampled, sampled_rows, guided)
        for item in items:
            item.seq.num_computed_tokens += item.num_new_tokens + k - 1
            item.seq.token_ids.extend([UNREAD_TOKEN] * k)  # filled in after the round's one read
        drafts = drafted.tolist()  # the round's one read from the device: [B, k]
        probs: dict[int, torch.Tensor | None] = dict.fromkeys((seq.seq_id for seq in active), None)
        if rows:
            q = torch.stack([d for d in step_dists if d is not None], dim=1)  # [sampled, k, vocab]
            for j, i in enumerate(rows):
                probs[active[i].seq_id] = q[j]
        for seq, tokens in zip(active, drafts):
            seq.token_ids[-k:] = tokens
        return Proposal({seq.seq_id: tokens for seq, tokens in zip(active, drafts)}, probs)

    def _step_by_step(self, batch: Batch, k: int, sampled: list[Sequence], sampled_rows: torch.Tensor | None,
                      guided: _Guided | None) -> tuple[torch.Tensor, list[torch.Tensor | None]]:
        """The round one forward pass at a time: draft tokens [B, k] and, per step, the sampled rows' q (under
        the grammar for the ``guided`` rows, whose tokens are read back each step to walk their guides)."""
        steps: list[torch.Tensor] = []  # each step's tokens, still on the device
        step_dists: list[torch.Tensor | None] = []
        logits = self._widened(self.runner.run(batch))
        for step in range(k):
            if step:  # steps after the first advance the batch on the device: one new token per sequence
                batch = self.runner.advance(batch, steps[-1])
                logits = self._widened(self.runner.run(batch))
            if guided is not None:
                logits = guided.mask(logits)
            tokens, dists = self._sample(logits, sampled, sampled_rows)
            if guided is not None:
                guided.advance(tokens)
            steps.append(tokens)
            step_dists.append(dists)
        return torch.stack(steps, dim=1), step_dists

    def enable_round_graphs(self, max_batch: int, k: int, eager: bool = False) -> None:
        """Replay steady-state greedy rounds of ``k`` drafts for up to ``max_batch`` sequences from CUDA graphs
        (``eager``: the same static-buffer round, uncaptured, for tests on any device)."""
        runner = self.runner
        if not runner.attention.supports_cuda_graphs:
            raise ConfigError(f"draft round graphs need an attention backend that supports CUDA graphs, not "
                              f"{type(runner.attention).__name__}; use --attention triton")
        self.round_graphs = DraftRoundGraphs(self.draft.model, runner.attention, runner.kv_caches, runner.block_size,
                                             max_batch, k, self.draft.device, eager=eager)
        self.round_graphs.capture()

    def on_verified(self, seq: Sequence, num_accepted: int) -> None:
        shadow = self.shadows.get(seq.seq_id)
        if shadow is not None:  # the draft's KV stays valid for the real tokens and the accepted drafts
            self._truncate(shadow, shadow.synced + num_accepted)

    def release(self, seq: Sequence) -> None:
        self.foreign.discard(seq.seq_id)
        shadow = self.shadows.pop(seq.seq_id, None)
        if shadow is not None:
            self.kv.free(shadow.seq)
        self.seeded.pop(seq.seq_id, None)

    # ------------------------------------------------------------ internals
    def _admit(self, seqs: list[Sequence], k: int) -> list[Sequence]:
        """The shadows that draft this round, synced and with their KV reserved. A new shadow prefills the whole
        context: past the token budget (a burst of new sequences) the rest draft in later rounds, so that the first
        draft forward stays within max_num_batched_tokens (or one sequence's context, when that alone is more)."""
        active: list[Sequence] = []
        left = self.token_budget
        for seq in seqs:
            shadow = self._sync(seq, k)
            if shadow is None:
                continue
            tail = max(shadow.seq.num_tokens - shadow.seq.num_computed_tokens, 2)  # see _reserve: 2 at least
            if left is not None and active and tail > left:
                continue
            if self._reserve(shadow, k):
                active.append(shadow.seq)
                left = None if left is None else left - tail
        return active

    def _sync(self, seq: Sequence, k: int) -> _Shadow | None:
        """The shadow of ``seq``, rolled back to the prefix it shares with the target's tokens."""
        if seq.seq_id in self.foreign:  # released when it was marked
            return None
        if seq.num_tokens + k > self.max_len:
            self.release(seq)
            return None
        shadow = self.shadows.get(seq.seq_id)
        start = 0 if shadow is None else shadow.synced  # the tokens before it were checked in an earlier round
        if self.target_vocab > self.draft_vocab and any(t >= self.draft_vocab for t in seq.token_ids[start:]):
            self.release(seq)
            self.foreign.add(seq.seq_id)
            return None
        if shadow is None:
            copy = Sequence(seq.seq_id, seq.request_id, seq.prompt_token_ids, seq.params, seq.arrival_time,
                            seq.index, max_model_len=self.max_len, token_ids=list(seq.token_ids))
            shadow = self.shadows[seq.seq_id] = _Shadow(copy, 0)
        common, mine, theirs = shadow.synced, shadow.seq.token_ids, seq.token_ids
        while common < min(len(mine), len(theirs)) and mine[common] == theirs[common]:
            common += 1
        self._truncate(shadow, common)
        shadow.seq.token_ids = list(seq.token_ids)
        shadow.synced = seq.num_tokens
        return shadow

    def _truncate(self, shadow: _Shadow, num_tokens: int) -> None:
        seq = shadow.seq
        if num_tokens < seq.num_computed_tokens:
            seq.num_computed_tokens = num_tokens
            self.kv.truncate(seq, num_tokens)

    def _reserve(self, shadow: _Shadow, k: int) -> bool:
        """Draft KV for the whole round (the new tail, then k - 1 drafts), so no step waits on an allocation."""
        seq = shadow.seq
        if seq.num_tokens - seq.num_computed_tokens == 1 and seq.num_computed_tokens > 0:
            # After a verification the new tail is one token (a rejection) or two (all k accepted): recompute one
            # more so that every steady-state round starts with two query tokens, a shape with a CUDA graph.
            seq.num_computed_tokens -= 1
        if self.kv.allocate(seq, seq.num_tokens - seq.num_computed_tokens + k - 1):
            return True
        self.release(seq)  # out of draft KV: this sequence gets no drafts
        if not self.warned_kv_full:
            self.warned_kv_full = True
            log.warning("the draft model's KV pool (%d blocks) is full: some sequences decode without drafts; "
                        "lower --max-num-seqs to keep every sequence speculating", self.kv.stats().total_blocks)
        return False

    def _widened(self, logits: torch.Tensor) -> torch.Tensor:
        """The draft's logits over the target's vocabulary: the ids past the draft's at -inf (never drafted)."""
        extra = self.target_vocab - logits.shape[-1]
        return logits if extra <= 0 else torch.nn.functional.pad(logits, (0, extra), value=float("-inf"))

    def _sample(self, logits: torch.Tensor, sampled: list[Sequence], sampled_rows: torch.Tensor | None
                ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """One draft token per row, on the device: argmax for greedy requests, else, for the ``sampled`` sequences
        at ``sampled_rows``, a draw from the filtered distribution q, returned for those rows. Nothing here waits on
        the device."""
        tokens = logits.argmax(dim=-1)
        if sampled_rows is None:
            return tokens, None
        q = Sampler.filtered_probs(logits.index_select(0, sampled_rows), [seq.params for seq in sampled])
        noise = torch.empty_like(q)
        for j, seq in enumerate(sampled):
            noise[j].exponential_(generator=self._generator(seq))
        tokens.index_copy_(0, sampled_rows, (q / noise).argmax(dim=-1))  # exponential race: a draw from q
        return tokens, q

    def _generator(self, seq: Sequence) -> torch.Generator:
        if seq.params.seed is None:
            return self.generator
        gen = self.seeded.get(seq.seq_id)
        if gen is None:
            gen = self.seeded[seq.seq_id] = torch.Generator(device=self.draft.device)
        return gen

    def _reseed(self, seqs: list[Sequence]) -> None:
        """A seeded request's draft draws of a round depend on its seed and the round's start only: not on what ran
        beside it (other requests' room sets how many steps a round takes) nor on earlier rounds."""
        for seq in seqs:
            if seq.params.seed is not None:
                self._generator(seq).manual_seed(
                    stream_seed(seq.params.seed, seq.index, DRAFT_SEED_SALT, position=seq.num_tokens))


@dataclass
class _Guided:
    """The rows of a round that draft under their grammar (``Proposer.propose_guided``), with their guides."""

    guides: list[GrammarMatcher]
    rows: torch.Tensor  # on the draft's device

    @classmethod
    def of(cls, active: list[Sequence], guides: dict[int, GrammarMatcher], device: torch.device) -> _Guided | None:
        rows = [i for i, seq in enumerate(active) if seq.seq_id in guides]
        if not rows:
            return None
        return cls([guides[active[i].seq_id] for i in rows], to_device(rows, device))

    def mask(self, logits: torch.Tensor) -> torch.Tensor:
        """``logits`` with the guided rows' disallowed tokens at -inf (a copy: the runner's stays as it was)."""
        allowed = torch.stack([guide.allowed() for guide in self.guides]).to(logits.device)
        masked = logits.index_select(0, self.rows).masked_fill(~allowed, float("-inf"))
        return logits.index_put((self.rows,), masked)

    def advance(self, tokens: torch.Tensor) -> None:
        """Walk each guide along its row's draft: a read from the device, once per draft step."""
        for guide, token in zip(self.guides, tokens.index_select(0, self.rows).tolist()):
            guide.advance(token)


def round_graphs_option(config: EngineConfig) -> bool:
    """``plugin_options["spec_decode"]["round_graphs"]``: whole greedy draft rounds as CUDA graphs."""
    return read_plugin_options(config, "spec_decode", SPEC_DECODE_OPTIONS)["round_graphs"]


def check_same_vocab(target: LoadedModel, draft: LoadedModel) -> None:
    """Refuse a draft whose tokenizer differs, or whose vocabulary has more ids than the target's: p and q must be
    over the same token ids (a draft with fewer, the same tokenizer, gets its logits widened)."""
    t_size, d_size = target.model.spec.vocab_size, draft.model.spec.vocab_size
    if d_size > t_size:
        raise CheckpointError(f"draft model {str(draft.path)!r} has a vocabulary of {d_size} ids but the target "
                              f"{str(target.path)!r} has {t_size}; speculative decoding needs a draft with the "
                              "target's tokenizer and no more ids than the target")
    t_vocab, d_vocab = target.tokenizer.get_vocab(), draft.tokenizer.get_vocab()
    if t_vocab != d_vocab:
        differing = sorted(t for t in t_vocab.keys() | d_vocab.keys() if t_vocab.get(t) != d_vocab.get(t))
        examples = "; ".join(f"{t!r} is {t_vocab.get(t, 'absent')} in the target, {d_vocab.get(t, 'absent')} in the "
                             "draft" for t in differing[:3])
        raise CheckpointError(f"draft model {str(draft.path)!r} does not share the target's tokenizer "
                              f"({len(t_vocab)} and {len(d_vocab)} tokens, {len(differing)} of them with different "
                              f"ids, e.g. {examples}); speculative decoding needs a draft trained with the "
                              "target's tokenizer")


def load_draft(config: EngineConfig, target: LoadedModel, plugins: PluginManager) -> LoadedModel:
    """The draft built for the target's context (its RoPE tables are those the target's sequences need: LongRoPE
    picks one by the context), or for its own default where it cannot serve that long (a ConfigError says so before
    any weight is read)."""
    path = Path(config.model)
    try:
        return load_model(config.replace(max_model_len=target.model.spec.max_model_len), plugins, path)
    except ConfigError:
        return load_model(config.replace(max_model_len=None), plugins, path)


def draft_kv_blocks(config: EngineConfig, draft: LoadedModel) -> int:
    """Enough blocks for max_num_seqs sequences of the draft's context, within a small memory budget."""
    per_block = ModelRunner.bytes_per_block(draft.model, config.block_size, draft.dtype)
    needed = config.max_num_seqs * -(-draft.model.spec.max_model_len // config.block_size) + 1
    budget = 2**30 if draft.device.type == "cuda" else 2**28
    if config.kv_cache_memory_gb is not None:
        budget = min(budget, int(config.kv_cache_memory_gb * 2**30))
    return max(1, min(needed, budget // per_block))


def default_draft_for(target_path: Path) -> Path | None:
    """The shipped draft when ``target_path`` is the shipped target (models/pretrained/target)."""
    from ..models.tiny import PRETRAINED_DIR

    shipped = PRETRAINED_DIR / "target"
    if shipped.exists() and Path(target_path).resolve() == shipped.resolve():
        return PRETRAINED_DIR / "draft"
    return None
