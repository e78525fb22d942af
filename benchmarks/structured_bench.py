"""Structured output: what its masks cost.

Part 1, the engine (the shipped pair's target, greedy, all requests at once): the same prompts free, under a
regex, under a GBNF grammar of the same language (a pushdown automaton instead of a DFA: the same tokens, printed)
and under a JSON schema; each arm in its own engine, first ``cold`` (the grammar compiled and every state's
mask built on first use), then ``--rounds`` times ``warm`` (masks cached), the arms taking turns. Per arm: output
tokens, how many outputs ended whole (at EOS), the engine steps of the last round (what speculation saves on a
device where a step's cost hardly depends on its tokens), and wall time per output token, cold and the warm
median, and its ratio to the free arm's. The arms end at different lengths (a structured output ends at EOS once
whole), so compare per-token times. The ``+ PROPOSER`` arms add speculative decoding (``--proposer``, default the
shipped draft model; K ``--num-speculative-tokens``; ``--spec-option KEY=JSON`` sets a ``spec_decode`` plugin
option, e.g. ``structured=true``, without which structured requests do not speculate, and ``guided=false``;
``jump-forward`` drafts the text the grammar forces, for structured requests only, whatever the options): the draft
model drafts under the grammar (unless ``guided=false``), and a structured request's drafts are verified under its
grammar's masks, up to the first one the grammar refuses; their column "drafts accepted" counts the drafts verified
and accepted. ``--device cuda`` runs the engines on the GPU.

Part 2, the backend alone: the time to index a vocabulary and to build the first mask of a permissive state (inside
a JSON string: nearly every token allowed) and of a narrow one (digits), by the regex's DFA and by the same language's
GBNF grammar (whose table grows as masks meet its configurations; and, for comparison, the byte-order walk of
the vocabulary that its masks took before), for byte-level BPE vocabularies trained on
the Python standard library (the shipped 1,024 tokens, and ``--vocab`` sizes; the corpus caps a trained vocabulary
at about 39k).
Prints a table last.
"""
from __future__ import annotations

import argparse
import json
import sysconfig
import tempfile
import time
from pathlib import Path
from typing import Any

PROMPTS = ["def fibonacci(n):", "import os\n", "class Point:", "for i in range(", "x = {", "# a list of names\n",
           "def parse(text):", "with open(path) as f:"]
SCHEMA = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 16},
                                           "kind": {"enum": ["function", "class", "module"]},
                                           "tags": {"type": "array", "items": {"type": "string", "maxLength": 8},
                                                    "maxItems": 2}},
          "required": ["name", "kind"]}
REGEX = r"[a-z_]{1,16}\([a-z_, ]{0,24}\)( # [a-z ]{1,24})?"
GRAMMAR = ('root ::= name "(" args ")" comment?\nname ::= [a-z_]{1,16}\nargs ::= [a-z_, ]{0,24}\n'
           'comment ::= " # " [a-z ]{1,24}')  # REGEX's language
STRING_OR_DIGITS = (r'"[^"\\]*"|[0-9]+', 'root ::= "\\"" [^"\\\\]* "\\"" | [0-9]+')  # part 2: a regex, a grammar


def engine_rows(requests: int, max_tokens: int, rounds: int, k: int, proposer: str,
                options: dict[str, Any], device: str) -> list[tuple[str, ...]]:
    import statistics

    from infer.core.config import EngineConfig
    from infer.core.engine import Engine
    from infer.core.request import SamplingParams, StructuredOutput
    from infer.models.tiny import PRETRAINED_DIR

    specs = {"free": None, "regex": StructuredOutput(regex=REGEX), "gbnf": StructuredOutput(grammar=GRAMMAR),
             "json": StructuredOutput(json_schema=SCHEMA)}
    arms = {**{name: (spec, False) for name, spec in specs.items()},
            **{f"{name} + {proposer}": (spec, True) for name, spec in specs.items()}}
    prompts = [PROMPTS[i % len(PROMPTS)] for i in range(requests)]
    draft = {"proposer": proposer, "num_speculative_tokens": k, "plugin_options": {"spec_decode": options}}
    engines = {name: Engine(EngineConfig(model=str(PRETRAINED_DIR / "target"), device=device, max_num_seqs=requests,
                                         **(draft if speculative else {})))
               for name, (_, speculative) in arms.items()}
    times: dict[str, list[float]] = {name: [] for name in arms}
    counts: dict[str, tuple[int, int, int, int, int]] = {}
    outputs: dict[str, list[list[int]]] = {}
    for index in range(rounds + 1):  # round 0 is cold: grammars compiled, masks built; arms take turns
        for name in (arms if index % 2 else reversed(arms)):
            params = SamplingParams(max_tokens=max_tokens, temperature=0, structured_output=arms[name][0])
            start, steps = time.perf_counter(), engines[name].steps_taken
            outs = engines[name].generate(prompts, params)
            outputs[name] = [o.outputs[0].token_ids for o in outs]
            tokens = sum(len(o.outputs[0].token_ids) for o in outs)
            times[name].append((time.perf_counter() - start) / tokens)
            counts[name] = (tokens, sum(o.outputs[0].finish_reason.value == "stop" for o in outs),
                            sum(o.metrics.get("spec_accepted", 0) for o in outs),
                            sum(o.metrics.get("spec_proposed", 0) for o in outs), engines[name].steps_taken - steps)
    free = statistics.median(times["free"][1:])
    print(f"gbnf outputs equal regex outputs (the same language): {outputs['gbnf'] == outputs['regex']}")
    return [(name, str(counts[name][0]), f"{counts[name][1]}/{requests}", str(counts[name][4]),
             f"{counts[name][2]}/{counts[name][3]}" if arms[name][1] else "-", f"{times[name][0] * 1e3:.2f}",
             f"{statistics.median(times[name][1:]) * 1e3:.2f}", f"{statistics.median(times[name][1:]) / free:.2f}")
            for name in arms]


def mask_rows(sizes: list[int]) -> list[tuple[str, ...]]:
    import torch

    from infer.core.interfaces import Vocabulary
    from infer.core.loader import load_tokenizer
    from infer.core.request import StructuredOutput
    from infer.models.tiny import PRETRAINED_DIR, stdlib_corpus, train_tokenizer
    from infer.plugins.fsm_output import FsmBackend

    folders = [PRETRAINED_DIR / "target"]
    scratch = Path(tempfile.mkdtemp())
    whole_stdlib = sorted(Path(sysconfig.get_paths()["stdlib"]).rglob("*.py"))  # its packages too: enough text for
    for size in sizes:  # a 128k vocabulary (the top-level modules alone stop near 39k)
        train_tokenizer(scratch / str(size), vocab_size=size, files=stdlib_corpus(2000) if size <= 32768 else
                        whole_stdlib)
        folders.append(scratch / str(size))
    rows = []
    for folder in folders:
        tokenizer = load_tokenizer(folder)
        backend = FsmBackend(Vocabulary(tokenizer, len(tokenizer), frozenset({0}), torch.device("cpu")))
        start = time.perf_counter()
        backend.compile(StructuredOutput(regex=STRING_OR_DIGITS[0]))
        indexed = time.perf_counter() - start
        quote = tokenizer.convert_tokens_to_ids('"')
        row = [f"{len(tokenizer):,}", f"{indexed * 1e3:.0f}"]
        for spec in (StructuredOutput(regex=STRING_OR_DIGITS[0]), StructuredOutput(grammar=STRING_OR_DIGITS[1])):
            grammar = backend.compile(spec)
            for prefix in ([quote], []):  # inside a string: almost every token; at the start: '"', digits, tokens
                matcher = grammar.matcher()
                for token in prefix:
                    matcher.advance(token)
                start = time.perf_counter()
                allowed = int(matcher.allowed().sum())
                row.append(f"{(time.perf_counter() - start) * 1e3:.1f} ({allowed:,} allowed)")
        walked = backend.compile(StructuredOutput(grammar=STRING_OR_DIGITS[1]))  # compiled anew: no step cached
        matcher = walked.matcher()
        matcher.advance(quote)
        start = time.perf_counter()
        walked.walk(matcher.state)  # the byte-order walk, which a grammar's masks took before the table grew
        row.append(f"{(time.perf_counter() - start) * 1e3:.1f}")
        rows.append(tuple(row))
    return rows


def table(header: tuple[str, ...], rows: list[tuple[str, ...]]) -> str:
    widths = [max(len(r[i]) for r in [header, *rows]) for i in range(len(header))]
    return "\n".join(" | ".join(c.ljust(w) for c, w in zip(r, widths)) for r in [header, *rows])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--requests", type=int, default=16)
    parser.add_argument("--max-tokens", type=int, default=96)
    parser.add_argument("--rounds", type=int, default=5, help="warm rounds, after the cold one")
    parser.add_argument("--num-speculative-tokens", type=int, default=3, help="K of the + proposer arms")
    parser.add_argument("--proposer", default="draft-model", help="the proposer of the + proposer arms")
    parser.add_argument("--spec-option", action="append", default=[], metavar="KEY=JSON",
                        help="a spec_decode plugin option of the + proposer arms (repeatable)")
    parser.add_argument("--device", default="cpu", help="the engines' device (cpu, cuda)")
    parser.add_argument("--vocab", type=int, nargs="*", default=[8192, 32768, 131072],
                        help="trained vocabulary sizes to time masks on (above 32,768 trained on the whole standard "
                             "library, packages included)")
    parser.add_argument("--masks-only", action="store_true", help="time the vocabularies' masks only (part 2)")
    args = parser.parse_args()
    options = {key: json.loads(value) for key, _, value in (o.partition("=") for o in args.spec_option)}
    if not args.masks_only:
        engine = engine_rows(args.requests, args.max_tokens, args.rounds, args.num_speculative_tokens,
                             args.proposer, options, args.device)
        print(table(("arm", "output tokens", "ended whole", "steps", "drafts accepted", "cold ms / token",
                     "warm ms / token (median)", "warm / free"), engine))
        print()
    masks = mask_rows(args.vocab)
    print(table(("vocabulary", "index ms", "regex: first mask inside a string, ms", "regex: at the start, ms",
                 "grammar: inside a string, ms", "grammar: at the start, ms", "grammar, byte walk: inside, ms"),
                masks))


if __name__ == "__main__":
    main()
