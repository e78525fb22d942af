"""The ``infer bench`` click command: parse arms and workload, build each arm once, run the rounds (A B, B A, ...),
report."""
from __future__ import annotations

import dataclasses
import datetime
import math
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

import click

from ..cli.options import EngineArgs, sampling_option, sampling_options
from .arms import ArmError, ArmSpec, parse_arms
from .tasks import check_embedding_lines, task_pooling
from .workloads import (TASKS, WORKLOADS, FileEntry, RequestSampling, WorkloadError, WorkloadSpec, check_task,
                        check_vocabulary, good_lines, lora_adapters_used, validate_spec)

OUTPUT_FILES = ("results.json", "table.txt", "latency_cdf.png", "throughput.png")
AB_HINT = 'quote each arm as one argument: --ab "--kv-cache paged" "--kv-cache paged --no-prefix-caching"'


class BenchCommand(click.Command):
    """Accepts ``--ab A B C`` (every following argument up to the next bench option) as ``--ab A --ab B --ab C``."""

    def parse_args(self, ctx: click.Context, args: list[str]) -> list[str]:
        names = {name for param in self.get_params(ctx) for name in getattr(param, "opts", [])}
        return super().parse_args(ctx, expand_ab(args, names))


def expand_ab(args: list[str], option_names: set[str]) -> list[str]:
    out: list[str] = []
    i = 0
    while i < len(args):
        if args[i] != "--ab":
            out.append(args[i])
            i += 1
            continue
        i += 1
        arms = []
        while i < len(args) and args[i] != "--ab" and args[i].split("=", 1)[0] not in option_names:
            arms.append(args[i])
            i += 1
        if not arms:
            raise click.UsageError("--ab needs at least one arm after it: a quoted string of group options (\"\" "
                                   "for the defaults), hf, hf:static, hf:cb or openai:URL, e.g. --ab \"\" "
                                   "\"--no-prefix-caching\"")
        for arm in arms:
            out += ["--ab", arm]
    return out


@click.command("bench", cls=BenchCommand)
@click.option("--workload", type=click.Choice(WORKLOADS), default="random", show_default=True,
              help="Which requests to send (see docs/cli.md).")
@click.option("--task", type=click.Choice(TASKS), default="generate", show_default=True,
              help="generate: every request generates its output; embed: every request is an embedding request "
                   "(random, shared-prefix and file workloads; a file line may also say \"embed\": true).")
@click.option("--pooling", default=None, metavar="NAME",
              help="--task embed: the pooler (last, mean, ...; the hf arms pool last or mean) [default: the "
                   "checkpoint's sentence-transformers pooling, else last].")
@click.option("--dimensions", type=int, default=None,
              help="--task embed: keep the first N values of each embedding, before normalizing [default: all].")
@click.option("--normalize/--no-normalize", default=None,
              help="--task embed: L2-normalize each embedding [default: as the checkpoint says, else --normalize].")
@click.option("--ab", "arms", multiple=True, metavar="ARM...",
              help="Arms to compare: each a quoted string of group options (e.g. \"--kv-cache paged\"), or hf, "
                   "hf:static, hf:cb for the HF transformers baseline, or openai:URL for a running server of OpenAI's "
                   "HTTP API (URL its API base, e.g. http://127.0.0.1:8000/v1; the bearer token from "
                   "OPENAI_API_KEY). Default: one arm of the group options.")
@click.option("--repeats", type=click.IntRange(min=1), default=None,
              help="Rounds; each round runs every arm once, the order rotating by one arm per round (A B, B A, ...). "
                   "Default: 3, rounded up to a multiple of the number of arms (each arm then runs first equally "
                   "often).")
@click.option("--num-requests", type=int, default=32, show_default=True,
              help="Requests (multi-turn: conversations; long-prompt-arrival: steady decodes).")
@click.option("--input-len", type=int, default=128, show_default=True,
              help="Mean prompt length (multi-turn: new tokens per user turn).")
@click.option("--output-len", type=int, default=32, show_default=True, help="Mean output length.")
@click.option("--len-sigma", type=float, default=0.5, show_default=True,
              help="Lognormal sigma of the random lengths; 0 makes every length its mean.")
@click.option("--prefix-len", type=int, default=1000, show_default=True,
              help="shared-prefix: tokens of the system prompt every request shares.")
@click.option("--question-len", type=int, default=100, show_default=True,
              help="shared-prefix: mean tokens of each request's own question.")
@click.option("--turns", type=int, default=4, show_default=True, help="multi-turn: turns per conversation.")
@click.option("--long-len", type=int, default=1000, show_default=True,
              help="long-prompt-arrival: tokens of the long prompt.")
@click.option("--long-delay", type=float, default=0.25, show_default=True,
              help="long-prompt-arrival: seconds after the start when the long prompt arrives.")
@click.option("--rate", type=float, default=math.inf, show_default=True,
              help="Poisson arrival rate in requests (conversations) per second; inf sends all at once.")
@click.option("--file", "workload_file", type=click.Path(dir_okay=False, path_type=Path), default=None,
              help='file workload: JSONL, one {"prompt": "text" or [token ids], "max_tokens": N} per line, or a chat: '
                   '{"messages": [...], "tools": [...] (optional), "max_tokens": N}; a line may add '
                   '"structured_output": {"json_schema": {...}} (or "regex", "choice", "grammar"): it ends at EOS once '
                   'whole.')
@click.option("--skip-bad-lines", is_flag=True, help="file workload: run the good lines, warn about the bad ones.")
@click.option("--lora-adapter", "lora_adapters", multiple=True, metavar="NAME",
              help="Run the requests on LoRA adapters: session i (a request, or a whole conversation) on the "
                   "(i mod count)-th NAME given (repeatable; repeat a name to weight it). Every arm loads them with "
                   "--lora NAME=DIR. Default: the base model. A --workload file names each line's own instead.")
@click.option("--workload-seed", type=int, default=0, show_default=True,
              help="Seed of the workload's lengths, arrivals and tokens.")
@click.option("--warmup-rounds", type=click.IntRange(min=0), default=1, show_default=True,
              help="Unmeasured rounds per arm before the first measured one (fresh prompts of the same shape).")
@sampling_options
@click.option("--sampling-seed", type=click.IntRange(0, 2**63 - 1), default=None,
              help="Seed every request's sampling with its own seed derived from this one, its round and its place in "
                   "the workload, so that every arm samples it from the same stream [default: each engine's random "
                   "stream: outputs are then not compared].")
@click.option("--hf-batch-size", type=click.IntRange(min=1), default=32, show_default=True,
              help="hf:static: most requests per padded batch (embedding requests: per AutoModel batch, longest "
                   "first).")
@click.option("--out", "out_dir", type=click.Path(file_okay=False, path_type=Path), default=None,
              help="Write results.json, table.txt, latency_cdf.png and throughput.png here.")
@click.pass_context
def bench(ctx: click.Context, workload: str, task: str, pooling: str | None, dimensions: int | None,
          normalize: bool | None, arms: tuple[str, ...], repeats: int | None, num_requests: int,
          input_len: int, output_len: int, len_sigma: float, prefix_len: int, question_len: int, turns: int,
          long_len: int, long_delay: float, rate: float, workload_file: Path | None, skip_bad_lines: bool,
          lora_adapters: tuple[str, ...], workload_seed: int, warmup_rounds: int, sampling: dict[str, Any],
          sampling_seed: int | None, hf_batch_size: int, out_dir: Path | None) -> None:
    """Benchmark arms side by side on one seeded workload, interleaved over rounds so that drift cancels.

    Example: infer --model DIR bench --workload multi-turn --ab "--kv-cache paged" "--no-prefix-caching" hf
    --repeats 3 --out results/

    Embeddings: infer --model DIR bench --task embed --workload shared-prefix --ab "--kv-cache paged" hf

    A running server (vLLM, another infer): infer --model DIR bench --ab "" "openai:http://127.0.0.1:8000/v1"
    """
    from rich.console import Console

    base = ctx.find_object(EngineArgs) or EngineArgs()
    try:
        specs = parse_arms(arms, base, component_field_of(ctx))
    except ArmError as exc:
        raise click.BadParameter(f"{exc}\n({AB_HINT})", param_hint="'--ab'") from None
    err = Console(stderr=True, soft_wrap=True)  # a message is one line: a log stays greppable
    repeats = balanced_repeats(repeats, len(specs), err)
    if workload_file is not None and workload != "file":
        raise click.UsageError(f"--file is read by --workload file only; this run's workload is {workload!r}")
    request_sampling = check_sampling(sampling, sampling_seed, specs, ctx)
    spec = WorkloadSpec(workload, num_requests, input_len, output_len, len_sigma, prefix_len, question_len, turns,
                        long_len, long_delay, rate, workload_seed, workload_file, skip_bad_lines, request_sampling,
                        lora_adapters, task)
    try:
        check_task(spec)  # before the task's options: the workload it refuses is the first thing to fix
        spec = dataclasses.replace(spec, pooling=task_pooling(ctx, task, pooling, dimensions, normalize, specs))
        entries = validate_spec(spec)
    except WorkloadError as exc:
        raise click.UsageError(str(exc)) from None
    check_embedding_lines(entries or [], specs)
    check_lora_adapters(lora_adapters_used(spec, entries), specs)
    check_structured_lines(entries or [], specs, request_sampling)
    if spec.name == "file" and skip_bad_lines:
        _warn_bad_lines(spec, err)

    if out_dir is not None:  # before the run, not after it
        if earlier := [name for name in OUTPUT_FILES if (out_dir / name).exists()]:
            raise click.BadParameter(f"{out_dir} holds an earlier run's {', '.join(earlier)}, which this run would "
                                     "overwrite; choose another folder, or delete them first", param_hint="'--out'")
        try:
            out_dir.mkdir(parents=True, exist_ok=True)
            with tempfile.TemporaryFile(dir=out_dir):
                pass
            for name in ("table.txt", "results.json"):
                if (out_dir / name).is_dir():
                    raise IsADirectoryError(f"{out_dir / name} is a folder")
        except OSError as exc:
            raise click.BadParameter(f"cannot create or write the output folder: {exc}", param_hint="'--out'") from None
    from .report import BenchResult
    from .session import (ProcessSettings, RunError, arm_info, build_arms, keep_fitting_lines, keep_poolable_lines,
                          keep_structured_lines, make_workloads, run_info, run_rounds, warm_up)

    started = datetime.datetime.now(datetime.timezone.utc)
    settings = ProcessSettings()  # before any arm's engine sets the thread count
    try:  # the engine refuses an arm's options (status 2, as `generate` would exit) or its model (status 1)
        built = build_arms(specs, base, hf_batch_size, err, task)
    except ArmError as exc:
        from ..cli.main import CommandLineError

        raise (CommandLineError if exc.options_refused else click.ClickException)(str(exc)) from None
    from ..cli.main import CommandLineError

    vocab = min(arm.vocab.size for arm in built)
    if outside := [token for token, _ in request_sampling.fields.get("logit_bias", ()) if token >= vocab]:
        raise CommandLineError(f"--logit-bias names token ids {outside[:5]} outside the vocabulary of "
                               f"{vocab} tokens{' (the smallest of the arms)' if len(built) > 1 else ''}")
    try:
        if entries is not None:  # the checks that need the models, every bad line of all four listed at once
            every = dataclasses.replace(spec, skip_bad_lines=True)
            entries, skipped = check_vocabulary(every, entries, vocab)
            entries, unfollowed = keep_structured_lines(every, built, entries)
            entries, too_long = keep_fitting_lines(every, built, entries)
            entries, unpooled = keep_poolable_lines(every, built, entries)
            bad = skipped + unfollowed + too_long + unpooled  # by check, each in line order
            entries = good_lines(spec, entries, bad, "bad line(s) found once the models loaded")
            for line in bad:
                err.print(f"[yellow]skipped {spec.file} {line}[/yellow]", highlight=False)
        workloads = make_workloads(spec, range(repeats), built, entries)
        warmups = make_workloads(spec, range(-1, -1 - warmup_rounds, -1), built, entries)
    except WorkloadError as exc:  # the workload the options or the file describe does not fit the models: status 2
        raise CommandLineError(str(exc)) from None
    try:
        warm_up(built, warmups, settings, err)
        runs, failure = run_rounds(built, workloads, settings, err), None
    except RunError as exc:
        runs, failure = {arm.spec.key: exc.runs.get(arm.spec.key, []) for arm in built}, exc
    meta = run_info(spec, repeats, warmup_rounds, specs, started)
    meta["failure"] = None if failure is None else str(failure)  # the rounds every arm completed are still reported
    meta["rounds_completed"] = min((len(kept) for kept in runs.values()), default=0)
    result = BenchResult(specs, runs, meta, {arm.spec.key: arm_info(arm) for arm in built}, request_sampling)
    if any(runs.values()):
        _report(result, out_dir)
    elif out_dir is not None:  # no round to tabulate: the failure and the arms' configs are still on record
        from .report import write_json

        write_json(result, out_dir / "results.json")
    if failure is not None:
        completed = len(next(iter(runs.values()), []))
        message = f"{failure}" + (f"\n(the table shows the {completed} round(s) every arm completed)"
                                  if completed else "")
        if failure.interrupted:
            click.echo(message, err=True)
            raise SystemExit(130)
        raise click.ClickException(message)


def balanced_repeats(repeats: int | None, num_arms: int, err: Any) -> int:
    """The rounds to run: by default 3 rounded up to a multiple of the arms, so that the rotation puts each arm
    first equally often; a count given that does not do so is warned about."""
    if repeats is None:
        return math.ceil(3 / num_arms) * num_arms
    if repeats % num_arms:
        err.print(f"[yellow]--repeats {repeats} with {num_arms} arms: arm A runs first in "
                  f"{math.ceil(repeats / num_arms)} of {repeats} rounds, so drift during a run can favour some arms; "
                  f"use a multiple of {num_arms}[/yellow]", highlight=False)
    return repeats


def check_sampling(sampling: dict[str, Any], seed: int | None, specs: list[ArmSpec], ctx: click.Context
                   ) -> RequestSampling:
    """The workload's sampling, refused (exit status 2) where a value is out of range or an HF arm cannot sample
    that way."""
    from ..cli.main import option_error
    from ..core.errors import InvalidRequestError

    request_sampling = RequestSampling(sampling, seed)
    try:
        request_sampling.params(max(1, sampling["min_tokens"]), 0, 0, 0).validate()
    except InvalidRequestError as exc:
        raise option_error(exc, ctx) from None
    unsupported = [sampling_option(name) for name in ("frequency_penalty", "presence_penalty", "logits_processors")
                   if sampling[name]]
    if unsupported and any(spec.is_hf for spec in specs):
        raise click.UsageError(f"HF transformers has no {' or '.join(unsupported)}: drop it or the hf arms")
    if sampling["logits_processors"] and any(spec.is_openai for spec in specs):
        raise click.UsageError("OpenAI's API takes no --logits-processor (a server runs its own): drop it or the "
                               "openai arms")
    if any(spec.hf_mode == "cb" for spec in specs) and (dropped := dropped_by_hf_cb(sampling)):
        raise click.UsageError(f"transformers' continuous batching drops {', '.join(dropped)} (its processor does "
                               "not support it), so hf:cb would not sample as the other arms: drop it or the hf:cb "
                               "arm (hf, static batches, applies it)")
    if seed is not None and request_sampling.greedy:
        click.echo("warning: --sampling-seed seeds sampled requests, and these are greedy (--temperature 0)",
                   err=True)
    return request_sampling


def check_lora_adapters(used: list[str], specs: list[ArmSpec]) -> None:
    """Refuse (exit status 2, before any model loads) an arm that cannot serve every adapter the requests name."""
    if not used:
        return
    if hf := [spec.text for spec in specs if spec.is_hf]:
        raise click.UsageError(f"the HF baseline ({', '.join(hf)}) serves no LoRA adapters, and this workload's "
                               f"requests run on {', '.join(used)}: drop the hf arms or the adapters")
    for spec in specs:
        if spec.args is None:  # a server: its adapters are checked against GET /models once it is reached
            continue
        loaded = spec.args.values.get("lora_adapters") or {}
        if missing := [name for name in used if name not in loaded]:
            have = f"it loads {', '.join(loaded)}" if loaded else "it loads none"
            raise click.UsageError(f"arm {spec.label} cannot serve LoRA adapter(s) {', '.join(missing)}, which the "
                                   f"workload's requests run on ({have}); give every arm --lora NAME=DIR, before "
                                   "`bench` or in the arm")


def check_structured_lines(entries: list[FileEntry], specs: list[ArmSpec], sampling: RequestSampling) -> None:
    """Refuse (exit status 2, before any model loads) structured lines (forced tool calls too) beside an HF arm or
    a server (an openai arm), or beside sampling options they cannot take."""
    from ..cli.main import CommandLineError
    from ..core.errors import InvalidRequestError

    structured = [entry for entry in entries if entry.structured_output is not None]
    if not structured:
        return
    if hf := [spec.text for spec in specs if spec.is_hf]:
        raise click.UsageError(f"HF transformers ({', '.join(hf)}) has no structured output, and {len(structured)} "
                               f"of the file's lines give one or force tool calls (line {structured[0].line} "
                               "first): drop the hf arms or those lines' structured_output or tool_choice")
    if servers := [spec.text for spec in specs if spec.is_openai]:
        raise click.UsageError(f"openai arms ({', '.join(servers)}) do not send structured output (servers read "
                               f"grammars in dialects of their own), and {len(structured)} of the file's lines give "
                               f"one or force tool calls (line {structured[0].line} first): drop the openai arms or "
                               "those lines' structured_output or tool_choice")
    try:
        sampling.params(1, 0, 0, 0, structured_output=structured[0].structured_output).validate()
    except InvalidRequestError as exc:
        raise CommandLineError(f"line {structured[0].line}: {exc}") from None


def dropped_by_hf_cb(sampling: dict[str, Any]) -> list[str]:
    """The sampling options whose transformers processor says it does not support continuous batching."""
    from transformers.generation import logits_process as processors

    used = {"repetition_penalty": (sampling["repetition_penalty"] != 1.0, "RepetitionPenaltyLogitsProcessor"),
            "min_p": (bool(sampling["min_p"]), "MinPLogitsWarper"),
            "logit_bias": (bool(sampling["logit_bias"]), "SequenceBiasLogitsProcessor")}
    return [f"--{name.replace('_', '-')}" for name, (given, cls) in used.items()
            if given and getattr(getattr(processors, cls, None), "supports_continuous_batching", None) is False]


def component_field_of(ctx: click.Context) -> Callable[[str], str | None]:
    """The EngineConfig field a --plugin name sets (None for names of no component kind), from the plugins."""
    from ..cli.main import _plugins
    from ..core.config import COMPONENT_FIELDS

    plugins = _plugins(ctx)
    return lambda name: next((field for kind, field in COMPONENT_FIELDS.items() if name in plugins.registry(kind)),
                             None)


def _warn_bad_lines(spec: WorkloadSpec, err: Any) -> None:
    from .workloads import parse_workload_file

    assert spec.file is not None
    _, errors = parse_workload_file(spec.file, spec.task_pooling)
    for line in errors:
        err.print(f"[yellow]skipped {spec.file} {line}[/yellow]", highlight=False)


def _report(result: Any, out_dir: Path | None) -> None:
    from rich.console import Console

    from .report import render_table, write_json, write_plots

    text = render_table(result, Console())
    if out_dir is None:
        return
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "table.txt").write_text(text, encoding="utf-8")
    write_json(result, out_dir / "results.json")
    written = ["results.json", "table.txt"]
    try:
        written += [p.name for p in write_plots(result, out_dir)]
    except ImportError:
        click.echo("matplotlib is not installed: no plots (pip install 'infer-engine[bench]')", err=True)
    click.echo(f"wrote {', '.join(written)} to {out_dir}", err=True)
