"""Running an A/B comparison: build each arm once, make every round's workload, run the rounds interleaved."""
from __future__ import annotations

import dataclasses
import datetime
import gc
import logging
import os
import platform
import sys
from dataclasses import asdict
from collections.abc import Callable
from pathlib import Path
from typing import Any, Protocol, TypeVar

from ..cli.options import EngineArgs
from ..core.chat import ChatPrompt
from ..core.errors import ConfigError, InferError, InvalidRequestError
from ..core.pooling import PoolingParams
from ..core.request import SamplingParams
from ..core.tool_choice import forces_calls
from .arms import ArmError, ArmSpec
from .stats import RunResult
from .workloads import FileEntry, Vocab, Workload, WorkloadError, WorkloadSpec, build_workload, good_lines

log = logging.getLogger("infer")
T = TypeVar("T")


class Arm(Protocol):
    """What the runner needs from an engine arm, the HF baseline or a server (an ``openai:URL`` arm)."""

    spec: ArmSpec
    vocab: Vocab
    max_model_len: int
    kv_capacity_tokens: int | None  # the most tokens one request may hold in the arm's KV pool (None: no limit)
    cpu_threads: int | None  # torch's intra-op threads while the arm runs (None: the process default)
    freeze_gc: bool  # run with the heap frozen (gc.freeze), as `infer serve` does

    def tokenize(self, text: str) -> list[int]: ...

    def check_request(self, prompt: list[int], max_tokens: int) -> None:
        """InferError where the arm would refuse this request (the HF baseline refuses none)."""

    def check_embedding(self, prompt: list[int], pooling: PoolingParams) -> None:
        """InferError where the arm would refuse this embedding request (a pooler it does not compute, say)."""

    def keep_structured(self, params: SamplingParams) -> None: ...

    def reasons_before_grammar(self, chat: ChatPrompt) -> bool: ...

    def warm_up(self, workloads: list[Workload]) -> None: ...

    def run(self, workload: Workload, on_request_done: Callable[[], None]) -> RunResult: ...

    def describe(self) -> dict[str, object]: ...


def build_arms(specs: list[ArmSpec], base: EngineArgs, hf_batch_size: int, err: Any, task: str = "generate"
               ) -> list[Arm]:
    """Build every arm once (engines first: the HF baseline runs the first engine arm's model, and a server's
    requests are tokenized by its tokenizer) for ``task``'s requests. Raises ArmError."""
    from ..core.plugins import PluginManager
    from .runner import EngineArm

    engine_specs = [s for s in specs if s.is_engine]
    if engine_specs:  # every arm's component names, before the first engine loads a model
        plugins = PluginManager.from_entry_points()
        for spec in engine_specs:
            assert spec.args is not None
            try:
                spec.args.build(plugins)
            except InferError as exc:
                hint = (" (the options before `bench` apply to every arm; an arm overrides them with its own, e.g. "
                        "--no-async-scheduling for a switch the group turned on)") \
                    if _group_options_matter(spec, plugins) else ""
                raise ArmError(f"arm {spec.key} ({spec.text!r}): {exc}{hint}", isinstance(exc, ConfigError)) from None
    share_gpu_memory(engine_specs, sum(s.is_hf for s in specs))  # a server's memory is its own
    built: dict[str, Arm] = {}
    for spec in engine_specs:
        err.print(f"building arm {spec.label} ...", highlight=False)
        try:
            built[spec.key] = EngineArm(spec, PluginManager.from_entry_points(), task)
        except InferError as exc:
            raise ArmError(f"arm {spec.key} ({spec.text!r}): {exc}", isinstance(exc, ConfigError)) from None
    for spec in specs:
        if spec.is_hf:
            from .hf import HFArm

            err.print(f"building arm {spec.label} (HF transformers) ...", highlight=False)
            built[spec.key] = HFArm(spec, hf_model_path(base, built), hf_batch_size, base.values.get("device", "auto"),
                                    base.values.get("dtype", "auto"), base.values.get("cpu_threads"), task)
        elif spec.is_openai:
            from .openai_arm import OpenAIArm

            err.print(f"building arm {spec.label} (a server of OpenAI's API) ...", highlight=False)
            try:
                built[spec.key] = OpenAIArm(spec, hf_model_path(base, built), task, os.environ.get("OPENAI_API_KEY"))
            except InferError as exc:
                raise ArmError(f"arm {spec.key} ({spec.text!r}): {exc}") from None
    return [built[s.key] for s in specs]


def _group_options_matter(spec: ArmSpec, plugins: Any) -> bool:
    """Whether an arm that failed to build builds from its own options alone: then the options before `bench`,
    which every arm inherits, are part of its error."""
    from .arms import parse_engine_options

    try:
        parse_engine_options(spec.text).build(plugins)
    except (InferError, ArmError):
        return False
    return True


class ProcessSettings:
    """Applies an arm's process-wide settings before each of its runs. Every arm is built before the first run,
    so without this the last arm built would set torch's thread count and the frozen heap for all of them."""

    def __init__(self) -> None:
        import torch

        self.default_threads = torch.get_num_threads()

    def enter(self, arm: Arm) -> None:
        import torch

        from ..core.engine import freeze_heap

        torch.set_num_threads(arm.cpu_threads or self.default_threads)
        gc.unfreeze()
        gc.collect()  # every arm starts from a collected heap
        if arm.freeze_gc:
            freeze_heap()


def hf_model_path(base: EngineArgs, built: dict[str, Arm]) -> Path:
    from .runner import EngineArm

    if base.values.get("model"):
        return Path(base.values["model"])
    for arm in built.values():
        if isinstance(arm, EngineArm) and arm.engine.config.model:
            return Path(arm.engine.config.model)
    from ..models.tiny import ensure_default_model

    return ensure_default_model()


def share_gpu_memory(engine_specs: list[ArmSpec], hf_arms: int) -> None:
    """On CUDA, engines size their KV pool from free memory: give each arm that sets no size an equal share."""
    try:
        import torch
    except ImportError:
        return
    unsized = [s for s in engine_specs if s.args is not None and s.args.values.get("device", "auto") != "cpu"
               and "num_kv_blocks" not in s.args.values and "kv_cache_memory_gb" not in s.args.values]
    if not unsized or len(engine_specs) + hf_arms < 2 or not torch.cuda.is_available():
        return
    free, _ = torch.cuda.mem_get_info()
    models = [s.args.values.get("model") for s in engine_specs if s.args is not None]
    weights = sum(map(weights_bytes, models)) + hf_arms * weights_bytes(models[0])  # HF loads its own copy
    share = (0.8 * free - weights) / (len(engine_specs) + hf_arms)
    for s in unsized:
        assert s.args is not None
        s.args.values["kv_cache_memory_gb"] = max(0.25, share / 2**30)


def weights_bytes(model: str | None) -> int:
    if not model:
        return 0
    return sum(p.stat().st_size for p in Path(model).glob("*.safetensors"))


LENGTH_OPTIONS = {  # what sets a workload's longest request
    "random": "lower --input-len/--output-len",
    "shared-prefix": "lower --prefix-len/--question-len/--output-len",
    "multi-turn": "lower --input-len/--output-len/--turns",
    "long-prompt-arrival": "lower --long-len/--input-len/--output-len",
    "file": "shorten the file's prompts or max_tokens",
}


def length_options(spec: WorkloadSpec) -> str:
    """What shortens the spec's longest request (under --task embed, no output length)."""
    text = LENGTH_OPTIONS[spec.name]
    return text.replace("/--output-len", "").replace(" or max_tokens", "") if spec.task == "embed" else text


def make_workloads(spec: WorkloadSpec, rounds: range, arms: list[Arm], entries: list[FileEntry] | None
                    ) -> list[Workload]:
    """One workload per round, valid for every arm: tokens every vocabulary has, lengths every context fits.
    Warm-up rounds have negative indices: the same shapes with other tokens."""
    if not rounds:
        return []
    vocab = Vocab(min(a.vocab.size for a in arms), frozenset().union(*(a.vocab.special for a in arms)))
    workloads = [build_workload(spec, r, vocab, arms[0].tokenize, entries) for r in rounds]
    limit = min(a.max_model_len for a in arms)
    longest = workloads[0].longest_request()
    if longest > limit:
        raise WorkloadError(
            f"the {spec.name} workload has a request of {longest} tokens (prompt, history and output) but the "
            f"context length is {limit}; {length_options(spec)} or use a model with a longer context")
    for arm in arms:
        if arm.kv_capacity_tokens is not None and longest > arm.kv_capacity_tokens:
            raise WorkloadError(
                f"the {spec.name} workload has a request of {longest} tokens (prompt, history and output) but arm "
                f"{arm.spec.key} ({arm.spec.text!r}) has KV blocks for {arm.kv_capacity_tokens} tokens; "
                f"{length_options(spec)} or give that arm more KV memory (--num-kv-blocks, --kv-cache-memory-gb)")
    first_turns = [session.turns[0] for session in workloads[0].sessions if session.turns]
    generated = [turn for turn in first_turns if turn.pooling is None]
    if generated:  # what else an arm refuses (a prompt over a non-chunking scheduler's step budget): before any run
        turn = max(generated, key=lambda t: (len(t.tokens), t.max_tokens))
        for arm in arms:
            try:
                arm.check_request(list(turn.tokens), turn.max_tokens)
            except InferError as exc:
                raise WorkloadError(f"the {spec.name} workload's longest prompt ({len(turn.tokens)} tokens) does "
                                    f"not fit arm {arm.spec.key} ({arm.spec.text!r}): {exc}") from None
    if embedded := [turn for turn in first_turns if turn.pooling is not None]:  # its pooling too (a file's lines:
        turn = max(embedded, key=lambda t: len(t.tokens))  # keep_poolable_lines checked each one)
        for arm in arms:
            try:
                arm.check_embedding(list(turn.tokens), turn.pooling)  # type: ignore[arg-type]
            except InferError as exc:
                raise WorkloadError(f"arm {arm.spec.key} ({arm.spec.text!r}) refuses the {spec.name} workload's "
                                    f"embedding requests (the longest: {len(turn.tokens)} tokens): {exc}") from None
    return workloads


def keep_structured_lines(spec: WorkloadSpec, arms: list[Arm], entries: list[FileEntry]
                          ) -> tuple[list[FileEntry], list[str]]:
    """Every line's structured output (its own, or its forced tool calls') compiled by every arm and kept
    compiled there (compiling is never measured); like check_vocabulary: the good lines and an error per bad one,
    WorkloadError listing them all without --skip-bad-lines."""
    good, errors = [], []
    for entry in entries:
        refusal = None if entry.structured_output is None else _reasoning_refusal(arms, entry) or _refusal(
            arms, spec.sampling.params(entry.max_tokens, 0, 0, 0, entry.lora_adapter, entry.structured_output))
        if refusal is None:
            good.append(entry)
        else:
            errors.append(f"line {entry.line}: {refusal}")
    return good_lines(spec, good, errors, "line(s) whose structured output an arm cannot follow"), errors


def keep_fitting_lines(spec: WorkloadSpec, arms: list[Arm], entries: list[FileEntry]
                       ) -> tuple[list[FileEntry], list[str]]:
    """The lines whose request (prompt tokens, as the first arm renders and tokenizes it, plus max_tokens) fits
    every arm's context and KV pool, their prompts as those token ids (what every arm runs: tokenized once); like
    check_vocabulary: an error per bad line, WorkloadError listing them all without --skip-bad-lines
    (make_workloads then names no line)."""
    good, errors = [], []
    limit = min(arm.max_model_len for arm in arms)
    for entry in entries:
        try:
            ids = entry.prompt if isinstance(entry.prompt, tuple) else tuple(arms[0].tokenize(entry.prompt))
        except InvalidRequestError as exc:  # a chat the first arm's template cannot render (or no template)
            raise WorkloadError(f"line {entry.line}: {exc}") from None
        embeds = entry.pooling is not None
        total = len(ids) + (1 if embeds else entry.max_tokens)
        what = "prompt and the token an embedding reserves" if embeds else "prompt and max_tokens"
        short = [arm for arm in arms if arm.kv_capacity_tokens is not None and total > arm.kv_capacity_tokens]
        if total > limit:
            errors.append(f"line {entry.line}: a request of {total} tokens ({what}), over the context length of "
                          f"{limit}")
        elif short:
            errors.append(f"line {entry.line}: a request of {total} tokens ({what}), over the "
                          f"{short[0].kv_capacity_tokens} tokens arm {short[0].spec.key}'s KV blocks hold")
        else:
            good.append(dataclasses.replace(entry, prompt=ids))
    return good_lines(spec, good, errors, "line(s) too long for an arm"), errors


def keep_poolable_lines(spec: WorkloadSpec, arms: list[Arm], entries: list[FileEntry]
                        ) -> tuple[list[FileEntry], list[str]]:
    """The lines whose embedding request (if any) every arm computes (a pooler it has, dimensions within the
    hidden size, as the arm's check_embedding says); like check_vocabulary: the good lines and an error per bad one,
    WorkloadError listing them all without --skip-bad-lines."""
    good, errors = [], []
    for entry in entries:
        refusal = None
        prompt = entry.prompt
        for arm in arms if entry.pooling is not None else ():
            try:
                ids = list(prompt) if isinstance(prompt, tuple) else arms[0].tokenize(prompt)  # type: ignore[arg-type]
                arm.check_embedding(ids, entry.pooling)  # type: ignore[arg-type]
            except InferError as exc:
                refusal = f"arm {arm.spec.key} ({arm.spec.text!r}) refuses its embedding request: {exc}"
                break
        if refusal is None:
            good.append(entry)
        else:
            errors.append(f"line {entry.line}: {refusal}")
    return good_lines(spec, good, errors, "line(s) whose embedding request an arm refuses"), errors


def _reasoning_refusal(arms: list[Arm], entry: FileEntry) -> str | None:
    """Why a chat line's own structured output cannot be measured as served: an arm's reasoning parser would have
    the grammar hold after the reply's reasoning, but the bench sends every chat as token ids (the first arm's
    rendering, the same for every arm), where the grammar holds from the first token."""
    if not isinstance(entry.prompt, ChatPrompt) or forces_calls(entry.prompt):  # forced calls never reason first
        return None
    for arm in arms:
        if arm.reasons_before_grammar(entry.prompt):
            return (f"arm {arm.spec.key} ({arm.spec.text!r}) has a reasoning parser that lets this chat's reply "
                    "reason before its structured output, and the bench sends chats as token ids, whose structured "
                    "output holds from the first token; drop the line's structured_output or the arm's "
                    "--reasoning-parser")
    return None


def _refusal(arms: list[Arm], params: SamplingParams) -> str | None:
    """Why an arm cannot follow the structured output of ``params``; None when each can (and keeps it)."""
    for arm in arms:
        try:
            arm.keep_structured(params)
        except (InferError, WorkloadError) as exc:
            return f"arm {arm.spec.key} ({arm.spec.text!r}) cannot follow its structured output: {exc}"
    return None


class RunError(Exception):
    """An arm failed (or Ctrl-C) during a run; ``runs`` holds the rounds every arm completed before it."""

    def __init__(self, message: str, runs: dict[str, list[RunResult]], interrupted: bool = False) -> None:
        super().__init__(message)
        self.runs, self.interrupted = runs, interrupted


def _failure(arm: Arm, exc: BaseException, when: str) -> RunError:
    """The RunError of ``arm`` stopped by ``exc`` ``when`` (e.g. "in round 2 of 3"): infer's own errors by their
    message, others (CUDA out of memory, a bug) with their type; a Ctrl-C as an interruption, not a failure."""
    if isinstance(exc, KeyboardInterrupt):
        return RunError(f"interrupted {when} (arm {arm.spec.key}, {arm.spec.text!r})", {}, True)
    reason = str(exc) if isinstance(exc, InferError) else f"{type(exc).__name__}: {exc}"
    return RunError(f"arm {arm.spec.key} ({arm.spec.text!r}) failed {when}: {reason}", {})


def warm_up(arms: list[Arm], warmups: list[Workload], settings: ProcessSettings, err: Any) -> None:
    for arm in arms:
        if warmups:
            err.print(f"warming up arm {arm.spec.key} ...", highlight=False)
        try:
            settings.enter(arm)
            arm.warm_up(warmups)  # also with no rounds: records the counters the runs are measured from
        except (Exception, KeyboardInterrupt) as exc:
            log.debug("arm %s failed while warming up", arm.spec.key, exc_info=True)
            raise _failure(arm, exc, "while warming up") from exc


def round_order(arms: list[T], round_index: int) -> list[T]:
    """Round i runs the arms rotated by i (A B, B A, ...), so that drift during a round favours no arm."""
    shift = round_index % len(arms)
    return arms[shift:] + arms[:shift]


def run_rounds(arms: list[Arm], workloads: list[Workload], settings: ProcessSettings, err: Any
               ) -> dict[str, list[RunResult]]:
    """Every round runs every arm, in :func:`round_order`. Raises RunError naming the arm and round that failed."""
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    runs: dict[str, list[RunResult]] = {arm.spec.key: [] for arm in arms}
    total = sum(w.num_requests for w in workloads) * len(arms)
    with Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                  console=err) as progress:
        task = progress.add_task("bench", total=total)
        for i, workload in enumerate(workloads):
            for arm in round_order(arms, i):
                progress.update(task, description=f"round {i + 1}/{len(workloads)} arm {arm.spec.key}")
                try:
                    settings.enter(arm)
                    result = arm.run(workload, lambda: progress.advance(task))
                    result.long_session = workload.long_session
                    runs[arm.spec.key].append(result)
                except (Exception, KeyboardInterrupt) as exc:  # keep what completed, whatever the failure
                    log.debug("arm %s failed in round %d", arm.spec.key, i + 1, exc_info=True)
                    failure = _failure(arm, exc, f"in round {i + 1} of {len(workloads)}")
                    failure.runs = {key: done[:i] for key, done in runs.items()}
                    raise failure from exc
    return runs


def arm_info(arm: Arm) -> dict[str, Any]:
    """What the JSON keeps about an arm besides its runs: its config, and for an engine its own counters."""
    return {"config": arm.describe(), "warmup": getattr(arm, "warmup_counters", None),
            "engine_totals": engine_totals(arm)}


def engine_totals(arm: Arm) -> dict[str, Any] | None:
    """The engine's own cumulative metrics at the end (warm-up and every round included)."""
    from .runner import EngineArm

    if not isinstance(arm, EngineArm):
        return None
    kv = arm.engine.kv.stats()
    return {"prefix_queries": kv.prefix_queries, "prefix_hits": kv.prefix_hits,
            "summary": arm.engine.stats.summary()}


def run_info(spec: WorkloadSpec, repeats: int, warmup_rounds: int, specs: list[ArmSpec],
          started: datetime.datetime) -> dict[str, Any]:
    import torch

    from .. import __version__

    device = torch.cuda.get_device_name() if torch.cuda.is_available() else _cpu_name()
    workload = {k: (str(v) if isinstance(v, Path) else v) for k, v in asdict(spec).items()}
    return {
        "date": started.isoformat(timespec="seconds"),
        "infer_version": __version__,
        "argv": sys.argv,
        "machine": {"platform": platform.platform(), "python": platform.python_version(), "torch": torch.__version__,
                    "device": device, "cpus": _cpu_count()},
        "workload": workload,
        "repeats": repeats,
        "warmup_rounds": warmup_rounds,
        "order": [s.key for s in specs],
        "round_orders": [[s.key for s in round_order(specs, i)] for i in range(repeats)],
    }


def _cpu_name() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "cpu"


def _cpu_count() -> int:
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
