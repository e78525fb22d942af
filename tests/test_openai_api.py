"""OpenAI's HTTP API (`infer serve --http-port`) driven by the official `openai` client, against an in-process
server on 127.0.0.1 (one for the module). The reference is the same engine run offline (``Engine.generate``,
``LLM.chat``, ``Engine.embed``): the front must answer what the engine computes, in OpenAI's shapes."""
from __future__ import annotations

import asyncio
import base64
import http.client
import json
import logging
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pytest

pytest.importorskip("grpc_health", reason="the server needs grpcio-health-checking (a dependency of infer-engine; "
                    "the GPU image lacks it)")
openai = pytest.importorskip("openai", reason="the HTTP front's tests drive it with the openai client (dev extra)")

from infer.core.chat import ChatPrompt  # noqa: E402
from infer.core.llm import LLM  # noqa: E402
from infer.core.pooling import PoolingParams  # noqa: E402
from infer.core.errors import InvalidRequestError  # noqa: E402
from infer.core.request import SamplingParams, StructuredOutput  # noqa: E402
from conftest import LoopThread, random_adapter, serving  # noqa: E402
from infer.server.app import InferenceServer, ServeOptions  # noqa: E402

TEMPLATE = ("{%- if tools %}<|system|>\n{%- for tool in tools %}{{ tool | tojson }}\n{%- endfor %}{% endif %}"
            "{%- for m in messages %}<|{{ m.role }}|>\n{{ m.content }}"
            "{%- for c in m.tool_calls or [] %}{{ c.function.name }}{{ c.function.arguments | tojson }}{%- endfor %}"
            "\n{%- endfor %}<|assistant|>\n")
FORECAST = {"type": "function", "function": {"name": "forecast", "description": "The forecast.", "parameters": {
    "type": "object", "properties": {"unit": {"enum": ["C", "F"]}, "hourly": {"type": "boolean"}},
    "required": ["unit", "hourly"]}}}
ASK = [{"role": "user", "content": "Weather in Oslo tomorrow?"}]
NAME = "tiny"
CONTEXT = 256  # the served engine's max_model_len
TOKEN = "sesame"
ADAPTER = "sql"  # a LoRA adapter the server serves: a body's model may name it
PAGE = "https://app.example"  # the web origin the server lets call it (--allowed-origins)


@dataclass
class Served:
    server: InferenceServer
    llm: LLM
    loop: asyncio.AbstractEventLoop

    def client(self, **options: object) -> openai.OpenAI:
        return openai.OpenAI(base_url=f"http://127.0.0.1:{self.server.http_port}/v1", api_key=TOKEN, max_retries=0,
                             **options)  # type: ignore[arg-type]

    def unfinished(self) -> bool:
        future = self.server.worker.call(lambda engine: engine.has_unfinished())
        return bool(future.result(30))


@pytest.fixture(scope="module")
def served(tiny_model: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Served]:
    """One server for the module (token required, max_queue 2), its event loop on a thread of its own."""
    folder = tmp_path_factory.mktemp("openai")
    template = folder / "tools.jinja"
    template.write_text(TEMPLATE)
    llm = LLM(model=str(tiny_model), device="cpu", num_kv_blocks=128, chat_template=str(template),
              tool_parser="hermes", reasoning_parser="deepseek-r1", max_model_len=CONTEXT,
              lora_adapters={ADAPTER: str(random_adapter(tiny_model, folder / ADAPTER))})
    loops = LoopThread()
    try:
        with serving(llm.engine, loops, http_port=0, token=TOKEN, served_model_name=NAME, max_queue=2,
                     allowed_origins=(PAGE,)) as server:
            yield Served(server, llm, loops.loop)
    finally:
        loops.stop()


def offline(served: Served, fn):  # type: ignore[no-untyped-def]
    """``fn(engine)`` on the server's engine thread (the engine is the worker's while it serves)."""
    return served.server.worker.call(fn).result(120)


def test_completions_answer_what_the_engine_generates(served: Served) -> None:
    """Greedy and seeded sampling with n=2 over two prompts: each choice's text, finish reason and the usage are
    the engine's own; choice i*n+j is completion j of prompt i."""
    prompts = ["def add(a, b):", "import os\n"]
    params = SamplingParams(max_tokens=10, temperature=0.9, seed=7, n=2)
    want = offline(served, lambda engine: engine.generate(prompts, params))
    got = served.client().completions.create(model=NAME, prompt=prompts, max_tokens=10, temperature=0.9, seed=7, n=2)
    assert [c.index for c in got.choices] == [0, 1, 2, 3]
    assert [c.text for c in got.choices] == [c.text for out in want for c in out.outputs]
    assert [c.finish_reason for c in got.choices] == [c.finish_reason.value for out in want for c in out.outputs]
    assert got.usage.prompt_tokens == sum(len(out.prompt_token_ids) for out in want)
    assert got.usage.completion_tokens == sum(len(c.token_ids) for out in want for c in out.outputs)
    assert got.model == NAME and got.object == "text_completion" and got.id.startswith("cmpl-")


def test_a_completion_streams_the_same_text_with_usage_last(served: Served) -> None:
    want = offline(served, lambda engine: engine.generate(["x = "], SamplingParams(max_tokens=12, temperature=0)))[0]
    chunks = list(served.client().completions.create(model=NAME, prompt="x = ", max_tokens=12, temperature=0,
                                                     stream=True, stream_options={"include_usage": True}))
    assert "".join(c.choices[0].text for c in chunks[:-1]) == want.outputs[0].text
    assert chunks[-2].choices[0].finish_reason == "length" and chunks[-1].choices == []
    assert chunks[-1].usage.completion_tokens == 12 and chunks[-1].usage.prompt_tokens == len(want.prompt_token_ids)
    assert all(c.usage is None for c in chunks[:-1])


def test_echo_with_logprobs_gives_the_prompts_logprobs_first_as_lm_eval_reads_them(served: Served) -> None:
    """lm-evaluation-harness's loglikelihood request (echo, logprobs 1, max_tokens 1, temperature 0): the tokens are
    the prompt's then the completion's, each prompt token's logprob is the engine's prompt logprob (the first null),
    and a stream gives the same lists."""
    ids = offline(served, lambda engine: engine.tokenize("def add(a, b): return a + b"))
    want = offline(served, lambda engine: engine.generate([ids], SamplingParams(
        max_tokens=1, temperature=0, logprobs=1, prompt_logprobs=1)))[0]
    names = offline(served, lambda engine: [engine.tokenizer.decode([t]) for t in ids + want.outputs[0].token_ids])
    client = served.client()
    got = client.completions.create(model=NAME, prompt=ids, max_tokens=1, temperature=0, logprobs=1, echo=True)
    logprobs = got.choices[0].logprobs
    assert logprobs.tokens == names
    chosen = [None] + [entry[t] for t, entry in zip(ids[1:], want.prompt_logprobs[1:])]
    chosen += [want.outputs[0].logprobs[0][want.outputs[0].token_ids[0]]]
    assert logprobs.token_logprobs[0] is None and logprobs.top_logprobs[0] is None
    assert logprobs.token_logprobs[1:] == pytest.approx(chosen[1:])
    top = [max(e, key=e.get) for e in [*want.prompt_logprobs[1:], *want.outputs[0].logprobs]]  # the top 1
    top_names = offline(served, lambda engine: [engine.tokenizer.decode([t]) for t in top])
    assert [list(entry) for entry in logprobs.top_logprobs[1:]] == [[name] for name in top_names]
    chunks = client.completions.create(model=NAME, prompt=ids, max_tokens=1, temperature=0, logprobs=1, echo=True,
                                       stream=True)
    streamed = [c.choices[0].logprobs for c in chunks if c.choices[0].logprobs]
    assert [t for part in streamed for t in part.tokens] == names
    assert [lp for part in streamed for lp in part.token_logprobs] == logprobs.token_logprobs


def test_return_token_ids_gives_each_choices_ids_whole_and_streamed(served: Served) -> None:
    """vLLM's return_token_ids: a choice's prompt_token_ids (with its first chunk) and token_ids (each chunk's)."""
    prompts = ["def add(a, b):", "x = "]
    params = SamplingParams(max_tokens=9, temperature=0.8, seed=5, n=2)
    want = offline(served, lambda engine: engine.generate(prompts, params))
    body = {"model": NAME, "prompt": prompts, "max_tokens": 9, "temperature": 0.8, "seed": 5, "n": 2,
            "return_token_ids": True}
    status, whole = post(served, "/v1/completions", json.dumps(body).encode())
    assert status == 200
    expected = [(out.prompt_token_ids, c.token_ids) for out in want for c in out.outputs]
    assert [(c["prompt_token_ids"], c["token_ids"]) for c in whole["choices"]] == expected
    fields = {key: value for key, value in body.items() if key != "return_token_ids"}
    chunks = served.client().completions.create(**fields, stream=True,  # type: ignore[call-overload]
                                                extra_body={"return_token_ids": True})
    prompt_ids: dict[int, list[int]] = {}
    ids: dict[int, list[int]] = {i: [] for i in range(4)}
    for chunk in chunks:
        choice = chunk.choices[0].model_extra
        if "prompt_token_ids" in choice:
            assert chunk.choices[0].index not in prompt_ids
            prompt_ids[chunk.choices[0].index] = choice["prompt_token_ids"]
        ids[chunk.choices[0].index] += choice["token_ids"]
    assert [(prompt_ids[i], ids[i]) for i in range(4)] == expected
    chat = served.client().chat.completions.create(model=NAME, messages=ASK, max_tokens=6, temperature=0,
                                                   stream=True, extra_body={"return_token_ids": True})
    want_chat = offline(served, lambda engine: served.llm.chat(ASK, SamplingParams(max_tokens=6, temperature=0)))
    assert [t for c in chat for t in (c.choices[0].model_extra or {}).get("token_ids", [])] == \
        want_chat[0].outputs[0].token_ids


def test_token_prompts_echo_and_logprobs(served: Served) -> None:
    """Token ids go in as the prompt; echo puts the prompt's text before the completion's; logprobs carry the
    engine's logprob of each sampled token, the top 3 by name and offsets into the text."""
    ids = offline(served, lambda engine: engine.tokenize("def add(a, b):"))
    want = offline(served, lambda engine: engine.generate([ids], SamplingParams(max_tokens=6, temperature=0,
                                                                               logprobs=3)))[0].outputs[0]
    text = offline(served, lambda engine: engine.tokenizer.decode(ids))
    client = served.client()
    echoed = client.completions.create(model=NAME, prompt=ids, max_tokens=6, temperature=0, echo=True)
    assert echoed.choices[0].text == text + want.text
    got = client.completions.create(model=NAME, prompt=ids, max_tokens=6, temperature=0, logprobs=3).choices[0]
    names = offline(served, lambda engine: [engine.tokenizer.decode([t]) for t in want.token_ids])
    assert got.logprobs.tokens == names and "".join(names) == got.text
    assert got.logprobs.token_logprobs == pytest.approx([e[t] for t, e in zip(want.token_ids, want.logprobs)])
    assert [len(top) for top in got.logprobs.top_logprobs] == [len(e) for e in want.logprobs]
    assert got.logprobs.text_offset == [sum(map(len, names[:i])) for i in range(len(names))]


def test_chat_answers_and_streams_what_llm_chat_answers(served: Served) -> None:
    """deepseek-r1 reads the tiny model's replies as all reasoning (the template opened the block; test_reasoning.py
    has the rules): the message's reasoning_content and content are LLM.chat's, whole and streamed."""
    params = SamplingParams(max_tokens=10, temperature=0, logprobs=2)
    want = offline(served, lambda engine: served.llm.chat(ASK, params))[0].outputs[0]
    assert want.reasoning_content == want.text and want.content == ""
    client = served.client()
    got = client.chat.completions.create(model=NAME, messages=ASK, max_tokens=10, temperature=0, logprobs=True,
                                         top_logprobs=2).choices[0]
    assert (got.message.role, got.message.content, got.finish_reason) == ("assistant", "", "length")
    assert got.message.reasoning_content == want.reasoning_content
    assert [e.logprob for e in got.logprobs.content] == pytest.approx([e[t] for t, e in zip(want.token_ids,
                                                                                              want.logprobs)])
    assert all(len(e.top_logprobs) == 2 for e in got.logprobs.content)
    chunks = list(client.chat.completions.create(model=NAME, messages=ASK, max_tokens=10, temperature=0,
                                                 stream=True))
    assert chunks[0].choices[0].delta.role == "assistant"
    deltas = [c.choices[0].delta for c in chunks]
    assert "".join(getattr(d, "reasoning_content", None) or "" for d in deltas) == want.reasoning_content
    assert not "".join(d.content or "" for d in deltas)
    assert chunks[-1].choices[0].finish_reason == "length" and chunks[-1].object == "chat.completion.chunk"


def test_without_max_tokens_a_chat_may_fill_the_context(served: Served) -> None:
    """OpenAI's default: no max_tokens is the room the context has after the prompt (not SamplingParams' 16)."""
    got = served.client().chat.completions.create(model=NAME, messages=ASK, temperature=0,
                                                  extra_body={"ignore_eos": True})
    assert got.choices[0].finish_reason == "length"
    assert got.usage.completion_tokens == CONTEXT - got.usage.prompt_tokens


def test_a_forced_tool_call_comes_back_as_tool_calls_whole_and_streamed(served: Served) -> None:
    choice = {"type": "function", "function": {"name": "forecast"}}
    want = offline(served, lambda engine: served.llm.chat(ASK, SamplingParams(max_tokens=40, temperature=0),
                                                          tools=[FORECAST], tool_choice=choice))[0].outputs[0]
    want_calls = [(c.name, dict(c.arguments)) for c in want.tool_calls]
    assert want_calls
    client = served.client()
    got = client.chat.completions.create(model=NAME, messages=ASK, max_tokens=40, temperature=0, tools=[FORECAST],
                                         tool_choice=choice).choices[0]
    assert got.finish_reason == "tool_calls" and not got.message.content
    assert [(c.function.name, json.loads(c.function.arguments)) for c in got.message.tool_calls] == want_calls
    assert all(c.id and c.type == "function" for c in got.message.tool_calls)
    chunks = list(client.chat.completions.create(model=NAME, messages=ASK, max_tokens=40, temperature=0,
                                                 tools=[FORECAST], tool_choice=choice, stream=True))
    calls = [call for c in chunks for call in c.choices[0].delta.tool_calls or ()]
    assert [(c.function.name, json.loads(c.function.arguments)) for c in calls] == want_calls
    assert [c.index for c in calls] == list(range(len(calls))) and chunks[-1].choices[0].finish_reason == "tool_calls"


def test_response_format_and_structured_outputs_shape_the_reply_as_the_engine_does(served: Served) -> None:
    """OpenAI's json_schema response format and vLLM's structured_outputs choice: the engine's StructuredOutput."""
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"],
              "additionalProperties": False}
    shaped = SamplingParams(max_tokens=30, temperature=0, structured_output=StructuredOutput(json_schema=json.dumps(
        schema)))
    want = offline(served, lambda engine: served.llm.chat(ASK, shaped))[0].outputs[0].text
    client = served.client()
    got = client.chat.completions.create(model=NAME, messages=ASK, max_tokens=30, temperature=0, response_format={
        "type": "json_schema", "json_schema": {"name": "a", "schema": schema}}).choices[0].message.content
    assert got == want and set(json.loads(got)) == {"a"}
    choices = ("yes", "no", "maybe")
    picked = SamplingParams(max_tokens=5, temperature=0, structured_output=StructuredOutput(choice=choices))
    want = offline(served, lambda engine: engine.generate(["Is it? "], picked))[0].outputs[0].text
    got = client.completions.create(model=NAME, prompt="Is it? ", max_tokens=5, temperature=0,
                                    extra_body={"structured_outputs": {"choice": list(choices)}}).choices[0].text
    assert got == want and got in choices


def test_embeddings_as_floats_and_base64(served: Served) -> None:
    """Floats, and base64 of little-endian float32 (which the client asks for and decodes unless told a format):
    each is the engine's vector."""
    texts = ["What is gravity?", "def add(a, b):"]
    want = offline(served, lambda engine: engine.embed(texts, PoolingParams(dimensions=16)))
    client = served.client()
    for encoding in ("float", "base64"):
        got = client.embeddings.create(model=NAME, input=texts, dimensions=16, encoding_format=encoding)
        assert [d.index for d in got.data] == [0, 1]
        for data, out in zip(got.data, want):
            vector = data.embedding if encoding == "float" else np.frombuffer(base64.b64decode(data.embedding), "<f4")
            assert list(vector) == pytest.approx(out.embedding, abs=1e-6)
        assert got.usage.prompt_tokens == sum(len(out.prompt_token_ids) for out in want)
    default = client.embeddings.create(model=NAME, input=texts[0], dimensions=16)  # base64 on the wire
    assert list(default.data[0].embedding) == pytest.approx(want[0].embedding, abs=1e-6)


def test_models_lists_the_model_and_its_adapters_and_a_body_may_name_either(served: Served) -> None:
    client = served.client()
    listed = client.models.list().data
    assert [(m.id, m.parent) for m in listed] == [(NAME, None), (ADAPTER, NAME)]
    assert [client.models.retrieve(m.id) for m in listed] == listed  # OpenAI's retrieve: GET /v1/models/{model}
    with pytest.raises(openai.NotFoundError, match="'gpt-4' does not exist here"):
        client.models.retrieve("gpt-4")
    base, adapted = offline(served, lambda engine: engine.generate(["def f("] * 2, [
        SamplingParams(max_tokens=8, temperature=0), SamplingParams(max_tokens=8, temperature=0,
                                                                    lora_adapter=ADAPTER)]))
    assert base.outputs[0].text != adapted.outputs[0].text  # the adapter changes the answer
    for model, want in ((NAME, base), (ADAPTER, adapted)):
        got = client.completions.create(model=model, prompt="def f(", max_tokens=8, temperature=0)
        assert got.choices[0].text == want.outputs[0].text
    status, answer = post(served, "/v1/completions", json.dumps({"prompt": "def f(", "max_tokens": 8,
                                                                 "temperature": 0}).encode())
    assert status == 200 and answer["choices"][0]["text"] == base.outputs[0].text  # no model: the served one


def test_errors_come_as_openai_errors_with_their_status(served: Served) -> None:
    """A bad field is 400 naming it; an unknown field is 400, never dropped; an unknown model is 404; no token is
    401; an engine refusal (a prompt past the context) is 400 with the engine's message."""
    client = served.client()
    with pytest.raises(openai.BadRequestError, match="temperature"):
        client.completions.create(model=NAME, prompt="x", temperature="hot")  # type: ignore[arg-type]
    with pytest.raises(openai.BadRequestError, match="bogus"):
        client.completions.create(model=NAME, prompt="x", extra_body={"bogus": 1})
    with pytest.raises(openai.NotFoundError, match="'gpt-4'"):
        client.completions.create(model="gpt-4", prompt="x")
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=f"http://127.0.0.1:{served.server.http_port}/v1", api_key="wrong",
                      max_retries=0).models.list()
    with pytest.raises(openai.BadRequestError, match="context length"):
        client.completions.create(model=NAME, prompt="x", max_tokens=10**6)
    with pytest.raises(openai.BadRequestError, match="response_format"):
        client.chat.completions.create(model=NAME, messages=ASK, response_format={"type": "yaml"})  # type: ignore


def test_a_full_server_answers_429_and_a_client_gone_frees_its_request(served: Served,
                                                                        caplog: pytest.LogCaptureFixture) -> None:
    """max_queue 2: two streams in flight hold the server, a third request is 429; closing a stream's connection
    aborts its request, quietly (a client gone is no server error)."""
    client = served.client()
    streams = [client.completions.create(model=NAME, prompt="a", max_tokens=200, temperature=0, stream=True,
                                         extra_body={"ignore_eos": True}) for _ in range(2)]
    for stream in streams:
        next(iter(stream))
    with pytest.raises(openai.RateLimitError, match="--max-queue 2"):
        client.completions.create(model=NAME, prompt="b", max_tokens=1)
    for stream in streams:
        stream.close()
    deadline = time.monotonic() + 30
    while served.unfinished() and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not served.unfinished()
    assert served.server.servicer.in_flight == 0
    assert [r.getMessage() for r in caplog.records if r.levelno >= logging.ERROR] == []


def post(served: Served, path: str, body: bytes) -> tuple[int, dict]:
    """A POST by http.client (the openai client always sends a model, and only JSON): (status, JSON answer)."""
    connection = http.client.HTTPConnection("127.0.0.1", served.server.http_port, timeout=60)
    try:
        connection.request("POST", path, body, {"Authorization": f"Bearer {TOKEN}",
                                                "Content-Type": "application/json"})
        response = connection.getresponse()
        return response.status, json.loads(response.read())
    finally:
        connection.close()


def test_tokenize_and_detokenize_are_the_engines(served: Served) -> None:
    """vLLM's /tokenize (a prompt, or a conversation by the chat template) and /detokenize."""
    text = "def add(a, b):"
    ids = offline(served, lambda engine: engine.tokenize(text))
    chat_ids = offline(served, lambda engine: engine.tokenize(ChatPrompt.of(ASK)))
    assert post(served, "/tokenize", json.dumps({"model": NAME, "prompt": text}).encode()) == (
        200, {"count": len(ids), "max_model_len": CONTEXT, "tokens": ids})
    assert post(served, "/tokenize", json.dumps({"messages": ASK}).encode())[1]["tokens"] == chat_ids
    want = offline(served, lambda engine: engine.tokenizer.decode(chat_ids))
    assert post(served, "/detokenize", json.dumps({"tokens": chat_ids}).encode()) == (200, {"prompt": want})
    status, answer = post(served, "/detokenize", json.dumps({"tokens": [10**6]}).encode())
    assert status == 400 and "token ids in [0, " in answer["error"]["message"]
    status, answer = post(served, "/tokenize", json.dumps({"prompt": text, "messages": ASK}).encode())
    assert status == 400 and "give one" in answer["error"]["message"]


def test_x_request_id_names_the_engine_request_and_the_answer(served: Served) -> None:
    """vLLM's X-Request-Id: the engine's request id while it runs (what gRPC's Abort takes, what logs name), the
    answer's id after its prefix, and echoed in the answer's headers; a bad one is 400."""
    body = json.dumps({"model": NAME, "prompt": "a", "max_tokens": 150, "temperature": 0, "ignore_eos": True,
                       "stream": True}).encode()
    connection = http.client.HTTPConnection("127.0.0.1", served.server.http_port, timeout=60)
    try:
        connection.request("POST", "/v1/completions", body, {"Authorization": f"Bearer {TOKEN}",
                                                             "X-Request-Id": "trace-42"})
        response = connection.getresponse()
        first = json.loads(response.fp.readline().decode().removeprefix("data: "))
        assert (response.status, response.getheader("X-Request-Id"), first["id"]) == (200, "trace-42", "cmpl-trace-42")
        assert offline(served, lambda engine: "trace-42" in engine.requests)
        response.read()
    finally:
        connection.close()
    status, headers, _ = request(served, "POST", "/v1/completions", {"Authorization": f"Bearer {TOKEN}",
                                                                     "X-Request-Id": "trace-43"}, b"{}")
    assert status == 400 and headers["x-request-id"] == "trace-43"  # an error answer carries it too
    for bad in ("x" * 300, "caf\u00e9"):
        connection = http.client.HTTPConnection("127.0.0.1", served.server.http_port, timeout=60)
        try:
            connection.putrequest("POST", "/v1/completions")
            for name, value in (("Authorization", f"Bearer {TOKEN}"), ("X-Request-Id", bad),
                                ("Content-Length", str(len(body)))):
                connection.putheader(name, value.encode("utf-8"))
            connection.endheaders(body)
            response = connection.getresponse()
            assert response.status == 400 and "X-Request-Id must be" in json.loads(response.read())["error"]["message"]
        finally:
            connection.close()


def request(served: Served, method: str, path: str, headers: dict[str, str], body: bytes = b""
            ) -> tuple[int, dict[str, str], bytes]:
    connection = http.client.HTTPConnection("127.0.0.1", served.server.http_port, timeout=60)
    try:
        connection.request(method, path, body, headers)
        response = connection.getresponse()
        return response.status, {k.lower(): v for k, v in response.getheaders()}, response.read()
    finally:
        connection.close()


def test_pages_of_an_allowed_origin_may_call_from_a_browser(served: Served) -> None:
    """--allowed-origins (CORS): a preflight is answered without the token, with the route's methods; every answer
    to a page of the origin says it may read it, an error too; another origin's page gets no such header."""
    status, headers, _ = request(served, "OPTIONS", "/v1/chat/completions", {
        "Origin": PAGE, "Access-Control-Request-Method": "POST",
        "Access-Control-Request-Headers": "authorization, x-stainless-os"})  # openai-node's own headers too
    assert status == 200 and headers["access-control-allow-origin"] == PAGE
    assert (headers["access-control-allow-methods"], headers["access-control-allow-headers"]) == (
        "POST", "authorization, x-stainless-os")
    body = json.dumps({"model": NAME, "prompt": "x", "max_tokens": 2}).encode()
    status, headers, answer = request(served, "POST", "/v1/completions", {"Origin": PAGE,
                                                                          "Authorization": f"Bearer {TOKEN}"}, body)
    assert status == 200 and headers["access-control-allow-origin"] == PAGE and json.loads(answer)["choices"]
    status, headers, _ = request(served, "POST", "/v1/completions", {"Origin": PAGE}, body)  # no token
    assert status == 401 and headers["access-control-allow-origin"] == PAGE
    for method in ("OPTIONS", "POST"):
        status, headers, _ = request(served, method, "/v1/completions", {"Origin": "https://evil.example",
                                                                         "Authorization": f"Bearer {TOKEN}"}, body)
        assert "access-control-allow-origin" not in headers and status == (405 if method == "OPTIONS" else 200)


def test_allowed_origins_need_the_http_api_and_an_origin_shape() -> None:
    from infer.core.errors import ConfigError

    for options, complaint in (({"allowed_origins": ("*",)}, "add --http-port"),
                               ({"allowed_origins": ("app.example",), "http_port": 0}, "got 'app.example'"),
                               ({"allowed_origins": ("https://app.example/",), "http_port": 0}, "no path")):
        with pytest.raises(ConfigError, match=complaint):
            ServeOptions(**options).validate()  # type: ignore[arg-type]
    ServeOptions(http_port=0, allowed_origins=("*", "http://localhost:3000")).validate()


def test_refusals_are_their_own_status_streamed_or_not_and_leave_no_reader_behind(served: Served) -> None:
    """A stream the engine refuses (a prompt past the context) is a 400 before any event, as without stream; a body
    of several prompts one of which is refused leaves no reader task waiting on the event loop; a body nested past
    the JSON reader's depth is a 400."""
    client = served.client()
    for stream in (False, True):
        with pytest.raises(openai.BadRequestError, match="context length"):
            client.completions.create(model=NAME, prompt="x " * 400, max_tokens=4, stream=stream)
    with pytest.raises(openai.BadRequestError, match="context length"):
        client.completions.create(model=NAME, prompt=["def f():", "x " * 400], max_tokens=30)

    async def readers() -> list[str]:
        return [repr(t.get_coro()) for t in asyncio.all_tasks() if "_collect" in repr(t.get_coro())]

    assert asyncio.run_coroutine_threadsafe(readers(), served.loop).result(30) == []
    status, answer = post(served, "/v1/completions", b"[" * 100_000)
    assert status == 400 and "nests too deeply" in answer["error"]["message"]


def test_a_chat_without_max_tokens_may_ask_for_more_than_16_min_tokens(served: Served) -> None:
    got = served.client().chat.completions.create(model=NAME, messages=ASK, temperature=0,
                                                  extra_body={"min_tokens": 40})
    assert got.usage.completion_tokens >= 40


def test_priority_reads_as_vllm_reads_it_and_model_must_be_a_string() -> None:
    """vLLM's priority: lower runs first, so the engine's (higher first) is its negation, for generation and
    embeddings; a model that is not a string is a bad request, not an unknown model."""
    from infer.server import openai_params

    served = openai_params.Served(NAME, lambda: ())
    assert openai_params.completion_request({"prompt": "x", "priority": -3}, served).params.priority == 3
    assert openai_params.embedding_request({"input": "x", "priority": 2}, served).params.priority == -2
    with pytest.raises(InvalidRequestError, match="model must be a string"):
        openai_params.completion_request({"prompt": "x", "model": 7}, served)


def test_health_is_503_once_the_engine_thread_is_not_running() -> None:
    """As gRPC health turns NOT_SERVING when the engine thread fails, so that a balancer routes elsewhere."""
    from types import SimpleNamespace

    from infer.server.http import HttpError, HttpRequest
    from infer.server.openai_front import OpenAIFront

    worker = SimpleNamespace(serving=True)
    servicer = SimpleNamespace(worker=worker, served_adapters=(), draining=False)
    front = OpenAIFront(servicer, NAME)  # type: ignore[arg-type]
    answers: list[tuple[int, object]] = []

    class Respond:
        headers: dict[str, str] = {}

        async def json(self, status: int, payload: object) -> None:
            answers.append((status, payload))

    health = HttpRequest("GET", "/health", {}, {}, b"")
    asyncio.run(front(health, Respond()))  # type: ignore[arg-type]
    assert answers == [(200, {"status": "ok"})]
    worker.serving = False
    with pytest.raises(HttpError, match="engine thread is not running") as failed:
        asyncio.run(front(health, Respond()))  # type: ignore[arg-type]
    assert failed.value.status == 503


def test_a_token_outside_ascii_authenticates_as_over_grpc() -> None:
    """The Authorization header's bytes are compared with the token's UTF-8, as gRPC metadata is."""
    from types import SimpleNamespace

    from infer.server.http import HttpError, HttpRequest
    from infer.server.openai_front import OpenAIFront

    front = OpenAIFront(SimpleNamespace(worker=None, served_adapters=()), NAME, "s\u00e9same")  # type: ignore[arg-type]
    answered: list[str] = []

    async def route(request: HttpRequest, respond: object) -> None:
        answered.append(request.path)

    front.routes[("GET", "/v1/models")] = route
    sent = "Bearer s\u00e9same".encode().decode("latin-1")  # as the HTTP layer reads the header's bytes
    asyncio.run(front(HttpRequest("GET", "/v1/models", {}, {"authorization": sent}, b""),
                      SimpleNamespace(headers={})))  # type: ignore[arg-type]
    assert answered == ["/v1/models"]
    with pytest.raises(HttpError, match="bearer token"):
        asyncio.run(front(HttpRequest("GET", "/v1/models", {}, {"authorization": "Bearer sesame"}, b""),
                          SimpleNamespace(headers={})))  # type: ignore[arg-type]


def test_metrics_are_served_on_the_api_port_without_the_token(served: Served) -> None:
    """Prometheus' text of the same Stats as --metrics-port (GetStats' fields), no token needed (counts only)."""
    served.client().completions.create(model=NAME, prompt="x", max_tokens=2)
    status, headers, text = request(served, "GET", "/metrics", {})
    stats = asyncio.run_coroutine_threadsafe(served.server.servicer.stats(), served.loop).result(30)
    assert status == 200 and headers["content-type"].startswith("text/plain")
    lines = dict(line.rsplit(" ", 1) for line in text.decode().splitlines() if line and not line.startswith("#"))
    assert float(lines["infer_requests_finished_total"]) == stats.requests_finished > 0
    assert float(lines["infer_server_max_queue"]) == 2


def test_malformed_json_is_400(served: Served) -> None:
    status, answer = post(served, "/v1/completions", b"{not json")
    assert status == 400 and "not JSON" in answer["error"]["message"]
    assert answer["error"]["type"] == "invalid_request_error"


def test_every_field_the_readers_take_is_documented(monkeypatch: pytest.MonkeyPatch) -> None:
    """docs/serving.md's OpenAI section names every body field the three readers take (each reader takes all of
    its fields, given or not, so a minimal body shows them all)."""
    from infer.server import openai_params
    from infer.server.openai_params import Fields

    taken: set[str] = set()
    take, drop = Fields.take, Fields.drop

    def spy_take(self: Fields, name: str, *args: object, **kwargs: object) -> object:
        taken.add(name)
        return take(self, name, *args, **kwargs)  # type: ignore[arg-type]

    def spy_drop(self: Fields, *names: str) -> None:
        taken.update(names)
        drop(self, *names)

    monkeypatch.setattr(Fields, "take", spy_take)
    monkeypatch.setattr(Fields, "drop", spy_drop)
    served = openai_params.Served(NAME, lambda: ())
    openai_params.completion_request({"prompt": "x"}, served)
    openai_params.chat_request({"messages": ASK}, served)
    openai_params.embedding_request({"input": "x"}, served)
    openai_params.tokenize_request({"messages": ASK}, served)
    openai_params.detokenize_request({"tokens": [1]}, served, 8)
    assert len(taken) > 40
    docs = (Path(__file__).parents[1] / "docs" / "serving.md").read_text(encoding="utf-8")
    section = docs[docs.index("## OpenAI's HTTP API"):docs.index("## Security")]
    assert sorted(name for name in taken if f"`{name}`" not in section) == []


def test_a_client_gone_mid_answer_passes_through_the_front_unlogged(caplog: pytest.LogCaptureFixture) -> None:
    """A write to a closed connection (ClientGone) is the HTTP layer's to end quietly, not an internal error (500,
    logged); any other failure of a route is one."""
    from types import SimpleNamespace

    from infer.server.http import ClientGone, HttpError, HttpRequest
    from infer.server.openai_front import OpenAIFront

    front = OpenAIFront(SimpleNamespace(worker=None, served_adapters=()), NAME)  # type: ignore[arg-type]
    request = HttpRequest("GET", "/v1/models", {}, {}, b"")
    for failure, raised in ((ClientGone("gone"), ClientGone), (RuntimeError("bug"), HttpError)):
        async def route(request: HttpRequest, respond: object, failure: Exception = failure) -> None:
            raise failure

        front.routes[("GET", "/v1/models")] = route
        caplog.clear()
        with pytest.raises(raised):
            asyncio.run(front(request, SimpleNamespace(headers={})))  # type: ignore[arg-type]
        assert bool(caplog.records) is (raised is HttpError)



PICK = {"type": "function", "function": {"name": "f", "strict": True, "parameters": {
    "type": "object", "properties": {"x": {"type": "integer"}}}}}  # strict: the client's .stream() parses it
HI = [{"role": "user", "content": "Hi"}]
TWO_CALLS = ('<tool_call>{"name": "f", "arguments": {"x": 1}}</tool_call>'
             '<tool_call>{"name": "f", "arguments": {}}</tool_call>')


def test_parsed_calls_reach_the_clients_stream_helper_and_parallel_tool_calls_false_keeps_the_first(
        served: Served) -> None:
    """A reply of two hermes calls (forced by a choice): whole and through the openai client's .stream() helper
    (ChatCompletionStreamState) the calls are LLM.chat's, each delta's first carrying id, type and name; with
    parallel_tool_calls false each carries the first call alone, as vLLM does."""
    forced = SamplingParams(max_tokens=100, temperature=0, structured_output=StructuredOutput(choice=(TWO_CALLS,)))
    want = offline(served, lambda engine: served.llm.chat(HI, forced, tools=[PICK]))[0].outputs[0]
    want_calls = [(c.name, dict(c.arguments)) for c in want.tool_calls]
    assert len(want_calls) == 2
    client = served.client()
    ask = {"model": NAME, "messages": HI, "max_tokens": 100, "temperature": 0, "tools": [PICK],
           "extra_body": {"structured_outputs": {"choice": [TWO_CALLS]}}}
    for parallel, wanted in ((True, want_calls), (False, want_calls[:1])):
        whole = client.chat.completions.create(**ask, parallel_tool_calls=parallel).choices[0]
        assert [(c.function.name, json.loads(c.function.arguments)) for c in whole.message.tool_calls] == wanted
        assert whole.finish_reason == "tool_calls" and whole.message.content is None
        with client.chat.completions.stream(**ask, parallel_tool_calls=parallel) as stream:
            done = [(e.name, e.parsed_arguments) for e in stream if e.type == "tool_calls.function.arguments.done"]
            streamed = stream.get_final_completion().choices[0]
        assert done == wanted and streamed.finish_reason == "tool_calls"
        assert [(c.function.name, c.function.parsed_arguments) for c in streamed.message.tool_calls] == wanted
        assert all(c.id.startswith("call_") and c.type == "function" for c in streamed.message.tool_calls)


def test_max_completion_tokens_and_its_deprecated_name_max_tokens(served: Served) -> None:
    """Either bounds a chat's reply; both must agree (a value never loses to the other silently)."""
    client = served.client()
    ask = {"model": NAME, "messages": ASK, "temperature": 0, "extra_body": {"ignore_eos": True}}
    assert client.chat.completions.create(**ask, max_completion_tokens=5).usage.completion_tokens == 5
    assert client.chat.completions.create(**ask, max_tokens=7).usage.completion_tokens == 7
    assert client.chat.completions.create(**ask, max_tokens=6, max_completion_tokens=6).usage.completion_tokens == 6
    with pytest.raises(openai.BadRequestError, match=r"max_completion_tokens \(5\) and max_tokens \(7\) disagree"):
        client.chat.completions.create(**ask, max_completion_tokens=5, max_tokens=7)


def test_the_clients_parse_helper_gets_the_engines_json_under_its_strict_schema(served: Served) -> None:
    """client.chat.completions.parse sends a pydantic model as a strict json_schema response format: the reply is
    the engine's under that schema, parsed into the model; a json_schema key OpenAI does not define is refused."""
    import pydantic
    from openai.lib._pydantic import to_strict_json_schema

    class Answer(pydantic.BaseModel):
        a: int

    shaped = SamplingParams(max_tokens=30, temperature=0, structured_output=StructuredOutput(
        json_schema=json.dumps(to_strict_json_schema(Answer))))
    want = offline(served, lambda engine: served.llm.chat(ASK, shaped))[0].outputs[0].text
    client = served.client()
    got = client.chat.completions.parse(model=NAME, messages=ASK, max_tokens=30, temperature=0, response_format=Answer)
    assert got.choices[0].message.content == want
    assert got.choices[0].message.parsed == Answer.model_validate_json(want)
    for form in ({"type": "json_schema", "json_schema": {"name": "a", "schema": {}, "strcit": True}},
                 {"type": "json_schema", "json_schema": {"name": "a", "schema": {}}, "strict": True},
                 {"type": "json_schema", "json_schema": {"name": "a", "schema": {}, "strict": "yes"}}):
        with pytest.raises(openai.BadRequestError, match="response_format must be"):
            client.chat.completions.create(model=NAME, messages=ASK, max_tokens=1, response_format=form)


def test_a_logprob_of_minus_infinity_is_sent_as_json_can_carry_it() -> None:
    """-inf (a token the model rules out) is not JSON: it goes as -9999.0, vLLM's value, whole and in top lists."""
    from infer.core.request import CompletionOutput
    from infer.server.openai_params import OpenAIRequest
    from infer.server.openai_replies import Reply, TokenText

    async def names(ids: list[int]) -> list[str]:
        return [f"<{i}>" for i in ids]

    body = OpenAIRequest(["x"], SamplingParams(logprobs=2))
    reply = Reply("text_completion", "cmpl-1", NAME, body, TokenText(names))
    entry = {5: -0.1, 6: float("-inf"), 7: float("-inf")}
    got = asyncio.run(reply._logprobs(0, CompletionOutput(0, [7], "<7>", logprobs=[entry])))
    assert got == {"tokens": ["<7>"], "token_logprobs": [-9999.0], "top_logprobs": [{"<5>": -0.1, "<6>": -9999.0}],
                   "text_offset": [0]}
    json.dumps(got, allow_nan=False)


def test_many_streams_some_cut_off_leave_nothing_behind(tiny_model: Path, caplog: pytest.LogCaptureFixture) -> None:
    """16 streams at once on their own server, half of them cut off by their clients after 0-20 events: the others
    get every token, and the server ends with no request running, no KV block used, nothing in flight and nothing
    logged as an error."""
    import random

    from infer.core.config import EngineConfig
    from infer.core.engine import Engine

    engine = Engine(EngineConfig(model=str(tiny_model), device="cpu", num_kv_blocks=128, max_model_len=CONTEXT))
    rng = random.Random(0)
    cuts = [rng.choice([0, 1, 5, 20]) if i % 2 else None for i in range(16)]

    async def one(port: int, index: int) -> dict | None:
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        body = json.dumps({"prompt": [3 + index, 5, 7], "max_tokens": 60, "temperature": 0, "ignore_eos": True,
                           "stream": True, "stream_options": {"include_usage": True}}).encode()
        writer.write(b"POST /v1/completions HTTP/1.1\r\nContent-Length: %d\r\n\r\n" % len(body) + body)
        usage, events = None, 0
        try:
            while (await reader.readline()) not in (b"\r\n", b""):
                pass
            while line := await reader.readline():
                if not line.startswith(b"data: ") or line[6:].strip() == b"[DONE]":
                    continue
                events += 1
                usage = json.loads(line[6:]).get("usage") or usage
                if cuts[index] is not None and events > cuts[index]:
                    return None
            return usage
        finally:
            writer.close()

    async def main() -> tuple[list[dict | None], bool]:
        server = InferenceServer(engine, ServeOptions(port=0, http_port=0, grace_period_s=0.0))
        await server.start()
        try:
            results = await asyncio.gather(*(one(server.http_port, i) for i in range(16)))  # type: ignore[arg-type]
            for _ in range(600):
                settled = await asyncio.wrap_future(server.worker.call(
                    lambda e: not e.has_unfinished() and e.kv.stats().used_blocks == 0))
                if settled and server.servicer.in_flight == 0:
                    return results, True
                await asyncio.sleep(0.05)
            return results, False
        finally:
            await server.close(grace=0.0)

    with caplog.at_level(logging.ERROR):
        results, settled = asyncio.run(main())
    assert settled
    assert [r is None for r in results] == [cut is not None for cut in cuts]
    assert all(r is not None and r["completion_tokens"] == 60 for r, cut in zip(results, cuts) if cut is None)
    assert [r.getMessage() for r in caplog.records if r.levelno >= logging.ERROR] == []
