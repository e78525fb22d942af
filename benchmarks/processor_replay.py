"""Logits processors alone, infer's against HF transformers' on the same batch shapes (host_overhead.py ``--peer``).

The engine's outputs are replayed step by step as the engine decoded them when every request starts at once: step
``s`` holds the requests with more than ``s`` output tokens, each row's tokens its prompt and its first ``s`` output
tokens, and a [rows, vocabulary] float32 logits tensor. Timed per step: infer's ``LogitsProcessors.apply`` (the
rows as ``Sequence`` objects, the engine's own processor objects) and the transformers processors that do the same
(``NoRepeatNGramLogitsProcessor``, ``NoBadWordsLogitsProcessor``, and for allowed tokens
``PrefixConstrainedLogitsProcessor``, which scatters each row's allowed ids into a -inf mask) on the left-padded
[rows, longest] ids a transformers batch holds. Logits copies and padding are not timed.
"""
from __future__ import annotations

import json
import time
from dataclasses import dataclass
from typing import Any


@dataclass
class ReplayTimes:
    infer_s: float
    peer_s: float
    steps: int
    tokens: int


def transformers_processors(calls: list[tuple[str, str]], tokenizer: Any) -> list[Any]:
    """The transformers processors doing what ``calls`` (name, JSON text) ask of infer's shipped ones."""
    from transformers import NoBadWordsLogitsProcessor, NoRepeatNGramLogitsProcessor, PrefixConstrainedLogitsProcessor

    built = []
    for name, text in calls:
        args = json.loads(text)
        if name == "no-repeat-ngram":
            built.append(NoRepeatNGramLogitsProcessor(args["size"]))
        elif name == "bad-words":
            spelled = [tokenizer.encode(form, add_special_tokens=False) for word in args.get("words", ())
                       for form in (word, " " + word)]
            built.append(NoBadWordsLogitsProcessor([*args.get("token_ids", ()), *(ids for ids in spelled if ids)]))
        elif name == "allowed-tokens":
            allowed = list(args["token_ids"])
            built.append(PrefixConstrainedLogitsProcessor(lambda batch_id, ids: allowed, num_beams=1))
        else:
            raise SystemExit(f"--peer: no transformers counterpart for logits processor {name!r}")
    return built


def replay(engine: Any, prompts: list[list[int]], outputs: list[list[int]], calls: list[tuple[str, str]],
           vocab: int, tokenizer: Any) -> ReplayTimes:
    """Seconds infer's processors and transformers' spent over the replayed steps (see the module's docstring)."""
    import torch

    from infer.core.request import SamplingParams, Sequence

    params = SamplingParams(max_tokens=max(map(len, outputs)), temperature=0.0, ignore_eos=True,
                            logits_processors=calls)
    seqs = [Sequence(seq_id=10**9 + i, request_id=f"replay-{i}", prompt_token_ids=list(prompt), params=params,
                     arrival_time=0.0) for i, prompt in enumerate(prompts)]
    peers = transformers_processors(calls, tokenizer)
    generator = torch.Generator().manual_seed(0)
    source = torch.randn(len(prompts), vocab, generator=generator)
    infer_s = peer_s = 0.0
    steps = 0
    for step in range(max(map(len, outputs))):
        live = [i for i, output in enumerate(outputs) if len(output) > step]
        rows = [seqs[i] for i in live]
        logits = source[:len(live)].clone()
        start = time.perf_counter()
        engine.processors.apply(logits, rows)
        infer_s += time.perf_counter() - start
        longest = max(len(seq.token_ids) for seq in rows)
        ids = torch.zeros(len(rows), longest, dtype=torch.long)
        for row, seq in enumerate(rows):
            ids[row, longest - len(seq.token_ids):] = torch.tensor(seq.token_ids)
        scores = source[:len(live)].clone()
        start = time.perf_counter()
        for processor in peers:
            scores = processor(ids, scores)
        peer_s += time.perf_counter() - start
        for i in live:
            seqs[i].token_ids.append(outputs[i][step])
        steps += 1
    for seq in seqs:
        engine.processors.release(seq)
    return ReplayTimes(infer_s, peer_s, steps, sum(map(len, outputs)))
