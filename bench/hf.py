"""The HF transformers baseline: static ``generate`` on padded batches, or transformers' continuous batching.

``static`` takes every request that has arrived (up to ``batch_size``), left-pads them into one batch and runs
``generate`` for the longest output; a token's time is the time of the decoding step that produced it, and every
request of a batch finishes when the batch does. ``cb`` runs transformers' continuous batching manager with an
explicit cache size (on CPU its default sizing reads the machine's whole memory) and per-token timestamps.
Neither reports KV usage, prefix hits, acceptance or preemptions: those metrics are "n/a" for this arm. Embedding
requests run as padded ``AutoModel`` batches (bench/hf_embed.py), in ``static`` mode only: transformers' continuous
batching generates.
"""
from __future__ import annotations

import dataclasses
import math
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from ..cli.terminal import transformers_bars_on_terminal_only
from ..core.chat import ChatPrompt
from ..core.request import SamplingParams
from ..core.loader import checkpoint_dtype, read_config, resolve_dtype
from ..core.pooling import PoolingParams, read_pooling_defaults
from .arms import ArmSpec
from .hf_embed import HFPooling, classifier_pooling, embed_padded, longest_first, resolve_hf_pooling
from .runner import Replay
from .stats import RequestRecord, RunResult
from .workloads import RequestSampling, Session, Turn, Vocab, Workload, WorkloadError

CB_PAGE_SIZE = 32


class _StepTimes:
    """A transformers streamer that records when each decoding step's tokens arrive (the first put is the prompt)."""

    def __init__(self) -> None:
        self.times: list[float] = []
        self._prompt_seen = False

    def put(self, value: Any) -> None:
        if self._prompt_seen:
            self.times.append(time.perf_counter())
        self._prompt_seen = True

    def end(self) -> None:
        """Called once generation stops; nothing to flush."""


class HFArm:
    """HF transformers on the model of the engine arms, in the group's --dtype (``auto`` resolved as the engine
    resolves it). It runs with the group's --cpu-threads and a frozen heap, like the engine arms. With ``task``
    "embed" it loads ``AutoModel`` (an embedding checkpoint may have no LM head); otherwise the causal LM, whose
    backbone embeds a file workload's embedding lines. A sequence classifier (``*ForSequenceClassification``) loads
    as one, its embeddings the score head's label logits of the pooled backbone state, as the engine's are."""

    freeze_gc = True

    def __init__(self, spec: ArmSpec, model_path: Path, batch_size: int, device: str = "auto", dtype: str = "auto",
                 cpu_threads: int | None = None, task: str = "generate") -> None:
        import torch
        from transformers import AutoModel, AutoModelForCausalLM, AutoModelForSequenceClassification, AutoTokenizer

        self.spec, self.task = spec, task
        self.mode = spec.hf_mode or "static"
        self.cpu_threads = cpu_threads
        self.batch_size = batch_size
        self.device = torch.device("cuda" if device == "auto" and torch.cuda.is_available() else
                                   ("cpu" if device == "auto" else device))
        config = read_config(model_path)
        self.dtype = resolve_dtype(dtype, checkpoint_dtype(config), self.device)
        architecture = str((config.get("architectures") or [""])[0])
        self.classifier = architecture.endswith("ForSequenceClassification")
        builder = AutoModelForSequenceClassification if self.classifier else \
            AutoModel if task == "embed" else AutoModelForCausalLM
        with transformers_bars_on_terminal_only():  # its "Loading weights" bar
            model = builder.from_pretrained(str(model_path), dtype=self.dtype)
        self.model = model.to(self.device).eval()
        self.backbone = self.model.base_model  # the model itself for an AutoModel
        self.label_head = self.model.score if self.classifier else None
        self.pooling_defaults = read_pooling_defaults(model_path)
        self.tokenizer = AutoTokenizer.from_pretrained(str(model_path))
        config = self.model.config
        self.max_model_len = int(getattr(config, "max_position_embeddings", 1 << 30))
        self.kv_capacity_tokens: int | None = None  # HF caches grow as needed
        self.vocab = Vocab(int(config.vocab_size), frozenset(self.tokenizer.all_special_ids))
        self.pad_id = self.tokenizer.pad_token_id if self.tokenizer.pad_token_id is not None else 0
        self.model_path = model_path

    def describe(self) -> dict[str, object]:
        import transformers

        return {"transformers": transformers.__version__, "mode": self.mode, "task": self.task,
                "model": str(self.model_path),
                "device": str(self.device), "dtype": str(self.dtype),
                "batch_size": self.batch_size if self.mode == "static" else None}

    def reasons_before_grammar(self, chat: ChatPrompt) -> bool:
        return False  # no reasoning parser (and no structured output: keep_structured refuses it)

    def keep_structured(self, params: SamplingParams) -> None:
        raise WorkloadError("HF transformers has no structured output; drop the hf arms or the lines' "
                            "structured_output")

    def check_request(self, prompt: list[int], max_tokens: int) -> None:
        """The baseline refuses nothing the context holds (make_workloads checked that)."""

    def check_embedding(self, prompt: list[int], pooling: PoolingParams) -> None:
        """InvalidRequestError for a pooling the baseline does not compute (it pools last or mean)."""
        self.hf_pooling(pooling)

    def hf_pooling(self, pooling: PoolingParams) -> HFPooling:
        if self.classifier:
            return classifier_pooling(pooling)
        return resolve_hf_pooling(pooling, self.pooling_defaults, int(self.model.config.hidden_size))

    def tokenize(self, prompt: str | ChatPrompt) -> list[int]:
        """Text as the tokenizer encodes it; a chat as HF's apply_chat_template renders it."""
        if isinstance(prompt, ChatPrompt):
            return prompt.render(self.tokenizer)
        return list(self.tokenizer.encode(prompt))

    def _generation_config(self, max_new_tokens: int, cb: bool, sampling: RequestSampling) -> Any:
        """Exactly ``max_new_tokens`` tokens per request, as the engine arms generate (ignore_eos), sampled as the
        workload says (min_tokens aside: EOS never stops these arms anyway)."""
        from transformers import GenerationConfig

        fields = sampling.fields
        sample: dict[str, Any] = {"do_sample": False, "repetition_penalty": fields.get("repetition_penalty", 1.0)}
        if bias := fields.get("logit_bias"):
            sample["sequence_bias"] = {(token,): value for token, value in bias}
        if not sampling.greedy:
            sample.update(do_sample=True, temperature=fields["temperature"], top_p=fields.get("top_p", 1.0),
                          top_k=fields.get("top_k", 0), min_p=fields.get("min_p") or None)
        # an eos id no token has: EOS is generated like any token and stops nothing, as in the engine arms (a
        # min_new_tokens masked it, and the static arm's outputs left the others' at every EOS argmax); continuous
        # batching takes -1 as "never stop early", static generate warns about a negative id: the logits' width
        never = -1 if cb else self.vocab.size
        return GenerationConfig(max_new_tokens=max_new_tokens, eos_token_id=never, pad_token_id=self.pad_id, **sample)

    def warm_up(self, workloads: list[Workload]) -> None:
        """A short request, then each warm-up workload, unmeasured: first-call costs are not timed."""
        turn = Turn(self.vocab.allowed[:8], 0, pooling=PoolingParams(pooling="last")) if self.task == "embed" \
            else Turn(self.vocab.allowed[:8], 4)
        short = Workload("warm-up", -1, (Session(0.0, (turn,)),))
        for workload in [short, *workloads]:
            self.run(workload, lambda: None)

    def run(self, workload: Workload, on_request_done: Callable[[], None]) -> RunResult:
        if self.mode == "static":
            return self._run_static(workload, on_request_done)
        return self._run_cb(workload, on_request_done)

    # ------------------------------------------------------------ static generate
    def _generate_batch(self, prompts: list[list[int]], max_new_tokens: int, sampling: RequestSampling,
                        seed: int | None) -> tuple[list[float], list[list[int]]]:
        """Step times and the generated tokens of each row; a sampled batch draws from ``seed`` when given."""
        import torch

        if seed is not None:
            torch.manual_seed(seed)
        width = max(map(len, prompts))
        ids = torch.tensor([[self.pad_id] * (width - len(p)) + p for p in prompts], device=self.device)
        mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts], device=self.device)
        streamer = _StepTimes()
        with torch.no_grad():
            out = self.model.generate(input_ids=ids, attention_mask=mask, generation_config=self._generation_config(
                max_new_tokens, cb=False, sampling=sampling), streamer=streamer)
        return streamer.times, out[:, width:].tolist()

    def _run_static(self, workload: Workload, on_request_done: Callable[[], None]) -> RunResult:
        replay = Replay(workload)
        waiting: list[tuple[float, int, int, list[int], int]] = []
        records: list[RequestRecord] = []
        start = time.perf_counter()
        while replay.pending() or waiting:
            now = time.perf_counter() - start
            waiting += replay.pop_due(now)
            if not waiting:
                time.sleep(max(0.0, (replay.next_arrival() or now) - now))
                continue
            if embeds := [w for w in waiting if workload.sessions[w[1]].turns[w[2]].pooling is not None]:
                batch = [embeds[i] for i in longest_first([w[3] for w in embeds])][: self.batch_size]
                waiting = [w for w in waiting if w not in batch]
                vectors = self._embed_batch(workload, batch)
                done = time.perf_counter() - start
                for (arrival, session, turn, prompt, _), vector in zip(batch, vectors):
                    records.append(RequestRecord(session, turn, arrival, len(prompt), 0, [], done,
                                                 priority=workload.priority(session, turn), embed=True,
                                                 embedding=vector))
                    replay.finished(session, turn, prompt, [], done)
                    on_request_done()
                continue
            batch, waiting = waiting[: self.batch_size], waiting[self.batch_size:]
            first_seed = workload.sampling.request_seed(workload.round, batch[0][1], batch[0][2])
            step_times, outputs = self._generate_batch([b[3] for b in batch], max(b[4] for b in batch),
                                                       workload.sampling, first_seed)
            steps = [t - start for t in step_times]
            done = time.perf_counter() - start
            for (arrival, session, turn, prompt, max_tokens), generated in zip(batch, outputs):
                times = steps[:max_tokens]
                output = generated[:max_tokens]
                records.append(RequestRecord(session, turn, arrival, len(prompt), len(times), times, done,
                                             output_ids=list(output), priority=workload.priority(session, turn)))
                replay.finished(session, turn, prompt, output, done)
                on_request_done()
        duration = time.perf_counter() - start
        records.sort(key=lambda r: (r.session, r.turn))
        return RunResult(self.spec.key, workload.round, duration, records, None, {"batch_size": self.batch_size})

    def _embed_batch(self, workload: Workload, batch: list[tuple[float, int, int, list[int], int]]
                     ) -> list[list[float]]:
        poolings = [self.hf_pooling(workload.sessions[s].turns[t].pooling) for _, s, t, _, _ in batch]  # type: ignore
        return embed_padded(self.backbone, [b[3] for b in batch], poolings, self.pad_id, self.device,  # on the host
                            self.label_head)

    # ------------------------------------------------------------ continuous batching
    def _cb_config(self, longest: int, concurrent: int) -> Any:
        from transformers import ContinuousBatchingConfig

        blocks_per_request = math.ceil(longest / CB_PAGE_SIZE) + 1
        num_blocks = max(16, min(blocks_per_request * max(concurrent, 1), 8192))
        max_batch_tokens = 512 if self.device.type == "cpu" else 8192
        # the page size is `page_size` in newer transformers and `block_size` in 5.17 (the GPU image)
        page = "page_size" if "page_size" in {f.name for f in dataclasses.fields(ContinuousBatchingConfig)} \
            else "block_size"
        return ContinuousBatchingConfig(num_blocks=num_blocks, max_batch_tokens=max_batch_tokens,
                                        **{page: CB_PAGE_SIZE})

    def _run_cb(self, workload: Workload, on_request_done: Callable[[], None]) -> RunResult:
        import torch

        longest = workload.longest_request()
        if (seed := workload.sampling.request_seed(workload.round, 0, 0)) is not None:
            torch.manual_seed(seed)
        manager = self.model.init_continuous_batching(
            generation_config=self._generation_config(max(1, longest), cb=True, sampling=workload.sampling),
            continuous_batching_config=self._cb_config(longest, len(workload.sessions)))
        manager.start()
        try:
            return self._drive_cb(manager, workload, on_request_done)
        finally:
            manager.stop(block=True)
            self.model.destroy_cached_continuous_batching_manager()

    def _drive_cb(self, manager: Any, workload: Workload, on_request_done: Callable[[], None]) -> RunResult:
        replay = Replay(workload)
        live: dict[str, tuple[float, int, int, list[int]]] = {}
        records: list[RequestRecord] = []
        start = time.perf_counter()
        while replay.pending() or live:
            now = time.perf_counter() - start
            for arrival, session, turn, prompt, max_tokens in replay.pop_due(now):
                rid = f"bench-{workload.round}-{session}-{turn}"
                manager.add_request(prompt, request_id=rid, max_new_tokens=max_tokens, record_timestamps=True,
                                    eos_token_id=-1)
                live[rid] = (arrival, session, turn, prompt)
            next_at = replay.next_arrival()
            wait = 1.0 if next_at is None else max(0.0, min(1.0, next_at - now))
            result = manager.get_result(timeout=wait) if live else None
            if result is None:
                if not live and next_at is not None:
                    time.sleep(max(0.0, next_at - now))
                continue
            if result.error:
                raise RuntimeError(f"transformers continuous batching failed on {result.request_id}: {result.error}")
            arrival, session, turn, prompt = live.pop(result.request_id)
            times = [t - start for t in result.timestamps or []]
            finish = (result.lifespan[1] - start) if result.lifespan[1] > 0 else time.perf_counter() - start
            output = list(result.generated_tokens)
            records.append(RequestRecord(session, turn, arrival, len(prompt), len(output), times, finish,
                                         output_ids=output, priority=workload.priority(session, turn)))
            replay.finished(session, turn, prompt, output, time.perf_counter() - start)
            on_request_done()
        duration = time.perf_counter() - start
        records.sort(key=lambda r: (r.session, r.turn))
        return RunResult(self.spec.key, workload.round, duration, records, None, {"mode": "cb"})
