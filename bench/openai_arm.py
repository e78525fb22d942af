"""An ``openai:URL`` arm: a running server of OpenAI's HTTP API (``infer serve --http-port``, vLLM, SGLang) driven
with the bench's workload, over bench/openai_client.py.

Every request goes as token ids (the workload's, tokenized once by the group model's tokenizer, which the server
must share: checked at build through vLLM's ``/tokenize``), streaming ``/completions`` with vLLM's ``ignore_eos``
and ``return_token_ids``: a token's time is the arrival of the chunk that carried it, and the output ids are the
chunks' ``token_ids``. Requests arrive as in the other arms (bench/runner.py's Replay), each on its own connection,
all on one event loop per run. A server reports no KV usage, prefix hits or steps: those metrics are "n/a".
"""
from __future__ import annotations

import asyncio
import json
import logging
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from ..core.chat import ChatPrompt
from ..core.errors import InvalidRequestError
from ..core.loader import read_config
from ..core.pooling import PoolingParams
from ..core.request import SamplingParams
from .arms import ArmError, ArmSpec
from .openai_client import Endpoint, OpenAIServerError, error_message, get_json, post_events, post_json
from .runner import Replay
from .stats import RequestRecord, RunResult
from .workloads import Session, Turn, Vocab, Workload, WorkloadError

log = logging.getLogger("infer")
TOKENIZER_PROBE = "def add(a, b):\n    return a + b  # Hello, world! 123 über"  # words, code, digits, non-ASCII
WARMUP_PROMPT_TOKENS = 8


class OpenAIArm:
    """The server at ``spec.openai_url`` (the API base), its requests tokenized by the tokenizer at
    ``tokenizer_path`` (the group model's). ``api_key``: the bearer token (OPENAI_API_KEY)."""

    freeze_gc = True  # the client's heap frozen, as the other arms run: no collection stalls its clock
    cpu_threads: int | None = None
    kv_capacity_tokens: int | None = None  # the server's pool is its own: it refuses what it cannot hold

    def __init__(self, spec: ArmSpec, tokenizer_path: Path, task: str = "generate", api_key: str | None = None
                 ) -> None:
        from transformers import AutoTokenizer

        assert spec.openai_url is not None
        self.spec, self.task, self.tokenizer_path = spec, task, tokenizer_path
        self.endpoint = Endpoint(spec.openai_url, api_key)
        self.tokenizer = AutoTokenizer.from_pretrained(str(tokenizer_path))
        config = read_config(tokenizer_path)
        self.model, self.adapters, served_len = self._served_model()
        self.max_model_len = served_len or int(config.get("max_position_embeddings") or 1 << 30)
        size = min(len(self.tokenizer), int(config.get("vocab_size") or len(self.tokenizer)))  # ids both know
        self.vocab = Vocab(size, frozenset(self.tokenizer.all_special_ids))
        self._check_tokenizer()

    def _served_model(self) -> tuple[str, list[str], int | None]:
        """GET /models: the served model (the first card without a parent), its LoRA adapters (the cards whose
        parent it is) and its context length (``max_model_len``, where the server gives it)."""
        answer = asyncio.run(get_json(self.endpoint, self.endpoint.path("/models")))
        cards = answer.get("data") if isinstance(answer, dict) else None
        models = [card for card in cards or [] if isinstance(card, dict) and card.get("parent") is None]
        if not models or not isinstance(models[0].get("id"), str):
            raise OpenAIServerError(f"GET {self.endpoint.url}/models lists no model (a card whose parent is null): "
                                    f"{json.dumps(answer)[:200]}; is the URL the API base of a server of OpenAI's API?")
        name = models[0]["id"]
        adapters = [card["id"] for card in cards or [] if isinstance(card, dict) and card.get("parent") == name]
        length = models[0].get("max_model_len")
        return name, adapters, length if isinstance(length, int) and length > 0 else None

    def _check_tokenizer(self) -> None:
        """ArmError where the server tokenizes otherwise than this arm's tokenizer (another model): the workload's
        token ids would be other text there. A server without vLLM's /tokenize is warned about, not refused."""
        path = self.endpoint.server_path("/tokenize")
        try:
            answer = asyncio.run(post_json(self.endpoint, path, {"model": self.model, "prompt": TOKENIZER_PROBE}))
        except OpenAIServerError as exc:
            if exc.status not in (404, 405):
                raise
            log.warning("arm %s: %s has no /tokenize (vLLM's route), so the bench cannot check that it tokenizes as "
                        "%s; make sure it serves that model", self.spec.key, self.endpoint.url, self.tokenizer_path)
            return
        theirs = answer.get("tokens") if isinstance(answer, dict) else None
        ours = list(self.tokenizer.encode(TOKENIZER_PROBE))
        if theirs != ours:
            raise ArmError(f"arm {self.spec.key} ({self.spec.text!r}): the server's model {self.model!r} tokenizes "
                           f"{TOKENIZER_PROBE!r} as {str(theirs)[:120]}, but the bench's tokenizer "
                           f"({self.tokenizer_path}) as {str(ours)[:120]}: the workload's token ids would be other "
                           "text there; give the served model's folder as --model (before `bench`)")

    def describe(self) -> dict[str, object]:
        return {"url": self.endpoint.url, "model": self.model, "adapters": self.adapters,
                "tokenizer": str(self.tokenizer_path), "max_model_len": self.max_model_len, "task": self.task,
                "api_key": self.endpoint.api_key is not None}

    def tokenize(self, prompt: str | ChatPrompt) -> list[int]:
        """Text as the tokenizer encodes it; a chat as HF's apply_chat_template renders it."""
        if isinstance(prompt, ChatPrompt):
            return prompt.render(self.tokenizer)
        return list(self.tokenizer.encode(prompt))

    def check_request(self, prompt: list[int], max_tokens: int) -> None:
        """The server refuses what it cannot hold itself, at run time (make_workloads checked its context)."""

    def check_embedding(self, prompt: list[int], pooling: PoolingParams) -> None:
        if pooling.pooling is not None:
            raise InvalidRequestError(f"OpenAI's /embeddings cannot choose a pooler ({pooling.pooling!r}): the "
                                      "server pools as its model says; drop --pooling (or the line's \"pooling\")")

    def keep_structured(self, params: SamplingParams) -> None:
        raise WorkloadError("an openai: arm does not send structured output (servers read its grammars in dialects "
                            "of their own); drop the openai arms or the lines' structured_output")

    def reasons_before_grammar(self, chat: ChatPrompt) -> bool:
        return False  # no structured output: keep_structured refuses it

    def warm_up(self, workloads: list[Workload]) -> None:
        """A short request, then each warm-up workload, unmeasured (the server's first-call costs, connections)."""
        short = tuple(self.vocab.allowed[:WARMUP_PROMPT_TOKENS])
        turn = Turn(short, 0, pooling=PoolingParams()) if self.task == "embed" else Turn(short, 4)
        for workload in [Workload("warm-up", -1, (Session(0.0, (turn,)),)), *workloads]:
            self.run(workload, lambda: None)

    def run(self, workload: Workload, on_request_done: Callable[[], None]) -> RunResult:
        self._check_adapters(workload)
        records, duration = asyncio.run(self._replay(workload, on_request_done))
        records.sort(key=lambda r: (r.session, r.turn))
        return RunResult(self.spec.key, workload.round, duration, records, None, {"server": self.endpoint.url})

    def _check_adapters(self, workload: Workload) -> None:
        wanted = {s.lora_adapter for s in workload.sessions if s.lora_adapter is not None}
        if missing := sorted(wanted - set(self.adapters)):
            raise InvalidRequestError(f"the server at {self.endpoint.url} serves no LoRA adapter {', '.join(missing)} "
                                      f"(GET /models lists {', '.join(self.adapters) or 'none'}); load it there")

    async def _replay(self, workload: Workload, on_request_done: Callable[[], None]
                      ) -> tuple[list[RequestRecord], float]:
        """Every request sent when due, concurrently; a session's next turn once its previous one is done. The
        records, and the run's duration (from the loop's start: its set-up is not timed)."""
        replay = Replay(workload)
        live: set[asyncio.Task[tuple[RequestRecord, list[int]]]] = set()
        prompts: dict[asyncio.Task[Any], list[int]] = {}
        records: list[RequestRecord] = []
        start = time.perf_counter()
        try:
            while replay.pending() or live:
                now = time.perf_counter() - start
                for arrival, session, turn, prompt, max_tokens in replay.pop_due(now):
                    task = asyncio.ensure_future(self._request(workload, session, turn, arrival, prompt, max_tokens,
                                                               start))
                    live.add(task)
                    prompts[task] = prompt
                next_at = replay.next_arrival()
                wait = None if next_at is None else max(0.0, next_at - (time.perf_counter() - start))
                if not live:
                    await asyncio.sleep(wait or 0.0)
                    continue
                done, live = await asyncio.wait(live, timeout=wait, return_when=asyncio.FIRST_COMPLETED)
                for task in done:
                    record, output = task.result()
                    records.append(record)
                    replay.finished(record.session, record.turn, prompts.pop(task), output,
                                    time.perf_counter() - start)
                    on_request_done()
        finally:
            for task in live:
                task.cancel()
            await asyncio.gather(*live, return_exceptions=True)
        return records, time.perf_counter() - start

    async def _request(self, workload: Workload, s: int, t: int, arrival: float, prompt: list[int],
                       max_tokens: int, start: float) -> tuple[RequestRecord, list[int]]:
        session = workload.sessions[s]
        turn = session.turns[t]
        model = session.lora_adapter or self.model
        if turn.pooling is not None:
            vector = await self._embed(model, prompt, turn.pooling, turn.priority)
            done = time.perf_counter() - start
            return RequestRecord(s, t, arrival, len(prompt), 0, [], done, priority=turn.priority, embed=True,
                                 embedding=vector), []
        params = workload.sampling.params(max_tokens, workload.round, s, t, session.lora_adapter, None, turn.priority)
        output, times = await self._generate(model, prompt, params, start)
        done = time.perf_counter() - start
        return RequestRecord(s, t, arrival, len(prompt), len(output), times, done, output_ids=output,
                             priority=turn.priority), output

    async def _generate(self, model: str, prompt: list[int], params: SamplingParams, start: float
                        ) -> tuple[list[int], list[float]]:
        """The output ids of one streamed completion, and the arrival time of each (its chunk's)."""
        body = {"model": model, "prompt": prompt, "max_tokens": params.max_tokens, "ignore_eos": True,
                "stream": True, "stream_options": {"include_usage": True}, "return_token_ids": True,
                **sampling_fields(params)}
        output: list[int] = []
        times: list[float] = []
        choices, with_ids, counted = 0, 0, None
        async for event in post_events(self.endpoint, self.endpoint.path("/completions"), body):
            now = time.perf_counter() - start
            chunk = json.loads(event)
            if not isinstance(chunk, dict) or "error" in chunk:
                raise OpenAIServerError(f"{self.endpoint.url}/completions failed mid-stream: {error_message(event)}")
            for choice in chunk.get("choices") or []:
                choices += 1
                if (ids := choice.get("token_ids")) is not None:
                    with_ids += 1
                    output += ids
                    times += [now] * len(ids)
            if usage := chunk.get("usage"):
                counted = usage.get("completion_tokens")
        if choices and not with_ids:
            raise OpenAIServerError(f"{self.endpoint.url}/completions streamed no token ids: the bench needs "
                                    "vLLM's return_token_ids (each chunk's choices[0].token_ids; vLLM 0.10.2 or "
                                    "later, infer serve), which this server does not return")
        if len(output) != params.max_tokens or counted not in (None, len(output)):
            raise OpenAIServerError(f"{self.endpoint.url}/completions returned {len(output)} token ids (usage: "
                                    f"{counted}) for max_tokens {params.max_tokens} with ignore_eos; the bench needs "
                                    "a server that generates exactly max_tokens (vLLM's ignore_eos)")
        return output, times

    async def _embed(self, model: str, prompt: list[int], pooling: PoolingParams, priority: int) -> list[float]:
        body: dict[str, Any] = {"model": model, "input": prompt, "encoding_format": "float"}
        if pooling.dimensions is not None:
            body["dimensions"] = pooling.dimensions
        if pooling.normalize is not None:
            body["normalize"] = pooling.normalize
        if priority:
            body["priority"] = -priority  # vLLM's API (infer's front too): lower first
        answer = await post_json(self.endpoint, self.endpoint.path("/embeddings"), body)
        try:
            return [float(value) for value in answer["data"][0]["embedding"]]
        except (KeyError, IndexError, TypeError, ValueError):
            raise OpenAIServerError(f"{self.endpoint.url}/embeddings answered no embedding: "
                                    f"{json.dumps(answer)[:200]}") from None


def sampling_fields(params: SamplingParams) -> dict[str, Any]:
    """The body fields of a request's sampling, by OpenAI's and vLLM's names: temperature and top_p always (the
    API's defaults are not greedy), the others where they are set."""
    fields: dict[str, Any] = {"temperature": params.temperature, "top_p": params.top_p}
    if params.seed is not None:
        fields["seed"] = params.seed
    optional = {"top_k": params.top_k, "min_p": params.min_p,
                "repetition_penalty": None if params.repetition_penalty == 1.0 else params.repetition_penalty,
                "frequency_penalty": params.frequency_penalty, "presence_penalty": params.presence_penalty,
                "min_tokens": params.min_tokens, "priority": -params.priority,
                "logit_bias": {str(token): bias for token, bias in params.logit_bias}}
    return fields | {name: value for name, value in optional.items() if value not in (None, 0, {})}
