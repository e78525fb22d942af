"""Engine: add_request / step / abort / generate / stream (the offline wrapper, LLM, is in core/llm.py)."""
from __future__ import annotations

import atexit
import contextlib
import dataclasses
import gc
import logging
import math
import os
import threading
import time
import uuid
from collections.abc import Callable, Iterator, Sequence as Seq
from typing import TYPE_CHECKING

import torch

from .admission import RequestChecker, at_prompt, check_prompt_list, check_schedule
from .assembly import assemble
from .beam_search import BeamSearch, BeamSearches, BeamSearchOutput, BeamSearchParams
from .chat import Prompt, check_can_sanitize, check_default_template_kwargs, read_chat_template
from .classification import read_pad_token_id
from .config import EngineConfig
from .detokenizer import detokenizer_factory
from .errors import InferError, InvalidRequestError, NotFoundError, PluginError
from .forks import PendingForks, start_forks
from .intake import Intake
from .interrupts import HeldInterrupts
from .loader import LoadProgress, out_of_memory
from .interfaces import LogitsProcessor, Pooler, SchedulerOutput, StructuredOutputBackend, Vocabulary
from .logits_processors import LogitsProcessors
from .lora import load_lora_adapter, unload_lora_adapter
from .metrics import EngineStats, StepTimes, count_decodes
from .model import no_lm_head
from .pooling import Embeddings, PoolingParams, Poolers, read_pooling_defaults
from .outputs import RequestState, append_output, build_output, with_every_sequence
from .plugins import Blame, PluginManager, checked_manager
from .readers import Reader, Readers
from .request import CompletionOutput, FinishReason, RequestOutput, SamplingParams, Sequence
from .runner import PENDING_TOKEN, Batch, InFlight
from .sampling import to_device
from .structured_output import StructuredOutputs

if TYPE_CHECKING:
    from ..models.lora import LoraAdapter
    from ..spec_decode.decoder import SpecDecoder

log = logging.getLogger("infer")

STEP_TOO_LARGE = ("the KV pool leaves too little room for its activations; lower --kv-cache-memory-gb (the "
                  "default takes 90% of the free memory, less 1 GiB), --max-num-batched-tokens or --max-num-seqs "
                  "(this engine may be inconsistent now: start a new one)")


Params = SamplingParams | PoolingParams  # a generation request's, or an embedding request's


def freeze_heap() -> None:
    """``gc.freeze()``, unfrozen again at exit (once per process), so that the frozen heap is collected as usual
    there (else extension modules, triton's and nanobind's among them, report its cycles as leaks)."""
    gc.freeze()
    atexit.unregister(gc.unfreeze)
    atexit.register(gc.unfreeze)


def live_part(out: SchedulerOutput, gone: set[int]) -> SchedulerOutput:
    """``out`` without the sequences in ``gone`` (finished since ``schedule``), for ``Scheduler.update``."""
    if not gone:
        return out
    return dataclasses.replace(out, scheduled=[item for item in out.scheduled if item.seq.seq_id not in gone])


class Engine:
    """The serving API. Not thread-safe: one thread drives ``step()`` (the gRPC server hands off to it); a step,
    add_request or abort from a second thread while the first is in one raises RuntimeError."""

    def __init__(self, config: EngineConfig, plugins: PluginManager | None = None,
                 load_progress: LoadProgress | None = None) -> None:
        """``load_progress(read, total)``: told the bytes of the weight files read as they load (the CLI's bar)."""
        plugins = checked_manager(plugins)
        config = config.replace().validate()  # a private copy: the engine resolves defaults into it
        self.config = config
        started = time.perf_counter()
        self.plugins = (plugins or PluginManager.from_entry_points()).collect()
        parts = assemble(config, self.plugins, load_progress)
        self.loaded, self.attention, self.kv_dtype, self.num_blocks = \
            parts.loaded, parts.attention, parts.kv_dtype, parts.num_blocks
        self.kv, self.scheduler, self.runner = parts.kv, parts.scheduler, parts.runner
        self.tokenizer = self.loaded.tokenizer
        if config.chat_template is not None:  # this engine's own tokenizer object: no one else sees the change
            self.tokenizer.chat_template = read_chat_template(config.chat_template, self.tokenizer)
        if config.default_chat_template_kwargs:
            check_default_template_kwargs(self.tokenizer, config.default_chat_template_kwargs)
        if config.sanitize_chat_control_tokens:
            check_can_sanitize(self.tokenizer)
        self.new_detokenizer = detokenizer_factory(self.tokenizer, self.loaded.model.spec.vocab_size)
        spec = self.loaded.model.spec
        self.max_model_len = spec.max_model_len
        # generation_config.json's eos ids when it names some (as HF's generate), else config.json's (HF would stop
        # at none if generation_config.json exists without them), else the tokenizer's
        tokenizer_eos = [self.tokenizer.eos_token_id] if self.tokenizer.eos_token_id is not None else []
        self.eos_token_ids = frozenset(self.loaded.generation_eos or spec.eos_token_ids or tokenizer_eos)
        checker = RequestChecker.for_model(self.tokenizer, spec.vocab_size, spec.max_model_len,
                                           config.default_chat_template_kwargs, config.sanitize_chat_control_tokens,
                                           frozenset(config.lora_adapters), self.eos_token_ids)
        self.structured = StructuredOutputs(self._structured_output_backend, config.structured_output_backend,
                                            spec.vocab_size)
        self.runner.structured = self.structured
        self.processors = self.runner.processors = LogitsProcessors(
            lambda name: self._logits_processor(name), self.plugins.registry("logits_processor").names,
            self._plugin_code)
        self.active = parts.active(config)
        self.requests: dict[str, RequestState] = {}
        self.async_scheduling = config.async_scheduling_on(self.loaded.device.type)
        self.async_output = config.async_output if config.async_output is not None else \
            self.loaded.device.type == "cuda" or self.async_scheduling  # async scheduling emits a step late
        self.unemitted: list[Sequence] = []  # async output: advanced in the last step, outputs not built yet
        self.in_flight: InFlight | None = None  # async scheduling: the last step's tokens, not read back yet
        self.deferred: InferError | None = None  # a step's output error, raised once the step is done
        self.interrupted = False  # a step raised: the next one emits requests it finished but left unemitted
        self.stepping = 0  # steps under way in this (the one) thread: nested ones count too
        self.entered = threading.RLock()  # held by the thread in a step, add_request or abort
        self.interrupts = HeldInterrupts()
        self.forks = PendingForks()  # n > 1 requests whose first sequence has not sampled yet
        self.stats = EngineStats()
        self.spec: SpecDecoder | None = None
        if parts.proposer is not None:
            from ..spec_decode.decoder import SpecDecoder

            self.spec = SpecDecoder(config, parts.proposer, self.kv, self.runner.sampler, self.stats, spec.vocab_size,
                                    self.structured)
        self.blame = Blame(self.plugins, parts.blamed(config))
        # checks requests and builds their state, numbering the sequences of requests and beam searches; its
        # tool_parser reads the replies of chats that offer tools, its reasoning_parser splits chats' replies
        self.intake = Intake(checker, self.structured, self.eos_token_ids, self.max_model_len,
                             self.new_detokenizer, parts.tool_parser, parts.reasoning_parser, config.reasoning_parser,
                             self.blame, self._plugin_code, self.processors)
        self.steps_taken = 0  # steps run, empty ones included (stats.steps counts those that recorded stats)
        self.prompt_logprob_requests = 0  # live requests that ask for prompt logprobs
        model = self.loaded.model  # a sequence classifier's embeddings are its score head's label logits
        self.embeddings = Embeddings(read_pooling_defaults(self.loaded.path),
                                     Poolers(self._pooler, self.plugins.registry("pooler").names),
                                     getattr(self.loaded.arch, "hidden_size", None), self.max_model_len, self.tokenize,
                                     model.label_logits if model.spec.num_labels is not None else None,
                                     self._truncated_text, read_pad_token_id(self.loaded.path))
        self.readers = Readers(self)  # stream and generate calls read their own requests' deltas
        self.searches = BeamSearches(self)  # beam searches under way, a token per step beside the requests
        if config.freeze_gc:
            gc.collect()
            freeze_heap()
        log.info("engine ready in %.1f s: %s", time.perf_counter() - started,
                 parts.summary(config, self.async_output, self.async_scheduling))

    @property
    def checker(self) -> RequestChecker:
        """What requests are checked against (the intake's: loading a LoRA adapter replaces it)."""
        return self.intake.checker

    def _structured_output_backend(self) -> StructuredOutputBackend:
        """Built at the first structured request: an engine that never gets one needs no backend installed."""
        name, spec = self.config.structured_output_backend, self.loaded.model.spec
        vocabulary = Vocabulary(self.tokenizer, spec.vocab_size, self.eos_token_ids, self.loaded.device)
        backend = self.plugins.build("structured_output_backend", name, StructuredOutputBackend, self.config,
                                     vocabulary)
        self.blame.add("structured_output_backend", name, backend)
        return backend

    def _logits_processor(self, name: str) -> LogitsProcessor:
        """Built at the first request that names it, and blamed for its errors from then on."""
        processor = self.plugins.build("logits_processor", name, LogitsProcessor, self.config, self.tokenizer)
        self.blame.add("logits_processor", name, processor)
        return processor

    # ------------------------------------------------------------ requests
    def tokenize(self, prompt: Prompt) -> list[int]:
        """A prompt's token ids; InvalidRequestError for an empty, non-UTF-8 or out-of-vocabulary prompt."""
        return self.checker.tokenize(prompt)

    def add_request(self, prompt: Prompt, params: SamplingParams | PoolingParams | None = None,
                    request_id: str | None = None, arrival_time: float | None = None) -> str:
        """Validate and queue a request; return its id. Raises InvalidRequestError or CapacityError. With
        PoolingParams it is an embedding request: its one output carries ``embedding`` (core/pooling.py).
        ``arrival_time``: when the request came in, on ``time.perf_counter()``'s clock and not after now (a server
        that queued it passes when it arrived: TTFT and priority aging count from there); None: now."""
        with self._one_thread():
            return self._add_request(prompt, params, request_id, arrival_time)

    def _add_request(self, prompt: Prompt, params: SamplingParams | PoolingParams | None, request_id: str | None,
                     arrival_time: float | None = None) -> str:
        now = time.perf_counter()
        if arrival_time is not None and (isinstance(arrival_time, bool) or not isinstance(arrival_time, (int, float))
                                         or not -math.inf < arrival_time <= now):
            raise InvalidRequestError(f"arrival_time must be a time.perf_counter() value not after now ({now:.3f}), "
                                      f"or None for now; got {arrival_time!r}")
        if request_id is None:
            request_id = uuid.uuid4().hex
        elif not isinstance(request_id, str) or not request_id:
            raise InvalidRequestError(f"request_id must be a non-empty string (or None for a generated one), got "
                                      f"{request_id!r}")
        if request_id in self.requests:
            raise InvalidRequestError(f"request id {request_id!r} is already in use")
        pooling = None
        if isinstance(params, PoolingParams):
            with self._plugin_code():
                prompt, params, pooling = self.embeddings.admit(prompt, params)
        else:
            self._check_generates()
        request, reasoning_end = self.intake.request(prompt, params or SamplingParams(), request_id,
                                                     now if arrival_time is None else arrival_time)
        seqs, params = request.seqs, request.params
        seqs[0].pooling = pooling
        with self._plugin_code():
            self.scheduler.add(seqs[0])  # the others are forked from it once its prompt is computed
        self.requests[request_id] = request
        if params.structured_output is not None:
            self.structured.admit(params.structured_output)  # compiled above: kept until the request ends
            if reasoning_end is not None:
                self.structured.follow_reasoning(seqs, reasoning_end)
        self.stats.prompt_tokens += len(request.prompt_token_ids)
        self.prompt_logprob_requests += params.prompt_logprobs is not None
        self.embeddings.live += pooling is not None
        if params.n > 1:
            self.forks.add(request_id, seqs[1:])
        return request_id

    def _check_generates(self) -> None:
        """InvalidRequestError for generation (and beam search) on a model without an LM head."""
        if not self.loaded.model.spec.has_lm_head:
            raise InvalidRequestError(no_lm_head(self.loaded.model.spec))

    def _truncated_text(self, text: str, length: int) -> list[int]:
        """``text``'s tokens cut to ``length`` by the tokenizer's own truncation, which keeps the special tokens it
        adds (a closing EOS, which last pooling reads), as sentence-transformers truncates."""
        return list(self.tokenizer(text, truncation=True, max_length=length)["input_ids"])

    def _pooler(self, name: str) -> Pooler:
        """Built at the first request that names it, and blamed for its errors from then on."""
        pooler = self.plugins.build("pooler", name, Pooler, self.config)
        self.blame.add("pooler", name, pooler)
        return pooler

    def check_request(self, prompt: Prompt, params: SamplingParams | PoolingParams | None = None) -> list[int]:
        """What add_request checks, without queueing: raises InvalidRequestError or CapacityError (the scheduler's
        ``check``), else returns the prompt's ids."""
        if isinstance(params, PoolingParams):
            with self._plugin_code():
                prompt, params, _ = self.embeddings.admit(prompt, params)
        else:
            self._check_generates()
        checked = self.intake.check(prompt, params or SamplingParams())
        with self._plugin_code():
            self.scheduler.check(self.intake.probe(checked))
        return checked.ids

    def check_structured_output(self, params: SamplingParams) -> None:
        """Compile the structured output of ``params`` now (cached): InvalidRequestError for one the backend cannot
        follow, or for any on a model without EOS (add_request and check_request call it)."""
        self.intake.check_structured_output(params)

    def check_requests(self, prompts: Seq[Prompt], params: Params | None = None) -> None:
        """:meth:`check_request` for each prompt; an error names the bad one's position, as generate's do."""
        for index, prompt in enumerate(prompts):
            try:
                self.check_request(prompt, params)
            except InferError as exc:
                raise at_prompt(exc, index, len(prompts)) from None

    def abort(self, request_id: str) -> RequestOutput:
        """Finish a request now and free its blocks; returns its final (aborted) output, which a stream or generate
        call reading the request gets too."""
        if not isinstance(request_id, str):
            raise InvalidRequestError(f"request_id must be a string, got {request_id!r}")
        with self._one_thread():
            final = self._abort(request_id)
            self.stats.refresh(self.kv, self.scheduler)  # its blocks are free now: the summary says so
            if request_id in self.readers.owned:  # the stream or generate call reading it gets the final delta too
                self.readers.route([final])
        return final

    def _abort(self, request_id: str) -> RequestOutput:
        req = self.requests.get(request_id)
        if req is None:
            raise NotFoundError(f"unknown request id {request_id!r} (it may have finished already)")
        self.unemitted += self._settle()  # async scheduling: its last tokens are in flight
        pending = {seq.seq_id for seq in self.unemitted if seq.request_id == request_id}
        self.unemitted = [seq for seq in self.unemitted if seq.request_id != request_id]
        early = self._emit(req, pending) if pending else None  # async output: stop strings come first
        if early is not None and early.finished:
            return early
        running = [seq for seq in req.seqs if not seq.is_finished]  # n > 1: a finished one has said so already
        for seq in running:
            self._finish(seq, FinishReason.ABORT)
        final = self._emit(req, {seq.seq_id for seq in running})
        return final if early is None else append_output(early, final)

    def _abort_after(self, request_ids: list[str], exc: BaseException) -> None:
        """Abort what is left of ``request_ids`` as ``exc`` propagates. After an error in a step the engine may be
        inconsistent, so a second error while aborting is logged, not raised: the first one is the one to see."""
        for rid in request_ids:
            if rid not in self.requests:
                continue
            try:
                self.abort(rid)
            except Exception as cleanup:
                if isinstance(exc, GeneratorExit):  # no error before: this one is news
                    raise
                if str(cleanup) != str(exc):  # the same failure again (an observer, say) would say nothing new
                    log.warning("could not abort request %s after an error (%s: %s)", rid, type(cleanup).__name__,
                                cleanup)
                return

    def has_unfinished(self) -> bool:
        """Whether requests or beam searches are under way (``step()`` advances both), or ``step()`` still has
        deltas to hand out (those of a step that a stream or generate call ran, or that ended in a Ctrl-C)."""
        return self._has_work() or bool(self.readers.loose)

    def _has_work(self) -> bool:
        """Whether requests or beam searches are under way: a step has work."""
        return bool(self.requests) or bool(self.searches)

    # ------------------------------------------------------------ the loop
    def step(self) -> list[RequestOutput]:
        """Run one iteration: a token of each active beam search, then schedule, forward, sample, update. Returns
        the deltas of requests that advanced (with async output: that advanced in the previous step, their outputs
        built while this step's forward ran), but those of requests a ``stream`` or ``generate`` call reads (they go
        to it), plus the deltas of other requests that such calls' steps made since the last ``step()``. An error
        raised in a plugin's code is a PluginError naming the plugin; one in a beam search's step fails that search
        only (its ``result()`` raises it)."""
        self._advance()
        return self.readers.take_loose()

    def _advance(self) -> None:
        """One step; every delta goes where it is read: to the call that owns its request, else to step()."""
        with self._one_thread():
            self.readers.drop_abandoned()
            if self.interrupted:  # e.g. Ctrl-C between a scheduler's finish and the output: nothing would visit them
                self.interrupted = False
                self.unemitted += [seq for req in self.requests.values() if all(s.is_finished for s in req.seqs)
                                   for seq in req.seqs]
            self.stepping += 1
            try:
                with self._plugin_code():
                    if self.searches:
                        self.searches.step()  # first: blocks freed by finished requests go to beams, then admissions
                    self.readers.route(self._step())
            except BaseException:
                self.interrupted = True
                raise
            finally:
                self.stepping -= 1

    @contextlib.contextmanager
    def _one_thread(self) -> Iterator[None]:
        """The engine is not thread-safe: a step, add_request or abort while another thread is in one is refused
        (two threads' steps returned wrong tokens without an error). The same thread may nest them."""
        if not self.entered.acquire(blocking=False):
            raise RuntimeError("this Engine is in use by another thread, and it is not thread-safe: drive it from one "
                               "thread (as `infer serve`'s engine worker does), or give each thread its own engine")
        try:
            with self.interrupts:  # Ctrl-C lands between steps, not in the middle of the KV bookkeeping
                yield
        finally:
            self.entered.release()

    @contextlib.contextmanager
    def _plugin_code(self) -> Iterator[None]:
        """Around calls into components: an exception raised in a component's code becomes a PluginError naming
        it (the original chained, its traceback logged for -v); running out of device memory, a CapacityError."""
        try:
            yield
        except InferError:
            raise
        except torch.OutOfMemoryError as exc:
            raise out_of_memory(self.runner.device, "running a step", STEP_TOO_LARGE) from exc
        except Exception as exc:
            if (blamed := self.blame.error(exc)) is None:
                raise
            log.info("%s", blamed, exc_info=exc)
            raise blamed from exc

    def _step(self) -> list[RequestOutput]:
        if self.async_scheduling:
            return self._step_ahead()
        self.steps_taken += 1
        start = time.perf_counter()
        out = self._schedule()
        if not self._check_schedule(out):
            return self._emit_unemitted()
        return self._run(out, start)

    def _run(self, out: SchedulerOutput, start: float) -> list[RequestOutput]:
        """The synchronous rest of a step whose schedule is ``out``: forward, sample (reading the tokens back),
        update, outputs."""
        decodes = count_decodes(out)
        if self.spec is not None:
            self.spec.propose(out)  # draft tokens for decoding sequences, verified by this step's forward pass
        batch, logits, outputs, times = self._forward(out)
        with self._delivered_if_raised(outputs):
            # sequences just finished by a read-back stop token or a stop string are in this batch: not sampled
            gone = {item.seq.seq_id for item in out.scheduled if item.seq.is_finished}
            embedded = self.embeddings.finished_in(out)
            sampled, forks = self._sample(out, batch, logits, gone | embedded)
            now = time.perf_counter()
            start_forks(self.scheduler, self._finish, out, forks, sampled, now)
            self.scheduler.update(live_part(out, gone), sampled, now)
            self._finish_embedded(out, embedded)
            advanced = [item.seq for item in out.scheduled if item.seq.seq_id not in gone] + [c for _, c in forks]
            if self.async_output:
                self.unemitted = advanced
            else:
                outputs += self._deferring(self._emit_progress, advanced)  # may finish sequences (stop strings)
            if self.spec is not None:
                self.spec.release_finished(advanced)
            self._record_step(out, start, times, now, decodes)
        return outputs

    def _step_ahead(self) -> list[RequestOutput]:
        """Async scheduling: schedule and launch this step, with the tokens of the step still in flight as PENDING
        placeholders that the device fills; then read that step's tokens back (the device is busy with this one),
        check their stops and build their outputs; then sample this step on the device and move on."""
        start = time.perf_counter()
        self.steps_taken += 1
        out = self._schedule()
        if not self._check_schedule(out):
            self.unemitted += self._settle()
            return self._emit_unemitted()
        if self.forks and self.forks.due_in(out):  # n > 1: children copy a token read back now
            return self._run(out, start)
        decodes = count_decodes(out)
        batch, logits, outputs, times = self._forward(out)
        with self._delivered_if_raised(outputs):
            items = {item.seq.seq_id: item.seq for item in out.scheduled}
            embedded = self.embeddings.finished_in(out)
            rows = [i for i, sid in enumerate(batch.sample_seq_ids) if not items[sid].is_finished
                    and sid not in embedded]
            seqs = [items[batch.sample_seq_ids[i]] for i in rows]
            if seqs:
                kept = logits if len(rows) == len(logits) else logits[to_device(rows, logits.device)]  # no host wait
                sample = self.runner.sample_pending(kept, seqs)
                self.in_flight = InFlight(sample, seqs, [seq.num_tokens for seq in seqs])
            now = time.perf_counter()
            gone = {item.seq.seq_id for item in out.scheduled if item.seq.is_finished}
            self.scheduler.update(live_part(out, gone), {seq.seq_id: [PENDING_TOKEN] for seq in seqs}, now)
            if embedded:
                self._finish_embedded(out, embedded)
                self.unemitted += [items[sid] for sid in embedded]
            self._record_step(out, start, times, now, decodes)
        return outputs

    def _forward(self, out: SchedulerOutput) -> tuple[Batch, torch.Tensor, list[RequestOutput], StepTimes]:
        """Launch the forward pass of ``out`` (tokens still in flight fill their places on the device); then, while
        it runs, read the in-flight tokens back and build the outputs that are due (async output), which may finish
        sequences of this batch (stop tokens, stop strings)."""
        scheduled = time.perf_counter()
        flight = self.in_flight
        cache = self.config.kv_cache
        batch, logits = self.runner.execute(out, self.kv, pending=flight.inputs if flight is not None else None,
                                            prompt_logprobs=cache if self.prompt_logprob_requests else None,
                                            pooling=cache if self.embeddings.live else None)
        executed = time.perf_counter()
        used_blocks = self.kv.stats().used_blocks  # before the sequences this step finishes free theirs
        self.unemitted += self._settle()  # waits for the previous step's tokens, not for this step
        settled = time.perf_counter()
        outputs = self._deferring(self._emit_unemitted)
        return batch, logits, outputs, StepTimes(scheduled, executed, settled, time.perf_counter(), used_blocks)

    def _finish_embedded(self, out: SchedulerOutput, embedded: set[int]) -> None:
        for item in out.scheduled:
            if item.seq.seq_id in embedded and not item.seq.is_finished:
                self._finish(item.seq, FinishReason.STOP)

    def _settle(self) -> list[Sequence]:
        """Read the tokens in flight back into their sequences (stopping those a token stops); returns them. Cleared
        once read: one interrupted (Ctrl-C while waiting for the device) is read again by the next settle."""
        if (flight := self.in_flight) is None:
            return []
        seqs = flight.read_back(self._finish)
        self.in_flight = None
        return seqs

    def _schedule(self) -> SchedulerOutput:
        """The scheduler's step, with the copy-on-write copies its KV cache still holds added to its block ops."""
        out = self.scheduler.schedule()
        if isinstance(out, SchedulerOutput):  # else _check_schedule names the scheduler
            if left := self.kv.take_block_ops():
                out.block_ops.extend(left)
        return out

    def _check_schedule(self, out: SchedulerOutput) -> bool:
        """Whether ``out`` has work to run. One without still gets its block ops done: its scheduler may have
        swapped a sequence out (preempted for want of blocks that beam searches hold), and that copy is the
        sequence's KV from now on."""
        settled = self.in_flight is None and not self.unemitted
        if check_schedule(out, self.config, self.scheduler, settled, self._open_sequences, bool(self.searches),
                          self._is_live):
            return True
        if out.block_ops:
            with torch.inference_mode():
                self.runner.apply_block_ops(out.block_ops)
        return False

    def _is_live(self, seq: Sequence) -> bool:
        """Whether ``seq`` is a sequence of one of the requests under way."""
        req = self.requests.get(seq.request_id)
        return req is not None and any(s is seq for s in req.seqs)

    def _open_sequences(self) -> int:
        """The requests' sequences not finished (read only when a schedule comes back empty)."""
        return sum(not seq.is_finished for req in self.requests.values() for seq in req.seqs)

    def _finish(self, seq: Sequence, reason: FinishReason) -> None:
        """``Scheduler.finish``, held to setting the sequence's status (else its request would never end)."""
        self.scheduler.finish(seq, reason)
        if not seq.is_finished:
            raise PluginError(f"scheduler {self.config.scheduler!r}: finish() left sequence {seq.seq_id} "
                              f"{seq.status.name}; it must set seq.status = SequenceStatus.FINISHED and "
                              "seq.finish_reason (the engine ends a request by its sequences' status); fix the plugin")

    def _emit_unemitted(self) -> list[RequestOutput]:
        seqs, self.unemitted = self.unemitted, []
        try:
            return self._emit_progress(seqs)
        finally:
            if self.spec is not None:
                self.spec.release_finished(seqs)  # some may have just finished by a stop string

    def _deferring(self, emit: Callable[..., list[RequestOutput]], *args: object) -> list[RequestOutput]:
        """``emit(*args)``; a reply parser's or an observer's error (once every other output is out) waits for
        the end of the step, which must still update the scheduler and be recorded: ``_delivered_if_raised``."""
        try:
            return emit(*args)
        except InferError as exc:
            self.deferred = self.deferred or exc
            return []

    @contextlib.contextmanager
    def _delivered_if_raised(self, outputs: list[RequestOutput]) -> Iterator[None]:
        """The rest of a step whose ``outputs`` are built, then the error ``_deferring`` held back, raised: if the
        step fails (that error, a plugin's, Ctrl-C), its outputs still reach the stream and generate calls that
        read them."""
        try:
            yield
            failure, self.deferred = self.deferred, None
            if failure is not None:
                raise failure
        except BaseException:
            self.deferred = None
            self.readers.route_owned(outputs)
            raise

    def _sample(self, out: SchedulerOutput, batch: Batch, logits: torch.Tensor, gone: set[int]
                ) -> tuple[dict[int, list[int]], list[tuple[Sequence, Sequence]]]:
        """New tokens per sequence id: verified drafts plus one (speculative), or one sample per logits row. The
        ``gone`` sequences draw nothing (an unseeded draw would shift every other row's)."""
        items = {item.seq.seq_id: item.seq for item in out.scheduled}
        rows = [i for i, sid in enumerate(batch.sample_seq_ids) if sid not in gone]
        seqs = [items[batch.sample_seq_ids[i]] for i in rows]
        forks = self.forks.take_due(seqs, rows)
        if self.spec is not None:
            self.spec.forget(gone)
        sampled = self.spec.verify(batch, logits) if self.spec is not None else {}
        if sampled:  # the verified sequences have their tokens
            plain = [i for i, seq in enumerate(seqs) if seq.seq_id not in sampled]
            seqs, rows = [seqs[i] for i in plain], [rows[i] for i in plain]
        if seqs:
            kept = logits if rows == list(range(len(logits))) else logits[to_device(rows, logits.device)]
            result = self.runner.sample(kept, seqs)  # a list index would copy synchronously
            for seq, token, entry in zip(seqs, result.token_ids, result.logprobs):
                sampled[seq.seq_id] = [token]
                if entry is not None:
                    seq.logprobs.append(entry)
        return sampled, forks

    def _emit_progress(self, seqs: list[Sequence]) -> list[RequestOutput]:
        """The outputs of the requests of ``seqs``. A reply parser's error fails the step once every other request
        is emitted (none is left behind): their outputs go to the stream or generate calls that read them; those of
        ``step()``'s caller are lost with the step (a late delivery could reach a new request of the same id)."""
        touched: dict[str, set[int]] = {}
        for seq in seqs:
            touched.setdefault(seq.request_id, set()).add(seq.seq_id)
        outputs, failure = [], None
        for rid, ids in touched.items():
            if rid in self.requests:
                try:
                    output = self._emit(self.requests[rid], ids)
                except InferError as exc:
                    failure = failure or exc
                    continue
                if output.outputs or output.finished:
                    outputs.append(output)
        if failure is not None:
            self.readers.route_owned(outputs)
            raise failure
        return outputs

    def _emit(self, req: RequestState, seq_ids: set[int]) -> RequestOutput:
        if req.seqs[0].pooling is not None:
            output = self.embeddings.output(req)
        else:
            output = build_output(req, seq_ids, self._finish)
        if req.params.prompt_logprobs is not None and not req.prompt_logprobs_sent and \
                (output.outputs or output.finished) and not req.seqs[0].collects_prompt_logprobs:
            output.prompt_logprobs, req.prompt_logprobs_sent = req.seqs[0].prompt_logprobs, True
        if output.finished:
            self._finish_request(req, output)
        return output

    def _finish_request(self, req: RequestState, output: RequestOutput) -> None:
        del self.requests[req.request_id]
        if req.params.structured_output is not None:
            self.structured.discharge(req.params.structured_output)
        self.forks.drop(req.request_id)
        self.prompt_logprob_requests -= req.params.prompt_logprobs is not None
        self.embeddings.live -= req.seqs[0].pooling is not None
        self.stats.embedding_requests_finished += req.seqs[0].pooling is not None
        for seq in req.seqs:
            self.runner.sampler.release(seq.seq_id)
            self.runner.controls.release(seq.seq_id)
            self.processors.release(seq)
            self.structured.release(seq.seq_id)
            self.stats.output_tokens += seq.num_output_tokens
        output.metrics.update(self.stats.record_finished(req.seqs, req.arrival))
        output.num_cached_tokens = max(seq.num_cached_tokens for seq in req.seqs)
        if self.spec is not None:
            self.spec.finish(req.seqs, output)
        self.plugins.observe("on_request_finished", output=with_every_sequence(req, output))

    def _record_step(self, out: SchedulerOutput, start: float, times: StepTimes, sampled: float,
                     decodes: int) -> None:
        step = self.stats.record_step(out, self.kv, self.scheduler, start, times, sampled, decodes)
        if self.spec is not None:
            self.spec.annotate(step)
        try:
            self.plugins.observe("on_step", stats=step)
        except InferError as exc:  # every observer saw the step: raised with the step's other error, if any
            self.deferred = self.deferred or exc

    # ------------------------------------------------------------ convenience
    def stream(self, prompt: Prompt, params: Params | None = None,
               request_id: str | None = None) -> Reader[RequestOutput]:
        """Add one request now (a bad one raises here) and return an iterator of its deltas, the last one finished;
        other requests advance too, and their deltas go to their own readers. Closing the iterator early aborts
        the request."""
        rid = self.add_request(prompt, params, request_id)
        return self.readers.own([rid], lambda: self.readers.deltas(rid))

    def generate(self, prompts: Seq[Prompt], params: Params | Seq[Params] | None = None) -> list[RequestOutput]:
        """Run prompts to completion; return one full RequestOutput per prompt, in order."""
        results = dict(self.generate_as_completed(prompts, params))
        return [results[i] for i in range(len(prompts))]

    def embed(self, prompts: Seq[Prompt], params: PoolingParams | Seq[PoolingParams] | None = None
              ) -> list[RequestOutput]:
        """Embed prompts (core/pooling.py); one RequestOutput per prompt, in order, its ``embedding`` set (and
        its one completion's finish reason stop; abort, with no embedding, if it was aborted)."""
        for one in params if isinstance(params, Seq) else [params]:
            if one is not None and not isinstance(one, PoolingParams):
                raise InvalidRequestError(f"embed takes PoolingParams, got {type(one).__name__}")
        if isinstance(params, Seq):  # a None among them is the default, as a None for all is
            return self.generate(prompts, [one or PoolingParams() for one in params])
        return self.generate(prompts, params or PoolingParams())

    def generate_as_completed(self, prompts: Seq[Prompt], params: Params | Seq[Params] | None = None
                              ) -> Reader[tuple[int, RequestOutput]]:
        """Submit every prompt now (all or none: a bad one raises here, naming its position in ``prompt_index``),
        then yield (prompt index, full RequestOutput) as each request finishes (one aborted by ``abort`` with finish
        reason abort). Closing the iterator aborts the rest. Other requests advance meanwhile; their deltas go to
        their own readers (``step()``, a stream, another generate call)."""
        ids = self.add_requests(prompts, params)
        results = {rid: RequestOutput(rid, self.requests[rid].prompt_token_ids,
                                      [CompletionOutput(i, [], "") for i in range(self.requests[rid].params.n)], False)
                   for rid in ids}
        index = {rid: i for i, rid in enumerate(ids)}
        return self.readers.own(ids, lambda: self.readers.completions(index, results))

    def beam_search(self, prompts: Seq[Prompt], params: BeamSearchParams | None = None
                    ) -> list[BeamSearchOutput]:
        """Beam search for each prompt (see core/beam_search.py), beams sharing KV blocks by fork; one
        BeamSearchOutput per prompt, in order. Steps the engine until it is done: other requests advance meanwhile,
        their deltas going to their own readers, as in ``generate``. Raises InvalidRequestError, or CapacityError
        when the beams cannot fit the KV pool (their blocks are freed first)."""
        search = self.start_beam_search(prompts, params)
        try:
            while not search.done:
                self._advance()
        finally:  # an error in a step, Ctrl-C: the beams go
            self.abort_beam_search(search)
        return search.result()

    def start_beam_search(self, prompts: Seq[Prompt], params: BeamSearchParams | None = None) -> BeamSearch:
        """Check the prompts (InvalidRequestError, CapacityError, before any work) and start a beam search, which
        each ``step()`` then advances by one token until its ``done``; its ``result()`` is what ``beam_search``
        returns, or the error that failed it (that search only)."""
        self._check_generates()
        with self._one_thread(), self._plugin_code():
            return self.searches.start(prompts, params or BeamSearchParams(), lambda: next(self.intake.seq_ids))

    def abort_beam_search(self, search: BeamSearch) -> None:
        """Stop a search started by ``start_beam_search`` now and free its beams' blocks (a finished one: nothing);
        its ``result()`` is then each prompt's best hypotheses so far, the live ones with finish reason abort."""
        with self._one_thread():
            self.searches.abort(search)

    def add_requests(self, prompts: Seq[Prompt], params: Params | Seq[Params] | None = None) -> list[str]:
        """Queue every prompt, or none: a bad one raises (its position in ``prompt_index``) and aborts the rest.
        Returns the request ids, in order."""
        check_prompt_list(prompts)
        params_list = list(params) if isinstance(params, Seq) else [params or SamplingParams()] * len(prompts)
        if len(params_list) != len(prompts):
            raise InvalidRequestError(f"got {len(prompts)} prompts but {len(params_list)} SamplingParams")
        ids: list[str] = []
        try:
            for prompt, sp in zip(prompts, params_list):
                ids.append(self.add_request(prompt, sp))
        except BaseException as exc:  # Ctrl-C included; all or nothing: no half-submitted batch stays behind
            self._abort_after(ids, exc)
            if isinstance(exc, InferError):
                at_prompt(exc, len(ids), len(prompts))
            raise
        return ids

    @property
    def lora_adapters(self) -> list[str]:
        """The names of the LoRA adapters served now (those of --lora and those loaded since), sorted."""
        return sorted(self.runner.lora.tokens.slot_of) if self.runner.lora is not None else []

    def load_lora_adapter(self, name: str, folder: str | os.PathLike[str] | LoraAdapter) -> None:
        """Serve the adapter PEFT's ``save_pretrained`` wrote to ``folder`` (or one ``models.lora.read_adapter``
        read already, off this thread) under ``name`` from the next step on, in a free slot
        (``--max-lora-adapters``). InvalidRequestError: a bad or taken name, or an engine started without adapter
        slots; CheckpointError: an adapter it cannot serve (the reason named); CapacityError: no free slot. Call it
        between steps, from the thread that drives the engine."""
        load_lora_adapter(self, name, folder)

    def unload_lora_adapter(self, name: str) -> None:
        """Stop serving ``name`` and free its slot. Refused (InvalidRequestError) while a request or beam search
        uses it; drops its cached prefixes (``KVCache.drop_namespace``; a cache that cannot has its whole prefix
        cache emptied), so that no KV computed under it serves a later adapter of that name."""
        unload_lora_adapter(self, name)
