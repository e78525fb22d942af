"""Sampling: greedy, temperature, top-k, top-p, min-p, per-sequence seeded generators, and top-n logprobs."""
from __future__ import annotations

from dataclasses import dataclass, field

import torch

from .request import SamplingParams


@dataclass
class SampleResult:
    token_ids: list[int]
    logprobs: list[dict[int, float] | None]  # per row: sampled token and top-n, when asked
    unsampleable: list[int] = field(default_factory=list)  # rows with no token to sample (a NaN, or all -inf)
    yielded: list[int] = field(default_factory=list)  # rows sampled without their logits processors


def stream_seed(seed: int, index: int, salt: int = 0, position: int = 0) -> int:
    """The generator seed of sequence ``index`` of a request seeded with ``seed`` (for speculative rounds, also of
    the ``position`` a round starts at): any non-negative seed, reduced to the 64 bits torch.Generator takes (a
    larger one overflowed it and failed the whole step)."""
    return ((seed * 1_000_003 + index) ^ salt ^ (position * 0x9E3779B97F4A7C15)) % 2**64


class Sampler:
    """Samples one token per row of logits. Rows with a seed use their own generator, so a seeded request
    gives the same tokens whatever else is in the batch."""

    def __init__(self, device: torch.device, seed: int) -> None:
        self.device = device
        self.generator = torch.Generator(device=device).manual_seed(seed)
        self.seeded: dict[int, torch.Generator] = {}  # seq_id -> generator

    def generator_for(self, seq_id: int, seed: int, index: int) -> torch.Generator:
        gen = self.seeded.get(seq_id)
        if gen is None:
            gen = torch.Generator(device=self.device).manual_seed(stream_seed(seed, index))
            self.seeded[seq_id] = gen
        return gen

    def release(self, seq_id: int) -> None:
        self.seeded.pop(seq_id, None)

    def __call__(self, logits: torch.Tensor, params: list[SamplingParams],
                 generators: list[torch.Generator | None]) -> SampleResult:
        """logits [N, V] float32; ``generators[i]`` is None for unseeded rows."""
        return self.sample_pending(logits, params, generators).result()

    def sample_pending(self, logits: torch.Tensor, params: list[SamplingParams],
                       generators: list[torch.Generator | None], controlled: torch.Tensor | None = None,
                       yielded: torch.Tensor | None = None) -> PendingSample:
        """Like ``__call__``, but nothing waits for the device: the tokens (and logprobs) are computed and copied to
        host memory in stream order, and ``PendingSample.result()`` reads them later. ``logits`` may be reused
        (a CUDA graph's output buffer) as soon as this returns. ``controlled``: the logits with the requests' logit
        controls applied, to sample from (the logprobs stay those of ``logits``); ``yielded`` [rows] bool: the rows
        sampled without their logits processors (reported in ``SampleResult.yielded``)."""
        source = logits if controlled is None else controlled
        tokens = self.sample_tokens(source, params, generators)
        rows, top = _logprob_tensors(logits, params, tokens)
        # per row: 1 no token to sample (a NaN, or every logit -inf: argmax picks 0), 2 processors yielded
        flags = (~(source.amax(dim=-1) > float("-inf"))).to(torch.int8)  # amax is NaN where any logit is
        if yielded is not None:
            flags = flags + 2 * yielded.to(torch.int8)
        return PendingSample(tokens, *_to_host((tokens, flags, *top)), rows=rows,
                             widths=[params[i].logprobs or 0 for i in rows], size=len(params))

    def sample_tokens(self, logits: torch.Tensor, params: list[SamplingParams],
                      generators: list[torch.Generator | None]) -> torch.Tensor:
        """One token id per row, on the logits' device."""
        greedy = logits.argmax(dim=-1)
        tokens = greedy
        if not all(p.greedy for p in params):
            probs = self.filtered_probs(logits, params)
            # Exponential race: argmax(p / E) with E ~ Exp(1) draws from p; one noise row per generator.
            noise = torch.empty_like(probs)
            unseeded = [i for i, g in enumerate(generators) if g is None]
            if unseeded:
                draws = torch.empty(len(unseeded), probs.shape[1], device=probs.device)
                noise[to_device(unseeded, probs.device)] = draws.exponential_(generator=self.generator)
            for i, gen in enumerate(generators):
                if gen is not None:
                    noise[i].exponential_(generator=gen)
            sampled = (probs / noise).argmax(dim=-1)
            is_greedy = to_device([p.greedy for p in params], logits.device)
            tokens = torch.where(is_greedy, greedy, sampled)
        return tokens

    @staticmethod
    def filtered_probs(logits: torch.Tensor, params: list[SamplingParams]) -> torch.Tensor:
        temps = to_device([1.0 if p.greedy else p.temperature for p in params], logits.device).unsqueeze(1)
        logits = logits / temps
        top_k = [p.top_k for p in params]
        if any(k > 0 for k in top_k):
            k = to_device([min(k, logits.shape[1]) if k > 0 else logits.shape[1] for k in top_k], logits.device)
            kth = logits.sort(dim=-1, descending=True).values.gather(1, (k - 1)[:, None])  # 1 <= k <= vocab
            logits = logits.masked_fill(logits < kth, float("-inf"))
        probs = logits.softmax(dim=-1)
        if any(p.top_p < 1.0 for p in params):
            # a row without top_p keeps every token: its cumsum may round past 1.0 in float32
            top_p = to_device([p.top_p if p.top_p < 1.0 else float("inf") for p in params], logits.device).unsqueeze(1)
            sorted_probs, order = probs.sort(dim=-1, descending=True)
            # the smallest set whose mass reaches top_p; the top token always stays (its preceding mass is 0)
            drop_sorted = (sorted_probs.cumsum(dim=-1) - sorted_probs) >= top_p
            drop_sorted[:, 0] = False  # also when a tiny top_p underflows to 0 in float32
            drop = torch.zeros_like(drop_sorted).scatter(1, order, drop_sorted)
            probs = probs.masked_fill(drop, 0.0)
        if any(p.min_p > 0 for p in params):
            min_p = to_device([p.min_p for p in params], logits.device).unsqueeze(1)
            probs = probs.masked_fill(probs < min_p * probs.max(dim=-1, keepdim=True).values, 0.0)
        return probs / probs.sum(dim=-1, keepdim=True)

    @staticmethod
    def logprobs(logits: torch.Tensor, params: list[SamplingParams], tokens: list[int]
                 ) -> list[dict[int, float] | None]:
        """Log-probabilities of the model's raw distribution (before temperature and filters) for given tokens."""
        rows, top = _logprob_tensors(logits, params, torch.tensor(tokens, device=logits.device))
        return logprob_entries(rows, [params[i].logprobs or 0 for i in rows], len(params), [t.tolist() for t in top],
                               tokens)


def _logprob_tensors(logits: torch.Tensor, params: list[SamplingParams], tokens: torch.Tensor
                     ) -> tuple[list[int], tuple[torch.Tensor, ...]]:
    """The rows that asked for logprobs and, on the logits' device, their (top values, top ids, logprob of the
    row's token in ``tokens``)."""
    rows = [i for i, p in enumerate(params) if p.logprobs is not None]
    if not rows:
        return rows, ()
    index = to_device(rows, logits.device)  # a list index would copy synchronously, waiting for the device
    return rows, top_logprobs(logits[index], tokens[index], max(params[i].logprobs or 0 for i in rows))


def top_logprobs(logits: torch.Tensor, tokens: torch.Tensor, width: int) -> tuple[torch.Tensor, ...]:
    """For each row of ``logits`` [N, V]: the ``width`` top log-probabilities and their ids, and the
    log-probability of the row's token in ``tokens`` [N] (on the logits' device)."""
    logp = logits.log_softmax(dim=-1)
    top_values, top_ids = logp.topk(width, dim=-1) if width else (logp[:, :0], logp[:, :0].long())
    return top_values, top_ids, logp.gather(1, tokens[:, None])[:, 0]


def logprob_entries(rows: list[int], widths: list[int], size: int, top: list[list], tokens: list[int]
                     ) -> list[dict[int, float] | None]:
    """Per row: None, or {token id: logprob} of its ``widths`` top tokens and its own token."""
    entries: list[dict[int, float] | None] = [None] * size
    if rows:
        top_values, top_ids, chosen = top
        for j, (i, n) in enumerate(zip(rows, widths)):
            entry = dict(zip(top_ids[j][:n], top_values[j][:n]))
            entry[tokens[i]] = chosen[j]
            entries[i] = entry
    return entries


@dataclass
class PendingSample:
    """Sampled tokens (and logprobs) on their way to host memory; ``result()`` waits for them, and for nothing
    the device was given after them."""

    device_tokens: torch.Tensor  # [rows] on the device: the next step reads its input ids from here
    host: list[torch.Tensor]  # tokens, row flags, then (top values, top ids, chosen logprob) when asked
    copied: torch.cuda.Event | None  # recorded after the copies (None: CPU tensors, ready now)
    rows: list[int]  # the rows that asked for logprobs, and how many top entries each
    widths: list[int]
    size: int

    def result(self) -> SampleResult:
        """The tokens (and logprobs), the rows that had no token to sample (their token is meaningless), and those
        sampled without their logits processors."""
        if self.copied is not None:
            self.copied.synchronize()
        token_list = self.host[0].tolist()
        flags = self.host[1].tolist()
        return SampleResult(token_list, logprob_entries(self.rows, self.widths, self.size,
                                                         [t.tolist() for t in self.host[2:]], token_list),
                            [row for row, flag in enumerate(flags) if flag & 1],
                            [row for row, flag in enumerate(flags) if flag & 2])


def _to_host(tensors: tuple[torch.Tensor, ...]) -> tuple[list[torch.Tensor], torch.cuda.Event | None]:
    """Copies in pinned host memory, queued behind the work that computes them, and the event that marks them."""
    if tensors[0].device.type != "cuda":
        return list(tensors), None
    host = [torch.empty(t.shape, dtype=t.dtype, pin_memory=True) for t in tensors]
    for dst, src in zip(host, tensors):
        dst.copy_(src, non_blocking=True)
    event = torch.cuda.Event()
    event.record(torch.cuda.current_stream(tensors[0].device))
    return host, event


def to_device(values: list, device: torch.device) -> torch.Tensor:
    """A small host list on ``device`` without waiting for the device's queued work (``torch.tensor(...,
    device=cuda)`` copies synchronously, which stalls the host until the stream drains)."""
    host = torch.tensor(values)
    if device.type == "cuda":
        host = host.pin_memory()  # an asynchronous copy needs page-locked memory (pinned buffers are cached)
    return host.to(device, non_blocking=True)
